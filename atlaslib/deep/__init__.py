"""Chapter 6: the exponential feature map phi*, the DeepTransformer (and SWDT), DOT and DLA (book ch. 6).

Public: ``exp_features`` (phi*_P, the truncated phi* of [A] eq. 22-23), ``deep_transformer``
(DeepTransformer / SWDT, [A] eq. 25), ``dot`` (the Deep Omega Transformer with window c and gates
gamma, [A] eq. 27 corrected), both with ``memory="linear"`` or ``"mlp"``, and ``dla`` (deep linear
attention: chapter 3's engine with the preset "dla", any memory, phi*_P through ``phi_star=("taylor", P)``).
Rooms: ``recurrent.py`` (per-token loops: the matrix memory on phi*_P, and the coefficient forms of
the kernel trick, DOT's window included) and ``chunk.py`` (masked matrix products; chapter 1's chunk
form on phi*_P features).

``features.py`` holds phi*_P, ``validation.py`` the checks of phi_star and of exp's range, and
``kernel.py`` the Triton forward of ``deep_transformer``: phi_star="kernel" (with or without
normalize and window) is causal exp-kernel attention with log-decays and eta, tiled as
FlashAttention (online max and sum with the normaliser); phi_star=("taylor", P) without a window
runs chapter 1's kernel on the features (D <= 256). Backward through the chunk form, as in every
chapter; ``backend="auto"`` runs the kernel on CUDA where it takes the inputs (not fp64, K <= 256).
Built ahead of time by ``python -m atlaslib.aot --family deep``. ``bench_cases.py`` holds the chapter's
rows of ``python -m atlaslib.bench`` (loop vs chunk, and the kernel trick vs PyTorch's SDPA).

``dot`` with a window c > 1 and phi_star=("taylor", P) is chapter 4's ``omega_rule`` on the features;
with phi_star="kernel" it is ``dot_coefficient_recurrent`` (per token) or ``dot_window_chunk``. Both
chunk forms freeze the gradients per chunk: an approximation for b > 1, as OmegaNet's.

``memory="mlp"`` (``mlp.py``) is chapter 3's MLP memory W2 act(W1 phi*(x)) started at W1 = 0, so that
GD keeps W1 in the span of the past features (chapter 6 §7). With ("taylor", P) ``deep_transformer`` is
``dla`` and ``dot`` the deep Omega rule, on chapter 3's engine (chunk form: gradients frozen per chunk,
exact only at b = 1; "frozen_seq" is its oracle); with phi_star="kernel" both run per token with W1 as
coefficients of the past features (``deep_mlp_recurrent``, ``dot_mlp_recurrent``, O(T^2), exact phi*).

``kernel.py`` also holds ``dot``'s kernel for c = 1 and phi_star="kernel" (``dot_kernel_triton``): the unit
lower-triangular system of the coefficients solved in halves, recursively (what the first half recalls
subtracted from the second half's right-hand sides in parallel, O(T^2) as attention), leaves of 128
tokens solved block by block in registers; K <= 128. With phi*_P and
c = 1, ``dot`` is chapter 2's ``delta_rule`` on the features, its kernel included.

Not here: a kernel for SWDT on phi*_P and for ``dot``'s kernel form with c > 1, a chunk
form of the deep memory with the exact phi* (and the normaliser or an SWDT window with a deep
memory), an exact chunk form of ``dot`` with c > 1 (both phi* forms freeze the
gradients per chunk, as chapter 4's).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from ..core import check_chunk_size, check_flag, check_qkv, check_state, gate_or_number
from ..core.chunking import LOG_FLOOR, compute_dtype
from ..core.dispatch import dispatch, lazy, matrix_kernel_limits
from ..core.gates import alpha_from_log
from ..core.types import Gate, ModelOutput
from ..core.validation import _value_check
from ..delta import delta_table
from ..omega import OMEGA_CHUNK_SIZE, omega_rule
from ..core.validation import check_window
from ..miras import MirasState
from ..omega.backends import memory_of_state, step_gates
from .chunk import dot_chunk, dot_window_chunk, hebbian_chunk, masked_chunk
from .dla import DLA_MEMORIES, dla, taylor_phi        # DLA: chapter 3's engine with the preset "dla"
from .features import exp_coefficients, exp_feature_dim, exp_features, exp_kernel
from .mlp import DEFAULT_EXPANSION, check_expansion, mlp_deep_transformer, mlp_dot, second_layer_init
from .validation import (MAX_EXPONENT, check_activation, check_exponents, check_phi_star,
                         check_read_write_exponents)
from .recurrent import (coefficient_recurrent, deep_mlp_recurrent, dot_coefficient_recurrent, dot_mlp_recurrent,
                        hebbian_recurrent)

DEFAULT_CHUNK_SIZE = 64          # the linear forms are exact for every chunk size: b sets the speed only
# Where chunking freezes gradients (dot with c > 1, the mlp memory) b is part of the model: those forms
# default to chapter 3's and 4's b, so that dot(window=c) == omega_rule on the features by default.
FROZEN_CHUNK_SIZE = OMEGA_CHUNK_SIZE
MAX_FEATURES = 256               # chapter 1's kernel (phi*_P without a window) holds D <= 256 feature channels
MEMORIES = ("linear", "mlp")     # the matrix memory, and chapter 3's MLP W2 act(W1 phi*(x)) with W1_0 = 0 (mlp.py)


def check_memory(memory, activation=None, expansion=None):
    """The memories deep_transformer and dot take (DLA has the residual and gated ones too), and the
    options only the deep memory has. Returns (activation, expansion) ((None, None) for the linear memory)."""
    if memory not in MEMORIES:
        raise ValueError(f"memory must be one of {MEMORIES} (the residual and gated memories run on "
                         f"atlaslib.deep.dla), got {memory!r}")
    if memory == "linear":
        for name, value in (("activation", activation), ("expansion", expansion)):
            if value is not None:
                raise ValueError(f"{name}={value!r} is an option of memory='mlp'; the linear memory has none")
        return None, None
    return check_activation("gelu" if activation is None else activation), check_expansion(expansion)


def check_inputs(q, k, v, memory, activation, expansion, phi_star):
    """The checks deep_transformer and dot start with: ((activation, expansion), (B, H, T, K, V), (form, order))."""
    return check_memory(memory, activation, expansion), check_qkv(q, k, v), check_phi_star(phi_star)


def default_chunk_size(chunk_size: int | None, frozen: bool) -> int:
    """chunk_size=None: DEFAULT_CHUNK_SIZE where every b is exact, FROZEN_CHUNK_SIZE where b is part of the model."""
    if chunk_size is None:
        return FROZEN_CHUNK_SIZE if frozen else DEFAULT_CHUNK_SIZE
    return check_chunk_size(chunk_size)


def kernel_table(chunk_size: int) -> dict:
    """phi_star="kernel": the three forms, each taking (q, k, v, alpha, eta, log_alpha, window, normalize)
    and returning (o, None), o in q's dtype (the normalised quotient taken in fp32/fp64)."""
    def exact(form):
        def run(q, k, v, alpha, eta, log_alpha, window, normalize):
            cd = compute_dtype(q)
            if form == "chunk":                   # the quotient taken block by block (see masked_chunk)
                return masked_chunk(q, k, v, alpha, eta, window, "exp", normalize, chunk_size, log_alpha,
                                    normalize)
            if normalize:
                v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)      # the last column carries z
            # in the compute dtype: numerator and denominator are rounded once, in the quotient
            o, _ = coefficient_recurrent(q.to(cd), k.to(cd), v.to(cd), alpha_from_log(alpha, log_alpha, cd), eta,
                                         window, "exp", normalize)
            if normalize:
                o = o[..., :-1].to(cd) / o[..., -1:].to(cd)
            return o.to(q.dtype), None
        run.__name__ = f"deep_kernel_{form}"
        return run
    return {"recurrent": exact("recurrent"), "chunk": exact("chunk"),
            "triton": lazy(f"{__name__}.kernel", "deep_kernel_triton")}


