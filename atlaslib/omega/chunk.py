"""The algorithm: the chunkwise Omega rule (frozen gradients) and chunkwise SWLA (exact).

Split the sequence into chunks of b tokens. For a chunk that starts from M_{t0} (the
state after the previous chunk), replace every gradient grad l2(M_{t-1}; .) by
grad l2(M_{t0}; .) ([A] §3.3, book ch. 4 §8). Each window then contributes a *fixed*
rank-one term e_i phi(k_i)^T with the error e_i = M_{t0} phi(k_i) - v_i, and everything
left (retention, learning rates, window gates) is linear, so the whole chunk is a few
masked matrix products.

The window rows of a chunk are idx = [t0 - c + 2, t0 + b] (b + c - 1 rows): a window
of token t0 + 1 **reaches c - 1 tokens into the previous chunk**. [A] describes the
mask as "an identity with the c - 1 positions before each diagonal entry set to 1",
which, read as a b x b matrix, would cut every window at the chunk start (so that
b = 1 silently became c = 1); the b x (b + c - 1) band used here is the reading under
which b = 1 gives back the per-token rule (book ch. 4 §8 and book/errata.md).

With, inside the chunk (t, n = 1..b local; col over the b + c - 1 window rows):

    A_t         = alpha_{t0+1} ... alpha_{t0+t}                 cumulative retention
    D[t, n]     = A_t / A_n  (n <= t, else 0)                  = exp(g_t - g_n), g = cumsum log alpha
    Gamma[n, col] = gamma_i^{(n)} for row col = token i with n - c < i <= n   (the band)
    C           = D diag(eta) Gamma                             [b, b + c - 1]
    E           = Phi_K,idx M_{t0}^T - V_idx                    errors at M_{t0}, [b + c - 1, V]

the chunk's outputs and end state are

    Y          = diag(A) Phi_Q M_{t0}^T - (C * Phi_Q Phi_K,idx^T) E
    M_{t0+b}   = A_b M_{t0} - (C[b, :] * E^T) Phi_K,idx .

(C[t, col] is the total weight, summed over the steps n <= t that saw token col in their
window and decayed to step t, with which token col's frozen gradient enters M_t.)
SWLA uses the same formulas with E = -V_idx: its gradient -v phi(k)^T never depended on
M, so for SWLA nothing is frozen and the chunk form is exact for every b.

Only differences g_t - g_n with n <= t are exponentiated (``core.chunking.causal_decay``),
so every decay factor lies in [0, 1]; tokens before the sequence start are zero rows
with zero gates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.chunking import (causal_decay, chunk_windows, compute_dtype, cumulative_logs, gate_logs,
                             start_memory)
from ..core.validation import check_chunk_size, check_form_shapes, check_window
from ..core.windows import band_gates, window_gates  # noqa: F401  (window_gates: part of this room's story)
from ..miras.config import DEFAULT_CHUNK_SIZE  # the Omega rule is a MIRAS model: one default chunk length


def window_weights(G, eta, g, window):
    """C = D diag(eta) Gamma [B, H, n, n + c - 1]: the weight of each window row's gradient in each M_t.

    G: [B, H, n, c] per-offset gates of the chunk; eta: [B, H, n]; g: None or [B, H, n]
    log-retention accumulated from the chunk start (fp64 from ``cumulative_logs``).
    """
    n = G.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=G.device).tril()
    D = causal.to(G.dtype) if g is None else causal_decay(g, causal, G.dtype)
    return (D * eta[..., None, :]) @ band_gates(G, window)


def window_chunk_step(M, q, k_win, v_win, C, g, hebbian=False):
    """One chunk. M: [B,H,V,D], the memory M_{t0} at the chunk's start; q: [B,H,n,D]; k_win, v_win:
    the n + c - 1 window rows; C: [B,H,n,n+c-1]; g: None or [B,H,n].
    Returns (o [B,H,n,V], the memory at the chunk's end).
    """
    E = -v_win if hebbian else k_win @ M.transpose(-1, -2) - v_win   # errors at M_{t0} (SWLA: -v)
    scores = (q @ k_win.transpose(-1, -2)) * C
    qM = q @ M.transpose(-1, -2)
    if g is None:
        o, M_decayed = qM - scores @ E, M
    else:
        A = torch.exp(g).to(M.dtype)                                 # A_t = e^{g_t}
        o = A[..., None] * qM - scores @ E
        M_decayed = A[..., -1:, None] * M                            # A_b M_{t0}
    c_end = C[..., -1, :, None]                                      # C[b, :]
    return o, M_decayed - (E * c_end).transpose(-1, -2) @ k_win


def windowed_chunk(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None,
                   chunk_size=64, hebbian=False, log_alpha=None):
    """The chunk loop shared by the Omega rule (``hebbian=False``) and SWLA (``hebbian=True``).
    Shapes, window and chunk_size are checked here; value ranges are the caller's."""
    B, H, T, D, _ = check_form_shapes(q, k, v, window=check_window(window), gamma=gamma, alpha=alpha, eta=eta,
                                      log_alpha=log_alpha)
    c = window
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    M = start_memory(q, v, initial_state)
    G = window_gates(gamma, B, H, T, c, cd, q.device)
    eta = torch.ones(B, H, T, dtype=cd, device=q.device) if eta is None else eta.to(cd)
    logs = gate_logs(alpha, log_alpha, cd)
    k_pad = F.pad(k, (0, 0, c - 1, 0))                               # c - 1 zero rows before token 0
    v_pad = F.pad(v, (0, 0, c - 1, 0))
    outputs = []
    b = check_chunk_size(chunk_size)
    # chunk [s, e) of every input, cut once; the padded rows s .. e + c - 2 are the tokens s - c + 1 .. e - 1
    chunks = zip(*(chunk_windows(x, b) for x in (q, G, eta)), chunk_windows(k_pad, b, c - 1),
                 chunk_windows(v_pad, b, c - 1), chunk_windows(logs, b) or [None] * -(-T // b))
    for q_c, G_c, eta_c, k_w, v_w, logs_c in chunks:
        g = None if logs_c is None else cumulative_logs(logs_c, dim=2)   # fp64
        C = window_weights(G_c, eta_c, g, c)
        o, M = window_chunk_step(M, q_c, k_w, v_w, C, g, hebbian)
        outputs.append(o)
    return torch.cat(outputs, dim=2).to(out_dtype), M


def omega_chunk(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None,
                chunk_size=DEFAULT_CHUNK_SIZE, log_alpha=None):
    """Chunkwise Omega rule with gradients frozen at each chunk's start state.

    Equals ``omega_frozen_seq(..., chunk_size)`` for every chunk size and ``omega_recurrent``
    at chunk_size = 1; for chunk_size > 1 it is a different (approximate) model.
    Same arguments and results as ``recurrent.omega_frozen_seq``; the retention may instead come as
    ``log_alpha`` ([B, H, T], <= 0), used without rounding. Shapes, window and chunk_size are checked
    here; value ranges are the caller's (``omega_rule`` checks them).
    """
    return windowed_chunk(q, k, v, window, gamma, alpha, eta, initial_state, chunk_size, False, log_alpha)


def swla_chunk(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None, chunk_size=64,
               log_alpha=None):
    """Chunkwise SWLA, exact for every chunk size. Same arguments and results as ``swla_recurrent``, plus
    chunk_size and ``log_alpha`` (the retention as its log, instead of alpha). Shapes, window and chunk_size
    are checked here; value ranges are the caller's (``swla`` checks them)."""
    return windowed_chunk(q, k, v, window, gamma, alpha, eta, initial_state, chunk_size, True, log_alpha)
