"""Chapter 5 mixers: ATLAS and ATLAS++ as token mixers for the tiny LM.

Both run ``atlaslib.atlas.atlas`` ([A] eqs 32-33, book ch. 5):

    ∇_t = sum_{i=t-c+1}^{t} gamma_i^{(t)} grad 1/2||M_{t-1}(phi(k_i)) - v_i||^2
    S_t = theta_t S_{t-1} + ∇_t,        M_t = alpha_t M_{t-1} - eta_t NS_5(S_t),        y_t = M_t(phi(q_t))

The gates come from chapter 4's ``WindowedMixer`` (window gates gamma, inner step
eta_t = eta_max sigmoid(.), retention alpha_t passed as ``log_alpha`` in fp32) plus a momentum
decay theta_t = sigmoid(w^T x_t + b) per head and token (starts near 0.5). NS_5 (Muon's
coefficients by default) normalises S_t, so eta_t is the step's size in the spectral norm;
the default eta_max is 0.1.

* ``"atlas"``: ``memory="linear"`` by default (fast; M [V, D] per head, one-token ``step``
  via ``atlas_step``); ``memory="mlp"`` or ``"residual"`` ([A]'s ATLAS) run on chapter 3's
  engine (forward only here: ``step`` raises NotImplementedError).
* ``"atlas++"``: ``memory="gated"`` (ATLAS++, needs head_k_dim == head_v_dim; forward only).

The chunk size **changes the model** (gradients frozen at the chunk start; chunk_size = 1 is
the per-token rule that ``step`` runs), default ``ATLAS_CHUNK_SIZE`` = 16.
"""
from __future__ import annotations

import torch
from torch import nn

from ..atlas import ATLAS_CHUNK_SIZE, MEMORIES, atlas
from ..atlas.recurrent import atlas_step, start_state
from .mixer import gate_dtype, register_mixer
from .mixers import empty_memory
from .omega_mixers import WindowedMixer


@register_mixer("atlas")
class AtlasMixer(WindowedMixer):
    """ATLAS: Omega window, momentum, Newton–Schulz on the momentum (linear memory by default)."""

    default_memory = "linear"
    default_eta_max = 0.1

    def __init__(self, d_model, n_heads, *, window: int = 1, memory: str | None = None, ns_steps: int = 5,
                 coeffs="muon", momentum: bool = True, **kw):
        memory = self.default_memory if memory is None else memory
        if memory not in MEMORIES:
            raise ValueError(f"memory must be one of {MEMORIES}, got {memory!r}")
        kw.setdefault("qk_norm", True)
        kw.setdefault("chunk_size", ATLAS_CHUNK_SIZE)
        super().__init__(d_model, n_heads, window=window, **kw)
        if memory in ("residual", "gated") and self.head_k_dim != self.head_v_dim:
            raise ValueError(f"memory={memory!r} needs head_k_dim == head_v_dim, "
                             f"got {self.head_k_dim} and {self.head_v_dim}")
        self.memory, self.ns_steps, self.coeffs = memory, ns_steps, coeffs
        self.theta_proj = nn.Linear(d_model, n_heads) if momentum else None

    def theta(self, x):
        """Momentum decay in (0, 1), [B, H, T], or None (no momentum)."""
        return None if self.theta_proj is None else torch.sigmoid(self.theta_proj(x)).transpose(1, 2)

    def mix(self, q, k, v, x):
        q, k = self.features(q, k)
        dtype = gate_dtype(q)
        gamma, _, eta = self.gate_tensors(x, dtype, alpha=False)
        theta = self.theta(x)
        return atlas(q, k, v, window=self.window, gamma=gamma, log_alpha=self.log_alpha(x), eta=eta,
                     theta=None if theta is None else theta.to(dtype), ns_steps=self.ns_steps, coeffs=self.coeffs,
                     memory=self.memory, backend=self.backend, chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        """One token of the per-token rule (the model of ``chunk_size=1``), linear memory only."""
        if self.memory != "linear":
            raise NotImplementedError(f"{type(self).__name__}: step is written for memory='linear', "
                                      f"not {self.memory!r} (use forward)")
        if self.gamma_mode == "source":
            raise NotImplementedError(f"{type(self).__name__}: step needs gamma='offset' or None, not 'source'")
        q, k = self.features(q, k)
        dtype = gate_dtype(q)
        gamma, alpha, eta = (None if g is None else g[:, :, 0] for g in self.gate_tensors(x, dtype))
        theta = self.theta(x)
        theta = None if theta is None else theta.to(dtype)[:, :, 0]
        state = start_state(empty_memory(q, v)) if state is None else state
        state, y_t = atlas_step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], self.window, gamma, alpha, eta, theta,
                                self.ns_steps, self.coeffs)
        return y_t[:, :, None].to(q.dtype), state

    @property
    def state_size(self) -> int:
        """Memory and momentum, each [V, D] per head (linear memory); None for deep memories."""
        if self.memory != "linear":
            return None
        return 2 * super().state_size

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, memory={self.memory!r}, ns_steps={self.ns_steps}, coeffs={self.coeffs!r}"


@register_mixer("atlas++")
class AtlasPlusPlus(AtlasMixer):
    """ATLAS++: ATLAS with the gated deep memory (head_k_dim == head_v_dim)."""

    default_memory = "gated"
