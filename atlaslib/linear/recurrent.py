"""The definition: linear attention and its gated (Hebbian) family, one token at a time.

    M_t = M_{t-1} * alpha_t + v_t k_t^T        (alpha_t: none, a scalar, or Diag on the key side)
    y_t = M_t q_t                              (read out after the update)

This is one gradient step with step size 1 on the dot-product attentional bias
-<M k_t, v_t>, whose gradient -v_t k_t^T does not depend on M (book ch. 1 §3).

``linear_attention_step`` is one token of it, the body of the loop below; a decoder
generating text calls it directly with the state M as all it keeps between tokens.
"""
from __future__ import annotations

import torch

from ..core.chunking import start_memory
from ..core.validation import check_form_shapes


def decay_state(M: torch.Tensor, alpha_t: torch.Tensor | None) -> torch.Tensor:
    """M * alpha_t: a scalar per (batch, head), or Diag(alpha_t) acting on the key side."""
    if alpha_t is None:
        return M
    alpha_t = alpha_t.to(M.dtype)
    if alpha_t.dim() == 2:                      # [B, H]: RetNet / Mamba2-style scalar decay
        return M * alpha_t[:, :, None, None]
    return M * alpha_t[:, :, None, :]           # [B, H, K]: GLA-style M Diag(alpha_t)


def linear_attention_step(M, q_t, k_t, v_t, alpha_t=None):
    """One token: M [B,H,V,K]; q_t, k_t [B,H,K]; v_t [B,H,V]; alpha_t None, [B,H] or [B,H,K].

    Returns (M_t, y_t [B,H,V]), both in M's dtype: the token is cast to the state's
    precision (fp32/fp64) so that a bf16 model's step accumulates like the loop does.
    """
    q_t, k_t, v_t = q_t.to(M.dtype), k_t.to(M.dtype), v_t.to(M.dtype)
    M = decay_state(M, alpha_t)                                  # M_{t-1} alpha_t
    M = M + v_t[:, :, :, None] * k_t[:, :, None, :]              # + v_t k_t^T
    return M, torch.einsum("bhvk,bhk->bhv", M, q_t)              # y_t = M_t q_t


def token_loop(step, q, k, v, *per_token, alpha=None, initial_state=None):
    """Runs M_t, y_t = step(M_{t-1}, q_t, k_t, v_t, *per_token_t, alpha_t) for t = 1..T from M_0 =
    ``initial_state`` (zeros when None). q, k: [B,H,T,K]; v: [B,H,T,V]; each of ``per_token`` and
    alpha: [B,H,T, ...] (alpha may be None).

    Returns (o [B,H,T,V] in q's dtype, final state M_T [B,H,V,K] in fp32/fp64).
    """
    T = q.shape[2]
    M = start_memory(q, v, initial_state)                    # zeros [B,H,V,K], or M_0 checked and cast
    outputs = []
    for t in range(T):
        token = [x[:, :, t] for x in (q, k, v, *per_token)]
        alpha_t = None if alpha is None else alpha[:, :, t]
        M, y_t = step(M, *token, alpha_t)
        outputs.append(y_t)
    return torch.stack(outputs, dim=2).to(q.dtype), M


def linear_attention_recurrent(q, k, v, alpha=None, initial_state=None):
    """Per-token loop. q, k: [B,H,T,K]; v: [B,H,T,V]; alpha: None, [B,H,T] or [B,H,T,K].
    Shapes are checked here; value ranges are the caller's (``linear_attention`` checks them).

    Returns (o [B,H,T,V] in q's dtype, final state M_T [B,H,V,K] in fp32/fp64).
    """
    check_form_shapes(q, k, v, alpha=alpha, per_channel=("alpha",))
    return token_loop(linear_attention_step, q, k, v, alpha=alpha, initial_state=initial_state)
