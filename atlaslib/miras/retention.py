"""Axis 3, retention: how the memory holds on to (or lets go of) what it stored.

The engines keep a *raw state* Z (one tensor per weight matrix) and read the memory's
weights from it with ``read``; each token's update u_t (from the optimizer, axis 4)
enters through ``combine``:

    name         combine                         read W = R(Z)                 gradient at
    none         Z_t = Z_{t-1} + u_t             W = Z                         W_{t-1}
    decay        Z_t = alpha_t Z_{t-1} + u_t     W = Z                         W_{t-1}          (Titans, TTT)
    decay_first  Z_t = alpha_t Z_{t-1} + u_t     W = Z                         alpha_t W_{t-1}  (Gated DeltaNet)
    proximal     as decay_first, with the implicit step eta_t / (1 + eta_t ||phi(k_t)||^2) (Longhorn)
    kl           Z_t = alpha_t Z_{t-1} + u_t     W = c softmax(Z) per matrix   W_{t-1}          (Memora)
    lq           Z_t = alpha_t Z_{t-1} + u_t     W = Z / ||Z||_q^(q-2)         W_{t-1}          (Moneta)
    elastic      Z_t = S_gamma(alpha_t Z_{t-1} + u_t),  W = Z                  W_{t-1}          (elastic net)

The two scalar-decay placements differ for the delta family (book ch. 2 §3): decaying
after the gradient gives M_{t-1}(alpha_t I - eta_t k k^T) + eta_t v k^T, decaying first
gives alpha_t M_{t-1}(I - eta_t k k^T) + eta_t v k^T, Gated DeltaNet.

kl is the KL divergence on the scaled simplex {W >= 0, sum W = c} with negative-entropy
regularisation; its closed form W_t = c Softmax(alpha_t log W_{t-1} - eta_t grad) ([M]
eq 31, where the gate is 1 - lambda_t; eq 10 calls it beta_t; book ch. 3 §5, the softmax over *all*
entries of each matrix) is computed in the log domain: softmax is shift-invariant, so the logits
Z_t = alpha_t Z_{t-1} - eta_t grad_t give exactly the same W_t, and the recursion on Z is linear (what
the chunk form needs).
lq is Moneta's normalisation: a linear accumulator Z_t = alpha_t Z_{t-1} - eta_t grad ([M]'s A_t), read
as W_t = Z_t / ||Z_t||_q^(q-2) with the entrywise q-norm of each whole matrix ([M] eq 8;
[M] Table 1 writes ||A||_2^2; q > 2 lies outside the range where it follows from a
retention, so it is a heuristic, book ch. 3 §5). elastic is the learning-retaining closed
form of the elastic net, W_t = S_gamma(lambda W_{t-1} - zeta grad) ([M] eq 32) with
alpha_t = lambda, eta_t = zeta and the soft threshold S_gamma(z) = sign(z) max(0, |z| - gamma).

Retentions whose ``combine`` is linear in (Z, u) (all but elastic) have the chunkwise
form Z_t = A_t Z_{t0} + sum_i (A_t / A_i) u_i, a masked matmul.
"""
from __future__ import annotations

import torch


def soft_threshold(z: torch.Tensor, gamma: float) -> torch.Tensor:
    """S_gamma(z) = sign(z) max(0, |z| - gamma), elementwise.

    Written as 0 where |z| < gamma, else z - gamma sign(z), so that gamma = 0 is the identity in its
    gradient too (sign(z) * |z| would have the derivative sign(z)^2 = 0 at z = 0: a zero memory, say),
    and a NaN stays NaN (a diverged state is not turned into a zero one)."""
    return torch.where(z.abs() < gamma, torch.zeros_like(z), z - gamma * torch.sign(z))


def _scale(alpha, like):
    """alpha [N] (or [N, n] for per-token states) broadcast against matrices [..., out, in]."""
    return alpha.reshape(*alpha.shape, *([1] * (like.dim() - alpha.dim())))


