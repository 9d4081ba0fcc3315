"""The definition: linear attention and its gated (Hebbian) family, one token at a time.

    M_t = M_{t-1} * alpha_t + v_t k_t^T        (alpha_t: none, a scalar, or Diag on the key side)
    y_t = M_t q_t                              (read out after the update)

This is one gradient step with step size 1 on the dot-product attentional bias
-<M k_t, v_t>, whose gradient -v_t k_t^T does not depend on M (book ch. 1 §3).
"""
from __future__ import annotations

import torch

from ..core.chunking import compute_dtype


def decay_state(M: torch.Tensor, alpha_t: torch.Tensor | None) -> torch.Tensor:
    """M * alpha_t: a scalar per (batch, head), or Diag(alpha_t) acting on the key side."""
    if alpha_t is None:
        return M
    if alpha_t.dim() == 2:                      # [B, H]: RetNet / Mamba2-style scalar decay
        return M * alpha_t[:, :, None, None]
    return M * alpha_t[:, :, None, :]           # [B, H, K]: GLA-style M Diag(alpha_t)


def linear_attention_recurrent(q, k, v, alpha=None, initial_state=None):
    """Per-token loop. q, k: [B,H,T,K]; v: [B,H,T,V]; alpha: None, [B,H,T] or [B,H,T,K].

    Returns (o [B,H,T,V] in q's dtype, final state M_T [B,H,V,K] in fp32/fp64).
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    M = torch.zeros(B, H, V, K, dtype=cd, device=q.device) if initial_state is None else initial_state.to(cd)
    outputs = []
    for t in range(T):
        M = decay_state(M, None if alpha is None else alpha[:, :, t].to(cd))
        M = M + v[:, :, t, :, None] * k[:, :, t, None, :]          # + v_t k_t^T
        outputs.append(torch.einsum("bhvk,bhk->bhv", M, q[:, :, t]))  # y_t = M_t q_t
    o = torch.stack(outputs, dim=2)
    return o.to(out_dtype), M
