"""Chapter 1 mixers: softmax attention, linear attention and its gated (Hebbian) family."""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..core.attention import cached_attention, softmax_attention
from ..core.validation import check_flag, check_positive_number
from ..core.chunking import compute_dtype
from ..linear import linear_attention
from ..linear.recurrent import linear_attention_step
from .base import TokenMixer, gate_dtype, register_mixer


def empty_memory(q, v) -> torch.Tensor:
    """M_0 = 0 [B, H, V, K] in the state's precision (fp32, fp64 for fp64 activations)."""
    B, H, _, K = q.shape
    return torch.zeros(B, H, v.shape[-1], K, dtype=compute_dtype(q), device=q.device)


def hebbian_step(M, q, k, v, alpha_t):
    """The mixers' call of ``linear_attention_step``: q, k [B,H,1,K], v [B,H,1,V] (M None: start at 0)
    -> (o [B,H,1,V] in q's dtype, M_t)."""
    M = empty_memory(q, v) if M is None else M
    M, y_t = linear_attention_step(M, q[:, :, 0], k[:, :, 0], v[:, :, 0], alpha_t)
    return y_t[:, :, None].to(q.dtype), M


@register_mixer("softmax")
class SoftmaxAttention(TokenMixer):
    """Causal softmax attention: the non-parametric memory that keeps every token (KV cache).

    One form only: ``backend`` and ``chunk_size`` are accepted (as by every mixer) and ignored."""

    def mix(self, q, k, v, x):
        return softmax_attention(q, k, v)

    def mix_step(self, q, k, v, x, state):
        """One token against a KV cache (keys [B,H,t,K], values [B,H,t,V]): softmax attention has no
        fixed-size state, so this cache grows by one key and one value per token."""
        keys, values = (k, v) if state is None else (torch.cat([state[0], k], 2), torch.cat([state[1], v], 2))
        return cached_attention(q, keys, values), (keys, values)           # every cached token is past

    @property
    def state_size(self):
        return None          # the KV cache grows with T: 2 * H * T * d per layer


