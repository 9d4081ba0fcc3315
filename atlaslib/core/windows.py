"""Sliding-window gates shared by the Omega rule (book ch. 4) and the MIRAS engine (ch. 3, ch. 5).

A window of c tokens weighs the gradient of token i seen at step t by gamma_i^{(t)}. Two
parametrisations are accepted: one gate per source token ([B, H, T]) or one per offset
([B, H, T, c]); ``window_gates`` turns both into per-offset gates, ``band_gates`` lays one
chunk's gates out as the b x (b + c - 1) band over its window rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .validation import check_shape, check_window


def window_gates(gamma, B: int, H: int, T: int, window: int, dtype, device) -> torch.Tensor:
    """Both gamma parametrisations as per-offset gates G [B, H, T, c]: G[t, j] = gamma_{t-j}^{(t)}.

    ``None`` is all ones; per source token [B, H, T] becomes G[t, j] = gamma[t - j]; per
    offset [B, H, T, c] is used as is. Entries whose source token t - j < 0 does not
    exist are set to 0. Shapes and window are checked here; values in [0, 1] are the caller's.
    """
    c = check_window(window)
    check_shape("gamma", gamma, (B, H, T), (B, H, T, c))
    if gamma is None:
        G = torch.ones(B, H, T, c, dtype=dtype, device=device)
    elif gamma.dim() == 3:
        padded = F.pad(gamma.to(dtype), (c - 1, 0))                 # gamma_{-c+1..-1} = 0 (no such token)
        G = padded.unfold(-1, c, 1).flip(-1)                         # [B, H, T, c]: G[t, j] = gamma[t - j]
    else:
        G = gamma.to(dtype)
    exists = torch.arange(c, device=device)[None, :] <= torch.arange(T, device=device)[:, None]
    return G * exists


def band_gates(G: torch.Tensor, window: int) -> torch.Tensor:
    """The banded gate matrix Gamma [B, H, n, n + c - 1] of one chunk from its per-offset gates G [B, H, n, c].

    Column col is window row i = col - (c - 1) (chunk-local, so negative i lie in the
    previous chunk); Gamma[t, col] = G[t, t - i] when 0 <= t - i < c, else 0.
    """
    B, H, n, c = G.shape
    t = torch.arange(n, device=G.device)[:, None]
    col = torch.arange(n + c - 1, device=G.device)[None, :]
    offset = t + (c - 1) - col                                       # j = t - i
    inside = (offset >= 0) & (offset < c)
    picked = G.gather(-1, offset.clamp(0, c - 1).expand(B, H, n, n + c - 1))
    return picked * inside
