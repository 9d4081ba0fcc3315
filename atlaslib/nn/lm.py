"""A tiny decoder-only language model whose sequence layer is any registered token mixer.

``TinyLM.generate`` decodes one token at a time through the mixers' ``step``: per layer it
keeps only the mixer's cache (the memory state and the short convolution's last inputs),
whose size does not depend on how many tokens came before -- except for the memories that grow
with T (``state_size`` None): softmax attention and the DeepTransformer without a window keep every
past key and value, DOT's exact form every key and coefficient, Memory Caching one state per segment,
and MAG / MAL over any of them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..core.validation import _value_check, check_flag, check_int, check_positive_number
from .base import make_mixer


class DecodeState(NamedTuple):
    """The decoder's state between tokens: the next position and one mixer cache per layer."""
    position: int
    layers: tuple


class MLP(nn.Module):
    def __init__(self, d_model: int, ratio: int = 4):
        super().__init__()
        self.up = nn.Linear(d_model, ratio * d_model)
        self.down = nn.Linear(ratio * d_model, d_model)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, d_model, mixer, n_heads, mlp_ratio=4, **mixer_kw):
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model)
        self.mixer = make_mixer(mixer, d_model, n_heads, **mixer_kw)
        self.norm2 = nn.RMSNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio)

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def step(self, x_t, cache=None):
        """``forward`` for one token x_t [B, D], with the mixer's cache."""
        h, cache = self.mixer.step(self.norm1(x_t), cache)
        x_t = x_t + h
        return x_t + self.mlp(self.norm2(x_t)), cache


