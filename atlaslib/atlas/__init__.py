"""Chapter 5: Newton–Schulz, Muon and ATLAS.

Public functions: ``atlas`` (the model), ``newton_schulz`` and ``polar`` (the
orthogonalisation and its exact SVD reference; they live in ``atlaslib.core.newton_schulz``
because chapter 3's optimizer axis uses them too, and are re-exported here). The three
rooms: ``recurrent.py`` (the per-token definition ``atlas_recurrent`` and the frozen-gradient
oracle ``atlas_frozen_seq``, linear memory), ``chunk.py`` (``atlas_chunk``, the chunkwise
algorithm of [A] §5.1 for the linear memory) and ``kernel.py`` (Triton: Newton–Schulz on a
chunk's batch of momenta, one program per matrix, inside the chunk form). Deep memories run
on chapter 3's engine, whose optimizer axis has Muon (``optimizer="muon"``): one engine, the
same rule.
"""
from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from ..core import apply_feature_map, check_chunk_size, check_qkv, check_state, gate_or_number
from ..core.chunking import compute_dtype
from ..core.dispatch import dispatch, lazy, matrix_kernel_limits
from ..core.gates import alpha_from_log, check_retention
from ..core.newton_schulz import COEFFICIENTS, NORM_EPS, check_ns_steps, newton_schulz, ns_coefficients, polar
from ..core.types import Coefficients, FeatureMap, Gate, ModelOutput
from ..core.validation import check_flag, check_one_retention, check_window
from ..core.windows import window_gates
from ..miras import DEFAULT_CHUNK_SIZE, MEMORIES, MirasConfig, MirasState, make_config, miras
from ..miras.config import check_memory_options
from ..miras.memory import DEEP_MEMORIES
from .chunk import atlas_chunk
from .recurrent import AtlasState, atlas_frozen_seq, atlas_recurrent, atlas_step, start_state

# "linear": this package's own rooms; the deep memories run on atlaslib.miras (optimizer "muon").
# "residual" (x + W1 act(W2 x), expansion 4, GELU) is the memory of [A]'s ATLAS; "gated"
# (x + W1(act(W2 x) * W3 x), [A] eq 43) is ATLAS++. Both need the feature width D == V.

# The chunk length b changes the model (gradients are frozen at each chunk's start), and ATLAS is a
# MIRAS model (optimizer "muon"): it takes chapter 3's default, whichever door reaches it.
ATLAS_CHUNK_SIZE = DEFAULT_CHUNK_SIZE

NO_KERNEL = ("the Triton kernel (Newton-Schulz on the momenta) serves memory='linear' only; deep memories run on "
             "atlaslib.miras: use backend='chunk' or 'recurrent'")


def atlas_config(memory: str = "residual", window: int = 1, ns_steps: int = 5,
                 ns_coeffs: Coefficients = "muon", **memory_options: Any) -> MirasConfig:
    """ATLAS as a MIRAS configuration: l2 bias, decay after the gradient, Muon with NS_J.

    ``atlaslib.miras.miras(q, k, v, config=atlas_config(), ...)`` runs the same model as
    ``atlas(q, k, v, memory="residual", ...)``. [A] gives no window length c (it sweeps it).
    ``memory_options``: ``expansion``, ``activation``, ``layer_norm`` of a deep memory.
    """
    return make_config(memory=memory, bias="l2", retention="decay", optimizer="muon", window=window,
                       ns_steps=ns_steps, ns_coeffs=tuple(ns_coeffs) if isinstance(ns_coeffs, list) else ns_coeffs,
                       name="atlas", **check_memory_options("atlas_config", memory, memory_options))


def _linear_state(initial_state, B, H, V, D, q):
    """(M_0, S_0) of the linear memory from None, a tensor [B, H, V, D] (S_0 = 0) or MirasState(M, S)."""
    if initial_state is None:
        return None, None
    if isinstance(initial_state, tuple):
        if len(initial_state) != 2:
            raise ValueError("initial_state must be a tensor [B, H, V, D] or a MirasState(memory, momentum), "
                             f"got a tuple of length {len(initial_state)}")
        M0, S0 = initial_state
        check_state("initial_state.memory", M0, (B, H, V, D), q)
        check_state("initial_state.momentum", S0, (B, H, V, D), q)
        if M0 is None:
            raise ValueError("initial_state.memory is None; pass initial_state=None for M_0 = 0")
        return M0, S0
    check_state("initial_state", initial_state, (B, H, V, D), q)
    return initial_state, None