def hebbian_table(chunk_size: int) -> dict:
    """phi_star=("taylor", P) without a window: the matrix memory on the features, each form taking
    (fq, fk, v, alpha, eta, initial_state, log_alpha); "triton" is chapter 1's kernel on them."""
    def recurrent(fq, fk, v, alpha, eta, initial_state, log_alpha):
        return hebbian_recurrent(fq, fk, v, alpha_from_log(alpha, log_alpha, compute_dtype(fq)), eta, initial_state)

    def chunk(fq, fk, v, alpha, eta, initial_state, log_alpha):
        return hebbian_chunk(fq, fk, v, alpha, eta, initial_state, chunk_size, log_alpha)
    return {"recurrent": recurrent, "chunk": chunk, "triton": lazy(f"{__name__}.kernel", "hebbian_triton")}


def feature_kernel_limits(fq):
    """What chapter 1's kernel refuses of the features phi*_P: fp64, or more than MAX_FEATURES channels."""
    if fq.shape[-1] > MAX_FEATURES and fq.dtype != torch.float64:
        return f"phi*_P features of D={fq.shape[-1]} channels (at most {MAX_FEATURES}: K and P too large)"
    return matrix_kernel_limits(fq, MAX_FEATURES)


def kernel_limits(q):
    """What the Triton kernel refuses, for ``backend="auto"`` (``kernel.kernel_limits``, imported lazily)."""
    return lazy(f"{__name__}.kernel", "kernel_limits")(q)