class TinyLM(nn.Module):
    """Embedding -> n_layers x Block(mixer) -> RMSNorm -> LM head. Input [B, T] ids, output [B, T, vocab] logits.

    ``max_len`` adds learned absolute position embeddings (off by default: the short
    convolution of the mixers already tells a token where its neighbours are).
    Extra keywords go to every mixer (e.g. ``normalize=True``, ``backend="chunk"``).
    """

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, mixer: str = "softmax",
                 n_heads: int = 1, *, mlp_ratio: int = 4, max_len: int | None = None, **mixer_kw):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                            ("mlp_ratio", mlp_ratio)):
            check_int(name, value, 1)
        if max_len is not None:
            check_int("max_len", max_len, 1, " (or None: no position embeddings)")
        self.vocab_size, self.mixer_name = vocab_size, mixer
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model) if max_len else None
        self.blocks = nn.ModuleList(Block(d_model, mixer, n_heads, mlp_ratio, **mixer_kw) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def check_ids(self, name: str, ids, ndim: int, layout: str):
        """Token ids: an int64 or int32 tensor (what the embedding takes) of ``layout`` with values in
        [0, vocab_size) (on a GPU a device-side assert, so the host does not wait)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != ndim or ids.dtype not in (torch.int64, torch.int32):
            got = f"{ids.dtype} of shape {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"{name} must be an integer tensor {layout} of token ids (int64 or int32), got {got}")
        how, msg = _value_check(ids), f"{name} must lie in [0, {self.vocab_size}) (vocab_size)"
        if how == "host" and ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.vocab_size):
            raise ValueError(f"{msg}, got values in [{int(ids.min())}, {int(ids.max())}]")
        if how == "device":
            torch._assert_async(((ids >= 0) & (ids < self.vocab_size)).all(), msg)

    def forward(self, ids):
        self.check_ids("ids", ids, 2, "[B, T]")
        if 0 in ids.shape:
            raise ValueError(f"ids must hold at least one sequence (B >= 1) of at least one token (T >= 1), "
                             f"got shape {list(ids.shape)}")
        x = self.embed(ids)
        if self.pos is not None:
            if ids.shape[1] > self.pos.num_embeddings:
                raise ValueError(f"sequence length {ids.shape[1]} exceeds max_len={self.pos.num_embeddings}")
            x = x + self.pos.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def step(self, ids_t: torch.Tensor, state: DecodeState | None = None):
        """One token of ``forward``: ids_t [B] and the state after the tokens before (None at the
        start) -> (logits [B, vocab] for the next token, the state after ids_t)."""
        self.check_ids("ids_t", ids_t, 1, "[B] (one per sequence)")
        if ids_t.shape[0] < 1:
            raise ValueError(f"ids_t must hold one token for each of B >= 1 sequences, got shape {list(ids_t.shape)}")
        position, caches = (0, (None,) * len(self.blocks)) if state is None else self.check_state(state)
        x = self.embed(ids_t)
        if self.pos is not None:
            if position >= self.pos.num_embeddings:
                raise ValueError(f"position {position} is past max_len={self.pos.num_embeddings}")
            x = x + self.pos.weight[position]
        new_caches = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block.step(x, cache)
            new_caches.append(cache)
        return self.head(self.norm(x)), DecodeState(position + 1, tuple(new_caches))

    def check_state(self, state) -> DecodeState:
        """The state after the previous token must be the ``DecodeState`` that ``step`` returned (each layer's
        cache is checked by its own mixer)."""
        if not isinstance(state, DecodeState):
            raise TypeError(f"state must be None (the first token) or the DecodeState that the previous step "
                            f"returned, got {type(state).__name__}")
        if not isinstance(state.layers, tuple) or len(state.layers) != len(self.blocks):
            raise ValueError(f"state.layers must hold one cache per layer ({len(self.blocks)}), got "
                             f"{len(state.layers) if isinstance(state.layers, tuple) else type(state.layers).__name__}")
        return state

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, *, greedy: bool = True,
                 temperature: float = 1.0, top_k: int | None = None, generator: torch.Generator | None = None,
                 return_state: bool = False):
        """Continue ``prompt_ids`` [B, T0] (T0 >= 1) by ``max_new_tokens`` tokens; returns [B, T0 + n].

        The prompt is read token by token through ``step`` (the same state a decoder keeps),
        then each new token is chosen from the last logits: the argmax (``greedy=True``), or
        a sample from softmax(logits / temperature) restricted to the ``top_k`` most likely
        tokens (None: all), drawn with ``generator``. ``return_state``: also return the final
        ``DecodeState``.

        ``step`` runs each mixer's per-token rule. Where the chunk length is part of the model (the
        chapter 3 presets, OmegaNet, ATLAS, DLA, DOT with a window, and MAG/MAL over them: their chunk
        form freezes the gradients at each chunk start), that rule is the model of ``chunk_size=1``, so
        generation continues what ``forward`` computes only for layers built with ``chunk_size=1``.
        """
        self.check_ids("prompt_ids", prompt_ids, 2, "[B, T0]")
        if 0 in prompt_ids.shape:
            raise ValueError(f"prompt_ids must be [B, T0] with B >= 1 and T0 >= 1, got shape {list(prompt_ids.shape)}")
        check_int("max_new_tokens", max_new_tokens, 0)
        if not check_flag("greedy", greedy):
            check_positive_number("temperature", temperature, "the softmax's temperature when sampling")
        if top_k is not None:
            check_int("top_k", top_k, 1, " (or None: every token)")
        state, ids = None, prompt_ids
        for t in range(prompt_ids.shape[1]):
            logits, state = self.step(prompt_ids[:, t], state)
        for _ in range(max_new_tokens):
            next_id = self.choose(logits, greedy, temperature, top_k, generator)
            ids = torch.cat([ids, next_id[:, None]], dim=1)
            logits, state = self.step(next_id, state)
        return (ids, state) if return_state else ids

    @staticmethod
    def choose(logits, greedy=True, temperature=1.0, top_k=None, generator=None):
        """The next token [B] from logits [B, vocab]: argmax, or a (top-k) sample at ``temperature``."""
        if greedy:
            return logits.argmax(-1)
        logits = logits.float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))    # only the k most likely remain
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]   # generator: on logits' device

    @property
    def state_size(self) -> int | None:
        """Recurrent-state numbers summed over layers; ``None`` if any layer's state grows with T."""
        sizes = [b.mixer.state_size for b in self.blocks]
        return None if any(s is None for s in sizes) else sum(sizes)
