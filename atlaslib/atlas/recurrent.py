"""The definition: ATLAS with a linear memory, one token at a time.

ATLAS (book ch. 5; [A] eqs 32-33 with the signs of gradient descent, see book/errata.md) keeps a
momentum S of the windowed gradients and moves the memory along its Newton–Schulz
orthogonalisation:

    ∇_t = sum_{i=t-c+1}^{t} gamma_i^{(t)} grad l2(M_{t-1}; phi(k_i), v_i)
        = sum_i gamma_i^{(t)} (M_{t-1} phi(k_i) - v_i) phi(k_i)^T          (the Omega window)
    S_t = theta_t S_{t-1} + ∇_t                                          (momentum on raw gradients)
    M_t = alpha_t M_{t-1} - eta_t NS_J(S_t)                              (eta outside NS)
    y_t = M_t phi(q_t)                                                   (read out after the update)

with l2(M; k, v) = 1/2 ||M k - v||^2. Newton–Schulz normalises its input, so a step size
placed inside S (as Titans does) would be erased: eta multiplies NS_J(S_t). With J = 0
(``ns_steps=0``, NS_0 = identity) the rule is momentum with eta outside the buffer; with
theta = 0 as well it is the Omega rule (``atlaslib.omega.omega_rule``); see book ch. 5
for the exact reductions to Titans, the delta rule and OmegaNet.

``atlas_step`` is one token, the body of both loops. What a token needs from the past is
M, S and the last c - 1 pairs of its window (``AtlasState``), so its size never grows
with the number of tokens. The window machinery (rows, per-offset gates, the windowed
gradient) is chapter 4's (``atlaslib.omega.recurrent``).

``atlas_frozen_seq`` is the same loop with every gradient of a chunk [t0, t0 + b) taken
at the chunk-start state M_{t0} (window rows that reach into the previous chunk too): the
sequential oracle of the chunkwise form (book ch. 5). At b = 1 it is
``atlas_recurrent``.

Here q, k are already features phi(q), phi(k) of width D; states are [B, H, V, D]; the
window gates come per offset, G [B, H, T, c] (``core.windows.window_gates`` makes them
from either parametrisation).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.chunking import start_memory
from ..core.newton_schulz import newton_schulz
from ..core.validation import check_chunk_size, check_form_shapes, check_shape, check_window
from ..miras import DEFAULT_CHUNK_SIZE
from ..omega.recurrent import (WindowState, _per_bh, check_token, scan_tokens, start_window, window_gradient,
                              window_rows)


class AtlasState(NamedTuple):
    """What ATLAS carries from one token to the next: the memory M and the momentum S
    [B, H, V, D], and the window's last c - 1 pairs (``window``, whose own M is not used)."""
    M: torch.Tensor
    S: torch.Tensor
    window: WindowState


def start_state(M: torch.Tensor, S: torch.Tensor | None = None) -> AtlasState:
    """The state before the first token: M_0, S_0 (zeros unless given) and an empty window."""
    return AtlasState(M, torch.zeros_like(M) if S is None else S, start_window(M))


