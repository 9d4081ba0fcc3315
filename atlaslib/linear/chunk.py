"""The algorithm: chunkwise-parallel linear attention, exact for every chunk size.

Inside a chunk that starts from state S (the state after the previous chunk), with
g_t = sum_{j<=t} log alpha_j accumulated from the chunk start,

    y_t = e^{g_t} S q_t + sum_{i<=t in chunk} e^{g_t - g_i} (k_i . q_t) v_i
    S'  = e^{g_b} S + sum_i e^{g_b - g_i} v_i k_i^T

(per-channel gates: the exponentials act channel by channel on the key side). Only
differences g_t - g_i with i <= t are exponentiated, so every factor lies in [0, 1]
and nothing overflows however strong the decay (book ch. 1 §7).

With per-channel gates the scores sum_c q_tc k_ic e^{g_tc - g_ic} would need an
[n, n, K] tile of decays. ``channel_scores`` avoids it: when the chunk's total decay is
at most SPLIT_SPAN (in log units), e^{g_tc - g_ic} = e^{g_tc} e^{-g_ic} with both
factors inside [e^-SPLIT_SPAN, e^SPLIT_SPAN], so the scores are one matrix product of
q e^g and k e^-g (each product of two factors is the exact term; nothing can overflow).
A chunk that decays more is split in halves: the off-diagonal block takes its
reference at the split, where both exponents are <= 0, and each half recurses.
Scalar gates take the same route (a scalar gate is a per-channel gate with equal
channels): the factors are then vectors, and no [n, n] matrix of exponentials is formed.
"""
from __future__ import annotations

import torch

from ..core.chunking import causal_decay, chunk_run, compute_dtype, from_chunks, gate_logs, log_gate, to_chunks  # noqa: F401


# Largest total per-channel decay (log units) of a block scored as one matrix product:
# factors e^{+-g} stay within e^30 ~ 1e13, far from fp32 overflow.
SPLIT_SPAN = 30.0


def channel_scores(x: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Causal per-channel decayed scores, [..., n, n]:

        out[t, i] = sum_c x_tc k_ic e^{g_tc - g_ic}   for i <= t, 0 above the diagonal,

    for x [..., n, K] (queries, or keys), k [..., n, K] and g [..., n, K] the log-gates
    accumulated from the block start (non-increasing, <= 0; leading dims broadcast).
    """
    n = g.shape[-2]
    if n == 1:                                                   # e^0: a plain dot product
        return (x * k).sum(-1, keepdim=True)
    if -g[..., -1, :].min().item() <= SPLIT_SPAN:               # bounded factors: one product
        return ((x * torch.exp(g)) @ (k * torch.exp(-g)).mT).tril_()
    h = n // 2
    r = g[..., h - 1:h, :]                                       # log-gate at the split
    top = channel_scores(x[..., :h, :], k[..., :h, :], g[..., :h, :])
    bottom = channel_scores(x[..., h:, :], k[..., h:, :], g[..., h:, :] - r)
    cross = (x[..., h:, :] * torch.exp(g[..., h:, :] - r)) @ (k[..., :h, :] * torch.exp(r - g[..., :h, :])).mT
    upper = torch.zeros(*cross.shape[:-2], h, n - h, dtype=cross.dtype, device=cross.device)
    return torch.cat([torch.cat([top, upper], -1), torch.cat([cross, bottom], -1)], -2)


def decayed_scores(xs, k, g):
    """Everything the gates touch in a chunk (or in all chunks at once).

    xs: a tuple of row sets [..., n, K] scored against the keys (the queries; chapter 2 adds
    the keys themselves); k: [..., n, K]; g: None, [..., n] (scalar) or [..., n, K] (per
    channel), log-gates accumulated from the chunk start. Returns (Ps, x_decs, k_end, s_dec):
    for each x the causal decayed scores P[t, i] = x_t . k_i e^{g_t - g_i} [..., n, n] and
    x * e^g; then k * e^{g_n - g}, and the factor e^{g_n} (None, [..., 1, 1] or [..., 1, K])
    that multiplies the start state.

    When the chunk's decay is bounded (the usual case) the scores are ``channel_scores``'s
    one product, with the factors e^{+-g} computed once for all row sets.
    """
    if g is None:
        return tuple((x @ k.mT).tril_() for x in xs), xs, k, None
    if g.dim() < k.dim():       # a scalar gate is a per-channel gate with equal channels: [..., n, 1]
        g = g[..., None]        # broadcasts over K, so the decay factors are vectors, not an [n, n] tile
    s_dec, e = torch.exp(g[..., -1:, :]), torch.exp(g)
    x_decs = tuple(x * e for x in xs)
    if -g[..., -1, :].min().item() <= SPLIT_SPAN:               # e^{g_t - g_i} = e^{g_t} e^{-g_i}
        k_inv = k / e                                            # e^{-g_i} <= e^SPLIT_SPAN here
        return tuple((x_dec @ k_inv.mT).tril_() for x_dec in x_decs), x_decs, k_inv * s_dec, s_dec
    return tuple(channel_scores(x, k, g) for x in xs), x_decs, k * torch.exp(g[..., -1:, :] - g), s_dec


def chunk_step(S, q, k, v, g):
    """One chunk. S: [B,H,V,K]; q,k: [B,H,n,K]; v: [B,H,n,V]; g: None, [B,H,n] or [B,H,n,K].

    Returns (o [B,H,n,V], S at the chunk's end).
    """
    (P,), (q_dec,), k_end, s_dec = decayed_scores((q,), k, g)
    o = q_dec @ S.mT + P @ v
    return o, (S if s_dec is None else S * s_dec) + v.mT @ k_end


def linear_attention_chunk(q, k, v, alpha=None, initial_state=None, chunk_size=64, log_alpha=None):
    """Chunkwise form; same arguments and results as ``linear_attention_recurrent``.

    The gates may instead be given as ``log_alpha`` (same shape), used without rounding.

    Does what a loop of ``chunk_step`` does, in three phases: the scores and gated q, k of
    all chunks at once, the chunk-to-chunk state recurrence (the only sequential part, one
    matrix product per chunk), then all outputs at once.
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    S = torch.zeros(B, H, V, K, dtype=cd, device=q.device) if initial_state is None else initial_state.to(cd)
    if T == 0:
        return v.to(out_dtype), S
    C = min(chunk_size, T)
    N = -(-T // C)
    q, k, v = (chunk_run(to_chunks(x, C), 0, N) for x in (q, k, v))
    logs = gate_logs(alpha, log_alpha, cd)                       # padding: log-gate 0 keeps everything
    g = None if logs is None else chunk_run(to_chunks(logs, C), 0, N).cumsum(dim=2)
    (P,), (q_dec,), k_end, s_dec = decayed_scores((q,), k, g)
    S = S.reshape(B * H, V, K)
    starts = []
    for c in range(q.shape[0]):                                  # S_{c+1} = S_c e^{g_n} + V^T (K e^{g_n - g})
        starts.append(S)
        S = torch.baddbmm(S if s_dec is None else S * s_dec[c], v[c].mT, k_end[c])
    o = q_dec @ torch.stack(starts).mT + P @ v                  # every chunk reads its start state
    return from_chunks(o, B, H, T).to(out_dtype), S.reshape(B, H, V, K)
