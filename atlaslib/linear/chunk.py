"""The algorithm: chunkwise-parallel linear attention, exact for every chunk size.

Inside a chunk of b tokens that starts from the memory M = M_{t0} (the state after the
previous chunk), with g_t = sum_{j<=t} log alpha_j accumulated from the chunk start,

    y_t    = e^{g_t} M q_t + sum_{i<=t in chunk} e^{g_t - g_i} (k_i . q_t) v_i
    M_next = e^{g_b} M + sum_i e^{g_b - g_i} v_i k_i^T

(per-channel gates: the exponentials act channel by channel on the key side). Only
differences g_t - g_i with i <= t are exponentiated, so every factor lies in [0, 1]
and nothing overflows however strong the decay (book ch. 1 §7).

With per-channel gates the scores sum_c q_tc k_ic e^{g_tc - g_ic} would need an
[n, n, K] tile of decays. ``halving_scores`` avoids it by halving the chunk, level by
level: the block of the second half's rows against the first half's keys is one matrix
product, with the reference token r taken at the end of the first half,

    (x_t e^{g_t - g_r}) . (k_i e^{g_r - g_i}),   both exponents <= 0 (g is non-increasing),

so no factor exceeds 1 and a factor that underflows stands for a term that is smaller
still. The two halves are scored the same way, down to single tokens (e^0: a plain dot
product). The factors of each level are products of the previous level's (one exponential
per entry in all), and the structure depends only on n, never on the gates' values: nothing
waits for the device to report them, and torch.compile sees one graph. Scalar gates need no
tile: their scores are x k^T times the masked [n, n] matrix of e^{g_t - g_i} (``causal_decay``).
"""
from __future__ import annotations

import torch

from ..core.chunking import (causal_decay, chunk_run, compute_dtype, cumulative_logs, from_chunks,  # noqa: F401
                             gate_logs, log_gate, start_memory, to_chunks)
from ..core.validation import check_chunk_size, check_form_shapes


def _pad_rows(x: torch.Tensor, rows: int, last: bool = False) -> torch.Tensor:
    """x [..., n, K] with ``rows`` more rows: zeros, or copies of the last row (``last``)."""
    if rows == 0:
        return x
    fill = x[..., -1:, :] if last else torch.zeros_like(x[..., :1, :])
    return torch.cat([x, fill.expand(*x.shape[:-2], rows, x.shape[-1])], -2)