def deep_transformer(q: Tensor, k: Tensor, v: Tensor, *, alpha: Gate = None, eta: Gate = None,
                     phi_star: str | tuple[str, int] = "kernel", normalize: bool = False, window: int | None = None,
                     memory: str = "linear", initial_state: Any = None, output_final_state: bool = False,
                     backend: str = "auto", chunk_size: int | None = None, log_alpha: Gate = None,
                     activation: str | None = None, expansion: int | None = None) -> ModelOutput:
    """DeepTransformer ([A] eq. 25) with a linear or deep memory; ``window=c`` gives SWDT (linear memory).

        M_t = alpha_t M_{t-1} + eta_t v_t phi*(k_t)^T,        y_t = M_t phi*(q_t)

    (GD on the dot-product bias -<M phi*(k), v>). With alpha = eta = 1 and the exact phi*,
    y_t = sum_{i<=t} exp(q_t^T k_i) v_i: *unnormalised* causal attention, which is all [A]'s
    "strict generalization" gives. ``normalize=True`` also carries the normaliser memory
    z_t = alpha_t z_{t-1} + eta_t phi*(k_t) and returns y_t / (z_t^T phi*(q_t)): with
    alpha = eta = 1 that is causal softmax attention exactly (its 1/sqrt(d) must be put into q).

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V].
        alpha: retention in [0, 1], a number or [B, H, T] (None: 1). Or ``log_alpha`` <= 0, [B, H, T] or a number.
        eta: write strength >= 0, a number or [B, H, T] (None: 1).
        phi_star: ``"kernel"`` (exact: the state is the coefficients u_j of the past features and a
            read is sum_j u_j exp(k_j^T q_t), O(T^2), book ch. 6 §kernel trick) or ``("taylor", P)``
            (the matrix memory on ``exp_features(., P)``, dimension C(K + P, P); its kernel is the
            degree-P Taylor polynomial of exp, positive for even P, so use an even P with normalize).
        normalize: divide by z_t^T phi*(q_t) (see above). The value gets a constant 1 as an extra last
            column, which is z's row of the state (as in ``linear_attention``). The quotient is
            undefined where every visible eta_i is 0, and with an odd P the Taylor kernel can reach
            0 or below once k^T q < -1 (even P: always positive).
        window: c >= 1 or None. SWDT: the memory holds only the last c pairs,
            M_t = sum_{i=t-c+1}^{t} eta_i (A_t / A_i) v_i phi*(k_i)^T, so normalised with alpha = eta = 1
            it is sliding-window softmax attention ([A] eq. 18), and c >= T is the DeepTransformer.
            (This is not chapter 4's SWLA, which windows the update and never forgets a pair.)
        memory: "linear" (the matrix memory above) or "mlp": DLA on phi*, W_t = alpha_t W_{t-1} - eta_t
            grad_W -<W2 act(W1 phi*(k_t)), v_t>, y_t = W2_t act(W1_t phi*(q_t)), started at W1 = 0
            (``mlp.py``). No normalize and no window with it. ("taylor", P) runs ``dla`` (backends
            "recurrent", "frozen_seq", "chunk", "auto" = chunk: the chunk form freezes the gradients per
            chunk, so chunk_size is part of the model and only b = 1 is the definition); "kernel" runs
            ``deep_mlp_recurrent`` (per token, W1 = sum_j U_j phi*(k_j)^T, O(T^2): backend "recurrent"
            or "auto"; "chunk" and "triton" are refused). Same start W2, so Taylor -> kernel as P grows.
        initial_state: linear memory: [B, H, V (+1 with normalize), D] start memory; ``("taylor", P)``
            without window only. "mlp": ``{"W2": [B, H, V, h]}`` (W1 = 0; h is the hidden width) or, with
            ("taylor", P) only, ``{"W1": [B, H, h, D], "W2": [B, H, V, h]}``; None: W1 = 0 and W2 ~ N(0, 1/h)
            per head from a generator seeded with 0, h = 4 K (``second_layer_init``). Either may also come
            as ``MirasState(memory, None)``, e.g. a previous call's final state.
        output_final_state: return the final state as ``MirasState(memory, None)`` for every memory: the
            linear memory's M_T [B, H, V (+1), D] or the "mlp" memory's ``{"W1", "W2"}`` (Taylor form only).
            It raises ValueError for the kernel form (its state grows with T; with memory="mlp" that holds
            although initial_state={"W2": ...} is taken, since W1 becomes one coefficient per token) and for
            a window, which must also remember the pairs it will drop.
        backend: "recurrent" (per token), "chunk" (masked matrix products), "triton" (``kernel.py``:
            phi_star="kernel", any normalize and window; or ("taylor", P) without a window, on chapter
            1's kernel; fp32/bf16/fp16 inputs, K <= 256 (D <= 256 features); forward only, gradients
            through the chunk form) or "auto" (the kernel on CUDA where it takes the inputs, else
            chunk). With the linear memory every form is exact for every ``chunk_size``.
        chunk_size: rows per block of the chunk form (with "mlp" the b of the frozen gradients). None:
            DEFAULT_CHUNK_SIZE (64), or FROZEN_CHUNK_SIZE (chapter 3's b) for "mlp", where b is part of the model.
        activation: "mlp" only: act of chapter 3's ``ACTIVATIONS`` (None: "gelu"). With W1 = 0 the first
            step moves W1 by act'(0): "relu" (act'(0) = 0 in torch) leaves the memory at its start forever.
        expansion: "mlp" only: the default W2's hidden width h = expansion * K (None: DEFAULT_EXPANSION, 4).
            An ``initial_state`` sets h by its W2; an expansion given with it must agree (h = expansion * K).

    Returns:
        (o [B, H, T, V] in q's dtype, ``MirasState(memory, None)`` or None).
    """
    (activation, expansion), (B, H, T, K, V), (form, order) = check_inputs(q, k, v, memory, activation, expansion,
                                                                           phi_star)
    check_flag("normalize", normalize)
    check_flag("output_final_state", output_final_state)
    cd = compute_dtype(q)
    alpha, log_alpha, eta = step_gates(alpha, log_alpha, eta, B, H, T, q)
    initial_state = memory_of_state(initial_state)
    if window is not None:
        check_window(window)
    chunk_size = default_chunk_size(chunk_size, frozen=memory == "mlp")
    if memory == "mlp":                          # DLA on phi* (mlp.py): no normaliser, no window
        if normalize:
            raise ValueError("deep_transformer: normalize=True needs memory='linear' (the normaliser z_t is a "
                             "linear memory of the features; a deep memory has no such quotient)")
        if window is not None:
            raise ValueError("deep_transformer: window (SWDT) needs memory='linear': a deep memory cannot drop the "
                             "pair that leaves the window (for the Omega window on a deep memory use dot, the l2 loss; "
                             "with the dot-product loss the library has a window only on a linear memory, "
                             "atlaslib.omega.swla)")
        o, state = mlp_deep_transformer(q, k, v, alpha, eta, log_alpha, order, initial_state, output_final_state,
                                        backend, chunk_size, activation, expansion)
        return o, (MirasState(state, None) if output_final_state else None)
    matrix = form == "taylor" and window is None                     # the forms that have a matrix state
    if (initial_state is not None or output_final_state) and not matrix:
        raise ValueError("initial_state and output_final_state need phi_star=('taylor', P) and window=None: "
                         "the kernel form keeps one coefficient per past token and a window also needs the "
                         "pairs it will drop, so neither has a fixed-size matrix state")
    D = exp_feature_dim(K, order) if form == "taylor" else None
    if matrix:
        check_state("initial_state", initial_state, (B, H, V + 1 if normalize else V, D), q)
    if form == "kernel" and not normalize:
        check_exponents(q, k, window)
    if form == "kernel":                         # the kernel trick: the table's forms take the inputs
        table = kernel_table(chunk_size)
        o, _ = dispatch(backend, q, table, q, k, v, alpha, eta, log_alpha, window, bool(normalize),
                        unsupported=lambda: kernel_limits(q), model="deep_transformer")
        return o.to(q.dtype), None
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)      # the last column carries z

    # features in fp32/fp64, and v with them: the forms take q, k, v of one dtype (bf16 v beside fp32
    # features was refused as "q, k, v must share a dtype", naming tensors the caller never made)
    fq, fk, v = exp_features(q.to(cd), order), exp_features(k.to(cd), order), v.to(cd)
    if matrix:
        o, state = dispatch(backend, q, hebbian_table(chunk_size), fq, fk, v, alpha, eta, initial_state, log_alpha,
                            unsupported=lambda: feature_kernel_limits(fq), model="deep_transformer")
    else:
        table = {"recurrent": lambda: coefficient_recurrent(fq, fk, v, alpha_from_log(alpha, log_alpha, cd), eta,
                                                            window, "dot"),
                 "chunk": lambda: masked_chunk(fq, fk, v, alpha, eta, window, "dot", False, chunk_size, log_alpha)}
        o, state = dispatch(backend, q, table, model="deep_transformer",
                            missing="its Triton kernels take phi_star='kernel', or ('taylor', P) without a window "
                                    "(chapter 1's kernel on the features); SWDT on phi*_P runs on backend='chunk' "
                                    "or 'recurrent'")
    if normalize:
        o = o[..., :V].to(cd) / o[..., V:].to(cd)
    return o.to(q.dtype), (MirasState(state, None) if output_final_state else None)