@register_mixer("linear")
class LinearAttention(TokenMixer):
    """M_t = M_{t-1} + v_t phi(k_t)^T, y_t = M_t phi(q_t) (optionally normalised by z_t^T phi(q_t))."""

    def __init__(self, d_model, n_heads, *, normalize: bool = False, **kw):
        if check_flag("normalize", normalize):
            kw.setdefault("feature_map", "elu+1")   # the normaliser needs positive features
        super().__init__(d_model, n_heads, **kw)
        self.normalize = normalize

    def mix(self, q, k, v, x):
        return linear_attention(q, k, v, normalize=self.normalize, backend=self.backend,
                                 chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        V = v.shape[-1]
        if self.normalize:                      # z_t rides along as one more value row (constant value 1)
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        if not self.normalize:
            return hebbian_step(state, q, k, v, None)
        # the step's read in fp32 (fp64), divided before rounding to q's dtype once, as ``mix`` does
        M = empty_memory(q, v) if state is None else state
        M, y_t = linear_attention_step(M, q[:, :, 0], k[:, :, 0], v[:, :, 0], None)
        return (y_t[..., :V] / y_t[..., V:])[:, :, None].to(q.dtype), M              # M_t q_t / z_t^T q_t

    @property
    def state_size(self):
        return self.n_heads * self.feature_dim() * (self.head_v_dim + (1 if self.normalize else 0))


@register_mixer("retnet")
class RetNet(TokenMixer):
    """Linear attention with a fixed per-head decay alpha_h = 1 - 2^(-5-h) (RetNet's choice)."""

    def log_alpha(self, dtype=torch.float32, device=None) -> torch.Tensor:
        """log alpha_h = log1p(-2^(-5-h)) [H], computed as a log in ``dtype`` (fp32 or fp64).

        Not a buffer: ``model.to(torch.bfloat16)`` would round it. log1p of the exact power of
        two keeps the decay's full precision; 1 - 2^(-5-h) formed first would lose, for the
        last heads, the digits that carry it (and in bf16, from 1 - 2^-9 on, all of them)."""
        return torch.log1p(-torch.exp2(-5.0 - torch.arange(self.n_heads, dtype=dtype, device=device)))

    @property
    def alpha(self) -> torch.Tensor:
        """The per-head decays [H], in fp32 (for reading; ``mix`` hands over ``log_alpha``)."""
        return self.log_alpha().exp()

    def mix(self, q, k, v, x):
        B, H, T, _ = q.shape
        log_alpha = self.log_alpha(gate_dtype(q), q.device)[None, :, None].expand(B, H, T)
        return linear_attention(q, k, v, log_alpha=log_alpha, backend=self.backend,
                                 chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        # exp of the log in the gate dtype (fp64 for fp64 inputs), as ``mix`` hands it over
        alpha_t = self.log_alpha(gate_dtype(q), q.device).exp()[None, :].expand(q.shape[0], -1)
        return hebbian_step(state, q, k, v, alpha_t)


class GatedLinear(TokenMixer):
    """Linear attention with a data-dependent retention gate projected from x.

    alpha_t = sigmoid(w^T x_t + b)^(1/tau), i.e. log alpha_t = logsigmoid(w^T x_t + b) / tau.
    The temperature tau (16, as in GLA) keeps gates close to 1 at initialisation so the
    memory starts long-lived and training learns where to forget.
    """

    per_channel = False                # False: one scalar per head (Mamba2); True: one per key channel (GLA)

    def __init__(self, d_model, n_heads, *, gate_temperature: float = 16.0, **kw):
        super().__init__(d_model, n_heads, **kw)
        check_positive_number("gate_temperature", gate_temperature, "the gate's sharpness")
        self.gate_temperature = gate_temperature
        width = self.feature_dim() if self.per_channel else 1       # one gate per channel of phi(k)
        self.gate_proj = nn.Linear(d_model, n_heads * width)

    def log_gate(self, x):
        """log alpha_t <= 0: [B, H, T] (scalar) or [B, H, T, K] (per channel), in fp32 (fp64 for fp64 x).

        The projection runs in the model's dtype; everything after it (logsigmoid, the
        temperature) in ``gate_dtype``, so a gate near 1 keeps its distance from 1."""
        z = self.gate_proj(x).to(gate_dtype(x))                                  # [B, T, H*w]
        log_alpha = F.logsigmoid(z) / self.gate_temperature
        B, T, _ = x.shape
        log_alpha = log_alpha.view(B, T, self.n_heads, -1).transpose(1, 2)      # [B, H, T, w]
        return log_alpha if self.per_channel else log_alpha.squeeze(-1)

    def gate(self, x):
        """Retention alpha_t in (0, 1), exp of ``log_gate`` (fp32, fp64 for fp64 x); ``mix`` passes the log."""
        return self.log_gate(x).exp()

    def mix(self, q, k, v, x):
        return linear_attention(q, k, v, log_alpha=self.log_gate(x), backend=self.backend,
                                 chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        return hebbian_step(state, q, k, v, self.gate(x).to(gate_dtype(q))[:, :, 0])


@register_mixer("mamba2")
class Mamba2Style(GatedLinear):
    """Scalar data-dependent decay per head and token: M_t = alpha_t M_{t-1} + v_t k_t^T."""

    per_channel = False


@register_mixer("gla")
class GLA(GatedLinear):
    """Per-key-channel decay (Gated Linear Attention): M_t = M_{t-1} Diag(alpha_t) + v_t k_t^T.

    The chunk form scores per-channel gates by halving the chunk (``linear.chunk.halving_scores``),
    never with a [chunk, chunk, K] tile; the default chunk of 16 took about 0.8 of the time of 64
    (forward and backward, B = 8, T = 256, d_model 64, 4 heads, one CPU thread).
    """

    per_channel = True

    def __init__(self, d_model, n_heads, **kw):
        kw.setdefault("chunk_size", 16)
        super().__init__(d_model, n_heads, **kw)
