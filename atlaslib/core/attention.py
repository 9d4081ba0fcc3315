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
    s = torch.einsum("bhtk,bhjk->bhtj", q.to(cd), k.to(cd)) * scale
    t = torch.arange(T, device=q.device)
    allowed = t[None, :] <= t[:, None]
    if window is not None:
        allowed &= t[None, :] > t[:, None] - window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhtj,bhjv->bhtv", s.softmax(-1), v.to(cd)).to(q.dtype)


def cached_attention(q, keys, values):
    """Queries q [B, H, t, K] against cached keys [B, H, n, K] and values [B, H, n, V], every one of them
    visible (a generation step): softmax(q keys^T / sqrt(K)) values, computed as ``softmax_attention``."""
    cd = compute_dtype(q)
    scores = torch.einsum("bhqk,bhjk->bhqj", q.to(cd), keys.to(cd)) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqj,bhjv->bhqv", scores.softmax(-1), values.to(cd)).to(q.dtype)
