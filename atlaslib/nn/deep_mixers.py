"""Chapter 6 mixers: the DeepTransformer, SWDT, DOT and DLA as token mixers for the tiny LM.

* ``"deep_transformer"``: ``atlaslib.deep.deep_transformer`` with the exact phi* (``phi_star="kernel"``)
  and the normaliser (``normalize=True``),

      y_t = sum_{i<=t} w_i^{(t)} exp(q_t^T k_i) v_i / sum_{i<=t} w_i^{(t)} exp(q_t^T k_i),
      w_i^{(t)} = alpha_{i+1} ... alpha_t,

  with q scaled by 1/sqrt(K) as attention does. Without the normaliser the read is a sum of
  exponentials that grows with t and with the scores (the library refuses scores above 80), which a
  layer in a residual stream cannot be trusted with; with it, the layer is causal softmax attention
  (``retention="none"``: exactly the ``"softmax"`` mixer) or, with the retention gate
  alpha_t = sigmoid(w^T x_t + b)^(1/16) (chapter 1's gate, the default), softmax attention whose past
  fades by a learned, data-dependent decay. The gate starts near 1, so the layer starts as attention.
* ``"swdt"``: the same with a window of c tokens (default 64): the memory holds only the last c pairs.
* ``"dot"``: ``atlaslib.deep.dot``, the Omega rule on phi* (window c, default 1: the delta rule on phi*),
  with the step eta_t = eta_max sigmoid(.), the retention alpha_t and optional window gates gamma
  (chapter 4's ``WindowedMixer``). q and k are unit vectors, so |phi*(k)|^2 = e and the GD step on the
  window loss is stable while eta_t c e < 2; eta_max = 1 / (c |phi*(k)|^2) keeps every step in (0, 1),
  as OmegaNet's 1 / c does. ``phi_star`` is ``"kernel"`` by default: on CPU at the book's sizes (T <= 512,
  head width 16-32) the exact coefficient form is faster than the truncated features, whose width
  C(K + P, P) is already 561 for K = 32, P = 2 (forward and backward, B = 8, H = 4, T = 256: 0.09 s
  against 0.65 s), and it has no truncation error. ``phi_star=("taylor", P)`` gives a fixed-size state instead.
* ``"dla"``: ``atlaslib.deep.dla`` (the MIRAS preset "dla": dot-product bias, GD, decay, the MLP
  memory), built on chapter 3's ``MirasMixer`` (gates, W_0 as parameters, the one-token engine step);
  ``phi_star=("taylor", P)`` makes it the DeepTransformer with a deep memory on phi*_P.

One-token steps (generation): the kernel forms have no fixed-size state. The DeepTransformer's step
keeps, like softmax attention's KV cache, every past key and value and one log-weight per pair
(``KernelCache``; SWDT keeps only the last c, a fixed size); DOT's kernel step keeps every past key
and the coefficients u_j of M_t = sum_j u_j phi*(k_j)^T (``CoefficientCache``), and its Taylor step is
chapter 4's ``omega_step`` on the features (a fixed [V, D] memory). DLA steps on chapter 3's engine.
A step runs the per-token rule: the forward's model for the DeepTransformer, SWDT and DOT with c = 1
at every chunk size (their chunk forms are exact), but for DOT with c > 1 and DLA's deep memories only
at ``chunk_size=1`` (their chunk forms freeze the gradients per chunk, so the chunk size is part of the
model: both default to 16, as ``dot`` and chapter 3's engine do).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..core.chunking import compute_dtype
from ..deep import (check_phi_star, deep_transformer, default_chunk_size, dla, dot, exp_coefficients, exp_feature_dim,
                     exp_features)
from ..deep.dla import MEMORY_OPTIONS
from ..deep.validation import check_scores
from ..core.validation import check_flag, check_window
from ..omega.recurrent import omega_step
from .miras_mixers import CONFIG_FIELDS, MirasMixer
from .base import check_scalar_retention, gate_dtype, register_mixer
from .linear_mixers import GatedLinear
from .omega_mixers import WindowedMixer


# ---------------------------------------------------------------- the DeepTransformer and SWDT

class KernelCache(NamedTuple):
    """The DeepTransformer's memory between tokens, as coefficients of past features (the kernel trick):
    keys [B, H, n, K], values [B, H, n, V] and log w_i [B, H, n], the log of pair i's weight in M_t
    (log eta_i plus the log retentions since)."""
    keys: torch.Tensor
    values: torch.Tensor
    log_weights: torch.Tensor


def kernel_attention_step(cache: KernelCache | None, q, k, v, log_alpha=None, window=None, normalize=True):
    """One token of the kernel-form DeepTransformer (eta = 1): q, k [B, H, K], v [B, H, V], log_alpha [B, H]
    or None -> (y [B, H, V] in fp32/fp64, the cache after the token).

    M_t = alpha_t M_{t-1} + v_t phi*(k_t)^T becomes: every past log-weight gains log alpha_t, the new pair
    enters with weight 1, a window drops the pair t - c; y_t = sum_i w_i exp(k_i^T q_t) v_i, divided by
    sum_i w_i exp(k_i^T q_t) with ``normalize`` (a softmax of the scores k_i^T q_t + log w_i). Without it a
    score above ``deep.MAX_EXPONENT`` is refused, as ``deep_transformer`` refuses it in the forward.
    """
    cd = compute_dtype(q)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    if cache is None:
        cache = KernelCache(k[:, :, None, :][:, :, :0], v[:, :, None, :][:, :, :0], k.new_zeros(k.shape[:2] + (0,)))
    log_w = cache.log_weights if log_alpha is None else cache.log_weights + log_alpha.to(cd)[..., None]
    keys = torch.cat([cache.keys, k[:, :, None]], dim=2)
    values = torch.cat([cache.values, v[:, :, None]], dim=2)
    log_w = torch.cat([log_w, log_w.new_zeros(log_w.shape[:2] + (1,))], dim=2)
    if window is not None:                                           # SWDT: the last c pairs stay
        keys, values, log_w = keys[:, :, -window:], values[:, :, -window:], log_w[:, :, -window:]
    scores = torch.einsum("bhnk,bhk->bhn", keys, q)
    if not normalize:                                                # exp(score) unshifted: refused past the cap
        check_scores(scores)
    scores = scores + log_w
    weights = scores.softmax(-1) if normalize else scores.exp()
    return torch.einsum("bhn,bhnv->bhv", weights, values), KernelCache(keys, values, log_w)


@register_mixer("deep_transformer")
class DeepTransformerMixer(GatedLinear):
    """The DeepTransformer on the exact phi*, normalised (see the module docstring): softmax attention
    with an optional learned retention. ``window`` (or the ``"swdt"`` mixer) gives SWDT. The write
    strength is eta = 1: with the normaliser a gate eta_i would only add log eta_i to key i's scores."""

    per_channel = False
    default_window = None

    def __init__(self, d_model, n_heads, *, window: int | None = None, retention: str = "decay",
                 normalize: bool = True, **kw):
        super().__init__(d_model, n_heads, **kw)
        window = self.default_window if window is None else window
        if window is not None:
            check_window(window)
        self.window, self.retention, self.normalize = window, check_scalar_retention(retention), check_flag(
            "normalize", normalize)
        if retention == "none":
            self.gate_proj = None

    def scaled(self, q):
        """q / sqrt(K): attention's temperature, which deep_transformer leaves to the caller."""
        return q * (1.0 / math.sqrt(q.shape[-1]))

    def mix(self, q, k, v, x):
        log_alpha = self.log_gate(x) if self.gate_proj is not None else None
        return deep_transformer(self.scaled(q), k, v, phi_star="kernel", normalize=self.normalize,
                                window=self.window, log_alpha=log_alpha, backend=self.backend,
                                chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        """One token against the cached pairs (``KernelCache``: all of them, or the last c with a window)."""
        log_alpha = self.log_gate(x)[:, :, 0] if self.gate_proj is not None else None
        y, state = kernel_attention_step(state, self.scaled(q)[:, :, 0], k[:, :, 0], v[:, :, 0], log_alpha,
                                         self.window, self.normalize)
        return y[:, :, None].to(q.dtype), state

    @property
    def state_size(self) -> int | None:
        """None (the cache grows with T, as softmax attention's) or, with a window, c keys, values and
        log-weights per head."""
        if self.window is None:
            return None
        return self.window * self.n_heads * (self.feature_dim() + self.head_v_dim + 1)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window={self.window}, retention={self.retention!r}, "
                f"normalize={self.normalize}")


