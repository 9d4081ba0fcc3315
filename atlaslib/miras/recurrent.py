"""The definition: any MIRAS configuration, one token at a time.

For each token t (book/notation.md and book ch. 3 §1), with W_{t-1} = R(Z_{t-1}) the memory's weights
read from the raw state (retention, axis 4):

    g_t = sum_{i=t-c+1}^{t} gamma_i^{(t)} grad_W l(W; phi(k_i), v_i) |_{W = W_{t-1}}
                                          (at alpha_t W_{t-1} for retention decay_first)
    u_t, S_t = optimizer(S_{t-1}, g_t, eta_t, theta_t)       e.g. S_t = theta_t S_{t-1} - eta_t g_t
    Z_t = combine(Z_{t-1}, u_t, alpha_t)                       e.g. alpha_t Z_{t-1} + u_t
    y_t = M_{W_t}(phi(q_t)),   W_t = R(Z_t)                    (read out after the update)

with c = 1 (one pair per step, gamma = 1) unless a window is configured. The gradient
is the chain rule done by autograd: the bias gives psi = d l / d y at the prediction
y = M_W(phi(k)), and ``torch.func.vjp`` pulls it back through the memory, so deep
memories need no hand-written derivatives and outer-loop gradients flow through it.

``miras_frozen_seq`` is the same loop with every gradient of chunk [t0, t0 + b) taken at
the chunk-start state W_{t0} (including the window rows that reach into the previous
chunk; at alpha_t W_{t0} for decay_first): the sequential oracle of the chunkwise form
(book ch. 3 §8). At b = 1 it is the per-token engine.

All tensors here are internal: q, k [N, T, D] and v [N, T, V] with N = B * H, gates
[N, T], states {name: [N, out, in]}; ``atlaslib.miras.miras`` validates and reshapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .bias import Bias
from .memory import Memory
from .optimizer import Optimizer
from .retention import Retention


class Parts(NamedTuple):
    """The four axes of one configuration, built for given widths."""
    cfg: object
    memory: Memory
    bias: Bias
    retention: Retention
    optimizer: Optimizer


@dataclass
class Gates:
    """Per-token gates, [N, T] each (None where the configuration has none).

    eta is always a tensor; G [N, T, c] holds the window gates per offset,
    G[:, t, j] = gamma_{t-j}^{(t)}, zero where t - j < 0.
    """
    eta: torch.Tensor
    G: torch.Tensor
    alpha: torch.Tensor | None = None
    theta: torch.Tensor | None = None
    delta: torch.Tensor | None = None

    def slice(self, s: int, e: int) -> "Gates":
        """The gates of tokens s .. e - 1."""
        cut = lambda x: None if x is None else x[:, s:e]          # noqa: E731
        return Gates(cut(self.eta), cut(self.G), cut(self.alpha), cut(self.theta), cut(self.delta))


def loss_gradient(parts: Parts, W: dict, k_rows, v_rows, delta_rows, weights, scale=None) -> dict:
    """sum_r weights_r grad_W l(W'; k_r, v_r) at W' = W (or scale * W), for each (batch, head).

    W: {name: [N, out, in]}; k_rows [N, R, D]; v_rows [N, R, V]; delta_rows [N, R] or None;
    weights [N, R]; scale [N] or None. The losses of different (batch, head) pairs involve
    different weights, so one vjp of the summed loss gives every pair's own gradient.
    """
    if scale is not None:
        W = {n: scale[:, None, None] * w for n, w in W.items()}           # the point alpha_t W_{t-1}
    y, pullback = torch.func.vjp(lambda params: parts.memory(params, k_rows), W)
    psi = parts.bias.psi(y, v_rows, delta_rows) * weights[..., None]      # d(sum_r w_r l_r) / dy
    (grad,) = pullback(psi)
    return grad


def window_rows(gates: Gates, t: int, window: int):
    """(slice of the window's rows, their gates gamma_i^{(t)} [N, rows]) for token t."""
    lo = max(0, t - window + 1)
    return slice(lo, t + 1), gates.G[:, t, : t - lo + 1].flip(-1)     # offsets t - i for i = lo .. t


def _at(x, t):
    return None if x is None else x[:, t]


def token_loop(parts: Parts, q, k, v, gates: Gates, Z: dict, S, chunk_size: int | None = None):
    """The loop shared by the two per-token engines (``chunk_size=None``: gradients at W_{t-1})."""
    ret, opt, mem = parts.retention, parts.optimizer, parts.memory
    T = q.shape[1]
    outputs = []
    for t in range(T):
        if chunk_size is not None and t % chunk_size == 0:
            Z_start = Z                                                    # frozen for this chunk
        W = ret.read(Z if chunk_size is None else Z_start)                 # W_{t-1} (or W_{t0})
        rows, weights = window_rows(gates, t, parts.cfg.window)
        delta = None if gates.delta is None else gates.delta[:, rows]
        scale = _at(gates.alpha, t) if ret.grad_at_decayed else None
        g = loss_gradient(parts, W, k[:, rows], v[:, rows], delta, weights, scale)
        u, S = opt.step(S, g, gates.eta[:, t], _at(gates.theta, t))       # optimizer (axis 3)
        Z = ret.combine(Z, u, _at(gates.alpha, t))                         # retention (axis 4)
        outputs.append(mem(ret.read(Z), q[:, t:t + 1])[:, 0])              # y_t = M_{W_t}(phi(q_t))
    return torch.stack(outputs, dim=1), Z, S


def miras_recurrent(parts: Parts, q, k, v, gates: Gates, Z: dict, S=None):
    """The per-token engine, gradients at W_{t-1}. Returns (o [N, T, V], Z_T, S_T)."""
    return token_loop(parts, q, k, v, gates, Z, S)


def miras_frozen_seq(parts: Parts, q, k, v, gates: Gates, Z: dict, S=None, chunk_size: int = 16):
    """The per-token loop with gradients frozen at each chunk's start state (book ch. 3 §8).

    Equal to ``miras_chunk`` for every chunk size, and to ``miras_recurrent`` at chunk size 1.
    """
    return token_loop(parts, q, k, v, gates, Z, S, chunk_size)
