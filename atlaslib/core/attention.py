"""Causal softmax attention: the non-parametric memory every chapter compares against."""
from __future__ import annotations

import math

import torch

from .chunking import compute_dtype
from .validation import check_int, check_qkv


def softmax_attention(q, k, v, *, window: int | None = None, scale: float | None = None):
    """y_t = sum_{j<=t} softmax_j(q_t.k_j * scale) v_j, optionally over the last ``window`` keys.

    q, k: [B, H, T, K]; v: [B, H, T, V]; returns [B, H, T, V]. ``scale`` defaults to
    1/sqrt(K). With ``window=c`` only keys j in (t-c, t] are attended (sliding-window
    attention, SWA). Computed in fp32 (fp64 for fp64 inputs) and returned in q's dtype.
    """
    B, H, T, K, V = check_qkv(q, k, v)
    if window is not None:
        check_int("window", window, 1, " (or None: every past key)")
    if scale is None:
        scale = 1.0 / math.sqrt(K)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (None: 1/sqrt(K)), got {scale!r}")
    cd = compute_dtype(q)
    if window is not None and 2 * window < T:     # the band alone: O(T c) memory, not a [T, T] matrix
        return banded_attention(q.to(cd), k.to(cd), v.to(cd), window, scale).to(q.dtype)
    s = torch.einsum("bhtk,bhjk->bhtj", q.to(cd), k.to(cd)) * scale
    t = torch.arange(T, device=q.device)
    allowed = t[None, :] <= t[:, None]
    if window is not None:
        allowed &= t[None, :] > t[:, None] - window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhtj,bhjv->bhtv", s.softmax(-1), v.to(cd)).to(q.dtype)


def banded_attention(q, k, v, c, scale):
    """``softmax_attention`` with window c, a block of c queries at a time: query t = i c + a of block i
    sees keys (t - c, t], all in blocks i - 1 and i, so each block's scores are [c, 2c] (the [T, T]
    matrix of the dense form, masked to its band, costs O(T^2) for any window)."""
    B, H, T, _ = q.shape
    n = -(-T // c)                                               # blocks of c queries, the last one padded

    def blocks(x, front):                                        # [B, H, n + front, c, .]
        return torch.nn.functional.pad(x, (0, 0, front * c, n * c - T)).unflatten(2, (n + front, c))
    kb, vb = blocks(k, 1), blocks(v, 1)                          # a block of zeros in front (masked below)
    keys = torch.cat([kb[:, :, :-1], kb[:, :, 1:]], dim=3)       # [B, H, n, 2c, K]: blocks i - 1 and i
    values = torch.cat([vb[:, :, :-1], vb[:, :, 1:]], dim=3)
    # contiguous: padding a view by nothing (T a multiple of c) keeps its strides in eager mode, which a
    # compiled graph's view of the blocks does not expect
    s = torch.einsum("bhiak,bhijk->bhiaj", blocks(q.contiguous(), 0), keys) * scale
    a = torch.arange(c, device=q.device)[:, None]                # query t = i c + a
    j = torch.arange(2 * c, device=q.device)[None, :]            # key i c - c + j
    i = torch.arange(n, device=q.device)[:, None, None]
    allowed = (j > a) & (j <= a + c) & (i * c - c + j >= 0)     # t - c < key <= t, not the zeros in front
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhiaj,bhijv->bhiav", p, values).flatten(2, 3)[:, :, :T]


def cached_attention(q, keys, values):
    """Queries q [B, H, t, K] against cached keys [B, H, n, K] and values [B, H, n, V], every one of them
    visible (a generation step): softmax(q keys^T / sqrt(K)) values, computed as ``softmax_attention``."""
    cd = compute_dtype(q)
    scores = torch.einsum("bhqk,bhjk->bhqj", q.to(cd), keys.to(cd)) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqj,bhjv->bhqv", scores.softmax(-1), values.to(cd)).to(q.dtype)
