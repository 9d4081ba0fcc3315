"""The deep ("mlp") memory of ``deep_transformer`` and ``dot``: M(x) = W2 act(W1 phi*(x)).

It is chapter 3's MLP memory (``miras.memory.MLPMemory``: two layers, no residual, GELU unless told
otherwise, W2 ~ N(0, 1/h)) with one change: the first layer starts at zero, W1_0 = 0. GD then keeps
W1 in the span of the past features (chapter 6 §7), W1 = sum_j U_j phi*(k_j)^T, so the exact phi* needs
only exp(k_j^T x), and the Taylor form and the kernel form start from the same memory:

* ``phi_star=("taylor", P)``: chapter 3's engine on ``exp_features(., P)`` -- ``deep_transformer`` is
  ``dla`` (dot-product bias, GD, decay), ``dot`` is the deep Omega rule (``miras`` with the l2 bias and
  the window c, what ``omega_rule(memory="mlp")`` runs). The engine's hidden width is expansion * D; a
  hidden width h that is not a multiple of D is padded with inert units (a zero row of W1 and a zero
  column of W2: act(0) = 0 for every activation, so both gradients of such a unit vanish and it stays
  zero), which changes no output. Its backends are the engine's: "recurrent" (the definition),
  "frozen_seq" (its oracle), "chunk" and "auto" (= chunk; no kernel): the chunk form freezes the
  gradients at each chunk's start, so it equals "frozen_seq" for every b and the definition only at b = 1.
* ``phi_star="kernel"``: ``recurrent.deep_mlp_recurrent`` / ``dot_mlp_recurrent``, per token, O(T^2);
  backend "recurrent" (or "auto"). There is no chunk form.

The start state is given as ``initial_state={"W2": [B, H, V, h]}`` (W1 = 0; h is W2's width), or, for
the Taylor form only, ``{"W1": [B, H, h, D], "W2": [B, H, V, h]}`` (any first layer: it lives in the
finite feature space). None: W2 drawn N(0, 1/h) per head from a generator seeded with 0, h = expansion * K
with expansion 4 unless given (the engine's default, on the raw key width, so the Taylor forms of every P
and the kernel form share it).
"""
from __future__ import annotations

import functools
import math
import numbers

import torch
import torch.nn.functional as F

from ..core import check_state
from ..core.dispatch import dispatch
from ..core.gates import alpha_from_log
from ..core.validation import process_constant, static_int
from ..miras import miras
from .dla import check_engine_backend, dla, taylor_phi
from .features import exp_feature_dim, exp_kernel
from .validation import check_read_write_exponents
from .recurrent import deep_mlp_recurrent, dot_mlp_recurrent

DEFAULT_EXPANSION = 4            # h = 4 K by default, as chapter 3's engine (expansion 4)
MLP_SEED = 0                     # the default W2 is drawn from a generator seeded with this


def check_expansion(expansion):
    """The hidden width's multiple of K: an int >= 1, or None (the default W2's DEFAULT_EXPANSION)."""
    if expansion is not None and (isinstance(expansion, bool) or not isinstance(expansion, numbers.Integral)
                                  or expansion < 1):
        raise ValueError(f"expansion must be an int >= 1 (the hidden width h = expansion * K), got {expansion!r}")
    return None if expansion is None else int(expansion)


def second_layer_init(B, H, V, hidden, dtype, device, seed=MLP_SEED):
    """The default W2: N(0, 1/h) per head (fp64 draw, as ``Memory.init``), shared by the batch."""
    w = seeded_w2(static_int(H), static_int(V), static_int(hidden), seed)
    return w.to(dtype=dtype, device=device).clone()[None].expand(B, H, V, hidden).contiguous()


@torch.compiler.assume_constant_result
def seeded_w2(H: int, V: int, hidden: int, seed: int) -> torch.Tensor:
    """The draw of ``second_layer_init`` [H, V, hidden] in fp64, kept for the process (read-only: callers
    copy). torch.compile takes it as a constant: a generator made while it traces stops a fullgraph
    compilation, and the draw is a function of these arguments alone."""
    return _seeded_w2(H, V, hidden, seed)


@functools.lru_cache(maxsize=64)
def _seeded_w2(H, V, hidden, seed):
    with process_constant():                  # kept: real CPU tensors, also for calls that train after an eval pass
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(H, V, hidden, generator=gen, dtype=torch.float64, device="cpu") / math.sqrt(hidden)


def mlp_start(initial_state, q, v, order, expansion=None):
    """(W1 or None for zero, W2, D) from ``initial_state`` (None: W2 drawn in fp32, fp64 for fp64 q, of width
    h = expansion * K, expansion None: DEFAULT_EXPANSION); D is the width C(K + P, P) of the features of
    order P (None: the exact phi*)."""
    B, H, _, K = q.shape
    V = v.shape[-1]
    D = None if order is None else exp_feature_dim(K, order)
    if initial_state is None:
        dtype = q.dtype if q.dtype == torch.float64 else torch.float32
        return None, second_layer_init(B, H, V, (expansion or DEFAULT_EXPANSION) * K, dtype, q.device), D
    allowed = {"W2"} if D is None else {"W1", "W2"}
    if not isinstance(initial_state, dict) or "W2" not in initial_state or set(initial_state) - allowed:
        got = sorted(initial_state) if isinstance(initial_state, dict) else type(initial_state).__name__
        why = ("with phi_star='kernel' the first layer starts at zero (W1 = 0 keeps it in the span of the past "
               "features; phi* has no finite W1)" if D is None else "W1 is optional (None: zero)")
        raise ValueError(f"initial_state of memory='mlp' must be a dict {{'W2': [B, H, V, h]}}"
                         f"{'' if D is None else ' or {W1: [B, H, h, D], W2: [B, H, V, h]}'}; {why}; got {got}")
    W2 = initial_state["W2"]
    if not isinstance(W2, torch.Tensor) or W2.dim() != 4 or W2.shape[-1] < 1:
        raise ValueError(f"initial_state['W2'] must be a tensor [B, H, V, h] = [{B}, {H}, {V}, h] with h >= 1, got "
                         f"{tuple(W2.shape) if isinstance(W2, torch.Tensor) else type(W2).__name__}")
    hidden = W2.shape[-1]
    check_state("initial_state['W2']", W2, (B, H, V, hidden), q)
    if expansion is not None and hidden != expansion * K:
        raise ValueError(f"expansion={expansion} asks for h = {expansion * K} hidden units, but initial_state's "
                         f"W2 has h = {hidden}: its width sets h (leave expansion out, or give a W2 of width "
                         f"{expansion * K})")
    W1 = initial_state.get("W1")
    check_state("initial_state['W1']", W1, (B, H, hidden, D), q)
    return W1, W2, D


