"""Checks of chapter 6's arguments: the choice of phi*, the kernel and the deep memory's activation, and the
range of exp in the kernel forms."""
from __future__ import annotations

import math

import torch

from ..core.featuremaps import check_degree
from ..core.validation import _value_check
from ..miras.memory import ACTIVATIONS

# exp(80) = 5.5e34: far below fp32's 3.4e38, with room for a sum of many such terms. A larger
# exponent in the unnormalised kernel form is refused (the normalised form shifts by the row max).
MAX_EXPONENT = 80.0


def check_phi_star(phi_star):
    """("taylor", P) with an int P >= 0, or "kernel". Returns ("taylor", P) or ("kernel", None)."""
    if isinstance(phi_star, str) and phi_star == "kernel":
        return "kernel", None
    if isinstance(phi_star, tuple) and len(phi_star) == 2 and phi_star[0] == "taylor":
        try:
            return "taylor", check_degree(phi_star[1])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"phi_star=('taylor', P) needs an int P >= 0, got P={phi_star[1]!r}") from None
    raise ValueError(f"phi_star must be ('taylor', P) (truncated features) or 'kernel' (exact), got {phi_star!r}")


KERNELS = ("exp", "dot")


def check_kernel(kernel):
    """The coefficient forms' kernel: "exp" (exp(k^T q), the exact phi*) or "dot" (given features). Any other
    name is refused: the forms branch on "exp" alone, so a misspelling would run the dot kernel."""
    if not (isinstance(kernel, str) and kernel in KERNELS):
        raise ValueError(f"kernel must be 'exp' or 'dot', got {kernel!r}")
    return kernel


def check_activation(activation):
    """A name from chapter 3's ``ACTIVATIONS`` (each has act(0) = 0, which the zero first layer relies on)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return activation


# Scores per tile of the exact check: rows of queries at a time, so that its memory is O(T * rows), never
# a [B, H, T, T] matrix.
TILE_ELEMENTS = 2 ** 20


def _norm_bound(q, k) -> torch.Tensor:
    """max_t |q_t| max_i |k_i| (over batch and head) >= every score k_i^T q_t, as a 0-dim tensor on q's
    device: an O(T K) test that spares the O(T^2 K) exact one whenever it already shows no score can
    overflow."""
    qn = torch.linalg.vector_norm(q.float(), dim=-1).amax(-1)
    kn = torch.linalg.vector_norm(k.float(), dim=-1).amax(-1)
    return (qn * kn).amax() * (1 + 1e-6)                          # a hair of slack for the rounding


def _tile_rows(budget: int, T: int, window: int | None) -> int:
    """The most query rows r whose tile of scores fits ``budget`` elements per (batch, head): r * T without
    a window, r * (r + window - 1) with one (r at least 1, at most T)."""
    if window is None:
        return max(1, min(T, budget // max(1, T)))
    span = min(window, T) - 1                           # keys a tile sees beyond its own rows
    r = int((math.isqrt(span * span + 4 * budget) - span) // 2)     # r * (r + span) <= budget
    return max(1, min(T, r))


def _top_score(q, k, window) -> torch.Tensor:
    """max over the visible pairs (i <= t, and i > t - window) of k_i^T q_t, a 0-dim tensor, computed a
    tile of query rows at a time (each tile against the keys it can see: rows + window - 1 of them with a
    window, so the tiles are sized by that span and their number grows as T, not T^2)."""
    B, H, T = q.shape[:3]
    rows = _tile_rows(TILE_ELEMENTS // max(1, B * H), T, window)
    qf, kf = q.float(), k.float()
    top = torch.full((), -math.inf, device=q.device)
    for a in range(0, T, rows):
        b = min(T, a + rows)
        lo = 0 if window is None else max(0, a - window + 1)
        t = torch.arange(a, b, device=q.device)[:, None]
        i = torch.arange(lo, b, device=q.device)[None, :]
        ok = (i <= t) if window is None else (i <= t) & (i > t - window)
        scores = (qf[:, :, a:b] @ kf[:, :, lo:b].mT).masked_fill_(~ok, -math.inf)
        top = torch.maximum(top, scores.amax())
    return top


# Ways out of an overflowing read: the query carries attention's scale, and deep_transformer's linear
# memory alone has a normaliser (dot and the deep memory have no normalize).
SCALE_Q = " (attention's 1/sqrt(d) goes into q)"
NORMALIZE_ADVICE = SCALE_Q + " or pass normalize=True, which shifts by each row's max"
UNNORMALIZED = "phi_star='kernel' without normalize"       # the form the checks guard unless told otherwise


def check_exponents(q, k, window, where=UNNORMALIZED, score="k_i^T q_t", advice=NORMALIZE_ADVICE):
    """exp(k_i^T q_t) must not overflow in the unnormalised kernel form: k_i^T q_t <= MAX_EXPONENT.

    First the norm bound |k_i^T q_t| <= |q_t| |k_i| (O(T K)); only when it fails, the exact maximum over
    the visible pairs, a tile of rows at a time (O(T * rows) memory). On an accelerator the bound costs
    one scalar read, and the exact check, when needed, is a device-side assert (no further host sync).
    ``where``, ``score`` and ``advice`` name the caller, the score (``k_i^T k_t`` for a write) and the way out."""
    how = _value_check(q)
    if how is None or q.shape[2] == 0:
        return
    with torch.no_grad():
        if bool(_norm_bound(q, k) <= MAX_EXPONENT):                 # Cauchy-Schwarz: no score can exceed it
            return
        _refuse_above_cap(_top_score(q, k, window), how, where, score, advice)


def check_scores(scores, where=UNNORMALIZED, score="k_i^T q_t", advice=NORMALIZE_ADVICE):
    """``check_exponents`` for a one-token step, which has its scores k_i^T q_t [B, H, n] at hand already."""
    how = _value_check(scores)
    if how is not None and scores.numel() > 0:
        with torch.no_grad():
            _refuse_above_cap(scores.amax(), how, where, score, advice)


def _refuse_above_cap(top, how, where, score, advice):
    """The top score (0-dim) above MAX_EXPONENT: a ValueError on the host, a device-side assert on an accelerator."""
    if how == "host" and top.item() > MAX_EXPONENT:
        raise ValueError(f"{where}: a score {score} = {top.item():.4g} exceeds {MAX_EXPONENT} and exp would "
                         f"overflow; scale the inputs down{advice}")
    if how == "device":
        torch._assert_async(top <= MAX_EXPONENT, f"{where}: a score {score} exceeds {MAX_EXPONENT}")


def check_read_write_exponents(q, k, where):
    """The unwindowed kernel forms that also write through exp: the reads exp(k_i^T q_t) and the
    corrections exp(k_i^T k_t) of the delta / Omega update (DOT, and the deep memory's gradient) must not
    overflow. They have no normaliser to offer."""
    check_exponents(q, k, None, where, "k_i^T q_t", SCALE_Q)
    check_exponents(k, k, None, where, "k_i^T k_t", "")
