"""DLA, deep linear attention ([A] eq 19, [MC] §4.3 eq 30): chapter 3's MIRAS engine with the preset "dla".

    M_t = alpha_t M_{t-1} - eta_t grad_M l(M_{t-1}; phi(k_t), v_t),   l(M; k, v) = -<M(k), v>,   y_t = M_t(phi(q_t))

The dot-product bias, gradient descent, retention alpha applied after the gradient, and a deep memory
(default the 2-layer MLP W2 act(W1 x)). It is a preset, not a new engine: ``dla`` only translates
its arguments into ``miras(preset="dla", ...)``. With ``memory="linear"`` the gradient is -v phi(k)^T
whatever the state, so DLA is gated linear attention (chapter 1) on the values eta_t v_t, and every
chunk size is exact; with a deep memory the gradient depends on the state, so the chunk form
(gradients frozen at each chunk start) equals ``frozen_seq`` for every b and the per-token
definition only at b = 1 (chapter 6 §7).

``phi_star=("taylor", P)`` uses phi = ``exp_features(., P)``: the DeepTransformer ([A] eq 25) on the
truncated phi*_P, with any memory the engine has (a linear one gives ``deep_transformer``'s
unnormalised matrix form). The exact kernel form of phi* is ``deep_transformer``'s business.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

from ..core.chunking import compute_dtype
from ..core.dispatch import choose_backend
from ..core.types import FeatureMap, Gate, ModelOutput
from ..miras import MEMORIES, miras
from ..miras.config import DEFAULT_CHUNK_SIZE, MEMORY_OPTIONS
from .features import exp_features
from .validation import check_phi_star

DLA_MEMORIES = MEMORIES          # every memory of chapter 3's engine
# The backends of chapter 3's engine for what runs on it here: its kernel is Titans/TTT's (l2, linear).
ENGINE_BACKENDS = ("recurrent", "frozen_seq", "chunk")


def check_engine_backend(backend: str, q: Tensor, model: str, why: str) -> None:
    """Refuse a backend the engine lacks under the caller's name: ``miras`` would name itself."""
    choose_backend(backend, q, dict.fromkeys(ENGINE_BACKENDS), model=model, missing=why)


def taylor_phi(order: int) -> Callable[[Tensor], Tensor]:
    """phi*_P as a feature map for ``miras``: exp_features in fp32 (fp64 for fp64 inputs)."""
    def phi(x: Tensor) -> Tensor:
        return exp_features(x.to(compute_dtype(x)), order)
    phi.__name__ = f"phi_star_taylor_{order}"
    return phi


def dla(q: Tensor, k: Tensor, v: Tensor, *, alpha: Gate = None, eta: Gate = None, phi: FeatureMap = None,
        phi_star: tuple[str, int] | None = None, memory: str = "mlp", initial_state: Any = None,
        output_final_state: bool = False, backend: str = "auto", chunk_size: int | None = None,
        log_alpha: Gate = None, **memory_options: Any) -> ModelOutput:
    """Deep linear attention: the MIRAS preset "dla" (dot-product bias, GD, decay, deep memory).

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V].
        alpha: retention in [0, 1], a number or [B, H, T] (None: 1), applied after the gradient.
            Or ``log_alpha`` (<= 0).
        eta: step >= 0, a number or [B, H, T] (None: 1).
        phi: feature map for q and k (None: identity, a name from ``core.FEATURE_MAPS`` or a callable),
            as in ``miras``.
        phi_star: None or ``("taylor", P)``: phi = ``exp_features(., P)`` (the DeepTransformer on phi*_P).
            Not together with ``phi``. ``"kernel"`` (exact phi*) is not offered here: the coefficient form
            needs W1 to start at 0 (in the span of past features), which is
            ``deep_transformer(memory="mlp", phi_star="kernel")`` (or memory="linear").
        memory: "mlp" (W2 act(W1 x), default), "linear" (gated linear attention), "residual" or "gated"
            (these two need the feature width to equal V). The one model whose default memory is not
            "linear": a deep memory is what DLA is (its linear case is chapter 1's gated linear attention).
        initial_state: as in ``miras`` (None: zeros for the linear memory, seeded random weights for deep
            ones; a deep memory started at zero has zero gradients forever).
        output_final_state: also return the final ``MirasState``.
        backend: "recurrent" (per token), "frozen_seq" (per token, gradients frozen at chunk starts),
            "chunk" or "auto" (chunk: there is no Triton kernel for the dot-product bias).
        chunk_size: b of "chunk" and "frozen_seq" (None: chapter 3's ``DEFAULT_CHUNK_SIZE`` = 16). It changes
            the model for a deep memory.
        **memory_options: ``expansion``, ``activation``, ``layer_norm`` of the deep memory.

    Returns:
        (o [B, H, T, V] in q's dtype, ``MirasState`` or None).
    """
    if memory not in DLA_MEMORIES:
        raise ValueError(f"dla: memory must be one of {DLA_MEMORIES}, got {memory!r}")
    other = sorted(set(memory_options) - set(MEMORY_OPTIONS))
    if other:
        raise TypeError(f"dla: unknown option(s) {other}; dla fixes bias='dot', optimizer='gd', retention='decay' "
                        f"(for other axes call atlaslib.miras.miras) and takes only {list(MEMORY_OPTIONS)}")
    if phi_star is not None:
        if phi is not None:
            raise ValueError("dla: give either phi or phi_star, not both (phi_star=('taylor', P) is phi = phi*_P)")
        form, order = check_phi_star(phi_star)
        if form == "kernel":
            raise ValueError("dla: phi_star='kernel' (exact phi*, coefficient state) is not available for DLA, whose "
                             "deep memory starts at random W1; use phi_star=('taylor', P), or "
                             "atlaslib.deep.deep_transformer(memory='mlp' or 'linear', phi_star='kernel'), which "
                             "starts W1 at 0")
        phi = taylor_phi(order)
    check_engine_backend(backend, q, "dla", "there is no Triton kernel for the dot-product bias")
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    return miras(q, k, v, preset="dla", memory=memory, alpha=alpha, eta=eta, phi=phi, initial_state=initial_state,
                 output_final_state=output_final_state, backend=backend, chunk_size=chunk_size, log_alpha=log_alpha,
                 **memory_options)


__all__ = ["dla", "taylor_phi", "check_engine_backend", "DLA_MEMORIES"]
