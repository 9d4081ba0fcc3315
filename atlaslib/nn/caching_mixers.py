"""Chapter 7 mixer: Memory Caching over a chapter 1 or 2 mixer, ``make_mixer("memory_caching", ...)``
(bases: linear, mamba2, gla, deltanet, gated_deltanet, kda; RetNet is not offered).

The layer is its base mixer (projections, short convolution, q/k normalisation, gates: the base's own
classes, inherited) whose sequence mixing is ``atlaslib.caching.memory_caching`` over the base's library
function and gates: the sequence is cut into segments, each segment's final memory is cached, and token
t reads its own segment's running memory together with the cached ones, mixed by an aggregator
([MC] eqs. 4-17, chapter 7 §1–2):

    y_t = gamma_s(t) M^(s)_t q_t + sum_{i < s} gamma_i(t) M^(i) q_t,
    gamma = softmax_i <u_t, mean of the keys of segment i>   (GRM; the online segment: its keys up to t)

with the relevance query u_t = x_t W_u, one K-vector per head ([MC] eq. 10), a learned projection of
the layer input (``u_proj``).

Options:
    base: "gated_deltanet" (default), "deltanet", "kda", "linear", "mamba2" or "gla"; the base's own
        keywords (gate_temperature, qk_norm, ...) pass through. ``linear`` with normalize=True is
        refused (the normaliser makes the read of a cached state nonlinear; the library refuses it).
    segments: the segment length C (default 16) or "log" (the log-linear, Fenwick segmentation:
        Log-Linear++ with GRM). A list of lengths is not offered: a layer sees sequences of any T.
    mode: "independent" (default) or "checkpoint". Independent: every segment starts from the zero
        memory, so a cached state summarises its own segment only and the GRM weights choose between
        segments rather than between nested prefixes of one memory; the library runs all segments of
        one length as one batched call of the base (one chunk-form call instead of T / C calls in
        turn); and "log" exists only in this mode, so the default works with both segmentations.
        Checkpoint: segment s starts from segment s-1's final state (the plain RNN with snapshots).
    aggregate: "grm" (default), "residual", "soup" (== GRM for these matrix memories) or "ssc"
        (with top_k: GRM over the top_k most relevant cached segments).
    pool: "mean" (None, the default: the library's choice) or "sum" of a segment's keys; not with
        aggregate="residual", which scores no segment.
    The defaults differ from ``memory_caching``'s (64, "checkpoint", "residual": the plain RNN with
    snapshots): the layer's are the setting chapter 7 trains (segments of 16, independent, GRM with a
    learned u_t).

One-token step (generation), constant segments only: the cache holds the cached states [B, H, N, V, K],
their pooled keys [B, H, N, K], the online memory (the base's own step state, advanced by the base
mixer's ``mix_step``) and the running sum of the online segment's keys; the token's readout is the
library's ``cached_readout`` on a sequence of one. When a segment is full its state is appended to the
cache and the online memory restarts from zero (independent) or goes on (checkpoint). The cache grows
by one state per segment, so ``state_size`` is None (it grows with T). The log-linear segmentation has
no step here: token t's online memory is the block of length lowbit(t + 1) ending at t, so a step would
have to keep one running memory per block level and advance each of them every token (a Fenwick tree
of states); ``mix_step`` says so.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..caching import cached_readout, check_options, memory_caching
from ..core.chunking import compute_dtype
from ..delta import delta_rule
from ..linear import linear_attention
from .delta_mixers import KDA, DeltaNet, GatedDeltaNet
from .base import TokenMixer, gate_dtype, register_mixer
from .linear_mixers import GLA, GatedLinear, LinearAttention, Mamba2Style


class CachingState(NamedTuple):
    """The memory between generated tokens: cached states [B, H, N, V, K] (fp32/fp64), their pooled
    keys [B, H, N, K], the base's online state (None at a segment start in independent mode), the sum
    of the online segment's keys [B, H, K] and its number of tokens so far."""
    states: torch.Tensor
    pooled: torch.Tensor
    online: object
    key_sum: torch.Tensor
    length: int


def check_segments(segments):
    if segments == "log":
        return
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be a segment length (int >= 1) or 'log', got {segments!r}")


