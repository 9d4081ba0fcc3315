"""Chapter 4 mixers: OmegaNet (linear memory) and SWLA as token mixers for the tiny LM.

Both update the memory with the last ``window`` = c pairs instead of one (book ch. 4 §2 and §5):

    OmegaNet  M_t = alpha_t M_{t-1} - eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} (M_{t-1} phi(k_i) - v_i) phi(k_i)^T
    SWLA      M_t = alpha_t M_{t-1} + eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} v_i phi(k_i)^T

Every gate is a linear projection of the layer input x_t, squashed as book ch. 4 §3 says:

* alpha_t (retention, one per head): chapter 1's gate, sigmoid(w^T x_t + b)^(1/16), so
  that memories start long-lived (``retention="none"`` drops it: alpha = 1);
* gamma (window gates in [0, 1]): sigmoid of a projection, in either parametrisation of
  book ch. 4 §2, ``gamma="offset"`` (c gates per token and head, gamma_i^{(t)} indexed by the
  offset t - i, chosen by the token that updates) or ``gamma="source"`` (one gate per
  token and head, gamma_i^{(t)} = gamma_i in every window that holds token i);
  ``gamma=None``: all ones;
* eta_t (inner step): bounded, eta_t = eta_max * sigmoid(w^T x_t + b). The Omega step is a
  GD step on sum_i gamma_i 1/2||M phi(k_i) - v_i||^2, whose Hessian has norm at most
  sum_i gamma_i ||phi(k_i)||^2 <= c for unit features; GD on it is stable while
  eta_t * c < 2. OmegaNet therefore uses unit features (q, k l2-normalised, also after the
  polynomial map) and eta_max = 1 / c by default: the window loss is in effect averaged
  and the step lies in (0, 1), like DeltaNet's beta at c = 1. SWLA has no such limit
  (its write does not read the state); its default eta_max is 1.

Polynomial features ([A] §3, book ch. 4 §6): ``degree=p`` applies to every head one fresh
``TaylorFeatures(p, compressed=True)`` per layer, its a_i shared by the heads (``poly="taylor"``: learnable a_i, kernel
sum_i a_i (q^T k)^i) or the unweighted monomials of degree <= p (``poly="monomial"``, the
map of Proposition 2) to the *normalised* q and k, then normalises the result again. The
memory grows to [V, D] per head with D = C(d_k + p, p), which ``state_size`` reports
(``constant=False`` drops the degree-0 feature: D = C(d_k + p, p) - 1).

The chunk size of the Omega chunk form **changes the model** (gradients frozen at the
chunk start; chunk_size = 1 is the per-token rule), so OmegaNet defaults to the rule's own
default, ``omega.OMEGA_CHUNK_SIZE`` = 16 (that of ``omega_rule`` and ``miras``); SWLA's chunk
form is exact for every chunk size (default 64, as ``swla``). The retention gate is handed
over as ``log_alpha`` in fp32 (fp64 for fp64 activations). Deep memories (OmegaNet with an MLP
memory) run on chapter 3's engine and are not mixers here.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..core import TaylorFeatures, monomial_features
from ..core.featuremaps import check_degree
from ..core.validation import check_flag, check_window
from ..omega import OMEGA_CHUNK_SIZE, omega_rule, swla
from ..omega.recurrent import omega_step, start_window, swla_step
from ..core.validation import check_positive_number
from .base import check_scalar_retention, gate_dtype, register_mixer
from .linear_mixers import GatedLinear, empty_memory

GAMMA_MODES = ("offset", "source", None)
POLY_MAPS = ("taylor", "monomial")


def without_constant(x, degree):
    """The monomials of degree 1..p (the constant feature 1 dropped)."""
    return monomial_features(x, degree)[..., 1:]


def check_has_features(degree, constant: bool) -> int:
    """The degree p, an int >= 0, checked when the mixer is built: with constant=False it must be >= 1, since
    without its constant the degree-0 map has no feature left (D = 0) and the first forward would fail."""
    degree = check_degree(degree)
    if degree == 0 and not constant:
        raise ValueError("degree=0 with constant=False leaves no feature (D = 0): give degree >= 1 or "
                         "constant=True")
    return degree


def polynomial_map(kind: str, degree: int, constant: bool = True):
    """A fresh polynomial feature map: ``TaylorFeatures(p, compressed=True)`` or the monomials of degree <= p.

    ``constant=False`` drops the degree-0 term: the monomials come without it, while the Taylor map keeps
    a channel for a_0 (started at 1e-12) that ``WindowedMixer.features`` drops, so it never counts.
    After normalisation a constant feature pulls all keys together (for unit inputs with q^T k >= 0
    their cosine is at least a_0 / sum_i a_i), which a memory that must tell keys apart does not want.
    """
    degree = check_has_features(degree, constant)
    if kind == "taylor":
        coefficients = None if constant else [0.0] + [1.0 / math.factorial(i) for i in range(1, degree + 1)]
        return TaylorFeatures(degree, compressed=True, coefficients=coefficients)
    if kind == "monomial":
        return functools.partial(monomial_features if constant else without_constant, degree=degree)
    raise ValueError(f"poly must be one of {POLY_MAPS}, got {kind!r}")


class WindowedMixer(GatedLinear):
    """Shared parts of OmegaNet and SWLA: the window gates gamma, the step eta, the retention
    alpha (chapter 1's ``GatedLinear`` gate) and the optional polynomial features."""

    per_channel = False              # alpha: one scalar per head and token
    default_eta_max = 1.0

    def __init__(self, d_model, n_heads, *, window: int = 8, gamma: str | None = "offset",
                 retention: str = "decay", eta_max: float | None = None, degree: int | None = None,
                 poly: str = "taylor", constant: bool = True, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.window = check_window(window)
        if gamma not in GAMMA_MODES:
            raise ValueError(f"gamma must be one of {GAMMA_MODES}, got {gamma!r}")
        self.gamma_mode = gamma
        if gamma is not None:
            width = window if gamma == "offset" else 1
            self.gamma_proj = nn.Linear(d_model, n_heads * width)
            nn.init.constant_(self.gamma_proj.bias, 2.0)            # sigmoid(2) ~ 0.88: windows start open
        self.retention = check_scalar_retention(retention)
        if retention == "none":
            self.gate_proj = None
        self.eta_max = check_positive_number("eta_max", self.default_eta_max if eta_max is None else eta_max,
                                             "the bound of the inner step eta_t")
        check_flag("constant", constant)
        self.eta_proj = nn.Linear(d_model, n_heads)
        self.degree, self.poly_kind, self.constant = degree, poly, constant
        if poly not in POLY_MAPS:                      # checked with or without a degree: a misspelling fails now
            raise ValueError(f"poly must be one of {POLY_MAPS}, got {poly!r}")
        self.poly = None if degree is None else polynomial_map(poly, degree, constant)

    # ---- gates, all [B, H, T] or [B, H, T, c], projected from x [B, T, D]
    def gammas(self, x):
        """Window gates in (0, 1): [B, H, T, c] (per offset), [B, H, T] (per source) or None."""
        if self.gamma_mode is None:
            return None
        B, T, _ = x.shape
        g = torch.sigmoid(self.gamma_proj(x).to(gate_dtype(x)))                 # squashed in fp32
        g = g.view(B, T, self.n_heads, -1).transpose(1, 2)                      # [B, H, T, w]
        return g if self.gamma_mode == "offset" else g.squeeze(-1)

    def eta(self, x):
        """Inner step eta_t = eta_max * sigmoid(w^T x_t + b) in (0, eta_max), [B, H, T]."""
        return self.eta_max * torch.sigmoid(self.eta_proj(x).to(gate_dtype(x))).transpose(1, 2)

    def alpha(self, x):
        """Retention in (0, 1), [B, H, T], or None without retention."""
        return self.gate(x) if self.gate_proj is not None else None

    def log_alpha(self, x):
        """log alpha_t <= 0, [B, H, T], computed as a log in fp32 (fp64 for fp64 x), or None without retention."""
        return self.log_gate(x) if self.gate_proj is not None else None

    def features(self, q, k):
        """phi(q), phi(k): the polynomial map of the unit q, k, normalised again (identity without ``degree``)."""
        if self.poly is None:
            return q, k
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        fq, fk = self.poly(q), self.poly(k)
        if not self.constant and self.poly_kind == "taylor":
            fq, fk = fq[..., 1:], fk[..., 1:]                    # the a_0 channel (first, degree 0): dropped
        return F.normalize(fq, dim=-1), F.normalize(fk, dim=-1)

    def feature_dim(self) -> int:
        """D, the width of phi(k): head_k_dim, or the polynomial (and base) feature map's output width."""
        x = torch.zeros(1, 1, 1, self.head_k_dim)
        with torch.no_grad():
            return self.features(self.phi(x), self.phi(x))[1].shape[-1]

    @property
    def state_size(self) -> int:
        """One [V, D] memory per head (D = the feature dimension). Not counted: the last c - 1 pairs that
        ``step`` also carries (``WindowState``), a size fixed by c, like the convolution's buffer."""
        return self.n_heads * self.feature_dim() * self.head_v_dim

    def gate_tensors(self, x, dtype, alpha: bool = True):
        """(gamma, alpha, eta) in ``dtype``; ``alpha=False`` skips the retention (None), for callers
        that pass it as ``log_alpha``."""
        cast = lambda t: None if t is None else t.to(dtype)       # noqa: E731
        return cast(self.gammas(x)), cast(self.alpha(x)) if alpha else None, cast(self.eta(x))

    def offset_gates(self, gamma, sources, B, H, q):
        """This token's per-offset window gates G [B, H, c] (G[..., j] = gamma_{t-j}^{(t)}, what the engine
        takes) and the per-source gates to carry (the last c - 1, oldest first; None unless gamma="source").

        For steps that keep their own window (ATLAS's deep memories, DOT's kernel form): ``gamma`` is this
        token's gate ([B, H, c] per offset, [B, H] per source, or None), ``sources`` the carried ones."""
        c = self.window
        if gamma is None:
            return torch.ones(B, H, c, dtype=gate_dtype(q), device=q.device), None
        if self.gamma_mode == "offset":
            return gamma, None
        sources = torch.cat([sources, gamma[:, :, None]], dim=2)          # gamma_{t-n+1} .. gamma_t
        n = sources.shape[2]
        G = F.pad(sources.flip(-1), (0, c - n))                           # offsets past the start: no token, 0
        return G, sources[:, :, max(n - (c - 1), 0):]                       # the oldest leaves a full window

    def window_step(self, rule, q, k, v, x, state):
        """One token of ``rule`` (``omega_step`` or ``swla_step``) with this layer's features and gates.

        The state is a ``WindowState``: the memory and the last c - 1 pairs (and their gates), since the
        next c - 1 updates still read them; its size depends on c, not on the tokens seen.
        """
        q, k = self.features(q, k)
        gamma, alpha, eta = (None if g is None else g[:, :, 0] for g in self.gate_tensors(x, gate_dtype(q)))
        state = start_window(empty_memory(q, v)) if state is None else state
        state, y_t = rule(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], self.window, gamma, alpha, eta)
        return y_t[:, :, None].to(q.dtype), state

    def extra_repr(self) -> str:
        poly = f", degree={self.degree} ({self.poly_kind}{'' if self.constant else ', no constant'})" \
            if self.degree is not None else ""
        return (f"{super().extra_repr()}, window={self.window}, gamma={self.gamma_mode!r}, "
                f"retention={self.retention!r}, eta_max={self.eta_max:.3g}{poly}")


@register_mixer("omeganet")
class OmegaNet(WindowedMixer):
    """OmegaNet with a linear memory: one GD step per token on the gated l2 loss of the last c pairs."""

    def __init__(self, d_model, n_heads, *, window: int = 8, eta_max: float | None = None, **kw):
        kw.setdefault("qk_norm", True)                           # unit features: the step bound needs them
        kw.setdefault("chunk_size", OMEGA_CHUNK_SIZE)
        check_window(window)
        super().__init__(d_model, n_heads, window=window, eta_max=1.0 / window if eta_max is None else eta_max,
                         **kw)

    def mix(self, q, k, v, x):
        q, k = self.features(q, k)
        gamma, _, eta = self.gate_tensors(x, gate_dtype(q), alpha=False)
        return omega_rule(q, k, v, window=self.window, gamma=gamma, log_alpha=self.log_alpha(x), eta=eta,
                          backend=self.backend, chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        """The per-token Omega rule (the model of ``chunk_size=1``; larger chunks freeze gradients)."""
        return self.window_step(omega_step, q, k, v, x, state)


@register_mixer("swla")
class SWLA(WindowedMixer):
    """Sliding-window linear attention: a gated Hebbian write of the last c pairs (exact chunk form)."""

    def mix(self, q, k, v, x):
        q, k = self.features(q, k)
        gamma, _, eta = self.gate_tensors(x, gate_dtype(q), alpha=False)
        return swla(q, k, v, window=self.window, gamma=gamma, log_alpha=self.log_alpha(x), eta=eta,
                    backend=self.backend, chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        return self.window_step(swla_step, q, k, v, x, state)