@register_mixer("swdt")
class SWDT(DeepTransformerMixer):
    """The sliding-window DeepTransformer: the last ``window`` pairs only (default 64)."""

    default_window = 64


# ---------------------------------------------------------------- DOT

class CoefficientCache(NamedTuple):
    """DOT's kernel-form memory between tokens: M_{t} = sum_j u_j phi*(k_j)^T as every past key [B, H, t, K]
    and its coefficient [B, H, t, V], plus the last c - 1 values (the window still reads them) and, for
    gamma="source", their gates [B, H, c - 1] (else None)."""
    keys: torch.Tensor
    coefficients: torch.Tensor
    values: torch.Tensor
    sources: torch.Tensor | None


def dot_kernel_step(cache: CoefficientCache, q, k, v, G, alpha, eta, window):
    """One token of DOT on the exact phi*: q, k [B, H, K], v [B, H, V], G [B, H, c] this token's per-offset
    window gates, alpha, eta [B, H] or None -> (y [B, H, V], keys, coefficients, values), in fp32/fp64.

    Each window pair i has the error e_i = M_{t-1} phi*(k_i) - v_i = sum_j u_j exp(k_j^T k_i) - v_i; the
    step scales every u_j by alpha_t, appends u_t = 0 and adds -eta_t gamma_i^{(t)} e_i to u_i.
    """
    cd = compute_dtype(q)
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    keys = torch.cat([cache.keys, k[:, :, None]], dim=2)                         # k_1 .. k_t
    values = torch.cat([cache.values, v[:, :, None]], dim=2)                     # the window's values
    n = values.shape[2]
    recall = torch.einsum("bhjn,bhjv->bhnv", torch.exp(cache.keys @ keys[:, :, -n:].mT), cache.coefficients)
    weight = G[:, :, :n].flip(-1).to(cd)                                         # row i has offset t - i
    if eta is not None:
        weight = weight * eta.to(cd)[..., None]
    U = cache.coefficients if alpha is None else cache.coefficients * alpha.to(cd)[..., None, None]
    U = torch.cat([U, torch.zeros_like(v[:, :, None])], dim=2)
    U = torch.cat([U[:, :, :-n], U[:, :, -n:] + weight[..., None] * (values - recall)], dim=2)
    y = torch.einsum("bhj,bhjv->bhv", torch.exp(keys @ q[..., None])[..., 0], U)
    return y, keys, U, values[:, :, max(n - (window - 1), 0):]                 # the last c - 1 stay


