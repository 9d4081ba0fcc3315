"""The definition: the Omega rule and SWLA with a linear memory, one token at a time.

Omega rule (GD on the windowed l2 objective, book ch. 4 §2; [A] eqs 9-10, 15):

    M_t = alpha_t M_{t-1} - eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} grad l2(M_{t-1}; phi(k_i), v_i)
        = alpha_t M_{t-1} - eta_t sum_i gamma_i^{(t)} (M_{t-1} phi(k_i) - v_i) phi(k_i)^T
        = M_{t-1} (alpha_t I - eta_t sum_i gamma_i^{(t)} phi(k_i) phi(k_i)^T)
          + eta_t sum_i gamma_i^{(t)} v_i phi(k_i)^T,
    y_t = M_t phi(q_t)                                   (read out after the update)

with l2(M; k, v) = 1/2 ||M k - v||^2. [A] eq 11 writes the last term with a minus sign;
that is gradient *ascent* on the values (see the errata). Each step sees the last
c pairs (the window), and every step re-evaluates all c gradients at the *current* state M_{t-1}:
token i's error is recomputed at c successive states, which is what separates the
Omega rule from momentum (momentum stores each gradient once, at the state it was
first seen). Tokens before the start of the sequence do not exist, so the first c - 1
steps use shorter windows.

``omega_step`` and ``swla_step`` are one token of each rule, the bodies of the loops
below. What a token needs from the past is the memory M and the last c - 1 pairs, so
the state between tokens is a ``WindowState`` of both: its size depends on c, never on
the number of tokens seen, which is what a decoder generating text one token at a
time keeps per layer.

SWLA (sliding-window linear attention, book ch. 4 §5) is the same window with the
dot-product bias -<M phi(k), v>, whose gradient -v phi(k)^T does not depend on M:

    M_t = alpha_t M_{t-1} + eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} v_i phi(k_i)^T .

``omega_frozen_seq`` is the sequential oracle of the chunkwise algorithm (book ch. 4 §8):
the same loop, but every gradient of chunk [t0+1, t0+b] is taken at the chunk-start
state M_{t0} instead of M_{t-1}.

Here q, k are already features phi(q), phi(k) of dimension D, so states are [B, H, V, D].
The window gates gamma come in two parametrisations (book ch. 4 §2):

* per source token, ``[B, H, T]``: gamma_i^{(t)} = gamma_i, the same weight for token i
  in every window that contains it (so the state keeps the gates of its buffered tokens);
* per offset, ``[B, H, T, c]``: gamma_i^{(t)} = gamma[t, t - i], a fresh set of c
  weights chosen by the token that updates (offset 0 is token t itself).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.chunking import start_memory
from ..core.validation import check_chunk_size, check_form_shapes, check_shape, check_window
from ..miras.config import DEFAULT_CHUNK_SIZE  # the Omega rule is a MIRAS model: one default chunk length


class WindowState(NamedTuple):
    """What the Omega rule and SWLA carry from one token to the next.

    M: the memory [B, H, V, D]. keys [B, H, n, D], values [B, H, n, V]: the last
    n <= c - 1 pairs, oldest first (fewer than c - 1 only near the start, where earlier
    tokens do not exist). gammas [B, H, n]: their per-source gates (ones when the gates
    are per offset or absent, which do not need them).
    """
    M: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    gammas: torch.Tensor


def start_window(M: torch.Tensor) -> WindowState:
    """The state before the first token: memory M [B, H, V, D] and an empty window."""
    if not isinstance(M, torch.Tensor) or M.dim() != 4 or not M.is_floating_point():
        got = f"{M.dtype} {list(M.shape)}" if isinstance(M, torch.Tensor) else type(M).__name__
        raise TypeError(f"the start memory M must be a floating tensor [B, H, V, D], got {got}")
    B, H, V, D = M.shape
    return WindowState(M, M.new_zeros(B, H, 0, D), M.new_zeros(B, H, 0, V), M.new_zeros(B, H, 0))


def window_rows(state: WindowState, k_t, v_t, gamma_t):
    """The window of token t: (keys [B,H,n,D], values [B,H,n,V], gates gamma_i^{(t)} [B,H,n]), oldest
    first and token t's own pair last; n = min(t + 1, c)."""
    keys = torch.cat([state.keys, k_t[:, :, None]], dim=2)
    values = torch.cat([state.values, v_t[:, :, None]], dim=2)
    n = keys.shape[2]
    if gamma_t is None:
        weights = torch.ones_like(keys[..., 0])
    elif gamma_t.dim() == 2:                                   # per source: each token brings its own gate
        weights = torch.cat([state.gammas, gamma_t[:, :, None]], dim=2)
    else:                                                      # per offset: row j is offset n - 1 - j
        weights = gamma_t[:, :, :n].flip(-1)
    return keys, values, weights


