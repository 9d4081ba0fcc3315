"""A tiny decoder-only language model whose sequence layer is any registered token mixer."""
from __future__ import annotations

from torch import nn

from .mixer import make_mixer


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


class TinyLM(nn.Module):
    """Embedding -> n_layers x Block(mixer) -> RMSNorm -> LM head. Input [B, T] ids, output [B, T, vocab] logits.

    ``max_len`` adds learned absolute position embeddings (off by default: the short
    convolution of the mixers already tells a token where its neighbours are).
    Extra keywords go to every mixer (e.g. ``normalize=True``, ``backend="chunk"``).
    """

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, mixer: str = "softmax",
                 n_heads: int = 1, *, mlp_ratio: int = 4, max_len: int | None = None, **mixer_kw):
        super().__init__()
        self.vocab_size, self.mixer_name = vocab_size, mixer
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model) if max_len else None
        self.blocks = nn.ModuleList(Block(d_model, mixer, n_heads, mlp_ratio, **mixer_kw) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, ids):
        if ids.dim() != 2:
            raise ValueError(f"ids must be [B, T] token ids, got shape {list(ids.shape)}")
        x = self.embed(ids)
        if self.pos is not None:
            if ids.shape[1] > self.pos.num_embeddings:
                raise ValueError(f"sequence length {ids.shape[1]} exceeds max_len={self.pos.num_embeddings}")
            x = x + self.pos.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @property
    def state_size(self) -> int | None:
        """Recurrent-state numbers summed over layers; ``None`` if any layer's state grows with T."""
        sizes = [b.mixer.state_size for b in self.blocks]
        return None if any(s is None for s in sizes) else sum(sizes)