def atlas_step(state: AtlasState, q_t, k_t, v_t, window: int, G_t=None, alpha_t=None, eta_t=None, theta_t=None,
               ns_steps: int = 5, ns_coeffs="muon", grad_at=None):
    """One token of ATLAS. Returns (the state after token t, y_t = M_t phi(q_t) [B, H, V]).

    q_t, k_t [B, H, D]; v_t [B, H, V]; G_t [B, H, c] per-offset window gates, [B, H] this token's
    per-source gate (the state keeps those of the last c - 1 tokens) or None (ones);
    alpha_t, eta_t, theta_t [B, H] or None (1, 1 and 0). ``grad_at``: take the gradients at
    this memory instead of M_{t-1} (``atlas_frozen_seq`` passes the chunk-start state).
    Shapes and window are checked here; value ranges are the caller's (``atlas`` checks them).
    """
    check_token(state.M, q_t, k_t, v_t, check_window(window), ("G_t", G_t), alpha_t=alpha_t, eta_t=eta_t,
                theta_t=theta_t)
    dtype = state.M.dtype
    q_t, k_t, v_t = q_t.to(dtype), k_t.to(dtype), v_t.to(dtype)
    G_t = None if G_t is None else G_t.to(dtype)
    keys, values, weights = window_rows(state.window, k_t, v_t, G_t)          # the last c pairs, t's own last
    grad = window_gradient(state.M if grad_at is None else grad_at, keys, values, weights)    # ∇_t
    S = grad if theta_t is None else _per_bh(theta_t, state.M) * state.S + grad              # S_t
    M = _per_bh(alpha_t, state.M) * state.M - _per_bh(eta_t, state.M) * newton_schulz(S, ns_steps, ns_coeffs)
    y_t = torch.einsum("bhvd,bhd->bhv", M, q_t)                                # y_t = M_t phi(q_t)
    drop = max(keys.shape[2] - (window - 1), 0)                                # the oldest pair leaves
    rows = WindowState(M, keys[:, :, drop:], values[:, :, drop:], weights[:, :, drop:])
    return AtlasState(M, S, rows), y_t


def _loop(q, k, v, window, G, alpha, eta, theta, ns_steps, ns_coeffs, initial_state, initial_momentum, chunk_size):
    B, H, T, D, V = check_form_shapes(q, k, v, alpha=alpha, eta=eta, theta=theta)
    check_shape("G", G, (B, H, T, check_window(window)), ref=q)          # per offset (``core.windows.window_gates``)
    check_shape("initial_momentum", initial_momentum, (B, H, V, D))
    M0 = start_memory(q, v, initial_state)
    state = start_state(M0, None if initial_momentum is None else initial_momentum.to(M0.dtype))
    o, state = scan_tokens(lambda s, *x, **kw: atlas_step(s, *x[:3], window, *x[3:], ns_steps, ns_coeffs, **kw),
                           state, q, k, v, G, alpha, eta, theta, freeze_every=chunk_size)
    return o, state.M, state.S


def atlas_recurrent(q, k, v, window=1, G=None, alpha=None, eta=None, theta=None, ns_steps=5, ns_coeffs="muon",
                    initial_state=None, initial_momentum=None):
    """The per-token ATLAS rule with a linear memory (gradients at M_{t-1}).

    q, k [B, H, T, D] features; v [B, H, T, V]; window c >= 1; G None or [B, H, T, c] per-offset
    window gates (``core.windows.window_gates``); alpha, eta, theta None or [B, H, T];
    initial_state, initial_momentum None or [B, H, V, D]. Returns (o [B, H, T, V] in q's dtype,
    M_T, S_T [B, H, V, D] in fp32, fp64 for fp64 inputs). Shapes and window are checked here; value
    ranges are the caller's (``atlas`` checks them).
    """
    return _loop(q, k, v, window, G, alpha, eta, theta, ns_steps, ns_coeffs, initial_state, initial_momentum, None)


def atlas_frozen_seq(q, k, v, window=1, G=None, alpha=None, eta=None, theta=None, ns_steps=5, ns_coeffs="muon",
                     initial_state=None, initial_momentum=None, chunk_size=DEFAULT_CHUNK_SIZE):
    """ATLAS with every gradient frozen at its chunk-start state M_{t0} (book ch. 5).

    Sequential, so it is the oracle that ``atlas_chunk(b)`` must match for every b; at b = 1 it
    is ``atlas_recurrent``. Arguments and results as ``atlas_recurrent``; chunk_size is checked here too.
    """
    return _loop(q, k, v, window, G, alpha, eta, theta, ns_steps, ns_coeffs, initial_state, initial_momentum,
                 check_chunk_size(chunk_size))


__all__ = ["AtlasState", "start_state", "atlas_step", "atlas_recurrent", "atlas_frozen_seq"]