def slide(M, keys, values, weights, gamma_t, window: int) -> WindowState:
    """The state after token t: M_t and the newest c - 1 window rows (the oldest one leaves)."""
    drop = max(keys.shape[2] - (window - 1), 0)                # rows to drop: 1 once the window is full
    per_source = gamma_t is not None and gamma_t.dim() == 2
    gammas = weights if per_source else torch.ones_like(weights)
    return WindowState(M, keys[:, :, drop:], values[:, :, drop:], gammas[:, :, drop:])


def window_gradient(M, keys, values, weights):
    """sum_i gamma_i^{(t)} (M phi(k_i) - v_i) phi(k_i)^T over the window rows.

    M [B,H,V,D]; keys [B,H,n,D]; values [B,H,n,V]; weights [B,H,n] (row j weighs pair j).
    """
    errors = torch.einsum("bhvd,bhnd->bhnv", M, keys) - values           # M phi(k_i) - v_i, every row
    return torch.einsum("bhn,bhnv,bhnd->bhvd", weights, errors, keys)   # weighted sum of e_i phi(k_i)^T


def check_token(M, q_t, k_t, v_t, window: int, window_gate: tuple, **gates) -> None:
    """The shapes of one token's inputs against the memory M [B, H, V, D] (no value is read): q_t, k_t
    [B, H, D]; v_t [B, H, V]; ``window_gate`` = (its name, the gates: None, [B, H] or [B, H, c]); every
    other gate, given as name=gate, None or [B, H]. The steps of chapters 4 and 5 share it."""
    B, H, V, D = M.shape
    check_shape("q_t", q_t, (B, H, D))
    check_shape("k_t", k_t, (B, H, D))
    check_shape("v_t", v_t, (B, H, V))
    check_shape(window_gate[0], window_gate[1], (B, H), (B, H, window))
    for name, g in gates.items():
        check_shape(name, g, (B, H))


def _per_bh(x_t, M):
    """A per-token gate [B, H] as a factor of the state [B, H, V, D] (None: 1)."""
    return 1.0 if x_t is None else x_t.to(M.dtype)[:, :, None, None]


def _as_state_dtype(state: WindowState, *xs):
    return tuple(None if x is None else x.to(state.M.dtype) for x in xs)


def omega_step(state: WindowState, q_t, k_t, v_t, window: int, gamma_t=None, alpha_t=None, eta_t=None,
               grad_at=None):
    """One token of the Omega rule. Returns (the state after token t, y_t = M_t phi(q_t) [B, H, V]).

    q_t, k_t [B,H,D] features; v_t [B,H,V]; gamma_t None, [B,H] (per source) or [B,H,c]
    (per offset); alpha_t, eta_t None or [B,H]. ``grad_at``: take the gradients at this
    state instead of M_{t-1} (``omega_frozen_seq`` passes the chunk-start state). Inputs
    are cast to the state's dtype. Shapes and window are checked here; value ranges are the caller's.
    """
    check_token(state.M, q_t, k_t, v_t, check_window(window), ("gamma_t", gamma_t),
                alpha_t=alpha_t, eta_t=eta_t)
    q_t, k_t, v_t, gamma_t = _as_state_dtype(state, q_t, k_t, v_t, gamma_t)
    keys, values, weights = window_rows(state, k_t, v_t, gamma_t)        # the last c pairs, t's own last
    M_grad = state.M if grad_at is None else grad_at                      # M_{t-1} (frozen: M_{t0})
    a_t, e_t = _per_bh(alpha_t, state.M), _per_bh(eta_t, state.M)
    M = a_t * state.M - e_t * window_gradient(M_grad, keys, values, weights)   # all c gradients at M_grad
    y_t = torch.einsum("bhvd,bhd->bhv", M, q_t)                           # y_t = M_t phi(q_t)
    return slide(M, keys, values, weights, gamma_t, window), y_t


def swla_step(state: WindowState, q_t, k_t, v_t, window: int, gamma_t=None, alpha_t=None, eta_t=None):
    """One token of SWLA: M_t = alpha_t M_{t-1} + eta_t sum_i gamma_i^{(t)} v_i phi(k_i)^T. Arguments and
    results as ``omega_step``."""
    check_token(state.M, q_t, k_t, v_t, check_window(window), ("gamma_t", gamma_t), alpha_t=alpha_t, eta_t=eta_t)
    q_t, k_t, v_t, gamma_t = _as_state_dtype(state, q_t, k_t, v_t, gamma_t)
    keys, values, weights = window_rows(state, k_t, v_t, gamma_t)
    write = torch.einsum("bhn,bhnv,bhnd->bhvd", weights, values, keys)    # sum_i gamma_i v_i phi(k_i)^T
    a_t, e_t = _per_bh(alpha_t, state.M), _per_bh(eta_t, state.M)
    M = a_t * state.M + e_t * write                                       # no state in the write
    y_t = torch.einsum("bhvd,bhd->bhv", M, q_t)
    return slide(M, keys, values, weights, gamma_t, window), y_t