def feature_norm2(order: int | None) -> float:
    """|phi*(k)|^2 for a unit k: e for the exact phi* (order None), sum_{n<=P} 1/n! for phi*_P.

    A number, summed on the CPU whatever the default device: a mixer built under torch.device("meta") needs
    it too, and torch's fp64 sum is kept (a Python sum of the same terms differs in the last bit for some P).
    """
    if order is None:
        return math.e
    with torch.device("cpu"):
        return float(exp_coefficients(order).sum())


@register_mixer("dot")
class DOTMixer(WindowedMixer):
    """The Deep Omega Transformer with a linear memory: GD on the l2 loss of the last c pairs in phi*.

    ``gamma`` (the per-pair window gates) is None by default, as in ``dot``: the window's pairs count
    alike; "offset" or "source" learn them as the Omega mixers do by default."""

    def __init__(self, d_model, n_heads, *, window: int = 1, phi_star="kernel", gamma: str | None = None,
                 eta_max: float | None = None, **kw):
        for name in ("degree", "poly", "constant"):
            if name in kw:
                raise TypeError(f"dot: {name!r} is chapter 4's polynomial map; DOT's features are phi* "
                                "(phi_star='kernel' or ('taylor', P))")
        kw.setdefault("qk_norm", True)                        # unit q, k: |phi*(k)|^2 = e, and exp stays small
        # with c > 1 the chunk freezes gradients, so b is part of the model: dot's own default
        kw.setdefault("chunk_size", default_chunk_size(None, frozen=check_window(window) > 1))
        self.phi_star, self.order = phi_star, check_phi_star(phi_star)[1]
        if eta_max is None:                                   # every step in (0, 1), as OmegaNet's 1 / c
            eta_max = 1.0 / (check_window(window) * feature_norm2(self.order))
        super().__init__(d_model, n_heads, window=window, gamma=gamma, eta_max=eta_max, **kw)

    def features(self, q, k):
        """phi*_P(q), phi*_P(k) in fp32/fp64 for ("taylor", P); q, k themselves for the kernel form."""
        if self.order is None:
            return q, k
        cd = compute_dtype(q)
        return exp_features(q.to(cd), self.order), exp_features(k.to(cd), self.order)

    def mix(self, q, k, v, x):
        gamma, _, eta = self.gate_tensors(x, gate_dtype(q), alpha=False)
        return dot(q, k, v, window=self.window, gamma=gamma, log_alpha=self.log_alpha(x), eta=eta,
                   phi_star=self.phi_star, backend=self.backend, chunk_size=self.chunk_size)[0]

    def mix_step(self, q, k, v, x, state):
        """The per-token rule (the forward's model for c = 1 with any chunk_size; for c > 1 with
        chunk_size=1): ``omega_step`` on phi*_P, or ``dot_kernel_step`` on the cached coefficients."""
        if self.order is not None:
            o, state = self.window_step(omega_step, q, k, v, x, state)
            return o.to(v.dtype), state
        B, H = q.shape[:2]
        gamma, alpha, eta = (None if g is None else g[:, :, 0] for g in self.gate_tensors(x, gate_dtype(q)))
        if state is None:
            cd = compute_dtype(q)
            sources = gamma.new_zeros(B, H, 0) if self.gamma_mode == "source" else None
            empty = lambda t: t[:, :, :0].to(cd)                   # noqa: E731
            state = CoefficientCache(empty(k), empty(v), empty(v), sources)
        G, sources = self.offset_gates(gamma, state.sources, B, H, q)
        y, keys, U, values = dot_kernel_step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], G, alpha, eta, self.window)
        return y[:, :, None].to(q.dtype), CoefficientCache(keys, U, values, sources)

    @property
    def state_size(self) -> int | None:
        """One [V, D] memory per head on phi*_P; None for the kernel form (a coefficient per past token)."""
        return None if self.order is None else super().state_size

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, phi_star={self.phi_star!r}"


