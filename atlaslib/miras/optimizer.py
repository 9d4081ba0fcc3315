"""Axis 3, the memory's optimizer: how the gradients g_t become the updates u_t.

    gd         u_t = -eta_t g_t
    momentum   S_t = theta_t S_{t-1} - eta_t g_t,   u_t = S_t            (Titans, [A] eqs 12-13)

so that with retention (axis 4) Titans is M_t = alpha_t M_{t-1} + S_t. Here g_t is the
gradient of the token's loss (or, with a window, the gamma-weighted sum over its c pairs).

Two interfaces, one per engine:

* ``step(S, g, eta, theta) -> (u, S)``: one token (the per-token engines).
* ``affine(Gamma, eta, h) -> (b, E)``: a chunk whose gradients g_r (one per window row r)
  were all taken at the chunk-start state. A *linear* optimizer's updates are then affine
  in those gradients, u_t = b_t S_{t0} + sum_r E[t, r] g_r, and (b, E) are small matrices:
  for gd, E = -diag(eta) Gamma; for momentum, with B_t = theta_{t0+1} ... theta_t,
  b_t = B_t and E = D diag(-eta) Gamma with the decay-ratio matrix D[t, i] = B_t / B_i
  (i <= t), a masked matmul ([A] §5.1, book ch. 3 §6). Gamma [n, R] holds the window gates
  (the identity for window 1).
* ``updates(S0, G, Gamma, eta, h) -> (U, S_end)``: the same with the per-row gradients
  G materialised; the default applies ``affine``.

The place for Muon (chapter 5). ATLAS orthogonalises the momentum matrix itself,
S_t = theta_t S_{t-1} + g_t and u_t = -eta_t NS_k(S_t) (per 2-D weight; eta must sit
outside NS because NS normalises its input, erasing any scale inside it). That optimizer is not
linear: it sets ``linear = False``, implements ``step`` with NS, and overrides
``updates`` to build all b momenta S_t = B_t S0 + (D Gamma) G as a batch (``affine``
with eta = -1 gives exactly those coefficients) and apply NS to the batch. The chunk
engine already routes optimizers with ``linear = False`` through ``updates`` and
materialised per-token weights, so registering the class in ``OPTIMIZERS`` is all
that is needed.
"""
from __future__ import annotations

import abc

import torch

from ..core.chunking import causal_decay


class Optimizer(abc.ABC):
    """One inner optimizer: the per-token step, and its affine form for the chunkwise path."""
    name = "base"
    formula = ""
    uses_theta = False          # takes the momentum decay theta
    has_state = False           # carries a buffer S from token to token
    linear = True               # updates are affine in the gradients (chunk by masked matmuls)

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def describe(cls, cfg) -> str:
        return cls.formula

    @abc.abstractmethod
    def step(self, S, g: dict, eta, theta):
        """One token: (the update u_t, the new buffer S_t) from the gradients g, per parameter name."""

    @abc.abstractmethod
    def affine(self, Gamma, eta, h):
        """(b [..., n] or None, E [..., n, R]) with u_t = b_t S_{t0} + sum_r E[t, r] g_r; any leading dims."""

    def updates(self, S0, G: dict, Gamma, eta, h):
        """Materialised chunk updates U {name: [N, n, out, in]} and the buffer after the chunk."""
        b, E = self.affine(Gamma, eta, h)
        U = {}
        for name, g in G.items():
            U[name] = torch.einsum("ntr,nroi->ntoi", E, g)
            if b is not None and S0 is not None:
                U[name] = U[name] + b[..., None, None] * S0[name][:, None]
        S_end = {name: u[:, -1] for name, u in U.items()} if self.has_state else None
        return U, S_end


def decay_matrix(g):
    """D[..., t, i] = exp(g_t - g_i) for i <= t, else 0, from log-gates g [..., n] accumulated over a chunk.

    Only differences g_t - g_i <= 0 are exponentiated (``atlaslib.core.chunking.causal_decay``),
    never quotients of cumulative products.
    """
    n = g.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
    return causal_decay(g.reshape(1, -1, n), causal).reshape(*g.shape, n)


def _bcast(x, like):
    return x.reshape(*x.shape, *([1] * (like.dim() - x.dim())))


class GD(Optimizer):
    name = "gd"
    formula = "GD"

    def step(self, S, g, eta, theta=None):
        return {n: -_bcast(eta, x) * x for n, x in g.items()}, None

    def affine(self, Gamma, eta, h=None):
        return None, -eta[..., None] * Gamma


class Momentum(Optimizer):
    name = "momentum"
    formula = "GD with momentum θₜ"
    uses_theta = True
    has_state = True

    def step(self, S, g, eta, theta):
        """S_t = theta_t S_{t-1} - eta_t g_t (theta None: 0); the update is S_t."""
        new = {}
        for n, x in g.items():
            s = -_bcast(eta, x) * x
            if theta is not None and S is not None:
                s = s + _bcast(theta, x) * S[n]
            new[n] = s
        return new, new

    def affine(self, Gamma, eta, h):
        """h: [..., n] chunk-local cumulative log theta (None: theta = 0, no carried momentum)."""
        step = -eta[..., None] * Gamma
        if h is None:
            return None, step
        return torch.exp(h), decay_matrix(h) @ step


OPTIMIZERS = {o.name: o for o in (GD, Momentum)}


def build_optimizer(cfg) -> Optimizer:
    return OPTIMIZERS[cfg.optimizer](cfg)