def _per_token(loop):
    """A per-token loop in the backend table's signature: log_alpha becomes alpha, chunk_size as the loop wants."""
    def run(q, k, v, window, G, alpha, eta, theta, ns_steps, ns_coeffs, M0, S0, chunk_size, log_alpha):
        alpha = alpha_from_log(alpha, log_alpha, compute_dtype(q))
        extra = {} if loop is atlas_recurrent else {"chunk_size": chunk_size}
        return loop(q, k, v, window, G, alpha, eta, theta, ns_steps, ns_coeffs, M0, S0, **extra)
    return run


LINEAR_BACKENDS = {"recurrent": _per_token(atlas_recurrent), "frozen_seq": _per_token(atlas_frozen_seq),
                   "chunk": atlas_chunk, "triton": lazy(f"{__name__}.kernel", "atlas_triton")}


def kernel_limits(fq, V, ns_coeffs):
    """What the Newton-Schulz kernel refuses, as ``core.dispatch`` wants it (None: it takes the inputs)."""
    from .kernel import MAX_SHORT_SIDE, MAX_SIDE, kernel_supports
    if kernel_supports(fq.shape[-1], V, ns_coeffs):
        return matrix_kernel_limits(fq)
    return (f"momenta of {V} x {fq.shape[-1]} (it takes sides up to {MAX_SHORT_SIDE} x {MAX_SIDE}) "
            f"or more than 3 coefficients")