def _lower_left_blocks(out: torch.Tensor, b: int) -> torch.Tensor:
    """A view [..., b, b, pairs] of out [..., m, m]: for each pair of neighbouring size-b blocks
    on the diagonal, the rows of the second block against the columns of the first."""
    m = out.shape[-1]
    grid = out.unflatten(-1, (m // (2 * b), 2, b)).unflatten(-4, (m // (2 * b), 2, b))
    return torch.diagonal(grid, 0, -6, -3)[..., 1, :, 0, :, :]


def halving_scores(xs, k: torch.Tensor, g: torch.Tensor):
    """Causal decayed scores of each row set x in ``xs`` (module docstring), and the gate factors.

    xs: a tuple of [..., m, K]; k: [..., m, K]; g: [..., m, K] or [..., m, 1], log-gates
    accumulated from the block start (non-increasing, <= 0); m a power of two. Returns
    (Ps, e^g, e^{g_m - g}) with P[t, i] = sum_c x_tc k_ic e^{g_tc - g_ic} for i <= t, else 0.

    While blocks of size b are paired, w[t] = e^{g_t - g_s} (s: the row before t's block) is the
    factor of a second-half row and v[i] = e^{g_e - g_i} (e: the end of i's block) that of a
    first-half key. Merging a pair multiplies the second half's w by the first half's last w,
    and the first half's v by the second half's last w: products of factors <= 1, so one
    exponential per entry (e^{log alpha}) serves every level.
    """
    m = g.shape[-2]
    outs = tuple(torch.zeros(*x.shape[:-2], m, m, dtype=x.dtype, device=x.device) for x in xs)
    for x, out in zip(xs, outs):
        out.diagonal(0, -2, -1).copy_((x * k).sum(-1))            # a token against itself: e^0
    logs = torch.diff(g, dim=-2, prepend=torch.zeros_like(g[..., :1, :]))   # from an fp64 g: fp32-exact
    # alpha_t and the products below in g's dtype (fp64 for fp32 inputs), rounded to k's where they meet x
    # and k: products of fp32 factors put one rounding per level into every decay, and alike gates round
    # alike, so the error of the chunk-end decay added up over the chunks (linearly in T)
    w = torch.exp(logs)
    v = torch.ones_like(w)
    b = 1
    while b < m:                                                 # log2(m) levels, fixed by m alone
        halves = (m // (2 * b), 2, b)                             # [pairs, first/second half, b]
        (w1, w2), (v1, _) = w.unflatten(-2, halves).unbind(-3), v.unflatten(-2, halves).unbind(-3)
        cols = k.unflatten(-2, halves)[..., 0, :, :] * v1.to(k.dtype)       # first-half keys: e^{g_r - g_i}
        for x, out in zip(xs, outs):                                        # second-half rows: e^{g_t - g_r}
            cross = (x.unflatten(-2, halves)[..., 1, :, :] * w2.to(k.dtype)) @ cols.mT   # [..., pairs, b, b]
            _lower_left_blocks(out, b).copy_(cross.movedim(-3, -1))
        one = torch.ones_like(w1[..., -1:, :])                   # [..., pairs, 1, K]
        w = (w.unflatten(-2, halves) * torch.stack([one, w1[..., -1:, :]], -3)).flatten(-4, -2)
        v = (v.unflatten(-2, halves) * torch.stack([w2[..., -1:, :], one], -3)).flatten(-4, -2)
        b *= 2
    return outs, w.to(k.dtype), v.to(k.dtype)


def scalar_gate_terms(xs, k, g):
    """``decayed_scores`` for scalar log-gates g [..., n]: the scores are (x k^T) * D with
    D = ``causal_decay(g)``, e^{g_t - g_i} masked to i <= t before the exponential, so every
    exponent is <= 0 and the [n, n] matrix costs one exponential per entry and one product.
    The exponents are differences taken in g's dtype; D and the factors come out in k's."""
    n, cd = g.shape[-1], k.dtype
    D = causal_decay(g, torch.ones(n, n, dtype=torch.bool, device=g.device).tril(), cd)
    e = torch.exp(g).to(cd)[..., None]                            # [..., n, 1]
    return (tuple((x @ k.mT) * D for x in xs), tuple(x * e for x in xs),
            k * torch.exp(g[..., -1:] - g).to(cd)[..., None], e[..., -1:, :])


def decayed_scores(xs, k, g):
    """Everything the gates touch in a chunk (or in all chunks at once).

    xs: a tuple of row sets [..., n, K] scored against the keys (the queries; chapter 2 adds
    the keys themselves); k: [..., n, K]; g: None, [..., n] (scalar) or [..., n, K] (per
    channel), log-gates accumulated from the chunk start (fp64 from ``cumulative_logs``: the factors
    are differences of g, rounded to k's dtype after they are taken). Returns (Ps, x_decs, k_end, m_dec):
    for each x the causal decayed scores P[t, i] = x_t . k_i e^{g_t - g_i} [..., n, n] and
    x * e^g; then k * e^{g_n - g}, and the factor e^{g_n} (None, [..., 1, 1] or [..., 1, K])
    that multiplies the start memory.

    Per-channel gates: ``halving_scores`` does the work, on n padded to a power of two with zero
    rows (they score 0) and log-gate 0 (they decay nothing). Scalar gates: ``scalar_gate_terms``.
    """
    if g is None:
        return tuple((x @ k.mT).tril_() for x in xs), xs, k, None
    if g.dim() < k.dim():
        return scalar_gate_terms(xs, k, g)
    n = g.shape[-2]
    pad = (1 << (n - 1).bit_length()) - n                          # up to a power of two
    Ps, e, e_end = halving_scores(tuple(_pad_rows(x, pad) for x in xs), _pad_rows(k, pad),
                                  _pad_rows(g, pad, last=True))
    e, e_end = e[..., :n, :], e_end[..., :n, :]
    return tuple(P[..., :n, :n] for P in Ps), tuple(x * e for x in xs), k * e_end, e[..., -1:, :]


def chunk_step(M, q, k, v, g):
    """One chunk. M: [B,H,V,K], the memory at the chunk's start; q,k: [B,H,n,K]; v: [B,H,n,V];
    g: None, [B,H,n] or [B,H,n,K].

    Returns (o [B,H,n,V], the memory at the chunk's end).
    """
    (P,), (q_dec,), k_end, m_dec = decayed_scores((q,), k, g)
    o = q_dec @ M.mT + P @ v
    return o, (M if m_dec is None else M * m_dec) + v.mT @ k_end


def linear_attention_chunk(q, k, v, alpha=None, initial_state=None, chunk_size=64, log_alpha=None):
    """Chunkwise form; same arguments and results as ``linear_attention_recurrent``.

    The gates may instead be given as ``log_alpha`` (same shape), used without rounding.
    Shapes and chunk_size are checked here; value ranges are the caller's (``linear_attention`` checks them).

    Does what a loop of ``chunk_step`` does, in three phases: the scores and gated q, k of
    all chunks at once, the chunk-to-chunk state recurrence (the only sequential part, one
    matrix product per chunk), then all outputs at once.
    """
    B, H, T, K, V = check_form_shapes(q, k, v, alpha=alpha, log_alpha=log_alpha, per_channel=("alpha", "log_alpha"))
    check_chunk_size(chunk_size)
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    M = start_memory(q, v, initial_state)
    if T == 0:
        return v.to(out_dtype), M
    b = min(chunk_size, T)
    N = -(-T // b)
    q, k, v = (chunk_run(to_chunks(x, b), 0, N) for x in (q, k, v))
    logs = gate_logs(alpha, log_alpha, cd)                       # padding: log-gate 0 keeps everything
    g = None if logs is None else cumulative_logs(chunk_run(to_chunks(logs, b), 0, N), dim=2)   # fp64
    (P,), (q_dec,), k_end, m_dec = decayed_scores((q,), k, g)
    M = M.reshape(B * H, V, K)
    starts = []
    # The chunks are taken by unbind, not by indexing: in the backward, one stack of their
    # gradients instead of a zero-filled copy of the whole tensor per chunk.
    decays = [None] * N if m_dec is None else m_dec.unbind(0)
    for v_c, k_c, d_c in zip(v.unbind(0), k_end.unbind(0), decays):   # M_next = M e^{g_b} + V^T (K e^{g_b - g})
        starts.append(M)
        M = torch.baddbmm(M if d_c is None else M * d_c, v_c.mT, k_c)
    o = q_dec @ torch.stack(starts).mT + P @ v                  # every chunk reads its start memory
    return from_chunks(o, B, H, T).to(out_dtype), M.reshape(B, H, V, K)
