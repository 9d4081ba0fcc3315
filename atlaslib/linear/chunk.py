"""The algorithm: chunkwise-parallel linear attention, exact for every chunk size.

Inside a chunk that starts from state S (the state after the previous chunk), with
g_t = sum_{j<=t} log alpha_j accumulated from the chunk start,

    y_t = e^{g_t} S q_t + sum_{i<=t in chunk} e^{g_t - g_i} (k_i . q_t) v_i
    S'  = e^{g_b} S + sum_i e^{g_b - g_i} v_i k_i^T

(per-channel gates: the exponentials act channel by channel on the key side). Only
differences g_t - g_i with i <= t are exponentiated, so every factor lies in [0, 1]
and nothing overflows however strong the decay (MATH.md §1).
"""
from __future__ import annotations

import torch

from .recurrent import compute_dtype

# log(alpha) is clamped here so that a gate of exactly 0 (a full reset) stays finite.
LOG_FLOOR = -60.0


def log_gate(alpha: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    return torch.log(alpha.to(cd)).clamp_min(LOG_FLOOR)


def causal_decay(g: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """D[t, i] = exp(g_t - g_i) for i <= t, else 0. g: [..., n] or [..., n, K] (per channel)."""
    if g.dim() == 3:                                            # scalar gates [B, H, n]
        diff = g[..., :, None] - g[..., None, :]
        return torch.exp(diff.masked_fill(~causal, float("-inf")))
    diff = g[..., :, None, :] - g[..., None, :, :]              # [B, H, n, n, K]
    return torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))


def chunk_step(S, q, k, v, g):
    """One chunk. S: [B,H,V,K]; q,k: [B,H,n,K]; v: [B,H,n,V]; g: None, [B,H,n] or [B,H,n,K].

    Returns (o [B,H,n,V], S at the chunk's end).
    """
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if g is None:
        scores = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
        o = q @ S.transpose(-1, -2) + scores @ v
        return o, S + v.transpose(-1, -2) @ k
    if g.dim() == 3:
        scores = (q @ k.transpose(-1, -2)) * causal_decay(g, causal)
        o = torch.exp(g)[..., None] * (q @ S.transpose(-1, -2)) + scores @ v
        g_last = g[..., -1:]                                     # [B, H, 1]
        v_decayed = v * torch.exp(g_last - g)[..., None]
        return o, torch.exp(g_last)[..., None] * S + v_decayed.transpose(-1, -2) @ k
    scores = torch.einsum("bhtc,bhic,bhtic->bhti", q, k, causal_decay(g, causal))
    o = (q * torch.exp(g)) @ S.transpose(-1, -2) + scores @ v
    g_last = g[..., -1:, :]                                      # [B, H, 1, K]
    k_decayed = k * torch.exp(g_last - g)
    return o, S * torch.exp(g_last) + v.transpose(-1, -2) @ k_decayed


def linear_attention_chunk(q, k, v, alpha=None, initial_state=None, chunk_size=64):
    """Chunkwise form; same arguments and results as ``linear_attention_recurrent``."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    S = torch.zeros(B, H, V, K, dtype=cd, device=q.device) if initial_state is None else initial_state.to(cd)
    logs = None if alpha is None else log_gate(alpha, cd)
    outputs = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        g = None if logs is None else logs[:, :, s:e].cumsum(dim=2)
        o, S = chunk_step(S, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g)
        outputs.append(o)
    return torch.cat(outputs, dim=2).to(out_dtype), S
