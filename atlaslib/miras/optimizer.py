"""Axis 4, the memory's optimizer: how the gradients ∇_t (``grad``) become the updates u_t.

    gd         u_t = -eta_t ∇_t
    momentum   S_t = theta_t S_{t-1} - eta_t ∇_t,   u_t = S_t            (Titans, [A] eqs 12-13)
    muon       S_t = theta_t S_{t-1} + ∇_t,         u_t = -eta_t NS_J(S_t)   (ATLAS, [A] eqs 32-33)

so that with retention (axis 3) Titans is M_t = alpha_t M_{t-1} + S_t and ATLAS is
M_t = alpha_t M_{t-1} - eta_t NS_J(S_t). Here ∇_t is the gradient of the token's loss (or,
with a window, the gamma-weighted sum over its c pairs); g is kept for the log-gates.

Two interfaces, one per engine:

* ``step(S, grad, eta, theta) -> (u, S)``: one token (the per-token engines).
* ``affine(Gamma, eta, h) -> (b, E)``: a chunk whose gradients ∇_r (one per window row r)
  were all taken at the chunk-start state. A *linear* optimizer's updates are then affine
  in those gradients, u_t = b_t S_{t0} + sum_r E[t, r] ∇_r, and (b, E) are small matrices:
  for gd, E = -diag(eta) Gamma; for momentum, with B_t = theta_{t0+1} ... theta_t,
  b_t = B_t and E = D diag(-eta) Gamma with the decay-ratio matrix D[t, i] = B_t / B_i
  (i <= t), a masked matmul ([A] §5.1, book ch. 3 §6). Gamma [n, R] holds the window gates
  (the identity for window 1).
* ``updates(S0, G, Gamma, eta, h) -> (U, S_end)``: the same with the per-row gradients
  materialised (``G`` {name: [N, R, out, in]}); the default applies ``affine``.

Muon (chapter 5) is not linear in its gradients: NS_J, Newton–Schulz orthogonalisation
(``atlaslib.core.newton_schulz``, applied to each 2-D weight's momentum on its own),
normalises its input, so eta must sit *outside* it (a step size inside S would be
erased). It sets ``linear = False``: its ``updates`` builds all b momenta of a chunk as a
batch, S_t = B_t S_{t0} + sum_i (B_t / B_i) sum_r Gamma[i, r] ∇_r (the masked matmul of
momentum with eta = -1), applies NS_J to the batch, and scales by -eta_t; the chunk engine
routes ``linear = False`` optimizers through ``updates`` and materialised per-token weights.
NS_J's steps and coefficients are the config's ``ns_steps`` and ``ns_coeffs``;
``ns_steps = 0`` is the identity, which makes muon momentum with eta outside the buffer.
"""
from __future__ import annotations

import abc

import torch

from ..core.chunking import causal_decay
from ..core.newton_schulz import newton_schulz


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
    def step(self, S, grad: dict, eta, theta):
        """One token: (the update u_t, the new buffer S_t) from the gradients ``grad``, per parameter name."""

    @abc.abstractmethod
    def affine(self, Gamma, eta, h):
        """(b [..., n] or None, E [..., n, R]) with u_t = b_t S_{t0} + sum_r E[t, r] ∇_r; any leading dims."""

    def updates(self, S0, G: dict, Gamma, eta, h):
        """Materialised chunk updates U {name: [N, n, out, in]} and the buffer after the chunk."""
        b, E = self.affine(Gamma, eta, h)
        U = {}
        for name, grad in G.items():
            U[name] = torch.einsum("ntr,nroi->ntoi", E, grad)
            if b is not None and S0 is not None:
                U[name] = U[name] + b[..., None, None] * S0[name][:, None]
        S_end = {name: u[:, -1] for name, u in U.items()} if self.has_state else None
        return U, S_end


def _bcast(x, like):
    return x.reshape(*x.shape, *([1] * (like.dim() - x.dim())))


class GD(Optimizer):
    name = "gd"
    formula = "GD"

    def step(self, S, grad, eta, theta=None):
        return {n: -_bcast(eta, x) * x for n, x in grad.items()}, None

    def affine(self, Gamma, eta, h=None):
        return None, -eta[..., None] * Gamma


class Momentum(Optimizer):
    name = "momentum"
    formula = "GD with momentum θₜ"
    uses_theta = True
    has_state = True

    def step(self, S, grad, eta, theta):
        """S_t = theta_t S_{t-1} - eta_t ∇_t (theta None: 0); the update is S_t."""
        new = {}
        for n, x in grad.items():
            s = -_bcast(eta, x) * x
            if theta is not None and S is not None:
                s = s + _bcast(theta, x) * S[n]
            new[n] = s
        return new, new

    def affine(self, Gamma, eta, h):
        """h: [..., n] chunk-local cumulative log theta, fp64 (None: theta = 0, no carried momentum)."""
        step = -eta[..., None] * Gamma
        if h is None:
            return None, step
        return torch.exp(h).to(step.dtype), causal_decay(h, dtype=step.dtype) @ step


class Muon(Optimizer):
    """ATLAS's optimizer: momentum on the raw gradients, orthogonalised by Newton–Schulz.

    S_t = theta_t S_{t-1} + ∇_t (theta None: 0) and u_t = -eta_t NS_J(S_t), NS_J applied to
    each weight's [out, in] momentum separately, in the state's dtype.
    """
    name = "muon"
    formula = "Muon: −ηₜ NSₖ(Sₜ), Sₜ = θₜ Sₜ₋₁ + ∇ₜ"
    uses_theta = True
    has_state = True
    linear = False

    @classmethod
    def describe(cls, cfg):
        k = getattr(cfg, "ns_steps", 5)
        return "momentum, NS off (η outside)" if k == 0 else cls.formula.replace("NSₖ", f"NS{k}")

    def orthogonalise(self, S):
        """NS_J of every momentum matrix (any leading dims)."""
        return newton_schulz(S, self.cfg.ns_steps, self.cfg.ns_coeffs)

    def step(self, S, grad, eta, theta):
        new, u = {}, {}
        for n, x in grad.items():
            s = x if (theta is None or S is None) else _bcast(theta, x) * S[n] + x
            new[n] = s
            u[n] = -_bcast(eta, x) * self.orthogonalise(s)
        return u, new

    def affine(self, Gamma, eta, h):
        """The momenta's coefficients: S_t = b_t S_{t0} + sum_r E[t, r] ∇_r (the updates are not affine)."""
        step = Gamma
        if h is None:
            return None, step
        return torch.exp(h).to(step.dtype), causal_decay(h, dtype=step.dtype) @ step

    def updates(self, S0, G, Gamma, eta, h):
        """All b momenta of the chunk by one masked matmul, NS_J on the batch, then -eta_t."""
        b, E = self.affine(Gamma, eta, h)
        U, S_end = {}, {}
        for name, grad in G.items():
            S = torch.einsum("ntr,nroi->ntoi", E, grad)                   # [N, n, out, in]
            if b is not None and S0 is not None:
                S = S + b[..., None, None] * S0[name][:, None]
            U[name] = -eta[..., None, None] * self.orthogonalise(S)
            S_end[name] = S[:, -1]
        return U, S_end


OPTIMIZERS = {o.name: o for o in (GD, Momentum, Muon)}


def build_optimizer(cfg) -> Optimizer:
    return OPTIMIZERS[cfg.optimizer](cfg)