def dot(q: Tensor, k: Tensor, v: Tensor, *, window: int = 1, gamma: Gate = None, alpha: Gate = None,
        eta: Gate = None, phi_star: str | tuple[str, int] = "kernel", memory: str = "linear",
        initial_state: Any = None, output_final_state: bool = False, backend: str = "auto",
        chunk_size: int | None = None, log_alpha: Gate = None, activation: str | None = None,
        expansion: int | None = None) -> ModelOutput:
    """The Deep Omega Transformer ([A] eq. 27): the Omega rule on phi*, with a linear or deep memory.

        M_t = alpha_t M_{t-1} - eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} grad l2(M_{t-1}; phi*(k_i), v_i)
            = M_{t-1} (alpha_t I - eta_t sum_i gamma_i^{(t)} phi*(k_i) phi*(k_i)^T)
              + eta_t sum_i gamma_i^{(t)} v_i phi*(k_i)^T,                         y_t = M_t phi*(q_t).

    ([A] eqs. 28-31 subtract the value term and multiply from the left; see the errata.) The gradients
    are taken at M_{t-1} and the decay applied after (chapter 4's Omega convention). With c = 1 this is
    the delta rule on phi* (alpha = 1: exactly DeltaNet with beta = eta gamma on the features). Stable
    while eta_t |sum_i gamma_i^{(t)} phi*(k_i) phi*(k_i)^T| <= 1 + alpha_t, and |phi*(k)|^2 = exp(|k|^2):
    for unit keys and gamma = 1, eta <= (1 + alpha) / (c e). With c = 1, eta_t > 1 + alpha_t is unstable
    for every key (|phi*(k)|^2 >= 1) and, for memory="linear", raises ValueError (``check_dot_step``).
    These are the per-token bounds. With c > 1 the chunk form freezes the gradients over each chunk of
    b tokens, and the bound becomes about eta * c * lambda_max(the chunk's Gram of phi*(k)) <= 1 + A_b.
    The phi* Gram of random unit keys has e on its diagonal and about 1 elsewhere, so lambda_max is
    about b + c - 2 + e and the bound about eta < 2 / (c (b + c + 1)): 0.024 at c = 4, b = 16 (measured,
    T = 1024, K = 16, fp32: bounded at eta = 0.025, growing from 0.03, 1e23 at 0.05, while the per-token
    rule stays bounded up to the 0.18 above). Lower eta, or run chunk_size=1, for larger steps.

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V].
        window: c >= 1, the number of pairs in each update (c >= T: every past pair).
        gamma: window gates in [0, 1], as ``omega_rule`` takes them: [B, H, T] per source token
            (gamma_i^{(t)} = gamma_i) or [B, H, T, c] per offset (gamma_i^{(t)} = gamma[..., t, t - i];
            entries before the sequence start are ignored), or a number. None: all ones. With c = 1 the gate is a
            factor of the step, eta_t gamma_t.
        alpha: retention in (0, 1] (a number or [B, H, T]; None: 1). It must be > 0: the c = 1 forms run
            chapter 2's Gated DeltaNet with beta = eta / alpha on the values alpha v (the same update for
            alpha > 0) and the kernel chunk form works with log alpha. Or ``log_alpha`` (> -inf and <= 0,
            a number or [B, H, T]), turned into alpha in fp32 (fp64 for fp64 inputs), where it must not
            underflow to 0 (log_alpha above about -103 in fp32, -744 in fp64).
        eta: step >= 0 (a number or [B, H, T]; None: 1).
        phi_star: "kernel" (exact phi*: coefficients u_j of phi*(k_j), O(T^2); c = 1 has a chunk form that
            solves a triangular system, exact for every chunk_size; c > 1 a frozen-gradient one) or
            ("taylor", P) (``exp_features``; c = 1 on chapter 2's ``delta_rule`` forms, c > 1 on chapter
            4's ``omega_rule`` with the features as q and k).
        memory: "linear" (the matrix memory above) or "mlp": W_t = alpha_t W_{t-1} - eta_t sum_i
            gamma_i^{(t)} grad_W 1/2 ||W2 act(W1 phi*(k_i)) - v_i||^2, every gradient at W_{t-1}, read
            y_t = W2_t act(W1_t phi*(q_t)), started at W1 = 0 (``mlp.py``). With
            ("taylor", P): chapter 3's engine as ``omega_rule(memory="mlp")`` runs it (c = 1: the deep
            delta rule), backends "recurrent", "frozen_seq", "chunk", "auto" = chunk, whose chunk form
            freezes the gradients per chunk (exact only at b = 1). With "kernel": ``dot_mlp_recurrent``
            (per token, W1 in coefficient form, O(T^2); backend "recurrent" or "auto").
        initial_state: ("taylor", P) with the linear memory: the start matrix [B, H, V, D] (None: zero);
            "mlp": as ``deep_transformer`` takes it (``{"W2": ...}``, plus "W1" for the Taylor form; None:
            W1 = 0, W2 seeded, h = 4 K). Either may come as ``MirasState(memory, None)``. The kernel form
            (phi_star="kernel") keeps one coefficient per past token and has no start state (ValueError).
        output_final_state: also return the final state, ``MirasState(memory, None)`` (the matrix, or the
            "mlp" weights ``{"W1", "W2"}``); ValueError for the kernel form, as for initial_state.
        backend: "recurrent" (per token: the definition), "chunk", "triton" or "auto".
            c = 1, "kernel": "recurrent", "chunk" (both exact for every chunk_size) and "triton"
            (``kernel.dot_kernel_triton``: the same solve, recursively in halves; fp32/bf16/fp16
            inputs, K <= 128; forward only, gradients through the chunk form); "auto" = the kernel on
            CUDA where it takes the inputs, else chunk.
            c = 1, ("taylor", P): chapter 2's ``delta_rule`` on the features, with its backends (its
            kernel where it takes the D = C(K + P, P) feature channels).
            c > 1, ("taylor", P): ``omega_rule``'s backends, whose chunk form (and kernel) freezes the
            gradients at each chunk's start state, so chunk(b > 1) is an *approximation* of the
            recurrent rule, exactly as OmegaNet's is (chunk(1) is exact; "frozen_seq" is its per-token
            oracle; see ``omega_rule``).
            c > 1, "kernel": "recurrent", "chunk" (``dot_window_chunk``, the same frozen-gradient
            approximation in coefficient space) or "frozen_seq" (its oracle,
            ``dot_coefficient_recurrent(chunk_size=b)``); "auto" = chunk; no kernel.
        chunk_size: rows per block of the chunk form; with c > 1 (or "mlp") it is the b of the
            frozen-gradient approximation and so part of the model (b = 1: the definition). None:
            DEFAULT_CHUNK_SIZE (64) for c = 1 with the linear memory, else FROZEN_CHUNK_SIZE, chapter 4's b
            (``OMEGA_CHUNK_SIZE``), so that by default dot(window=c, phi_star=("taylor", P)) is ``omega_rule``
            on the features.
        activation, expansion: "mlp" only, as ``deep_transformer`` takes them (None: "gelu", 4).

    Returns:
        (o [B, H, T, V] in q's dtype, ``MirasState(memory, None)`` or None).
    """
    (activation, expansion), (B, H, T, K, V), (form, order) = check_inputs(q, k, v, memory, activation, expansion,
                                                                           phi_star)
    check_flag("output_final_state", output_final_state)
    c = check_window(window)
    cd = compute_dtype(q)
    gamma = gate_or_number("gamma", gamma, B, H, T, cd, q, width=c)
    alpha, log_alpha, eta = step_gates(alpha, log_alpha, eta, B, H, T, q)
    alpha = alpha_from_log(alpha, log_alpha, cd)
    initial_state = memory_of_state(initial_state)
    if form == "kernel" and memory == "linear" and (initial_state is not None or output_final_state):
        # memory='mlp' takes a start W2 on the exact features, but its first layer has no final state either
        asked, fix = (("output_final_state", "") if output_final_state
                      else ("initial_state", " (or memory='mlp', which starts from a given W2)"))
        raise ValueError(f"dot: {asked} needs phi_star=('taylor', P){fix}: the kernel form keeps one "
                         "coefficient per past token, not a fixed-size matrix state")
    if alpha is not None:
        check_positive_alpha(alpha, from_log=log_alpha is not None)
    chunk_size = default_chunk_size(chunk_size, frozen=c > 1 or memory == "mlp")
    if c == 1 and gamma is not None:                # one pair per step: gamma_t^{(t)} scales the step
        g = (gamma if gamma.dim() == 3 else gamma[..., 0]).to(cd)
        eta = g if eta is None else eta.to(cd) * g
        gamma = None
    if c == 1 and memory == "linear":
        check_dot_step(eta, alpha)
    if memory == "mlp":                             # the deep Omega rule on phi* (mlp.py)
        o, state = mlp_dot(q, k, v, c, gamma, alpha, eta, order, initial_state, output_final_state, backend,
                           chunk_size, activation, expansion)
        return o, (MirasState(state, None) if output_final_state else None)
    if form == "kernel":
        check_read_write_exponents(q, k, "dot with phi_star='kernel'")
        if c > 1:                                   # the window: per token, or frozen per chunk
            table: dict[str, Callable[..., Any]] = {
                "recurrent": lambda: dot_coefficient_recurrent(q, k, v, alpha, eta, "exp", c, gamma),
                "frozen_seq": lambda: dot_coefficient_recurrent(q, k, v, alpha, eta, "exp", c, gamma, chunk_size),
                "chunk": lambda: dot_window_chunk(q, k, v, alpha, eta, "exp", c, gamma, chunk_size)}
            o, _ = dispatch(backend, q, table, model="dot",
                            missing="phi_star='kernel' with a window has no Triton kernel (use backend='recurrent' "
                                    "for the definition, 'chunk' for the frozen-gradient form or 'frozen_seq' "
                                    "for its per-token oracle)")
            return o.to(q.dtype), None
        # c = 1: the coefficient solve; the table's forms take (q, k, v, alpha, eta), so that the kernel's
        # gradients come from autograd through the chunk form (core.with_chunk_backward)
        table = {"recurrent": lambda q, k, v, alpha, eta: dot_coefficient_recurrent(q, k, v, alpha, eta, "exp"),
                 "chunk": lambda q, k, v, alpha, eta: dot_chunk(q, k, v, alpha, eta, "exp", chunk_size),
                 "triton": lazy(f"{__name__}.kernel", "dot_kernel_triton")}
        o, _ = dispatch(backend, q, table, q, k, v, alpha, eta, model="dot",
                        unsupported=lambda: lazy(f"{__name__}.kernel", "dot_kernel_limits")(q))
        return o.to(q.dtype), None
    fq, fk = exp_features(q.to(cd), order), exp_features(k.to(cd), order)
    check_state("initial_state", initial_state, (B, H, V, fk.shape[-1]), q)
    if c > 1:                                       # the Omega rule on the features (chapter 4)
        o, state = omega_rule(fq, fk, v.to(cd), window=c, gamma=gamma, alpha=alpha, eta=eta, backend=backend,
                              chunk_size=chunk_size, initial_state=initial_state,
                              output_final_state=output_final_state)
        return o.to(q.dtype), state
    beta = torch.ones(B, H, T, dtype=cd, device=q.device) if eta is None else eta.to(cd)
    vv = v.to(cd)
    if alpha is not None:                           # Gated DeltaNet decays before its step: undo it
        # with the gate every form of chapter 2 uses (its logs are floored at LOG_FLOOR), so that beta * alpha
        # stays eta where alpha < e^LOG_FLOOR too (a change of at most e^-60 relative to the definition)
        alpha = alpha.to(cd).clamp_min(math.exp(LOG_FLOOR))
        beta, vv = beta / alpha, alpha[..., None] * vv
    # chapter 2's delta rule on the features, with its backends (its kernel takes D up to its own limit).
    # Its forms are called directly: delta_rule's cap beta <= 2 is DeltaNet's unit-key condition, not
    # DOT's (check_dot_step), and beta = eta / alpha exceeds it for stable DOT inputs.
    o, state = dispatch(backend, fq, delta_table(chunk_size), fq, fk, vv, beta, alpha, initial_state, None,
                        unsupported=lambda: matrix_kernel_limits(fq), model="dot")
    return o.to(q.dtype), (MirasState(state, None) if output_final_state else None)


