"""The token-mixer base class and registry: the sequence layers that every chapter plugs into the same tiny LM.

A ``TokenMixer`` owns everything that is the same across models (the q/k/v/o
projections, the short causal convolution, the feature map, q/k normalisation, the head
split) and leaves one method to subclasses:

    mix(q, k, v, x) -> o        q, k: [B, H, T, K]; v: [B, H, T, V]; x: [B, T, D]; o: [B, H, T, V]

``x`` is the layer input, from which data-dependent gates are projected. A new model is
registered from any module with

    @register_mixer("deltanet")
    class DeltaNetMixer(TokenMixer):
        def __init__(self, d_model, n_heads, **kw):
            super().__init__(d_model, n_heads, **kw)
            self.beta_proj = nn.Linear(d_model, n_heads)
        def mix(self, q, k, v, x):
            ...

and built with ``make_mixer("deltanet", d_model, n_heads, **kw)``.

Generation runs one token at a time: ``y_t, cache = mixer.step(x_t, cache)`` (cache None
before the first token) applies the same projections, convolution and gates as
``forward`` to one token and hands the memory to the chapter's own step function
(``linear_attention_step``, ``delta_rule_step``, ``omega_step``, ``miras_step``), the
body of its per-token loop. A subclass opts in by defining

    mix_step(q, k, v, x, state) -> (o, state)    ``mix`` for T = 1, plus the memory state

and the cache holds that state and the convolution's last inputs: a fixed size, except for the memories
that grow with T (``state_size`` None: softmax attention, the DeepTransformer without a window, DOT's
exact form, Memory Caching), whose state is itself the past they keep. The step is
the per-token rule: for the mixers whose chunk length is part of the model (frozen gradients per chunk:
chapters 3-5 except SWLA, DLA, DOT with a window) it equals ``forward`` only at ``chunk_size=1``.

In another training loop: every mixer pickles (``torch.save(model)``), builds under
``torch.device("meta")``, and runs under ``torch.autocast`` (the library's forms switch it off and keep
their own precision: fp32 sums and states for bf16 q, k, v). Gradient checkpointing works with
``use_reentrant=True`` everywhere; the mixers on chapter 3's engine (ttt_linear, ttt_mlp, titans,
moneta, yaad, memora, dla, atlas++, and atlas with a deep memory) take their per-row gradients with
``torch.func.vjp`` in their PyTorch forms (``backend="chunk"``, the default, and ``"recurrent"``), which
saved-tensor hooks (``use_reentrant=False``, ``save_on_cpu``) do not support (a Triton form that has a
kernel, ttt_linear's, takes them).
"""
from __future__ import annotations

import abc
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..core import get_feature_map
from ..core.dispatch import KNOWN_BACKENDS, without_autocast
from ..core.validation import check_flag, check_int

MIXERS: dict[str, type] = {}


def gate_dtype(q: torch.Tensor) -> torch.dtype:
    """Gates travel in fp32 (fp64 with fp64 activations), never in the activation dtype.

    Below 1, bf16 can only tell apart steps of 2^-8: a retention gate sigmoid(z)^(1/16)
    rounds to exactly 1.0 for z >= 4 (and fp16 for z >= 7), so a bf16 model whose memory
    should forget over ~900 tokens would never forget. The retention gates are therefore
    computed as logs in this dtype and handed over as ``log_alpha``, which the chapters'
    functions use without rounding; the other gates (beta, eta, gamma) go in this dtype too.
    """
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def origin(cls: type) -> str:
    """Where a mixer class comes from, ``module.Class``: what a reader needs to find its code."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_mixer(name: str):
    """Class decorator: make a ``TokenMixer`` subclass available as ``make_mixer(name, ...)``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"mixer name must be a non-empty string, got {name!r}")

    def decorator(cls):
        if not (isinstance(cls, type) and issubclass(cls, TokenMixer)):
            raise TypeError(f"register_mixer({name!r}) needs a TokenMixer subclass, got {cls!r}")
        if name in MIXERS and MIXERS[name] is not cls:
            raise ValueError(f"mixer {name!r} is already registered by {origin(MIXERS[name])}; "
                             f"{origin(cls)} cannot register it again (pick another name)")
        MIXERS[name] = cls
        cls.mixer_name = name
        return cls
    return decorator


def available_mixers() -> list[str]:
    return sorted(MIXERS)


