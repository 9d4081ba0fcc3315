"""Axis 1, the memory architecture: which function of the key the memory computes.

Every memory here is built from named weight matrices W [out, in], each used as a
linear map x -> W x, and fixed (parameter-free) nonlinearities:

    linear    M(x) = M x                                  (one matrix M [V, K])
    mlp       M(x) = W2 act(W1 x)                         (TTT-MLP; W1 [h, K], W2 [V, h])
    residual  M(x) = x + W1 act(W2 x)      (+ optional LN on the branch; [A] eq 42, MIRAS)
    gated     M(x) = x + W1 (act(W2 x) * W3 x)            (ATLAS++, [A] eq 43)

(the residual form names its *first* layer W2, the reverse of TTT-MLP, as [A] does;
h = expansion * K). A memory is written once, as ``forward(linear, x)``, where
``linear(name, x)`` applies the matrix ``name`` to the rows of ``x``. The engines pass
different ``linear`` callbacks: the same weights for every row (per-token loop, frozen
gradients), one weight set per token (readouts inside a chunk), or the chunk's dual
form. Because a weight enters only through x -> W x, the gradient of a per-token loss
with respect to W is the rank-one matrix a x^T, with a = d loss / d (W x): the chunk
engine keeps gradients in that factored form.

Parameters are functional: a dict ``{name: tensor [..., out, in]}`` with any leading
batch dims (the engines use one parameter set per (batch, head)), so torch.func and
autograd see plain tensors.
"""
from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": torch.tanh}


def shared_linear(params: dict, scale: torch.Tensor | None = None):
    """``linear`` callback with the same weights for every row: x [N, R, in] -> x W^T [N, R, out].

    ``scale`` [N, R] multiplies row r's output, i.e. evaluates row r at the weights
    scale_r * W (used for gradients at the decayed state alpha_t M_{t-1}).
    """
    def linear(name, x):
        out = x @ params[name].transpose(-1, -2)
        return out if scale is None else out * scale[..., None]
    return linear


def per_token_linear(params: dict):
    """``linear`` callback with one weight set per token: W [N, n, out, in], x [N, n, in] -> [N, n, out]."""
    def linear(name, x):
        return torch.einsum("ntoi,nti->nto", params[name], x)
    return linear


class Memory(abc.ABC):
    """Base class. Subclasses set ``name``/``formula``/``shapes`` and implement ``forward``."""

    name = "base"
    formula = ""
    square = False                        # needs input width == output width (a skip connection)

    def __init__(self, K: int, V: int, expansion: int = 4, activation: str = "gelu", layer_norm: bool = False):
        if self.square and K != V:
            raise ValueError(f"memory={self.name!r} computes x + ... and needs the key (feature) width to equal "
                             f"the value width, got K={K} and V={V}; use memory='mlp' or 'linear', or make K == V")
        self.K, self.V, self.hidden = K, V, expansion * K
        self.act = ACTIVATIONS[activation]
        self.layer_norm = layer_norm
        self.shapes = self.weight_shapes()

    @classmethod
    def describe(cls, cfg) -> str:
        """One line for the four-axis table."""
        return cls.formula

    @abc.abstractmethod
    def weight_shapes(self) -> dict:
        """{name: (out, in)} of the memory's weight matrices."""

    @abc.abstractmethod
    def forward(self, linear, x):
        """x [..., K] -> prediction [..., V], with the weights applied through ``linear``."""

    def __call__(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        """M_params(x) for x [N, R, K] and params {name: [N, out, in]}."""
        return self.forward(shared_linear(params), x)

    def init(self, H: int, generator: torch.Generator | None = None, dtype=torch.float32, device="cpu") -> dict:
        """Default initial weights, one set per head: {name: [H, out, in]}.

        Deep memories draw W ~ N(0, 1/in) from ``generator`` (a zero deep memory would have
        zero gradients forever); the linear memory starts at zero, as linear attention and
        the delta rule do.
        """
        out = {}
        for name, (o, i) in self.shapes.items():
            w = torch.randn(H, o, i, generator=generator, dtype=torch.float64) / math.sqrt(i)
            out[name] = w.to(dtype=dtype, device=device)
        return out


class LinearMemory(Memory):
    name = "linear"
    formula = "linear: M φ(k)"

    def weight_shapes(self):
        return {"M": (self.V, self.K)}

    def forward(self, linear, x):
        return linear("M", x)

    def init(self, H, generator=None, dtype=torch.float32, device="cpu"):
        return {"M": torch.zeros(H, self.V, self.K, dtype=dtype, device=device)}


class MLPMemory(Memory):
    name = "mlp"
    formula = "2-layer MLP: W₂ σ(W₁ k)"

    def weight_shapes(self):
        return {"W1": (self.hidden, self.K), "W2": (self.V, self.hidden)}

    def forward(self, linear, x):
        return linear("W2", self.act(linear("W1", x)))


class ResidualMemory(Memory):
    name = "residual"
    square = True

    formula = "residual MLP: k + W₁ σ(W₂ k)"

    @classmethod
    def describe(cls, cfg):
        return "residual MLP: k + LN(W₁ σ(W₂ k))" if cfg.layer_norm else cls.formula

    def weight_shapes(self):
        return {"W2": (self.hidden, self.K), "W1": (self.V, self.hidden)}

    def forward(self, linear, x):
        branch = linear("W1", self.act(linear("W2", x)))
        if self.layer_norm:                                # no learnable affine: the memory's weights are W1, W2
            branch = F.layer_norm(branch, branch.shape[-1:])
        return x + branch


class GatedMemory(Memory):
    name = "gated"
    formula = "gated MLP: k + W₁(σ(W₂ k) ⊙ W₃ k)"
    square = True

    def weight_shapes(self):
        return {"W2": (self.hidden, self.K), "W3": (self.hidden, self.K), "W1": (self.V, self.hidden)}

    def forward(self, linear, x):
        return x + linear("W1", self.act(linear("W2", x)) * linear("W3", x))


# the memory classes by name, and the names alone: what every model with a ``memory`` argument accepts
MEMORY_CLASSES = {m.name: m for m in (LinearMemory, MLPMemory, ResidualMemory, GatedMemory)}
MEMORIES = tuple(MEMORY_CLASSES)
DEEP_MEMORIES = MEMORIES[1:]     # all but "linear": the models with a linear memory of their own run these here


def build_memory(cfg, K: int, V: int) -> Memory:
    """The memory of config ``cfg`` for keys (features) of width K and values of width V."""
    return MEMORY_CLASSES[cfg.memory](K, V, cfg.expansion, cfg.activation, cfg.layer_norm)