def atlas(q: Tensor, k: Tensor, v: Tensor, *, window: int = 1, gamma: Gate = None, alpha: Gate = None,
          eta: Gate = None, theta: Gate = None, ns_steps: int = 5, ns_coeffs: Coefficients = "muon",
          phi: FeatureMap = None, memory: str = "linear", initial_state: Any = None,
          output_final_state: bool = False, backend: str = "auto", chunk_size: int | None = None,
          log_alpha: Gate = None, **memory_options: Any) -> ModelOutput:
    """ATLAS: the Omega window, momentum, and Newton–Schulz on the momentum ([A] eqs 32-33).

        ∇_t = sum_{i=t-c+1}^{t} gamma_i^{(t)} grad l2(M_{t-1}; phi(k_i), v_i)
        S_t = theta_t S_{t-1} + ∇_t
        M_t = alpha_t M_{t-1} - eta_t NS_J(S_t),        y_t = M_t(phi(q_t))

    l2(M; k, v) = 1/2 ||M(k) - v||^2. For a deep memory every weight matrix has its own
    momentum and NS_J is applied to each. eta sits outside NS, which normalises its input (a
    step inside S would be erased). [A] Table 1 writes S = theta S - grad with M = alpha M -
    eta NS(S): gradient *ascent*; [A] App. D and MIRAS drop the outer eta (book/errata.md).

    Args:
        q, k: [B, H, T, K] queries and keys (phi applied here); v: [B, H, T, V].
        window: c >= 1 pairs in each gradient (the Omega window; 1: one pair).
        gamma: window gates in [0, 1], [B, H, T] per source token or [B, H, T, window] per offset,
            as in ``atlaslib.omega.omega_rule``, or a number (None: ones).
        alpha: retention in [0, 1], [B, H, T] or a number (None: 1); or ``log_alpha`` (<= 0).
        eta: outer step >= 0, [B, H, T] or a number (None: 1). NS_J(S) has singular values near
            1 whatever the size of S, so eta is the step's size in the spectral norm.
        theta: momentum decay in [0, 1], [B, H, T] or a number (None: 0, no momentum carried).
        ns_steps: J >= 0 Newton–Schulz steps; 0 is the identity (NS off: Titans with eta moved
            outside the momentum, or with theta = 0 the Omega rule, book ch. 5).
        ns_coeffs: "muon" (3.4445, -4.7750, 2.0315; fast, settles in a band around 1), "cubic",
            "quintic" (both converge to the polar factor U V^T) or a tuple or list (p0, p1[, p2, ...]).
            Muon's steep slope at 0 lifts rounding noise with the small singular directions: in fp32 a deep
            memory's outputs differ from fp64 by about 1e-5 relative at T = 128 and 1e-4 at T = 512 (measured
            with memory="mlp", K = V = 16), in the per-token and chunk forms alike; use fp64 for references.
        phi: feature map for q and k (None, a name from ``core.FEATURE_MAPS`` or a callable).
        memory: "linear" (M [V, D], this package's rooms), "mlp", "residual" ([A]'s ATLAS) or
            "gated" (ATLAS++), the deep ones on ``atlaslib.miras`` (D == V for the last two). A deep memory
            also takes ``**memory_options``: ``expansion``, ``activation``, ``layer_norm`` (as ``miras``).
        initial_state: None (zeros for the linear memory; ``miras.init_state`` for deep ones),
            the memory (a tensor [B, H, V, D] or, deep, a dict of weights) with zero momentum,
            or a ``MirasState(memory, momentum)``, e.g. a previous call's final state (which
            continues the sequence exactly for window=1 on "recurrent", and on the chunk forms when the
            split falls on a chunk boundary, since b fixes where gradients freeze; a window also needs the
            last c - 1 pairs, which ``atlas_step``'s ``AtlasState`` carries).
        output_final_state: also return the final ``MirasState(memory, momentum)``.
        backend: "recurrent" (per token, gradients at M_{t-1}), "frozen_seq" (per token,
            gradients frozen at each chunk start: the chunk form's oracle), "chunk" (chunkwise
            PyTorch), "triton" (the chunk form with Newton–Schulz on a Triton kernel, linear
            memory, max(V, D) <= 128 and min(V, D) <= 64, at most 3 coefficients,
            fp32/fp16/bf16; CPU under
            TRITON_INTERPRET=1; backward through the chunk form) or "auto" (triton on CUDA
            where the kernel takes the inputs, chunk otherwise).
        chunk_size: b of "chunk", "frozen_seq" and "triton"; None: 16 (``ATLAS_CHUNK_SIZE``, chapter 3's
            ``DEFAULT_CHUNK_SIZE``). **It changes the model**: b = 1 is the per-token rule.

    Which equalities hold (book ch. 5; all tested in tests/test_atlas.py):

    ==================================================================  ===================
    chunk(b) vs frozen_seq(b), every memory and b                      exact
    chunk(1) vs recurrent                                              exact
    chunk(b > 1) vs recurrent                                          differ (frozen
                                                                       gradients)
    triton(b) vs chunk(b), linear memory                               exact (fp32 rounding)
    linear memory vs ``miras(config=atlas_config("linear"))``           exact (recurrent,
                                                                       frozen_seq, chunk)
    ns_steps=0, window=1 vs Titans (``miras(preset="titans")``) (*)     exact
    ns_steps=0, theta=0, window=1, alpha=1 vs ``delta_rule`` (beta=eta) exact (DeltaNet)
    ns_steps=0, theta=0, window=1 vs ``delta_rule(q, k, alpha v,        exact (Gated DeltaNet
    beta=eta/alpha, alpha=alpha)``                                      decays first)
    ns_steps=0, theta=0 vs ``omega_rule`` (any window, gamma)           exact (OmegaNet)
    ==================================================================  ===================

    (*) With NS off, S_t accumulates raw gradients and eta_t scales the step; Titans keeps
    S'_t = -eta_t S_t. The two agree exactly when Titans gets eta'_t = eta_t and the momentum
    decay theta'_t = theta_t eta_t / eta_{t-1} (with S'_0 = -eta_0 S_0 for any eta_0 > 0): with a
    constant eta the decays are equal, otherwise they must be rescaled, and Titans can follow only while
    theta'_t <= 1, i.e. eta_t <= eta_{t-1} / theta_t (a step that grows faster has no Titans twin).

    Returns:
        (o [B, H, T, V] in q's dtype, ``MirasState(memory, momentum)`` in fp32 (fp64 for fp64 inputs) or
        None), for every memory: ATLAS carries its momentum, so even the linear memory's state is the pair.
    """
    if memory not in MEMORIES:
        raise ValueError(f"memory must be one of {MEMORIES}, got {memory!r}")
    B, H, T, K, V = check_qkv(q, k, v)
    check_window(window)
    check_ns_steps(ns_steps)
    ns_coefficients(ns_coeffs)
    chunk_size = ATLAS_CHUNK_SIZE if chunk_size is None else check_chunk_size(chunk_size)
    check_flag("output_final_state", output_final_state)
    cd = compute_dtype(q)
    check_retention(None if isinstance(alpha, numbers.Real) else alpha,
                    None if isinstance(log_alpha, numbers.Real) else log_alpha, B, H, T, ref=q)
    check_one_retention(alpha, log_alpha)
    gamma = gate_or_number("gamma", gamma, B, H, T, cd, q, width=window)
    alpha = gate_or_number("alpha", alpha, B, H, T, cd, q)
    if isinstance(log_alpha, numbers.Real) and not isinstance(log_alpha, bool):
        if not log_alpha <= 0:
            raise ValueError(f"log_alpha must be <= 0, got {log_alpha}")
        log_alpha = torch.full((B, H, T), float(log_alpha), dtype=cd, device=q.device)
    eta = gate_or_number("eta", eta, B, H, T, cd, q, high=None)
    theta = gate_or_number("theta", theta, B, H, T, cd, q)
    ns_coeffs = tuple(ns_coeffs) if isinstance(ns_coeffs, list) else ns_coeffs
    check_memory_options("atlas", memory, memory_options)
    if memory in DEEP_MEMORIES:
        return _atlas_deep(q, k, v, window, gamma, alpha, eta, theta, ns_steps, ns_coeffs, phi, memory, initial_state,
                           output_final_state, backend, chunk_size, log_alpha, memory_options)
    fq, fk = apply_feature_map(phi, q, k)
    D = fk.shape[-1]
    M0, S0 = _linear_state(initial_state, B, H, V, D, q)
    G = window_gates(gamma, B, H, T, window, cd, q.device)
    o, M, S = dispatch(backend, fq, LINEAR_BACKENDS, fq, fk, v, window, G, alpha, eta, theta, ns_steps, ns_coeffs,
                       M0, S0, chunk_size, log_alpha, model="atlas",
                       unsupported=lambda: kernel_limits(fq, V, ns_coeffs))
    return o.to(q.dtype), (MirasState(M, S) if output_final_state else None)


