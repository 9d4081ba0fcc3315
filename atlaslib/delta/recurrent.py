"""The definition: the delta rule and its gated variants, one token at a time.

    M'_t = M_{t-1} Diag(alpha_t)                       (retention; a scalar alpha_t just scales)
    M_t  = M'_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
         = M'_t - beta_t (M'_t k_t - v_t) k_t^T        (one GD step on 1/2 ||M k_t - v_t||^2 at M'_t)
    y_t  = M_t q_t                                     (read out after the update)

alpha = None is DeltaNet, a scalar alpha_t per token is Gated DeltaNet, a vector
alpha_t in [0, 1]^K acting on the key side is KDA (book ch. 2 §4). The matrix
I - beta_t k_t k_t^T is never formed: M'_t (I - beta_t k_t k_t^T) = M'_t - beta_t (M'_t k_t) k_t^T
costs O(V K) per token instead of O(V K^2).
"""
from __future__ import annotations

import torch

from ..core.chunking import compute_dtype
from ..linear.recurrent import decay_state


def delta_rule_recurrent(q, k, v, beta, alpha=None, initial_state=None):
    """Per-token loop. q, k: [B,H,T,K]; v: [B,H,T,V]; beta: [B,H,T]; alpha: None, [B,H,T] or [B,H,T,K].

    Returns (o [B,H,T,V] in q's dtype, final state M_T [B,H,V,K] in fp32/fp64).
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v, beta = q.to(cd), k.to(cd), v.to(cd), beta.to(cd)
    M = torch.zeros(B, H, V, K, dtype=cd, device=q.device) if initial_state is None else initial_state.to(cd)
    outputs = []
    for t in range(T):
        k_t, v_t, b_t = k[:, :, t], v[:, :, t], beta[:, :, t, None, None]
        M = decay_state(M, None if alpha is None else alpha[:, :, t].to(cd))   # M'_t = M_{t-1} Diag(alpha_t)
        Mk = torch.einsum("bhvk,bhk->bhv", M, k_t)                              # M'_t k_t
        M = M - b_t * Mk[..., :, None] * k_t[..., None, :] \
            + b_t * v_t[..., :, None] * k_t[..., None, :]                       # M'_t (I - b k k^T) + b v k^T
        outputs.append(torch.einsum("bhvk,bhk->bhv", M, q[:, :, t]))            # y_t = M_t q_t
    o = torch.stack(outputs, dim=2)
    return o.to(out_dtype), M
