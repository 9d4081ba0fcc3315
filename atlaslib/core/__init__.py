"""Shared parts: input checks, feature maps, reference attention, testing helpers, dispatch."""
from .alloc import empty
from .attention import softmax_attention
from .dispatch import BACKENDS, interpreter_on, resolve_backend, with_chunk_backward
from .featuremaps import (FEATURE_MAPS, TaylorFeatures, apply_feature_map, check_degree, elu_plus_one,
                          get_feature_map, identity, monomial_dim, monomial_features, taylor_features,
                          tensor_power)
from .testing import TOLERANCE, assert_close, poisoned_outputs, random_gate, random_qkv, rel_rmse
from .validation import (check_chunk_size, check_flag, check_gate, check_qkv, check_state, check_tensor, check_window,
                         gate_or_number)

__all__ = [
    "softmax_attention", "BACKENDS", "interpreter_on", "resolve_backend", "with_chunk_backward",
    "FEATURE_MAPS", "apply_feature_map", "elu_plus_one", "get_feature_map", "identity", "TaylorFeatures",
    "check_degree", "monomial_dim", "monomial_features", "taylor_features", "tensor_power", "TOLERANCE", "assert_close",
    "empty", "poisoned_outputs", "random_gate", "random_qkv", "rel_rmse", "check_chunk_size", "check_flag",
    "check_gate", "check_qkv", "check_state", "check_tensor", "check_window", "gate_or_number",
]
