"""Causal softmax attention: the non-parametric memory every chapter compares against."""
from __future__ import annotations

import math

import torch

from .validation import check_int, check_qkv


def softmax_attention(q, k, v, *, window: int | None = None, scale: float | None = None):
    """y_t = sum_{j<=t} softmax_j(q_t.k_j * scale) v_j, optionally over the last ``window`` keys.

    q, k: [B, H, T, K]; v: [B, H, T, V]; returns [B, H, T, V]. ``scale`` defaults to
    1/sqrt(K). With ``window=c`` only keys j in (t-c, t] are attended (sliding-window
    attention, SWA). Computed in fp32 and returned in q's dtype.
    """
    B, H, T, K, V = check_qkv(q, k, v)
    if window is not None:
        check_int("window", window, 1, " (or None: every past key)")
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    s = torch.einsum("bhtk,bhjk->bhtj", q.float(), k.float()) * scale
    t = torch.arange(T, device=q.device)
    allowed = t[None, :] <= t[:, None]
    if window is not None:
        allowed &= t[None, :] > t[:, None] - window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhtj,bhjv->bhtv", s.softmax(-1), v.float()).to(q.dtype)