def check_dot_step(eta, alpha):
    """DOT's own stability condition for one pair per step (c = 1): eta_t <= 1 + alpha_t.

    The update M_t = M_{t-1} (alpha_t I - eta_t phi*(k_t) phi*(k_t)^T) + ... scales the memory along
    phi*(k_t) by alpha_t - eta_t |phi*(k_t)|^2 and leaves the orthogonal directions at alpha_t, so it
    is non-expansive exactly when eta_t |phi*(k_t)|^2 <= 1 + alpha_t. Both feature maps have
    |phi*(k)|^2 >= 1 (exp(|k|^2) for the kernel, sum_n |k|^(2n) / n! for the Taylor features), so
    eta_t > 1 + alpha_t overshoots for every key: that is rejected here, for both forms alike; the
    sharper, key-dependent bound eta_t <= (1 + alpha_t) / |phi*(k_t)|^2 is left to the caller."""
    if eta is None:                                 # eta = 1 <= 1 + alpha for every alpha >= 0
        return
    one = 1.0 + (alpha.to(eta.dtype) if alpha is not None else torch.zeros((), dtype=eta.dtype, device=eta.device))
    msg = ("dot: eta must be at most 1 + alpha at every token (window=1): the update scales the memory along "
           "phi*(k_t) by alpha_t - eta_t |phi*(k_t)|^2 with |phi*(k)|^2 >= 1, so a larger eta overshoots for every key")
    how = _value_check(eta)
    if how == "host":
        with torch.no_grad():
            excess = (eta - one).max().item()
        if excess > 0:
            raise ValueError(f"{msg}; got eta - (1 + alpha) up to {excess:.4g}")
    elif how == "device":
        with torch.no_grad():
            torch._assert_async((eta <= one).all(), msg)


