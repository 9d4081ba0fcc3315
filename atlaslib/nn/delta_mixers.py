"""Chapter 2 mixers: DeltaNet, Gated DeltaNet and KDA as token mixers for the tiny LM.

All three l2-normalise q and k (the delta rule's step beta in [0, 2] is a contraction
only for unit keys), project a per-head step beta_t = sigmoid(w^T x_t) in (0, 1) and,
for the gated variants, reuse chapter 1's retention gates (scalar as in Mamba2, per key
channel as in GLA).
"""
from __future__ import annotations

import torch
from torch import nn

from ..delta import delta_rule
from ..delta.recurrent import delta_rule_step
from .base import TokenMixer, gate_dtype, register_mixer
from .linear_mixers import GatedLinear, empty_memory


class BetaProjection(nn.Module):
    """beta_t = sigmoid(w_h^T x_t + b_h): one delta-rule step size per head and token, [B, H, T]."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.proj = nn.Linear(d_model, n_heads)

    def forward(self, x):
        return torch.sigmoid(self.proj(x).to(gate_dtype(x))).transpose(1, 2)   # [B, T, H] -> [B, H, T], fp32


def delta_step(M, q, k, v, beta_t, alpha_t):
    """The mixers' call of ``delta_rule_step``: q, k [B,H,1,K], v [B,H,1,V] (M None: start at 0)
    -> (o [B,H,1,V] in q's dtype, M_t)."""
    M = empty_memory(q, v) if M is None else M
    M, y_t = delta_rule_step(M, q[:, :, 0], k[:, :, 0], v[:, :, 0], beta_t, alpha_t)
    return y_t[:, :, None].to(q.dtype), M


@register_mixer("deltanet")
class DeltaNet(TokenMixer):
    """M_t = M_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T with unit keys."""

    def __init__(self, d_model, n_heads, **kw):
        kw.setdefault("qk_norm", True)
        super().__init__(d_model, n_heads, **kw)
        self.beta = BetaProjection(d_model, n_heads)

    def mix(self, q, k, v, x):
        return delta_rule(q, k, v, self.beta(x).to(gate_dtype(q)), backend=self.backend,
                          chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        return delta_step(state, q, k, v, self.beta(x).to(gate_dtype(q))[:, :, 0], None)


class GatedDelta(GatedLinear):
    """The delta rule with chapter 1's data-dependent retention gate in front of each step."""

    def __init__(self, d_model, n_heads, **kw):
        kw.setdefault("qk_norm", True)
        super().__init__(d_model, n_heads, **kw)
        self.beta = BetaProjection(d_model, n_heads)

    def mix(self, q, k, v, x):
        return delta_rule(q, k, v, self.beta(x).to(gate_dtype(q)), log_alpha=self.log_gate(x),
                          backend=self.backend, chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        beta_t, alpha_t = self.beta(x).to(gate_dtype(q))[:, :, 0], self.gate(x).to(gate_dtype(q))[:, :, 0]
        return delta_step(state, q, k, v, beta_t, alpha_t)


@register_mixer("gated_deltanet")
class GatedDeltaNet(GatedDelta):
    """M_t = alpha_t M_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, one alpha per head and token."""

    per_channel = False


@register_mixer("kda")
class KDA(GatedDelta):
    """M_t = M_{t-1} Diag(alpha_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, alpha per key channel."""

    per_channel = True