def _atlas_deep(q, k, v, window, gamma, alpha, eta, theta, ns_steps, ns_coeffs, phi, memory, initial_state,
                output_final_state, backend, chunk_size, log_alpha, memory_options):
    """ATLAS with a deep memory: chapter 3's engine with optimizer "muon" and the Omega window."""
    cfg = atlas_config(memory, window, ns_steps, ns_coeffs, **memory_options)

    def engine(name):
        def run(q, k, v):
            return miras(q, k, v, config=cfg, alpha=alpha, log_alpha=log_alpha, eta=eta, theta=theta, gamma=gamma,
                         phi=phi, initial_state=initial_state, output_final_state=output_final_state,
                         backend=name, chunk_size=chunk_size)
        return run
    table = {name: engine(name) for name in ("recurrent", "frozen_seq", "chunk")}
    return dispatch(backend, q, table, q, k, v, model=f"atlas(memory={memory!r})", missing=NO_KERNEL)


__all__ = ["atlas", "atlas_config", "newton_schulz", "polar", "ns_coefficients", "COEFFICIENTS", "NORM_EPS",
           "atlas_recurrent", "atlas_frozen_seq", "atlas_chunk", "atlas_step", "AtlasState", "start_state",
           "MEMORIES", "DEEP_MEMORIES", "ATLAS_CHUNK_SIZE"]