def make_mixer(name: str, d_model: int, n_heads: int, **kw) -> "TokenMixer":
    """Build the mixer registered as ``name``; extra keywords go to its constructor."""
    if name not in MIXERS:
        known = ", ".join(f"{n} ({MIXERS[n].__module__})" for n in available_mixers())
        raise ValueError(f"unknown mixer {name!r}; available: {known}. Mixers are registered when their "
                         "module is imported (import atlaslib.nn registers the chapters' mixers)")
    return MIXERS[name](d_model, n_heads, **kw)


def check_size(name: str, value, default: str = "") -> int:
    """A width, a head count or a chunk length: an int >= 1 (TypeError for ``True`` and ``2.0``, ValueError
    below 1: 0 is not read as "the default"; ``default`` says how to ask for it, if there is one)."""
    return check_int(name, value, 1, default)


def check_scalar_retention(retention) -> str:
    """The retention of a mixer with a scalar gate, named as the MIRAS axis (chapter 3's mixers take the same
    names): "decay", a learned gate alpha_t, or "none", alpha = 1."""
    if not isinstance(retention, str) or retention not in ("decay", "none"):
        raise ValueError(f"retention must be 'decay' (a learned gate alpha_t) or 'none' (alpha = 1), got {retention!r}")
    return retention


def check_conv_size(conv_size) -> None:
    if conv_size is not None:
        check_int("conv_size", conv_size, 0, " (0 or None: no convolution)")


def check_backend(backend) -> None:
    """A misspelt backend fails when the mixer is built, not at its first forward (or never, for a mixer
    whose ``mix`` takes none); whether the library call has that backend, the call itself says."""
    if not isinstance(backend, str) or backend not in KNOWN_BACKENDS:
        raise ValueError(f"backend must be one of {KNOWN_BACKENDS}, got {backend!r}")


class ShortConv(nn.Module):
    """Causal depthwise convolution over time (each channel sees its last ``size`` inputs), then SiLU.

    It lets a token mix in its immediate predecessors before it is written to memory,
    which is what MQAR needs to bind a value to the key just before it.
    """

    def __init__(self, channels: int, size: int = 4):
        super().__init__()
        self.size = size
        self.conv = nn.Conv1d(channels, channels, size, groups=channels, padding=size - 1, bias=False)

    def forward(self, x):                                   # x: [B, T, C]
        T = x.shape[1]
        return F.silu(self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2))

    def start(self, x_t: torch.Tensor) -> torch.Tensor:
        """The buffer before the first token: size - 1 zero inputs [B, size - 1, C], the same zeros
        that ``forward``'s left padding puts before the sequence."""
        return x_t.new_zeros(x_t.shape[0], self.size - 1, x_t.shape[-1])

    def step(self, x_t: torch.Tensor, buffer: torch.Tensor):
        """One token: x_t [B, C] and the last size - 1 inputs [B, size - 1, C] -> (y_t [B, C], new buffer)."""
        window = torch.cat([buffer, x_t[:, None]], dim=1)                      # [B, size, C], oldest first
        y_t = torch.einsum("bsc,cs->bc", window, self.conv.weight[:, 0])      # the conv's taps, in order
        return F.silu(y_t), window[:, 1:]


class MixerCache(NamedTuple):
    """What a mixer keeps between generated tokens: the short convolutions' buffers (q, k, v;
    None without convolution) and the memory's own state (the mixer's ``mix_step`` decides), with
    the batch size and the layer (``TokenMixer.layout``) it was made for, which the next step checks."""
    conv: tuple | None
    memory: object
    batch: int | None = None
    layer: tuple | None = None


