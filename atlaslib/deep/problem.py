"""Checks of chapter 6's arguments: the choice of phi*, and the range of exp in the kernel forms."""
from __future__ import annotations

import math

import torch

from ..core.featuremaps import check_degree
from ..core.validation import _value_check

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


def _norm_bound(q, k) -> float:
    """max_t |q_t| max_i |k_i| (per batch and head) >= every score k_i^T q_t: an O(T K) test that
    spares the O(T^2 K) exact one whenever it already shows no score can overflow."""
    qn = torch.linalg.vector_norm(q.float(), dim=-1).amax(-1)
    kn = torch.linalg.vector_norm(k.float(), dim=-1).amax(-1)
    return (qn * kn).amax().item() * (1 + 1e-6)                   # a hair of slack for the rounding


def check_exponents(q, k, window):
    """exp(k_i^T q_t) must not overflow in the unnormalised kernel form: k_i^T q_t <= MAX_EXPONENT."""
    how = _value_check(q)
    if how is None:
        return
    with torch.no_grad():
        if how == "host" and _norm_bound(q, k) <= MAX_EXPONENT:     # Cauchy-Schwarz: no score can exceed it
            return
        T = q.shape[2]
        rows = torch.arange(T, device=q.device)
        ok = rows[None, :] <= rows[:, None]
        if window is not None:
            ok &= rows[None, :] > rows[:, None] - window
        top = (q.float() @ k.float().mT).masked_fill(~ok, -math.inf).amax()
        if how == "host" and top.item() > MAX_EXPONENT:
            raise ValueError(f"phi_star='kernel' without normalize: a score k_i^T q_t = {top.item():.4g} exceeds "
                             f"{MAX_EXPONENT} and exp would overflow; scale q and k down (attention's 1/sqrt(d) "
                             f"goes into q) or pass normalize=True, which shifts by each row's max")
        if how == "device":
            torch._assert_async(top <= MAX_EXPONENT,
                                f"phi_star='kernel' without normalize: a score k^T q exceeds {MAX_EXPONENT}")