# ---------------------------------------------------------------- DLA

@register_mixer("dla")
class DLAMixer(MirasMixer):
    """Deep linear attention: the MLP memory (by default) trained by GD on the dot-product bias, with
    retention. Chapter 3's mixer with the preset "dla"; ``memory`` and its options move the memory axis.

    ``phi_star=("taylor", P)`` reads phi*_P(q), phi*_P(k) (width C(K + P, P)): the DeepTransformer of
    [A] eq. 25 with a deep memory on the truncated features. The exact phi* (``"kernel"``) with a deep
    memory is a function only, ``deep_transformer(memory="mlp", phi_star="kernel")`` (per token, O(T^2));
    the ``deep_transformer`` mixer is the linear memory on it.
    """

    preset = "dla"

    def __init__(self, d_model, n_heads, *, phi_star=None, **kw):
        fixed = sorted(set(kw) & (CONFIG_FIELDS - {"memory", *MEMORY_OPTIONS}))
        if fixed:
            raise TypeError(f"dla: {fixed} are fixed by DLA (bias='dot', optimizer='gd', retention='decay'); "
                            f"it takes memory and {list(MEMORY_OPTIONS)}")
        if phi_star is not None and check_phi_star(phi_star)[0] == "kernel":
            raise ValueError("dla: phi_star must be None or ('taylor', P); the exact phi* ('kernel') with a deep "
                             "memory is the per-token function deep_transformer(memory='mlp', phi_star='kernel'), "
                             "not a mixer (the 'deep_transformer' mixer is the linear memory on it)")
        self.phi_star = phi_star
        self.order = None if phi_star is None else check_phi_star(phi_star)[1]
        self.memory_options = {name: kw[name] for name in MEMORY_OPTIONS if name in kw}   # as given: dla checks them
        super().__init__(d_model, n_heads, **kw)

    def memory_in_dim(self) -> int:
        """D = ``feature_dim()``, or the width C(D + P, P) of phi*_P on it."""
        d = self.feature_dim()
        return d if self.order is None else exp_feature_dim(d, self.order)

    def mix(self, q, k, v, x):
        g = self.gates(x, gate_dtype(q), log_alpha=True)
        return dla(q, k, v, eta=g["eta"], log_alpha=g["log_alpha"], phi_star=self.phi_star,
                   memory=self.config.memory, initial_state=self.initial_state(q.shape[0], q.dtype),
                   backend=self.backend, chunk_size=self.chunk_size, **self.memory_options)[0]

    def mix_step(self, q, k, v, x, state):
        """Chapter 3's engine one token at a time (the model of ``chunk_size=1``), from the same W_0, on
        phi*_P(q), phi*_P(k) with ``phi_star``."""
        if self.order is not None:
            cd = compute_dtype(q)
            q, k = exp_features(q.to(cd), self.order), exp_features(k.to(cd), self.order)
        o, state = super().mix_step(q, k, v, x, state)
        return o.to(v.dtype), state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, phi_star={self.phi_star!r}"
