"""Sliding-window attention and the two hybrid backbones of Titans / ATLAS: MAG and MAL.

* ``"swa"``: causal softmax attention over the last ``window`` tokens (key i is seen by
  query t iff t - window < i <= t), ``core.softmax_attention(window=...)``; ``step`` keeps
  only the last ``window`` keys and values (a fixed-size cache).
* ``"mal"`` (memory as a layer): y = SWA(RMSNorm(Memory(x))), the memory mixer's output (already
  projected back to d_model), normalised as a block's input is, is the input of a sliding-window
  attention mixer.
* ``"mag"`` (memory as a gate): both branches read x and are mixed per channel by a learned
  sigmoid gate,

      mu_t = sigmoid(W_mu x_t + b_mu)  in (0, 1)^{d_model},
      y_t = mu_t * SWA(x)_t + (1 - mu_t) * Memory(x)_t     (mu_t, not g_t: g is the book's log-gate).

  Titans (§4.2) combines the branches "with a gating mechanism" and normalisation, and ATLAS
  (§5, Figure 3) takes its MAG and MAL variants; both leave the exact form open. This is one simple choice (no extra
  normalisation in MAG; b_mu = 0, so the gate starts centred at 1/2). mu = 1 gives the SWA branch alone,
  mu = 0 the memory branch alone.

Both hybrids take any registered mixer as the memory: ``make_mixer("mag", d_model, n_heads,
memory="atlas", window=16, **memory_kw)``. ``window`` is the attention's window; every other
keyword goes to the memory mixer (its own Omega window, if any, is ``memory_window=``; ``memory`` names
the mixer, so the memory mixer's own ``memory=`` option keeps its default), and
``attention_kw`` (a dict) to the SWA mixer. ``head_k_dim`` and ``head_v_dim`` go to both branches
(the attention's own, in ``attention_kw``, take precedence).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..core.attention import cached_attention, softmax_attention
from ..core.validation import check_int
from .base import MIXERS, TokenMixer, make_mixer, register_mixer
from .linear_mixers import SoftmaxAttention


def check_attention_window(window) -> int:
    return check_int("window", window, 1, " (the attention's window)")


@register_mixer("swa")
class SlidingWindowAttention(SoftmaxAttention):
    """Causal softmax attention over the last ``window`` tokens (sliding-window attention)."""

    def __init__(self, d_model, n_heads, *, window: int = 64, **kw):
        self.window = check_attention_window(window)
        super().__init__(d_model, n_heads, **kw)

    def mix(self, q, k, v, x):
        return softmax_attention(q, k, v, window=self.window)

    def mix_step(self, q, k, v, x, state):
        """One token against the last ``window`` keys and values (this one included); the cache keeps
        the last window - 1 of them plus this one, at most ``window``."""
        keys, values = (k, v) if state is None else (torch.cat([state[0], k], 2), torch.cat([state[1], v], 2))
        keys, values = keys[:, :, -self.window:], values[:, :, -self.window:]
        return cached_attention(q, keys, values), (keys, values)

    @property
    def state_size(self):
        """The cache: ``window`` keys and values per head (fixed, unlike full attention's)."""
        return self.window * self.n_heads * (self.feature_dim() + self.head_v_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"


class HybridCache(NamedTuple):
    """What a hybrid keeps between generated tokens: its memory mixer's cache and its attention's."""
    memory: object
    attention: object


class Hybrid(TokenMixer):
    """A memory mixer and a sliding-window attention mixer, gated by ``MAG.combine`` or stacked by
    ``MAL.forward``.

    Not a projection-based mixer itself: each branch has its own projections (and convolution).
    """

    def __init__(self, d_model, n_heads, *, memory: str = "atlas", window: int = 64, attention_kw=None,
                 memory_window: int | None = None, **kw):
        nn.Module.__init__(self)
        check_attention_window(window)
        if not isinstance(memory, str) or memory not in MIXERS:
            raise ValueError(f"unknown memory mixer {memory!r}; available: {sorted(MIXERS)}")
        if memory in ("mag", "mal"):
            raise ValueError(f"the memory of a hybrid must be a memory mixer, not the hybrid {memory!r}")
        if attention_kw is not None and not isinstance(attention_kw, dict):
            raise TypeError(f"attention_kw must be a dict of the attention's options, "
                            f"got {type(attention_kw).__name__}")
        if "window" in (attention_kw or {}):
            raise ValueError("the attention's window is the hybrid's own window=, not attention_kw['window']")
        self.d_model, self.n_heads, self.window, self.memory_name = d_model, n_heads, window, memory
        if memory_window is not None:
            kw["window"] = memory_window
        try:
            self.memory = make_mixer(memory, d_model, n_heads, **kw)
        except TypeError as err:              # the memory mixer's own "unexpected keyword 'window'"
            if memory_window is not None and "'window'" in str(err):
                raise TypeError(f"memory_window={memory_window!r} was given, but the memory mixer {memory!r} "
                                "has no window of its own") from err
            raise
        heads = {name: kw[name] for name in ("head_k_dim", "head_v_dim") if name in kw}
        self.attention = SlidingWindowAttention(d_model, n_heads, window=window, **heads | (attention_kw or {}))

    def mix(self, q, k, v, x):              # pragma: no cover - forward is overridden
        raise NotImplementedError("a hybrid mixes through its branches' forward")

    @property
    def state_size(self):
        m = self.memory.state_size
        return None if m is None else m + self.attention.state_size

    def extra_repr(self) -> str:
        return f"name={self.mixer_name!r}, memory={self.memory_name!r}, window={self.window}"

    def check(self, x, dims):
        if x.dim() != dims or x.shape[-1] != self.d_model or 0 in x.shape[:-1]:
            what = "[B, T, {}] with B >= 1 and T >= 1" if dims == 3 else "[B, {}] with B >= 1"
            raise ValueError(f"x must have shape {what.format(self.d_model)}, got {list(x.shape)}")

    def split_cache(self, cache) -> HybridCache:
        """The branches' caches: None before the first token, else the ``HybridCache`` the previous step returned."""
        if cache is None:
            return HybridCache(None, None)
        if not isinstance(cache, HybridCache):
            raise TypeError(f"cache must be None (the first token) or the HybridCache that the previous step "
                            f"returned, got {type(cache).__name__}")
        return cache


@register_mixer("mal")
class MAL(Hybrid):
    """Memory as a layer: y = SWA(RMSNorm(Memory(x))).

    The RMSNorm (learned per-channel weight, as a block's pre-norm) is what a stack of two layers puts
    before its second one: without it the attention reads the memory's raw output, whose size at
    initialisation (memory at zero, small steps) is a few percent of a normalised input's, and its query and
    key projections start with gradients orders of magnitude smaller than a plain SWA's."""

    def __init__(self, d_model, n_heads, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.norm = nn.RMSNorm(d_model)

    def forward(self, x):
        self.check(x, 3)
        return self.attention(self.norm(self.memory(x)))

    def step(self, x_t, cache=None):
        self.check(x_t, 2)
        mem_cache, att_cache = self.split_cache(cache)
        h, mem_cache = self.memory.step(x_t, mem_cache)
        y, att_cache = self.attention.step(self.norm(h), att_cache)
        return y, HybridCache(mem_cache, att_cache)


@register_mixer("mag")
class MAG(Hybrid):
    """Memory as a gate: y = mu * SWA(x) + (1 - mu) * Memory(x), mu = sigmoid(W_mu x + b_mu) per channel."""

    def __init__(self, d_model, n_heads, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.gate_proj = nn.Linear(d_model, d_model)
        nn.init.zeros_(self.gate_proj.bias)

    def combine(self, x, attended, remembered):
        g = torch.sigmoid(self.gate_proj(x))
        return g * attended + (1 - g) * remembered

    def forward(self, x):
        self.check(x, 3)
        return self.combine(x, self.attention(x), self.memory(x))

    def step(self, x_t, cache=None):
        self.check(x_t, 2)
        mem_cache, att_cache = self.split_cache(cache)
        m, mem_cache = self.memory.step(x_t, mem_cache)
        a, att_cache = self.attention.step(x_t, att_cache)
        return self.combine(x_t, a, m), HybridCache(mem_cache, att_cache)
