"""The definition: the delta rule and its gated variants, one token at a time.

    M'_t = M_{t-1} Diag(alpha_t)                       (retention; a scalar alpha_t just scales)
    M_t  = M'_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
         = M'_t - beta_t (M'_t k_t - v_t) k_t^T        (one GD step on 1/2 ||M k_t - v_t||^2 at M'_t)
    y_t  = M_t q_t                                     (read out after the update)

alpha = None is DeltaNet, a scalar alpha_t per token is Gated DeltaNet, a vector
alpha_t in [0, 1]^K acting on the key side is KDA (book ch. 2 §4). The matrix
I - beta_t k_t k_t^T is never formed: M'_t (I - beta_t k_t k_t^T) = M'_t - beta_t (M'_t k_t) k_t^T
costs O(V K) per token instead of O(V K^2).

``delta_rule_step`` is one token, the body of the loop; generation calls it directly.
"""
from __future__ import annotations

import torch

from ..core.validation import check_form_shapes
from ..linear.recurrent import decay_state, token_loop


def delta_rule_step(M, q_t, k_t, v_t, beta_t, alpha_t=None):
    """One token: M [B,H,V,K]; q_t, k_t [B,H,K]; v_t [B,H,V]; beta_t [B,H]; alpha_t None, [B,H] or [B,H,K].

    Returns (M_t, y_t [B,H,V]) in M's dtype (the token is cast to the state's precision).
    """
    q_t, k_t, v_t = q_t.to(M.dtype), k_t.to(M.dtype), v_t.to(M.dtype)
    b_t = beta_t.to(M.dtype)[:, :, None, None]
    M = decay_state(M, alpha_t)                                   # M'_t = M_{t-1} Diag(alpha_t)
    Mk = torch.einsum("bhvk,bhk->bhv", M, k_t)                    # M'_t k_t
    M = M - b_t * (Mk - v_t)[:, :, :, None] * k_t[:, :, None, :]  # M'_t - beta_t (M'_t k_t - v_t) k_t^T
    return M, torch.einsum("bhvk,bhk->bhv", M, q_t)               # y_t = M_t q_t


def delta_rule_recurrent(q, k, v, beta, alpha=None, initial_state=None):
    """Per-token loop (chapter 1's ``token_loop``). q, k: [B,H,T,K]; v: [B,H,T,V]; beta: [B,H,T];
    alpha: None, [B,H,T] or [B,H,T,K]. Shapes are checked here; value ranges are the caller's (``delta_rule``
    checks them).

    Returns (o [B,H,T,V] in q's dtype, final state M_T [B,H,V,K] in fp32/fp64).
    """
    check_form_shapes(q, k, v, beta=beta, alpha=alpha, per_channel=("alpha",), required=("beta",))
    return token_loop(delta_rule_step, q, k, v, beta, alpha=alpha, initial_state=initial_state)
