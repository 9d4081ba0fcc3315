"""The definition: the Omega rule and SWLA with a linear memory, one token at a time.

Omega rule (GD on the windowed l2 objective, book ch. 4 §2; [A] eqs 9-10, 15):

    M_t = alpha_t M_{t-1} - eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} grad l2(M_{t-1}; phi(k_i), v_i)
        = alpha_t M_{t-1} - eta_t sum_i gamma_i^{(t)} (M_{t-1} phi(k_i) - v_i) phi(k_i)^T
        = M_{t-1} (alpha_t I - eta_t sum_i gamma_i^{(t)} phi(k_i) phi(k_i)^T)
          + eta_t sum_i gamma_i^{(t)} v_i phi(k_i)^T,
    y_t = M_t phi(q_t)                                   (read out after the update)

with l2(M; k, v) = 1/2 ||M k - v||^2. [A] eq 11 writes the last term with a minus sign;
that is gradient *ascent* on the values (see the errata). A ring buffer holds the last
c pairs, and every step re-evaluates all c gradients at the *current* state M_{t-1}:
token i's error is recomputed at c successive states, which is what separates the
Omega rule from momentum (momentum stores each gradient once, at the state it was
first seen). Tokens before the start of the sequence do not exist, so the first c - 1
steps use shorter windows.

SWLA (sliding-window linear attention, book ch. 4 §5) is the same window with the
dot-product bias -<M phi(k), v>, whose gradient -v phi(k)^T does not depend on M:

    M_t = alpha_t M_{t-1} + eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} v_i phi(k_i)^T .

``omega_frozen_seq`` is the sequential oracle of the chunkwise algorithm (book ch. 4 §8):
the same loop, but every gradient of chunk [t0+1, t0+b] is taken at the chunk-start
state M_{t0} instead of M_{t-1}.

Here q, k are already features phi(q), phi(k) of dimension D, so states are [B, H, V, D].
The window gates gamma come in two parametrisations (book ch. 4 §2):

* per source token, ``[B, H, T]``: gamma_i^{(t)} = gamma_i, the same weight for token i
  in every window that contains it;
* per offset, ``[B, H, T, c]``: gamma_i^{(t)} = gamma[t, t - i], a fresh set of c
  weights chosen by the token that updates (offset 0 is token t itself).
"""
from __future__ import annotations

from collections import deque

import torch

from ..core.chunking import compute_dtype


def gamma_weight(gamma, t: int, i: int):
    """gamma_i^{(t)} as a [B, H] tensor (or the number 1 when ``gamma`` is None)."""
    if gamma is None:
        return 1.0
    if gamma.dim() == 3:                       # per source token: gamma_i
        return gamma[:, :, i]
    return gamma[:, :, t, t - i]               # per offset: gamma^{(t)}[t - i]


def _per_bh(x):
    """A [B, H] weight broadcast against a [B, H, V, D] state (numbers pass through)."""
    return x[..., None, None] if isinstance(x, torch.Tensor) else x


def window_gradient(M, window, gamma, t):
    """sum_{i in window} gamma_i^{(t)} (M phi(k_i) - v_i) phi(k_i)^T, with the window a list of (i, k_i, v_i)."""
    grad = torch.zeros_like(M)
    for i, k_i, v_i in window:
        error = torch.einsum("bhvd,bhd->bhv", M, k_i) - v_i               # M phi(k_i) - v_i
        grad = grad + _per_bh(gamma_weight(gamma, t, i)) * error[..., :, None] * k_i[..., None, :]
    return grad


def _setup(q, k, v, gamma, alpha, eta, initial_state):
    B, H, T, D = q.shape
    V = v.shape[-1]
    cd = compute_dtype(q)
    cast = lambda x: None if x is None else x.to(cd)          # noqa: E731
    M = torch.zeros(B, H, V, D, dtype=cd, device=q.device) if initial_state is None else initial_state.to(cd)
    return (cast(q), cast(k), cast(v), cast(gamma), cast(alpha), cast(eta), M, T)


def _step_gates(alpha, eta, t):
    a = 1.0 if alpha is None else alpha[:, :, t, None, None]
    e = 1.0 if eta is None else eta[:, :, t, None, None]
    return a, e


def omega_recurrent(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None):
    """The per-token Omega rule (gradients at M_{t-1}).

    q, k: [B,H,T,D] features; v: [B,H,T,V]; window: c >= 1; gamma: None, [B,H,T] or
    [B,H,T,c]; alpha, eta: None or [B,H,T]. Returns (o [B,H,T,V] in q's dtype, M_T [B,H,V,D]).
    """
    out_dtype = q.dtype
    q, k, v, gamma, alpha, eta, M, T = _setup(q, k, v, gamma, alpha, eta, initial_state)
    pairs = deque(maxlen=window)                                          # ring buffer of the last c pairs
    outputs = []
    for t in range(T):
        pairs.append((t, k[:, :, t], v[:, :, t]))
        a_t, eta_t = _step_gates(alpha, eta, t)
        M = a_t * M - eta_t * window_gradient(M, pairs, gamma, t)           # every gradient at M_{t-1}
        outputs.append(torch.einsum("bhvd,bhd->bhv", M, q[:, :, t]))      # y_t = M_t phi(q_t)
    return torch.stack(outputs, dim=2).to(out_dtype), M


def omega_frozen_seq(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None, chunk_size=64):
    """The Omega rule with every gradient frozen at its chunk-start state (book ch. 4 §8).

    Chunks are tokens [0, b), [b, 2b), ...; for t in a chunk starting at t0 the window's
    gradients are taken at M_{t0}, the state after the previous chunk (the initial state
    for the first), *including* those of window tokens that lie in the previous chunk.
    Sequential, so it is the oracle that the chunkwise form must match for every b.
    At b = 1 it is ``omega_recurrent``. Same arguments and results as ``omega_recurrent``.
    """
    out_dtype = q.dtype
    q, k, v, gamma, alpha, eta, M, T = _setup(q, k, v, gamma, alpha, eta, initial_state)
    pairs = deque(maxlen=window)
    outputs = []
    for t in range(T):
        if t % chunk_size == 0:
            M_start = M                                                   # M_{t0}: frozen for this chunk
        pairs.append((t, k[:, :, t], v[:, :, t]))
        a_t, eta_t = _step_gates(alpha, eta, t)
        M = a_t * M - eta_t * window_gradient(M_start, pairs, gamma, t)   # gradients at M_{t0}
        outputs.append(torch.einsum("bhvd,bhd->bhv", M, q[:, :, t]))
    return torch.stack(outputs, dim=2).to(out_dtype), M


def swla_recurrent(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None):
    """Per-token SWLA: M_t = alpha_t M_{t-1} + eta_t sum_{i in window} gamma_i^{(t)} v_i phi(k_i)^T.

    Same arguments and results as ``omega_recurrent``.
    """
    out_dtype = q.dtype
    q, k, v, gamma, alpha, eta, M, T = _setup(q, k, v, gamma, alpha, eta, initial_state)
    pairs = deque(maxlen=window)
    outputs = []
    for t in range(T):
        pairs.append((t, k[:, :, t], v[:, :, t]))
        a_t, eta_t = _step_gates(alpha, eta, t)
        write = sum(_per_bh(gamma_weight(gamma, t, i)) * v_i[..., :, None] * k_i[..., None, :]
                    for i, k_i, v_i in pairs)
        M = a_t * M + eta_t * write
        outputs.append(torch.einsum("bhvd,bhd->bhv", M, q[:, :, t]))
    return torch.stack(outputs, dim=2).to(out_dtype), M