class Retention:
    name = "base"
    formula = ""
    uses_alpha = True           # takes the retention gate alpha (None means alpha = 1)
    linear = True               # combine is linear in (Z, u): chunk form by masked matmuls
    grad_at_decayed = False     # gradient taken at alpha_t W_{t-1} instead of W_{t-1}
    identity_read = True        # W = Z
    scalar_read = False         # W = Z / nu(Z), nu one number per matrix (``divisor``)

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def describe(cls, cfg) -> str:
        """``formula`` with the configuration's numbers filled in."""
        return cls.formula.format(cfg=cfg)

    def read(self, Z: dict) -> dict:
        """The memory's weights from the raw state (any leading dims)."""
        return Z

    def combine(self, Z: dict, u: dict, alpha) -> dict:
        """Z_t from Z_{t-1} and the update u_t; alpha [N] or None (= 1)."""
        if alpha is None:
            return {n: Z[n] + u[n] for n in Z}
        return {n: _scale(alpha, Z[n]) * Z[n] + u[n] for n in Z}

    def effective_eta(self, eta, k):
        return eta


class NoRetention(Retention):
    name, formula, uses_alpha = "none", "none", False


class Decay(Retention):
    name, formula = "decay", "scalar decay αₜ (after the gradient)"


class DecayFirst(Retention):
    name, formula, grad_at_decayed = "decay_first", "scalar decay αₜ (gradient at αₜM)", True


class Proximal(DecayFirst):
    name, formula = "proximal", "proximal (implicit) step, optional αₜ"

    def effective_eta(self, eta, k):
        """Longhorn's implicit step eta / (1 + eta ||phi(k)||^2): one GD step then lands on the
        exact minimiser of l2(M; k, v) + 1/(2 eta) ||M - alpha M_{t-1}||^2 (book ch. 2 §4)."""
        return eta / (1.0 + eta * k.square().sum(-1))


class KL(Retention):
    name = "kl"
    formula = "KL on the simplex, c={cfg.scale:g}: W = c·softmax(Z)"
    identity_read = False

    def read(self, Z):
        c = self.cfg.scale
        return {n: c * torch.softmax(z.flatten(-2), dim=-1).view_as(z) for n, z in Z.items()}


SUBSCRIPT, SUPERSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"), str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


class Lq(Retention):
    name = "lq"
    formula = "ℓq normalisation, q={cfg.lq:g}: W = Z / ‖Z‖_q^(q−2)"
    identity_read = False
    scalar_read = True          # W = Z / nu(Z) with a scalar nu per matrix: readouts can use the dual form

    @classmethod
    def describe(cls, cfg) -> str:
        """With a whole q the norm is written as the other rows write theirs: q = 4 gives W = Z / ‖Z‖₄²."""
        q = cfg.lq
        if not (float(q).is_integer() and q >= 2):
            return super().describe(cfg)
        q = int(q)
        return f"ℓq normalisation, q={q}: W = Z / ‖Z‖{str(q).translate(SUBSCRIPT)}{str(q - 2).translate(SUPERSCRIPT)}"

    def divisor(self, a):
        """nu = ||Z||_q^(q-2) over each matrix (last two dims), keepdim. The floor on ||Z||_q keeps
        Z = 0 -> W = 0 (no 0/0); W is singular there for q > 3 anyway (it scales like ||Z||^(3-q)).
        In fp32 the floor (3e-10 for q = 4) is reached by a memory that decays faster than it is
        written (alpha ~ U(0.5, 1), eta <= 0.01 on unit keys: after about 80 tokens), and W is then
        wrong by O(1) while fp64 still follows it: run such settings in fp64."""
        q = self.cfg.lq
        norm = torch.linalg.vector_norm(a, ord=q, dim=(-2, -1), keepdim=True)
        return norm.clamp_min(torch.finfo(a.dtype).tiny ** (1.0 / q)).pow(q - 2.0)

    def read(self, Z):
        return {n: a / self.divisor(a) for n, a in Z.items()}


class ElasticNet(Retention):
    name = "elastic"
    formula = "elastic net: Sᵧ(αW + u), γ={cfg.threshold:g}"
    linear = False

    def combine(self, Z, u, alpha):
        return {n: soft_threshold(z, self.cfg.threshold) for n, z in super().combine(Z, u, alpha).items()}


RETENTIONS = {r.name: r for r in (NoRetention, Decay, DecayFirst, Proximal, KL, Lq, ElasticNet)}


def build_retention(cfg) -> Retention:
    return RETENTIONS[cfg.retention](cfg)
