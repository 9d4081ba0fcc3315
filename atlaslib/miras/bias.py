"""Axis 2, the attentional bias: the loss l(M; k, v) the memory minimises at test time.

Each bias is a function of the prediction y = M(phi(k)) and the value v, with the error
e = y - v (book/notation.md and book ch. 3 §4; 1/2 and 1/p conventions):

    dot           -<y, v>                                  gradient in y: -v
    l2            1/2 ||e||^2                              e
    lp            1/p sum_j |e_j|^p                        sign(e) |e|^(p-1)   (smoothed, below)
    huber         sum_j H_delta(e_j)          (i)          e_j if |e_j| <= delta else delta sign(e_j)
    huber_norm    H_delta(||e||_2)            (ii)         e if ||e|| <= delta else delta e / ||e||
    huber_switch  1/2||e||^2 if ||e|| <= delta else delta ||e||_1    (iii, Yaad)
                                                           e if ||e|| <= delta else delta sign(e)
    value_shift   max_{||s|| <= delta} 1/2 ||e - s||^2 = 1/2||e||^2 + delta ||e|| + 1/2 delta^2
                                                           e + delta e / ||e||

with H_delta(a) = a^2 / 2 for |a| <= delta, delta (|a| - delta / 2) otherwise ([M] eqs 22-26).
The engines never differentiate ``loss`` itself: they take ``psi`` = d loss / d y from here
and pull it back through the memory (the chain rule, grad_W l = J_W(y)^T psi, by
torch.func.vjp). That lets the lp bias use the smoothing of [M] Remark 1 / App. F,
sign(x) ~ tanh(a x) and |x| ~ sqrt(x^2 + eps), which is a *gradient* approximation, not
the derivative of a simple loss. For every other bias ``psi`` is exactly the gradient of
``loss`` (tested). [M] drops the 1/2 of l2 and writes ||e||_p^p without 1/p, which puts
a factor 2 (p) into its step sizes; [M] eqs 6 and 9 also subtract a scalar delta^2 inside
Yaad's matrix update, a constant of the loss, not of its gradient (see the errata).

``delta`` (the Huber threshold, or the value-shift radius) is per row: a tensor [..., R]
broadcast over the value channels, data-dependent in MIRAS ([M] §4.2).
"""
from __future__ import annotations

import abc

import torch


def _norm(e: torch.Tensor) -> torch.Tensor:
    """||e||_2 over the last dim, with a floor so that e / ||e|| is 0 (and differentiable) at e = 0."""
    return e.square().sum(-1).clamp_min(torch.finfo(e.dtype).tiny).sqrt()


class Bias(abc.ABC):
    """One attentional bias: the loss of a read-out y against the value v, and its gradient psi."""
    name = "base"
    formula = ""
    uses_delta = False                      # takes the per-token threshold / radius delta

    def __init__(self, cfg):
        self.cfg = cfg

    @abc.abstractmethod
    def psi(self, y, v, delta=None):
        """d loss / d y, [..., R, V]."""

    @abc.abstractmethod
    def loss(self, y, v, delta=None):
        """The loss value per row, [..., R]."""

    @classmethod
    def describe(cls, cfg) -> str:
        return cls.formula


class DotBias(Bias):
    name = "dot"
    formula = "dot-product: −⟨M(k), v⟩"

    def psi(self, y, v, delta=None):
        return (-v).expand_as(y)

    def loss(self, y, v, delta=None):
        return -(y * v).sum(-1)


class L2Bias(Bias):
    name = "l2"
    formula = "ℓ2: ½‖M(k) − v‖²"

    def psi(self, y, v, delta=None):
        return y - v

    def loss(self, y, v, delta=None):
        return 0.5 * (y - v).square().sum(-1)


class LpBias(Bias):
    name = "lp"
    formula = "ℓp: (1/p)‖M(k) − v‖ₚᵖ"

    @classmethod
    def describe(cls, cfg):
        return f"ℓp, p={cfg.p:g}: (1/p)‖M(k) − v‖ₚᵖ"

    def smooth_sign(self, e):
        a = self.cfg.sign_sharpness
        return torch.sign(e) if a is None else torch.tanh(a * e)

    def smooth_abs(self, e):
        eps = self.cfg.abs_eps
        return e.abs() if not eps else (e.square() + eps).sqrt()

    def psi(self, y, v, delta=None):
        e = y - v
        return self.smooth_sign(e) * self.smooth_abs(e) ** (self.cfg.p - 1)

    def loss(self, y, v, delta=None):
        return self.smooth_abs(y - v).pow(self.cfg.p).sum(-1) / self.cfg.p


def huber(x, d):
    """H_d(x) for x >= 0: x^2 / 2 up to d, then d (x - d / 2), linear with the same slope at d."""
    return torch.where(x <= d, 0.5 * x.square(), d * (x - 0.5 * d))


class HuberBias(Bias):
    name, formula, uses_delta = "huber", "Huber (i), per coordinate: Σⱼ H_δ(eⱼ)", True

    def psi(self, y, v, delta):
        e, d = y - v, delta[..., None]
        return torch.where(e.abs() <= d, e, d * torch.sign(e))

    def loss(self, y, v, delta):
        return huber((y - v).abs(), delta[..., None]).sum(-1)


class HuberNormBias(Bias):
    name, formula, uses_delta = "huber_norm", "Huber (ii), on the norm: H_δ(‖e‖₂)", True

    def psi(self, y, v, delta):
        e = y - v
        n = _norm(e)
        inside = (n <= delta)[..., None]
        return torch.where(inside, e, delta[..., None] * e / n[..., None])

    def loss(self, y, v, delta):
        return huber(_norm(y - v), delta)


class HuberSwitchBias(Bias):
    name, formula, uses_delta = "huber_switch", "Huber (iii), switch: ℓ2 if ‖e‖ ≤ δₜ, else δₜ·ℓ1", True

    def psi(self, y, v, delta):
        e = y - v
        inside = (_norm(e) <= delta)[..., None]
        return torch.where(inside, e, delta[..., None] * torch.sign(e))

    def loss(self, y, v, delta):
        e = y - v
        return torch.where(_norm(e) <= delta, 0.5 * e.square().sum(-1), delta * e.abs().sum(-1))


class ValueShiftBias(Bias):
    name, formula, uses_delta = "value_shift", "robust to value shifts: max over ‖s‖ ≤ δ of ½‖e − s‖²", True

    def psi(self, y, v, delta):
        e = y - v
        # e / ||e|| has no derivative at e = 0, and the floored norm's is 1 / sqrt(tiny) (1e19 in fp32):
        # 0 there, as torch.sign's, so that one exact read does not swamp a step's gradient
        unfloored = e.square().sum(-1, keepdim=True) > torch.finfo(e.dtype).tiny
        return e + delta[..., None] * torch.where(unfloored, e / _norm(e)[..., None], torch.zeros_like(e))

    def loss(self, y, v, delta):
        n = _norm(y - v)
        return 0.5 * n.square() + delta * n + 0.5 * delta.square()


BIASES = {b.name: b for b in (DotBias, L2Bias, LpBias, HuberBias, HuberNormBias, HuberSwitchBias, ValueShiftBias)}


def build_bias(cfg) -> Bias:
    return BIASES[cfg.bias](cfg)