class TokenMixer(nn.Module, abc.ABC):
    """Shared front and back end of a sequence-mixing layer.

    Args:
        d_model: width D of the residual stream.
        n_heads: number of heads H.
        head_k_dim / head_v_dim: per-head key and value widths K, V, ints >= 1 (None: D // H).
        conv_size: size of the short causal convolution on q, k, v, an int >= 1 (0 or None: off).
        feature_map: phi applied to q and k (a name from ``atlaslib.core.FEATURE_MAPS``
            or a callable).
        qk_norm: l2-normalise q and k per head (after phi), as delta-rule models do (a bool).
        backend: passed to the library call in ``mix`` ("auto", "chunk", ...).
        chunk_size: passed to the library call in ``mix`` (chunk length of the chunk form, an
            int >= 1; None: that function's own default); 64, the default of the chapter 1 and
            2 functions (subclasses whose model has another default set it, e.g. the MIRAS and
            OmegaNet mixers: 16).
        ``softmax`` and ``swa`` take both and ignore them: their attention has one form, and one set of
        options should build every mixer.
    """

    mixer_name = "base"

    def __init__(self, d_model: int, n_heads: int, *, head_k_dim: int | None = None,
                 head_v_dim: int | None = None, conv_size: int | None = 4,
                 feature_map="identity", qk_norm: bool = False, backend: str = "auto",
                 chunk_size: int | None = 64):
        super().__init__()
        check_size("d_model", d_model)
        check_size("n_heads", n_heads)
        for name, val in (("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
            if val is not None:
                check_size(name, val, " (or None: d_model // n_heads)")
        if chunk_size is not None:
            check_size("chunk_size", chunk_size, " (or None: the library function's default)")
        check_conv_size(conv_size)
        check_flag("qk_norm", qk_norm)
        check_backend(backend)
        if (head_k_dim is None or head_v_dim is None) and d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; "
                             "pass head_k_dim and head_v_dim explicitly")
        self.d_model, self.n_heads = d_model, n_heads
        self.head_k_dim = d_model // n_heads if head_k_dim is None else head_k_dim
        self.head_v_dim = d_model // n_heads if head_v_dim is None else head_v_dim
        self.backend, self.chunk_size = backend, chunk_size
        self.qk_norm = qk_norm
        self.phi = get_feature_map(feature_map)
        dk, dv = n_heads * self.head_k_dim, n_heads * self.head_v_dim
        self.q_proj = nn.Linear(d_model, dk, bias=False)
        self.k_proj = nn.Linear(d_model, dk, bias=False)
        self.v_proj = nn.Linear(d_model, dv, bias=False)
        self.o_proj = nn.Linear(dv, d_model, bias=False)
        if conv_size:
            self.q_conv, self.k_conv, self.v_conv = (ShortConv(c, conv_size) for c in (dk, dk, dv))
        else:
            self.q_conv = self.k_conv = self.v_conv = None

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H*d] -> [B, H, T, d]."""
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        if x.dim() != 3 or x.shape[-1] != self.d_model or 0 in x.shape[:2]:
            raise ValueError(f"x must have shape [B, T, {self.d_model}] with B >= 1 and T >= 1, got {list(x.shape)}")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_conv is not None:
            q, k, v = self.q_conv(q), self.k_conv(k), self.v_conv(v)
        q, k, v = self.heads(q), self.heads(k), self.heads(v)
        q, k = self.phi(q), self.phi(k)
        if self.qk_norm:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        o = self.mix(q, k, v, x)                                   # [B, H, T, V]
        B, H, T, V = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * V))

    @abc.abstractmethod
    def mix(self, q, k, v, x):
        """The sequence mixing itself: q, k [B,H,T,K], v [B,H,T,V], x the layer input -> o [B,H,T,V]."""

    def step(self, x_t: torch.Tensor, cache: MixerCache | None = None):
        """One token of ``forward``: x_t [B, D] and the cache of the tokens before (None at the
        start, then the ``MixerCache`` the previous step returned) -> (y_t [B, D], the cache after x_t).

        The token goes through the same projections, feature map and normalisation as in
        ``forward`` (as a sequence of length 1), the convolution through its rolling buffer.
        """
        if x_t.dim() != 2 or x_t.shape[-1] != self.d_model or x_t.shape[0] < 1:
            raise ValueError(f"x_t must have shape [B, {self.d_model}] (one token, B >= 1), got {list(x_t.shape)}")
        if not self.steps_like_mix():
            self.no_step()
        conv, memory = (None, None) if cache is None else self.check_cache(cache, x_t.shape[0])[:2]
        q, k, v = self.q_proj(x_t), self.k_proj(x_t), self.v_proj(x_t)
        if self.q_conv is not None:
            convs = (self.q_conv, self.k_conv, self.v_conv)
            buffers = [c.start(x) for c, x in zip(convs, (q, k, v))] if conv is None else conv
            (q, bq), (k, bk), (v, bv) = (c.step(x, b) for c, x, b in zip(convs, (q, k, v), buffers))
            conv = (bq, bk, bv)
        x = x_t[:, None]                                           # [B, 1, D]: gates see a sequence of one
        q, k, v = self.heads(q[:, None]), self.heads(k[:, None]), self.heads(v[:, None])
        q, k = self.phi(q), self.phi(k)
        if self.qk_norm:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        with without_autocast(q):                  # as ``dispatch``: the steps keep their own precision
            o, memory = self.mix_step(q, k, v, x, memory)          # [B, H, 1, V]
        B, H, _, V = o.shape
        return self.o_proj(o.reshape(B, H * V)), MixerCache(conv, memory, B, self.layout())

    def layout(self) -> tuple:
        """What a cache must have been made by: the mixer and its sizes (name, d_model, H, K, V)."""
        return (self.mixer_name, self.d_model, self.n_heads, self.head_k_dim, self.head_v_dim)

    def check_cache(self, cache, B: int) -> MixerCache:
        """The cache after the previous token must be what that ``step`` returned: a ``MixerCache`` made
        for this batch size by a layer of this kind and size, whose convolution buffers fit (anything else
        failed deep inside with an unpacking or shape error, or silently returned the old batch's rows)."""
        if not isinstance(cache, MixerCache):
            raise TypeError(f"cache must be None (the first token) or the MixerCache that the previous step "
                            f"returned, got {type(cache).__name__}")
        if cache.batch is not None and cache.batch != B:
            raise ValueError(f"the cache was made for a batch of {cache.batch} sequences, x_t has {B} rows: "
                             "pass the cache of this batch (or None to start)")
        if cache.layer is not None and cache.layer != self.layout():
            raise ValueError(f"the cache comes from another layer (name, d_model, heads, K, V) = {cache.layer}, "
                             f"this layer is {self.layout()}")
        if self.q_conv is None:
            if cache.conv is not None:
                raise ValueError("cache.conv must be None: this mixer has no convolution (conv_size 0 or None), "
                                 "so the cache comes from another layer")
            return cache
        want = [[B, c.size - 1, c.conv.in_channels] for c in (self.q_conv, self.k_conv, self.v_conv)]
        conv = cache.conv
        if not (isinstance(conv, tuple) and len(conv) == 3
                and all(isinstance(b, torch.Tensor) and list(b.shape) == w for b, w in zip(conv, want))):
            seen = [list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__ for b in conv] \
                if isinstance(conv, tuple) else type(conv).__name__
            raise ValueError(f"cache.conv must hold the q, k, v convolution buffers of shapes {want} (batch, "
                             f"size - 1, channels) that the previous step returned, got {seen}")
        return cache

    def mix_step(self, q, k, v, x, state):
        """``mix`` for one token, with the memory carried: q, k [B,H,1,K], v [B,H,1,V], x [B,1,D] and
        the state after the previous token (None at the start) -> (o [B,H,1,V], new state)."""
        self.no_step()

    @classmethod
    def steps_like_mix(cls) -> bool:
        """Whether ``mix_step`` was written for this class's ``mix``: defined by the class that defines
        ``mix`` or below it. A subclass that overrides ``mix`` alone must not inherit its parent's step."""
        owner = lambda name: next(c for c in cls.__mro__ if name in vars(c))      # noqa: E731
        return issubclass(owner("mix_step"), owner("mix"))

    def no_step(self):
        raise NotImplementedError(f"{type(self).__name__} (mixer {self.mixer_name!r}) has no one-token step "
                                  "for its mix: define mix_step(q, k, v, x, state) to generate with it")

    def feature_dim(self) -> int:
        """D, the width of phi(k) that the memory reads: head_k_dim, or what the feature map makes of it."""
        with torch.no_grad():
            return self.phi(torch.zeros(1, 1, 1, self.head_k_dim)).shape[-1]

    @property
    def state_size(self) -> int | None:
        """Numbers in this layer's recurrent state: one [V, D] matrix per head (D = ``feature_dim()``).

        ``None`` for models whose state grows with T (softmax attention's KV cache).
        """
        return self.n_heads * self.feature_dim() * self.head_v_dim

    def extra_repr(self) -> str:
        return (f"name={self.mixer_name!r}, heads={self.n_heads}, K={self.head_k_dim}, "
                f"V={self.head_v_dim}, backend={self.backend!r}")