def _start(q, v, initial_state):
    """The loops' start state: M_0 (zeros unless given) in the compute dtype, an empty window."""
    return start_window(start_memory(q, v, initial_state))


def _at(x, t):
    """Token t of an optional per-token tensor [B, H, T, ...] (None stays None)."""
    return None if x is None else x[:, :, t]


def scan_tokens(step, state, q, k, v, *gates, freeze_every: int | None = None):
    """``state, y_t = step(state, q_t, k_t, v_t, *gates_t)`` for every token t in order.

    q, k: [B, H, T, D]; v: [B, H, T, V]; each gate None or [B, H, T, ...]. ``freeze_every=b``:
    the frozen-gradient oracles of the chunk forms; ``step`` also gets ``grad_at``, the memory
    ``state.M`` at the start of t's b-token chunk. Returns (o [B, H, T, V] in q's dtype, the
    final state).
    """
    outputs = []
    for t in range(q.shape[2]):
        extra = {}
        if freeze_every is not None:
            if t % freeze_every == 0:
                M_start = state.M                                     # M_{t0}: frozen for this chunk
            extra = {"grad_at": M_start}
        state, y_t = step(state, q[:, :, t], k[:, :, t], v[:, :, t], *(_at(g, t) for g in gates), **extra)
        outputs.append(y_t)
    return torch.stack(outputs, dim=2).to(q.dtype), state


def omega_recurrent(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None):
    """The per-token Omega rule (gradients at M_{t-1}).

    q, k: [B,H,T,D] features; v: [B,H,T,V]; window: c >= 1; gamma: None, [B,H,T] or
    [B,H,T,c]; alpha, eta: None or [B,H,T]. Returns (o [B,H,T,V] in q's dtype, M_T [B,H,V,D]).
    Shapes and window are checked here; value ranges are the caller's (``omega_rule`` checks them).
    """
    check_form_shapes(q, k, v, window=check_window(window), gamma=gamma, alpha=alpha, eta=eta)
    state = _start(q, v, initial_state)                       # M_0 and an empty window
    outputs = []
    for t in range(q.shape[2]):
        state, y_t = omega_step(state, q[:, :, t], k[:, :, t], v[:, :, t], window,
                                _at(gamma, t), _at(alpha, t), _at(eta, t))
        outputs.append(y_t)
    return torch.stack(outputs, dim=2).to(q.dtype), state.M


def omega_frozen_seq(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None,
                     chunk_size=DEFAULT_CHUNK_SIZE):
    """The Omega rule with every gradient frozen at its chunk-start state (book ch. 4 §8).

    Chunks are tokens [0, b), [b, 2b), ...; for t in a chunk starting at t0 the window's
    gradients are taken at M_{t0}, the state after the previous chunk (the initial state
    for the first), *including* those of window tokens that lie in the previous chunk.
    Sequential, so it is the oracle that the chunkwise form must match for every b.
    At b = 1 it is ``omega_recurrent``. Same arguments and results as ``omega_recurrent``.
    Shapes, window and chunk_size are checked here; value ranges are the caller's.
    """
    check_form_shapes(q, k, v, window=check_window(window), gamma=gamma, alpha=alpha, eta=eta)
    check_chunk_size(chunk_size)
    o, state = scan_tokens(lambda s, *x, **kw: omega_step(s, *x[:3], window, *x[3:], **kw),
                           _start(q, v, initial_state), q, k, v, gamma, alpha, eta, freeze_every=chunk_size)
    return o, state.M


def swla_recurrent(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None):
    """Per-token SWLA: M_t = alpha_t M_{t-1} + eta_t sum_{i in window} gamma_i^{(t)} v_i phi(k_i)^T.

    Same arguments and results as ``omega_recurrent``. Shapes and window are checked here; value ranges
    are the caller's (``swla`` checks them).
    """
    check_form_shapes(q, k, v, window=check_window(window), gamma=gamma, alpha=alpha, eta=eta)
    o, state = scan_tokens(lambda s, *x: swla_step(s, *x[:3], window, *x[3:]),
                           _start(q, v, initial_state), q, k, v, gamma, alpha, eta)
    return o, state.M
