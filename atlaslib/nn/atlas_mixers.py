"""Chapter 5 mixers: ATLAS and ATLAS++ as token mixers for the tiny LM.

Both run ``atlaslib.atlas.atlas`` ([A] eqs 32-33, book ch. 5):

    ∇_t = sum_{i=t-c+1}^{t} gamma_i^{(t)} grad 1/2||M_{t-1}(phi(k_i)) - v_i||^2
    S_t = theta_t S_{t-1} + ∇_t,        M_t = alpha_t M_{t-1} - eta_t NS_5(S_t),        y_t = M_t(phi(q_t))

The gates come from chapter 4's ``WindowedMixer`` (window gates gamma, inner step
eta_t = eta_max sigmoid(.), retention alpha_t passed as ``log_alpha`` in fp32) plus a momentum
decay theta_t = sigmoid(w^T x_t + b) per head and token (starts near 0.5). NS_5 (Muon's
coefficients by default) normalises S_t, so eta_t is the step's size in the spectral norm;
the default eta_max is 0.1.

* ``"atlas"``: ``memory="linear"`` by default (fast; M [V, D] per head); ``memory="mlp"`` or
  ``"residual"`` ([A]'s ATLAS) run on chapter 3's engine (``atlas_config``: optimizer "muon"
  and the Omega window), shaped by the deep memory's ``expansion``, ``activation``, ``layer_norm``.
* ``"atlas++"``: ``memory="gated"`` (ATLAS++, needs head_k_dim == head_v_dim), on that engine too.

Every memory and gamma mode has a one-token ``step`` (generation): the linear memory through
``atlas_step`` (its ``AtlasState`` keeps M, S, the last c - 1 pairs and their per-source gates),
the deep ones through ``miras_step`` (``miras_mixers.engine_step``), whose ``TokenState`` keeps
the weights, the momenta and the last c - 1 pairs; ``DeepState`` adds the per-source gates
that ``gamma="source"`` needs.

The linear memory starts at zero, as chapters 1 and 2's memories do. A deep memory's initial weights
W_0 (one set per head, shared by the batch) are parameters of the layer (``initial``), trained by the
outer loop as chapter 3's mixers train theirs (``miras_mixers.learned_start``: the engine's default
initialisation, drawn from torch's global generator, so two layers differ); the forward and ``step``
both start from them.

The chunk size **changes the model** (gradients frozen at the chunk start; chunk_size = 1 is
the per-token rule that ``step`` runs), default ``ATLAS_CHUNK_SIZE`` = 16.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..atlas import ATLAS_CHUNK_SIZE, MEMORIES, atlas, atlas_config
from ..atlas.recurrent import atlas_step, start_state
from ..core.chunking import compute_dtype
from ..core.newton_schulz import check_ns_steps, ns_coefficients
from ..core.validation import check_flag
from ..miras import build_parts
from ..miras.config import MEMORY_OPTIONS, check_memory_options
from ..miras.recurrent import TokenState
from .miras_mixers import batch_start, engine_step, learned_start, start_token_state
from .base import gate_dtype, register_mixer
from .linear_mixers import empty_memory
from .omega_mixers import WindowedMixer


class DeepState(NamedTuple):
    """What a deep ATLAS memory carries from one token to the next: the engine's ``TokenState`` (weights,
    momenta, the last c - 1 pairs) and, for ``gamma="source"``, the last c - 1 per-source gates
    [B, H, n] (the engine takes gates per offset, so the sources' own gates are kept here; else None)."""
    engine: TokenState
    gammas: torch.Tensor | None


@register_mixer("atlas")
class AtlasMixer(WindowedMixer):
    """ATLAS: Omega window, momentum, Newton–Schulz on the momentum (linear memory by default;
    deep memories on chapter 3's engine). ``step`` runs the per-token rule for every memory.

    With ``momentum=False``, ``window=1`` and ``ns_steps >= 1`` the window gate gamma_t has no effect:
    S_t = gamma_t grad_t, and Newton–Schulz divides S_t by its norm first (pass ``gamma=None`` to build
    no gate)."""

    default_memory = "linear"
    default_eta_max = 0.1

    def __init__(self, d_model, n_heads, *, window: int = 1, memory: str | None = None, ns_steps: int = 5,
                 ns_coeffs="muon", momentum: bool = True, **kw):
        memory = self.default_memory if memory is None else memory
        if memory not in MEMORIES:
            raise ValueError(f"memory must be one of {MEMORIES}, got {memory!r}")
        # a deep memory's expansion, activation, layer_norm (atlas_config checks their values)
        self.memory_options = check_memory_options(
            self.mixer_name, memory, {name: kw.pop(name) for name in MEMORY_OPTIONS if name in kw})
        kw.setdefault("qk_norm", True)
        kw.setdefault("chunk_size", ATLAS_CHUNK_SIZE)
        super().__init__(d_model, n_heads, window=window, **kw)
        if memory in ("residual", "gated") and self.head_k_dim != self.head_v_dim:
            raise ValueError(f"memory={memory!r} needs head_k_dim == head_v_dim, "
                             f"got {self.head_k_dim} and {self.head_v_dim}")
        ns_coefficients(ns_coeffs)                    # a misspelt name fails here, not at the first forward
        self.memory, self.ns_steps, self.ns_coeffs = memory, check_ns_steps(ns_steps), ns_coeffs
        self.theta_proj = nn.Linear(d_model, n_heads) if check_flag("momentum", momentum) else None
        # A deep memory's W_0 is learned, as chapter 3's mixers learn theirs; the linear memory starts at zero
        self.initial = None if memory == "linear" else learned_start(
            self.config(), n_heads, self.feature_dim(), self.head_v_dim)

    def config(self):
        """The deep memory's chapter 3 configuration (``atlas_config``), options included."""
        return atlas_config(self.memory, self.window, self.ns_steps, self.ns_coeffs, **self.memory_options)

    def theta(self, x):
        """Momentum decay in (0, 1), [B, H, T], or None (no momentum)."""
        if self.theta_proj is None:
            return None
        return torch.sigmoid(self.theta_proj(x).to(gate_dtype(x))).transpose(1, 2)    # squashed in fp32

    def deep_start(self, q) -> dict | None:
        """A deep memory's learned W_0 (``initial``) for q's batch, in q's compute dtype; None: the linear memory
        (``atlas`` starts it at zero)."""
        return None if self.initial is None else batch_start(self.initial, q.shape[0], compute_dtype(q))

    def mix(self, q, k, v, x):
        q, k = self.features(q, k)
        dtype = gate_dtype(q)
        gamma, _, eta = self.gate_tensors(x, dtype, alpha=False)
        theta = self.theta(x)
        return atlas(q, k, v, window=self.window, gamma=gamma, log_alpha=self.log_alpha(x), eta=eta,
                     theta=None if theta is None else theta.to(dtype), ns_steps=self.ns_steps, ns_coeffs=self.ns_coeffs,
                     memory=self.memory, initial_state=self.deep_start(q), backend=self.backend,
                     chunk_size=self.chunk_size, **self.memory_options)[0]

    def mix_step(self, q, k, v, x, state):
        """One token of the per-token rule (the model of ``chunk_size=1``).

        Linear memory: ``atlas_step`` and its ``AtlasState`` (M, S, the last c - 1 pairs and, for
        ``gamma="source"``, their gates). Deep memories: chapter 3's engine, see ``deep_step``.
        """
        q, k = self.features(q, k)
        dtype = gate_dtype(q)
        # per offset: [B, H, c]; per source: [B, H] (each token brings its own gate); None: ones
        gamma, alpha, eta = (None if g is None else g[:, :, 0] for g in self.gate_tensors(x, dtype))
        theta = self.theta(x)
        theta = None if theta is None else theta.to(dtype)[:, :, 0]
        if self.memory != "linear":
            return self.deep_step(q, k, v, gamma, alpha, eta, theta, state)
        state = start_state(empty_memory(q, v)) if state is None else state
        state, y_t = atlas_step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], self.window, gamma, alpha, eta, theta,
                                self.ns_steps, self.ns_coeffs)
        return y_t[:, :, None].to(q.dtype), state

    def deep_step(self, q, k, v, gamma, alpha, eta, theta, state):
        """One token of a deep memory on chapter 3's engine (``engine_step``: Muon and the Omega window),
        the engine ``atlas(memory=...)`` runs; it starts, as that forward does, from the learned W_0."""
        B, H, _, D = q.shape
        parts = build_parts(self.config(), D, v.shape[-1])
        if state is None:
            W0 = self.deep_start(q)
            sources = gamma.new_zeros(B, H, 0) if self.gamma_mode == "source" else None
            state = DeepState(start_token_state(W0, True, False, q, v), sources)
        G, sources = self.offset_gates(gamma, state.gammas, B, H, q)
        o, engine = engine_step(parts, state.engine, q, k, v, G, eta, alpha, theta)
        return o, DeepState(engine, sources)

    @property
    def state_size(self) -> int:
        """Memory and momentum per head: 2 [V, D] (linear memory) or twice the deep memory's weights; without
        momentum (``momentum=False``) the memory alone, as S_t is then the step's gradient and not carried.
        Not counted, as for every windowed mixer: the last c - 1 pairs (and per-source gates)."""
        carried = 2 if self.theta_proj is not None else 1
        if self.memory == "linear":
            return carried * super().state_size
        shapes = build_parts(self.config(), self.feature_dim(), self.head_v_dim).memory.shapes
        return carried * self.n_heads * sum(o * i for o, i in shapes.values())

    def extra_repr(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value in self.memory_options.items())
        return (f"{super().extra_repr()}, memory={self.memory!r}{options}, ns_steps={self.ns_steps}, "
                f"ns_coeffs={self.ns_coeffs!r}")


@register_mixer("atlas++")
class AtlasPlusPlus(AtlasMixer):
    """ATLAS++: ATLAS with the gated deep memory (head_k_dim == head_v_dim)."""

    default_memory = "gated"
