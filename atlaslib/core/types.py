"""Type aliases of the public model functions' signatures (checked by mypy in ``make test``)."""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch

# A gate or rate: a per-token tensor ([B, H, T], or wider where the model says so), a number, or
# None for the model's default.
Gate = Union[torch.Tensor, float, None]
# A feature map: None (identity), a name from ``core.FEATURE_MAPS`` or a callable on [..., K] tensors.
FeatureMap = Union[str, Callable[[torch.Tensor], torch.Tensor], None]
# Newton-Schulz coefficients: a name ("muon", "cubic", ...) or explicit (p0, p1, p2) triples.
Coefficients = Union[str, Sequence[Any]]
# What every model returns: the output o [B, H, T, V] and the final state, None unless requested.
# The state's type belongs to the function, never to an argument: a tensor [B, H, V, D] where the memory
# is always one matrix (linear_attention, delta_rule, swla), ``MirasState(memory, momentum)`` for every
# function with a ``memory`` option (miras, omega_rule, atlas, dla, deep_transformer, dot), the base's
# for memory_caching / log_linear_pp. The rest of the contract (book/notation.md, tests/test_contract.py):
# gates as tensors or numbers, alpha or log_alpha, ``chunk_size=None`` for the model's own default,
# ``backend="auto"``, ``beta`` for the delta rule's step and ``eta`` elsewhere, ``ns_steps``/``ns_coeffs``.
ModelOutput = tuple[torch.Tensor, Any]
