"""Chapter 4: the Omega rule (OmegaNet, linear or deep memory), SWLA and polynomial features.

Public functions: ``omega_rule`` and ``swla``; the three rooms are ``recurrent.py``
(the per-token definitions and the frozen-gradient oracle ``omega_frozen_seq``),
``chunk.py`` (the chunkwise algorithm) and ``kernel.py`` (Triton). ``backends.py`` validates
a call and holds the backend tables, and ``omega_deep``, which runs the deep memories on
chapter 3's engine. The polynomial feature maps live in ``atlaslib.core.featuremaps`` and
are re-exported here.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from ..core import TaylorFeatures, monomial_dim, monomial_features, tensor_power
from ..core.dispatch import dispatch
from ..core.types import FeatureMap, Gate, ModelOutput
from ..core.validation import check_flag, check_window
from ..core.windows import window_gates
from ..miras import DEFAULT_CHUNK_SIZE as MIRAS_CHUNK_SIZE
from ..miras.config import check_memory_options
from ..miras.memory import DEEP_MEMORIES, MEMORIES
from ..miras import MirasState
from .chunk import omega_chunk, swla_chunk
from .backends import OMEGA_BACKENDS, SWLA_BACKENDS, kernel_limits, omega_deep, prepare
from .recurrent import omega_frozen_seq, omega_recurrent, swla_recurrent

# Default chunk lengths. The Omega rule's chunk form freezes gradients at the chunk start, so b
# is part of the model, and the model is a MIRAS one (l2 bias, GD, a window; with c = 1 and no
# gate it is miras' frozen-gradient "deltanet"): it takes chapter 3's default, for every memory,
# whichever function (omega_rule, miras, the OmegaNet mixer) reaches it. SWLA's chunk form is
# exact for every b, so its default only sets the speed.
OMEGA_CHUNK_SIZE = MIRAS_CHUNK_SIZE
SWLA_CHUNK_SIZE = 64


def omega_rule(q: Tensor, k: Tensor, v: Tensor, *, window: int, gamma: Gate = None, alpha: Gate = None,
               eta: Gate = None, phi: FeatureMap = None, memory: str = "linear", initial_state: Any = None,
               output_final_state: bool = False, backend: str = "auto", chunk_size: int | None = None,
               log_alpha: Gate = None, **memory_options: Any) -> ModelOutput:
    """The Omega rule: gradient descent on the l2 loss of the last ``window`` pairs ([A] eq. 10).

        M_t = alpha_t M_{t-1} - eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} grad l2(M_{t-1}; phi(k_i), v_i)
            = M_{t-1} (alpha_t I - eta_t sum_i gamma_i^{(t)} phi(k_i) phi(k_i)^T)
              + eta_t sum_i gamma_i^{(t)} v_i phi(k_i)^T,
        y_t = M_t phi(q_t),            l2(M; k, v) = 1/2 ||M k - v||^2.

    Where the delta rule (c = 1) corrects the memory for the newest pair only, each Omega
    step corrects it for the whole window of c pairs, every one evaluated at the current
    state. Sign: the value term is *added*; [A] eq. 11 subtracts it (and multiplies from
    the left, with a diag(alpha_t) that eq. 10 does not have), see the errata. Tokens
    before the start of the sequence do not exist, so the windows of t < c are shorter.

    ``memory="linear"`` (a matrix M [V, D]) runs on this package's three rooms. The deep
    memories of OmegaNet ([A] §3) -- ``"mlp"`` (W2 act(W1 x)), ``"residual"``
    (x + W1 act(W2 x), needs D == V) and ``"gated"`` (ATLAS++) -- run on chapter 3's engine
    (``atlaslib.miras``, see ``omega_deep``): same window, gates and exactness table, but
    no kernel. The state is a ``MirasState(memory, None)`` for every memory (the memory a tensor
    [B, H, V, D] for "linear", a dict of weights for the deep ones; the Omega rule has no momentum).

    Args:
        q, k: [B, H, T, K] queries and keys (phi is applied here).
        v: [B, H, T, V] values.
        window: c >= 1, the number of pairs in each update (c = 1: the delta rule).
        gamma: window gates in [0, 1], in one of two parametrisations (book ch. 4 §2):
            ``[B, H, T]`` per source token, gamma_i^{(t)} = gamma_i (a token keeps its
            weight in every window it belongs to); ``[B, H, T, window]`` per offset,
            gamma_i^{(t)} = gamma[..., t, t - i] (offset 0 is token t itself; entries that
            point before the sequence start are ignored); or one number for every weight. ``None``: all ones.
        alpha: [B, H, T] retention in [0, 1] or a number (``None``: 1).
        log_alpha: the same gate as its log, [B, H, T] (values <= 0, fp32 or fp64) or a number, instead of
            alpha; never rounded to the activation dtype (a bf16 gate 1 - 2^-12 is exactly 1.0).
            Deep memories turn it into alpha in fp32 (fp64) at entry, as ``miras`` does.
        eta: [B, H, T] inner learning rate >= 0, or a number (``None``: 1). The step is stable while
            eta_t * ||sum_i gamma_i^{(t)} phi(k_i) phi(k_i)^T|| <= 1 + alpha_t (2 without retention): for
            unit features and gamma = 1 that is eta_t <= (1 + alpha_t) / c, so eta = 1 with c > 2 can diverge.
            That is the per-token rule's bound (chunk_size=1). With frozen gradients over a chunk of b
            tokens one step applies every row's gradient at once: eta_t * c * lambda_max(Phi Phi^T) <=
            1 + A_b over the chunk's window rows Phi is sufficient (random unit keys, K = 32, b = 16:
            lambda_max about 2.5). Measured at c = 1, chunk_size=16: bounded up to eta = 1.3, growing
            from 1.4, where the per-token rule stays bounded.
        phi: feature map for q and k: ``None`` (identity), a name from
            ``core.FEATURE_MAPS`` or a callable [B, H, T, K] -> [B, H, T, D], e.g.
            ``TaylorFeatures(2)`` (its coefficients then train through ``backend``).
        memory: "linear", "mlp", "residual" or "gated" (see above). A deep memory also takes
            ``**memory_options``: ``expansion``, ``activation``, ``layer_norm`` (as ``miras``).
        initial_state: optional start state: the memory (linear: a tensor [B, H, V, D]; deep: a dict of
            weights) or a ``MirasState(memory, None)``, e.g. a previous call's final state (which continues
            the sequence exactly only for window=1, and on the chunk forms only when the split falls on a
            chunk boundary, where the gradients freeze: a window also needs the last c - 1 pairs, which
            ``omega_step``'s state carries and the final state does not).
        output_final_state: also return the state after the last token, a ``MirasState(memory, None)``.
        backend: "recurrent" (the per-token definition: ring buffer, all c gradients at
            M_{t-1}), "frozen_seq" (per token, gradients frozen at each chunk start: the chunk
            form's oracle), "chunk" (chunkwise PyTorch with gradients frozen at the chunk start,
            book ch. 4 §8), "triton" (the same chunk form as a GPU kernel; CPU under
            TRITON_INTERPRET=1; backward by autograd through the chunk form; needs
            chunk_size <= 64, D <= 256 and a window tile of at most 128 * 128 entries,
            tile(chunk_size + window - 1) * tile(D) with tile(n) = max(16, next_pow2(n)))
            or "auto" (triton on CUDA where the tiles fit, chunk otherwise).
        chunk_size: b, the chunk length of "chunk", "frozen_seq" and "triton". **It changes the model**
            (see below); b = 1 is the exact per-token rule. None: 16 (``OMEGA_CHUNK_SIZE``),
            for every memory: the same as ``miras``, which runs the deep memories and is the
            same model for the linear one, and as the OmegaNet mixer.

    Which equalities hold (book ch. 4 §8; all are tested):

    ====================================================  ==============================
    comparison                                            result
    ====================================================  ==============================
    chunk(b) vs ``omega_frozen_seq(b)``                   exact for every b and c
    triton(b) vs chunk(b)                                 exact (fp32 rounding)
    chunk(1) vs recurrent                                 exact
    chunk(b > 1) vs recurrent                             differ: frozen gradients
                                                          are an approximation
    recurrent with c = 1, alpha = 1 vs ``delta_rule``     exact, with beta = eta * gamma
    (or chunk(1); any delta backend: its chunk form
    is exact)
    chunk(b > 1) with c = 1 vs ``delta_rule``             differ (frozen gradients)
    ====================================================  ==============================

    With alpha < 1 and c = 1 the Omega rule is *not* Gated DeltaNet: it takes the gradient
    at M_{t-1} and decays afterwards, M_{t-1}(alpha_t I - eta_t k k^T) + eta_t v k^T,
    whereas Gated DeltaNet takes it at alpha_t M_{t-1}: alpha_t M_{t-1}(I - beta_t k k^T) + beta_t v k^T.

    Returns:
        (o [B, H, T, V] in q's dtype, ``MirasState(memory, None)`` in fp32 (fp64 for fp64 inputs) — or None
        unless requested).
    """
    chunk_size = OMEGA_CHUNK_SIZE if chunk_size is None else chunk_size
    check_flag("output_final_state", output_final_state)
    fq, fk, gamma, alpha, eta, log_alpha, initial_state, window, chunk_size = prepare(
        q, k, v, window, gamma, alpha, eta, phi, memory, initial_state, chunk_size, log_alpha)
    check_memory_options("omega_rule", memory, memory_options)
    if memory in DEEP_MEMORIES:
        return omega_deep(fq, fk, v, window, gamma, alpha, eta, memory, initial_state, output_final_state,
                          backend, chunk_size, log_alpha=log_alpha, **memory_options)
    o, state = dispatch(backend, fq, OMEGA_BACKENDS, fq, fk, v, window, gamma, alpha, eta, initial_state,
                        chunk_size, log_alpha, unsupported=lambda: kernel_limits(fq, window, chunk_size),
                        model="omega_rule")
    return o, (MirasState(state, None) if output_final_state else None)


def swla(q: Tensor, k: Tensor, v: Tensor, *, window: int, gamma: Gate = None, alpha: Gate = None,
         eta: Gate = None, phi: FeatureMap = None, initial_state: Tensor | None = None,
         output_final_state: bool = False, backend: str = "auto", chunk_size: int | None = None,
         log_alpha: Gate = None) -> ModelOutput:
    """Sliding-window linear attention: the Omega window with the dot-product bias -<M phi(k), v>.

        M_t = alpha_t M_{t-1} + eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} v_i phi(k_i)^T,    y_t = M_t phi(q_t).

    The gradient of the dot-product loss, -v phi(k)^T, does not depend on M, so SWLA is
    linear attention with effective per-pair weights, and its chunkwise form (and kernel)
    is exact for every chunk size: recurrent == chunk(b) == triton(b) for all b. With
    c = 1 it is ``linear_attention`` on the values eta_t gamma_t v_t.

    SWLA is **not** sliding-window attention: nothing ever leaves the memory. With
    alpha = gamma = eta = 1, M_t = sum_{i<=t} min(c, t - i + 1) v_i phi(k_i)^T: every old
    pair stays, written c times, and the newest c - 1 pairs carry *less* weight. The
    window shapes the update, not the memory's contents. ([A] eq. 20 drops alpha_t and
    [A] eq. 55 flips the sign of the write.)

    Arguments as ``omega_rule`` (no ``memory``: the memory is one matrix; no backend "frozen_seq":
    the chunk form is exact), except the default chunk_size (None: 64, ``SWLA_CHUNK_SIZE``): exact
    for every b, it only sets the speed. The state is that matrix, a tensor [B, H, V, D] (as
    ``linear_attention``'s), in fp32 (fp64 for fp64 inputs).
    """
    chunk_size = SWLA_CHUNK_SIZE if chunk_size is None else chunk_size
    check_flag("output_final_state", output_final_state)
    fq, fk, gamma, alpha, eta, log_alpha, initial_state, window, chunk_size = prepare(
        q, k, v, window, gamma, alpha, eta, phi, "linear", initial_state, chunk_size, log_alpha)
    o, state = dispatch(backend, fq, SWLA_BACKENDS, fq, fk, v, window, gamma, alpha, eta, initial_state,
                        chunk_size, log_alpha, unsupported=lambda: kernel_limits(fq, window, chunk_size),
                        model="swla")
    return o, (state if output_final_state else None)


__all__ = ["omega_rule", "swla", "check_window", "omega_recurrent", "omega_frozen_seq", "omega_chunk",
           "swla_recurrent", "swla_chunk", "window_gates", "TaylorFeatures", "monomial_features",
           "monomial_dim", "tensor_power", "MEMORIES", "DEEP_MEMORIES", "omega_deep", "OMEGA_CHUNK_SIZE",
           "SWLA_CHUNK_SIZE"]