@register_mixer("memory_caching")
class MemoryCaching(TokenMixer):
    """Memory Caching over a base mixer (see the module docstring). ``make_mixer("memory_caching", D, H,
    base=...)`` builds the subclass that caches that base (``CACHED[base]``), which inherits the base
    mixer's constructor and gates and replaces its ``mix``."""

    library = None                     # the base's library function (set by each subclass)

    def __new__(cls, *args, base: str | None = None, **kw):
        if cls is MemoryCaching:       # pick the subclass that caches ``base``
            base = "gated_deltanet" if base is None else base
            if base not in CACHED:
                raise ValueError(f"memory_caching base must be one of {sorted(CACHED)}, got {base!r}")
            cls = CACHED[base]
        return super().__new__(cls)

    def __init__(self, d_model, n_heads, *, base: str | None = None, segments=16, mode: str = "independent",
                 aggregate: str = "grm", top_k: int | None = None, pool: str | None = None, **kw):
        if kw.get("normalize"):
            raise ValueError("memory_caching over linear attention needs normalize=False: the normaliser "
                             "z^T q makes the read of a cached state nonlinear")
        base = self.base_name() if base is None else base
        if CACHED.get(base) is not type(self):
            raise ValueError(f"{type(self).__name__} caches {self.base_name()!r}, not {base!r}: build it with "
                             f"make_mixer('memory_caching', ..., base={base!r})")
        super().__init__(d_model, n_heads, **kw)
        check_segments(segments)
        check_options(mode, aggregate, pool, top_k, log=segments == "log")
        self.base, self.segments, self.mode, self.aggregate, self.top_k, self.pool = \
            base, segments, mode, aggregate, top_k, pool
        # u_t = x_t W_u; residual MC reads no scores, and an unused parameter would stall DDP's reduction
        self.u_proj = None if aggregate == "residual" else nn.Linear(d_model, n_heads * self.feature_dim(), bias=False)

    @classmethod
    def base_name(cls) -> str:
        return next(name for name, c in CACHED.items() if c is cls)

    def base_gates(self, q, x) -> dict:
        """The base's gates as keywords of its library function ([B, H, T, ...] tensors)."""
        return {}

    def relevance(self, x):
        """u_t = x_t W_u per head: [B, T, D] -> [B, H, T, K]."""
        return self.heads(self.u_proj(x))

    def mix(self, q, k, v, x):
        u = None if self.aggregate == "residual" else self.relevance(x).to(q.dtype)
        o = memory_caching(q, k, v, base=type(self).library, base_kwargs=self.base_gates(q, x),
                           segments=self.segments, mode=self.mode, aggregate=self.aggregate, top_k=self.top_k,
                           u=u, pool=self.pool, backend=self.backend, chunk_size=self.chunk_size)[0]
        # A sequence of one segment caches nothing and reads no score: u_proj would get no gradient at all
        # (None), and DDP, which waits for every parameter's, stops at the next step. A zero term gives it 0.
        return o if u is None else o + 0 * u.sum()

    def mix_step(self, q, k, v, x, state: CachingState | None):
        """One token: the base's step on the online memory, then the cached readout of a sequence of one."""
        if self.segments == "log":
            raise NotImplementedError("memory_caching with segments='log' has no one-token step: the online "
                                      "memory of token t is the block of length lowbit(t + 1) ending at t, which "
                                      "needs one running memory per block level (see the module docstring)")
        B, H, _, K = q.shape
        cd = compute_dtype(q)
        if state is None:
            V = v.shape[-1]
            state = CachingState(q.new_zeros(B, H, 0, V, K, dtype=cd), q.new_zeros(B, H, 0, K, dtype=cd), None,
                                 q.new_zeros(B, H, K, dtype=cd), 0)
        o, online = super().mix_step(q, k, v, x, state.online)        # the base mixer's own step
        key_sum, length = state.key_sum + k[:, :, 0].to(cd), state.length + 1
        pooled_s = key_sum if self.pool == "sum" else key_sum / length      # None: the mean
        u = q.to(cd) if self.u_proj is None else self.relevance(x).to(cd)    # [B, H, 1, K]; residual: unread
        N = state.states.shape[2]
        blocks = torch.arange(N, device=q.device)[None] if N else torch.full((1, 1), -1, device=q.device)
        y = cached_readout(q, u, state.states, state.pooled, o, (u[:, :, 0] * pooled_s).sum(-1)[..., None],
                           blocks, self.top_k, self.aggregate)
        if length < self.segments:
            return y, CachingState(state.states, state.pooled, online, key_sum, length)
        # the segment is full: cache its final memory and its pooled keys, start the next segment
        states = torch.cat([state.states, online.to(cd)[:, :, None]], dim=2)
        pooled = torch.cat([state.pooled, pooled_s[:, :, None]], dim=2)
        restart = online if self.mode == "checkpoint" else None
        return y, CachingState(states, pooled, restart, torch.zeros_like(key_sum), 0)

    @property
    def state_size(self):
        return None          # one cached [V, K] memory per head and segment: grows with T

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, base={self.base!r}, segments={self.segments!r}, mode={self.mode!r}, "
                f"aggregate={self.aggregate!r}, top_k={self.top_k}")


def delta_gates(mixer, q, x) -> dict:
    """beta_t (and the gated variants' log alpha_t), as the delta mixers hand them to ``delta_rule``."""
    gates = {"beta": mixer.beta(x).to(gate_dtype(q))}
    if isinstance(mixer, GatedLinear):
        gates["log_alpha"] = mixer.log_gate(x)
    return gates


def hebbian_gates(mixer, q, x) -> dict:
    """The gated family's log alpha_t for ``linear_attention`` (none for plain linear attention)."""
    return {"log_alpha": mixer.log_gate(x)} if isinstance(mixer, GatedLinear) else {}


def cached_class(base: type, library, base_gates) -> type:
    """The mixer that caches ``base``: the base's constructor and gates, Memory Caching's ``mix`` over its
    library function ``library`` with the gates ``base_gates(mixer, q, x)``."""
    return type(f"Cached{base.__name__}", (MemoryCaching, base),
                {"library": staticmethod(library), "base_gates": base_gates, "__module__": __name__})


CACHED = {name: cached_class(base, library, gates) for name, base, library, gates in (
    ("gated_deltanet", GatedDeltaNet, delta_rule, delta_gates), ("deltanet", DeltaNet, delta_rule, delta_gates),
    ("kda", KDA, delta_rule, delta_gates), ("linear", LinearAttention, linear_attention, hebbian_gates),
    ("mamba2", Mamba2Style, linear_attention, hebbian_gates), ("gla", GLA, linear_attention, hebbian_gates))}
# module globals under their own names, so that pickle (torch.save of a model) finds the classes
globals().update({cls.__name__: cls for cls in CACHED.values()})
