"""The definition: any MIRAS configuration, one token at a time.

For each token t (book/notation.md and book ch. 3 §1), with W_{t-1} = R(Z_{t-1}) the memory's weights
read from the raw state (retention, axis 3):

    grad_t = sum_{i=t-c+1}^{t} gamma_i^{(t)} grad_W l(W; phi(k_i), v_i) |_{W = W_{t-1}}
                                          (at alpha_t W_{t-1} for retention decay_first)
    u_t, S_t = optimizer(S_{t-1}, grad_t, eta_t, theta_t)    e.g. S_t = theta_t S_{t-1} - eta_t grad_t
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

``miras_step`` is one token of the loop (the loop calls it): what a token needs from the
past is the raw state Z, the optimizer's S and the last c - 1 (k, v, delta) rows of the
window, carried in a ``TokenState`` whose size does not grow with the number of tokens.

All tensors here are internal: q, k [N, T, D] and v [N, T, V] with N = B * H, gates
[N, T], states {name: [N, out, in]}; ``atlaslib.miras.miras`` validates and reshapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..core.validation import check_shape, check_tensor
from .bias import Bias, build_bias
from .config import MirasConfig, make_config, validate_config
from .memory import Memory, build_memory
from .optimizer import Optimizer, build_optimizer
from .retention import Retention, build_retention


class Parts(NamedTuple):
    """The four axes of one configuration, built for given widths."""
    cfg: object
    memory: Memory
    bias: Bias
    retention: Retention
    optimizer: Optimizer


def build_parts(cfg: MirasConfig, K: int, V: int) -> Parts:
    """The four axis objects of ``cfg`` for memory input width K and value width V."""
    cfg = validate_config(cfg)
    return Parts(cfg, build_memory(cfg, K, V), build_bias(cfg), build_retention(cfg), build_optimizer(cfg))


@dataclass
class Gates:
    """Per-token gates, [N, T] each (None where the configuration has none).

    eta is always a tensor; G [N, T, c] holds the window gates per offset,
    G[:, t, j] = gamma_{t-j}^{(t)}, zero where t - j < 0. log_alpha: the retention gate's log when it
    was given as one (alpha is then its exp), so the chunk form's decays use it without a round trip.
    """
    eta: torch.Tensor
    G: torch.Tensor
    alpha: torch.Tensor | None = None
    theta: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    log_alpha: torch.Tensor | None = None

    def slice(self, s: int, e: int) -> "Gates":
        """The gates of tokens s .. e - 1."""
        cut = lambda x: None if x is None else x[:, s:e]          # noqa: E731
        return Gates(cut(self.eta), cut(self.G), cut(self.alpha), cut(self.theta), cut(self.delta),
                     cut(self.log_alpha))

    def at(self, t: int) -> "Gates":
        """The gates of token t alone: [N] each, G [N, c] (its per-offset window gates)."""
        pick = lambda x: None if x is None else x[:, t]           # noqa: E731
        return Gates(pick(self.eta), pick(self.G), pick(self.alpha), pick(self.theta), pick(self.delta),
                     pick(self.log_alpha))


class TokenState(NamedTuple):
    """What the engine carries from one token to the next (internal layout, N = B * H rows).

    Z, S: the raw memory state and the optimizer's state ({name: [N, out, in]}, S None
    without momentum). keys [N, n, D], values [N, n, V], deltas [N, n] or None: the last
    n <= c - 1 rows of the window, oldest first (n = 0 for c = 1).
    """
    Z: dict
    S: object
    keys: torch.Tensor
    values: torch.Tensor
    deltas: torch.Tensor | None = None


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


def memory_gradient(cfg, W: dict, k, v, delta=None):
    """grad_W sum_r l(W; k_r, v_r) for config ``cfg`` (a preset name or MirasConfig), by autograd.

    W: {name: [N, out, in]} (the linear memory's weight is named "M"); k [N, R, K];
    v [N, R, V]; delta [N, R] for biases that take it (default: the config's constant).
    The public face of ``loss_gradient``: it builds the parts and gives every row weight 1.
    """
    cfg = make_config(cfg) if not isinstance(cfg, MirasConfig) else cfg
    check_tensor("k", k, 3, "[N, R, K]")
    check_tensor("v", v, 3, "[N, R, V]")
    N, R = k.shape[:2]
    if tuple(v.shape[:2]) != (N, R):             # one value per key row, of the same (batch, head) pair
        raise ValueError(f"v must be [N, R, V] = [{N}, {R}, V] like k [N, R, K], got {list(v.shape)}")
    check_shape("delta", delta, (N, R), ref=k)
    parts = build_parts(cfg, k.shape[-1], v.shape[-1])
    shapes = parts.memory.shapes
    if not isinstance(W, dict) or set(W) != set(shapes):
        raise ValueError(f"W must be a dict with the weights {sorted(shapes)} of the {cfg.memory} memory, got "
                         f"{sorted(W) if isinstance(W, dict) else type(W).__name__}")
    for name, (o, i) in shapes.items():
        if not isinstance(W[name], torch.Tensor) or tuple(W[name].shape) != (N, o, i):
            raise ValueError(f"W[{name!r}] must be [N, {o}, {i}] = [{N}, {o}, {i}] for k [N, R, K] = {list(k.shape)} "
                             f"and V = {v.shape[-1]}, got "
                             f"{list(W[name].shape) if isinstance(W[name], torch.Tensor) else type(W[name]).__name__}")
    if parts.bias.uses_delta and delta is None:
        delta = torch.full(k.shape[:-1], float(cfg.delta), dtype=k.dtype, device=k.device)
    return loss_gradient(parts, W, k, v, delta, torch.ones(k.shape[:-1], dtype=k.dtype, device=k.device))


def miras_step(parts: Parts, state: TokenState, q_t, k_t, v_t, gates_t: Gates, grad_at: dict | None = None):
    """One token of the engine. Returns (the state after token t, y_t [N, V]).

    q_t, k_t [N, D]; v_t [N, V]; gates_t: this token's gates (``Gates.at(t)``; eta is the
    engine's step, after ``Retention.effective_eta``). ``grad_at``: take the gradient at
    this raw state instead of Z_{t-1} (``miras_frozen_seq`` passes the chunk-start state).
    """
    ret, opt, mem = parts.retention, parts.optimizer, parts.memory
    keys = torch.cat([state.keys, k_t[:, None]], dim=1)                   # the window: last c rows, t's last
    values = torch.cat([state.values, v_t[:, None]], dim=1)
    deltas = None if gates_t.delta is None else torch.cat([state.deltas, gates_t.delta[:, None]], dim=1)
    n = keys.shape[1]
    weights = gates_t.G[:, :n].flip(-1)                                   # gamma_i^{(t)}: row j is offset n-1-j
    W = ret.read(state.Z if grad_at is None else grad_at)                 # W_{t-1} (or W_{t0})
    scale = gates_t.alpha if ret.grad_at_decayed else None
    grad = loss_gradient(parts, W, keys, values, deltas, weights, scale)
    u, S = opt.step(state.S, grad, gates_t.eta, gates_t.theta)            # optimizer (axis 4)
    Z = ret.combine(state.Z, u, gates_t.alpha)                            # retention (axis 3)
    y_t = mem(ret.read(Z), q_t[:, None])[:, 0]                            # y_t = M_{W_t}(phi(q_t))
    drop = max(n - (parts.cfg.window - 1), 0)                             # the oldest row leaves a full window
    keep = lambda x: None if x is None else x[:, drop:]                   # noqa: E731
    return TokenState(Z, S, keep(keys), keep(values), keep(deltas)), y_t


def token_loop(parts: Parts, q, k, v, gates: Gates, Z: dict, S, chunk_size: int | None = None):
    """The loop shared by the two per-token engines (``chunk_size=None``: gradients at W_{t-1})."""
    deltas = None if gates.delta is None else gates.delta[:, :0]
    state = TokenState(Z, S, k[:, :0], v[:, :0], deltas)                  # no tokens yet: an empty window
    outputs = []
    for t in range(q.shape[1]):
        if chunk_size is not None and t % chunk_size == 0:
            Z_start = state.Z                                              # frozen for this chunk
        state, y_t = miras_step(parts, state, q[:, t], k[:, t], v[:, t], gates.at(t),
                                grad_at=None if chunk_size is None else Z_start)
        outputs.append(y_t)
    return torch.stack(outputs, dim=1), state.Z, state.S


def miras_recurrent(parts: Parts, q, k, v, gates: Gates, Z: dict, S=None):
    """The per-token engine, gradients at W_{t-1}. Returns (o [N, T, V], Z_T, S_T)."""
    return token_loop(parts, q, k, v, gates, Z, S)


def miras_frozen_seq(parts: Parts, q, k, v, gates: Gates, Z: dict, S=None, chunk_size: int = 16):
    """The per-token loop with gradients frozen at each chunk's start state (book ch. 3 §8).

    Equal to ``miras_chunk`` for every chunk size, and to ``miras_recurrent`` at chunk size 1.
    """
    return token_loop(parts, q, k, v, gates, Z, S, chunk_size)