def check_positive_alpha(alpha, from_log=False):
    """DOT divides by alpha (its coefficients carry 1 / prod alpha): a gate of 0 is refused, on a GPU by a
    device-side assert (no host sync), as ``check_dot_step`` does. ``from_log``: alpha = exp(log_alpha),
    which underflows to 0 below about -103 in fp32 (-744 in fp64: the smallest subnormal's log)."""
    msg = "dot: alpha must lie in (0, 1]; a gate of 0 is not supported"
    if from_log:
        msg = (f"dot: log_alpha must be > -inf and its exp must not underflow to 0 in {alpha.dtype} (log_alpha "
               f"above about {math.log(torch.finfo(alpha.dtype).tiny * torch.finfo(alpha.dtype).eps):.0f}); "
               "a gate of 0 is not supported")
    how = _value_check(alpha)
    if how == "host" and not bool((alpha > 0).all()):
        raise ValueError(msg)
    if how == "device":
        with torch.no_grad():
            torch._assert_async((alpha > 0).all(), msg)


__all__ = ["deep_transformer", "dot", "exp_features", "exp_feature_dim", "exp_coefficients", "check_phi_star",
           "dot_coefficient_recurrent", "dot_chunk", "dot_window_chunk",
           "hebbian_recurrent", "coefficient_recurrent", "hebbian_chunk", "masked_chunk", "MEMORIES",
           "DEFAULT_CHUNK_SIZE", "FROZEN_CHUNK_SIZE", "MAX_EXPONENT", "MAX_FEATURES", "kernel_table", "hebbian_table",
           "dla", "taylor_phi", "DLA_MEMORIES", "deep_mlp_recurrent", "dot_mlp_recurrent", "exp_kernel",
           "second_layer_init", "DEFAULT_EXPANSION"]