def check_exact_phi(q, k, output_final_state):
    """The deep memory on the exact phi* keeps its first layer as one coefficient per past token."""
    if output_final_state:
        raise ValueError("output_final_state with phi_star='kernel' and memory='mlp': the first layer is one "
                         "coefficient per past token, not a fixed-size state; use phi_star=('taylor', P)")
    check_read_write_exponents(q, k, "memory='mlp' with phi_star='kernel'")


def engine_state(W1, W2, D):
    """The engine's start state {W1, W2} and expansion: h padded with inert units up to a multiple of D."""
    B, H, V, hidden = W2.shape
    expansion = -(-hidden // D)
    pad = expansion * D - hidden
    W1 = W2.new_zeros(B, H, hidden, D) if W1 is None else W1.to(W2.dtype)
    return {"W1": F.pad(W1, (0, 0, 0, pad)), "W2": F.pad(W2, (0, pad))}, expansion


def cropped_state(state, hidden):
    """The engine's final {W1, W2} without the inert units."""
    return {"W1": state.memory["W1"][:, :, :hidden], "W2": state.memory["W2"][..., :hidden]}


def exact_phi_backend(backend):
    """phi_star="kernel" (the exact exp similarity) with the deep memory is per token only: "auto" runs it,
    the chunk forms are refused."""
    return "recurrent" if backend == "auto" else backend


DEEP_MEMORY_NO_KERNEL = "the deep memory runs on chapter 3's engine, whose Triton kernel is for linear memories"
EXACT_PHI_MISSING = ("phi_star='kernel' with memory='mlp' is per token only (the first layer is held as "
                     "coefficients of past features, O(T^2)); use backend='recurrent' (or 'auto'), or "
                     "phi_star=('taylor', P) for the engine's chunk form")


def mlp_deep_transformer(q, k, v, alpha, eta, log_alpha, order, initial_state, output_final_state, backend,
                         chunk_size, activation, expansion=None):
    """DeepTransformer with the deep memory (DLA on phi*). order: P of ("taylor", P), None for the kernel."""
    W1, W2, D = mlp_start(initial_state, q, v, order, expansion)
    if order is not None:
        check_engine_backend(backend, q, "deep_transformer(memory='mlp')", DEEP_MEMORY_NO_KERNEL)
        start, expansion = engine_state(W1, W2, D)
        o, state = dla(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", order), memory="mlp",
                       initial_state=start, output_final_state=output_final_state, backend=backend,
                       chunk_size=chunk_size, log_alpha=log_alpha, expansion=expansion, activation=activation)
        return o, (cropped_state(state, W2.shape[-1]) if output_final_state else None)
    check_exact_phi(q, k, output_final_state)
    table = {"recurrent": lambda: deep_mlp_recurrent(q, k, v, W2, alpha_from_log(alpha, log_alpha, W2.dtype), eta,
                                                     exp_kernel(), activation)}
    o, _ = dispatch(exact_phi_backend(backend), q, table, model="deep_transformer(memory='mlp')",
                    missing=EXACT_PHI_MISSING)
    return o.to(q.dtype), None


def mlp_dot(q, k, v, window, gamma, alpha, eta, order, initial_state, output_final_state, backend, chunk_size,
            activation, expansion=None):
    """DOT with the deep memory (the deep Omega rule on phi*). order: P of ("taylor", P), None for the kernel."""
    W1, W2, D = mlp_start(initial_state, q, v, order, expansion)
    if order is not None:                     # chapter 3's engine as omega_rule(memory="mlp") runs it
        check_engine_backend(backend, q, "dot(memory='mlp')", DEEP_MEMORY_NO_KERNEL)
        start, expansion = engine_state(W1, W2, D)
        o, state = miras(q, k, v, memory="mlp", bias="l2", optimizer="gd", retention="decay", window=window,
                         gamma=gamma, alpha=alpha, eta=eta, phi=taylor_phi(order), initial_state=start,
                         output_final_state=output_final_state, backend=backend, chunk_size=chunk_size,
                         expansion=expansion, activation=activation)
        return o, (cropped_state(state, W2.shape[-1]) if output_final_state else None)
    check_exact_phi(q, k, output_final_state)
    table = {"recurrent": lambda: dot_mlp_recurrent(q, k, v, W2, alpha, eta, exp_kernel(), activation, window, gamma)}
    o, _ = dispatch(exact_phi_backend(backend), q, table, model="dot(memory='mlp')", missing=EXACT_PHI_MISSING)
    return o.to(q.dtype), None
