"""The exponential feature map phi* of [A] eq. 22-23 and its truncation phi*_P.

    phi*(x) = (1, x, x^{(x)2} / sqrt(2!), x^{(x)3} / sqrt(3!), ...),   phi*(x)^T phi*(y) = exp(x^T y).

phi* is infinite-dimensional; ``exp_features(x, P)`` keeps the blocks n <= P, so that
phi*_P(x)^T phi*_P(y) = sum_{n<=P} (x^T y)^n / n!, the degree-P Taylor polynomial of exp(x^T y).
It is chapter 4's Taylor-weighted map with its weights fixed at a_n = 1/n!
(``core.featuremaps.taylor_features``), here in the input's own precision. Its truncation P is
called ``order`` here, after the Taylor series of exp (``phi_star=("taylor", P)``); chapter 4's maps
call the same number ``degree``.
"""
from __future__ import annotations

import functools
import math

import torch

from ..core.featuremaps import check_degree, check_input_dim, taylor_features
from ..core.validation import process_constant


def exp_coefficients(order: int) -> torch.Tensor:
    """a_n = 1/n!, n = 0..P, in fp64."""
    return torch.tensor([1.0 / math.factorial(n) for n in range(check_degree(order) + 1)], dtype=torch.float64)


def exp_features(x: torch.Tensor, order: int, *, compressed: bool = True) -> torch.Tensor:
    """phi*_P(x): [..., d] -> [..., D] with phi*_P(x)^T phi*_P(y) = sum_{n<=P} (x^T y)^n / n!.

    ``compressed=True`` (default): the symmetric-monomial form, D = C(d + P, P); each distinct
    monomial x^b, |b| = n, carries sqrt(multinomial(n; b) / n!). ``compressed=False``: the tensor
    powers x^{(x)n} / sqrt(n!) of [A] eq. 22, D = sum_{n<=P} d^n. Same inner product.

    The truncation error of the kernel is the Taylor remainder: for |x^T y| <= 1 it is at most
    e / (P + 1)!, so normalising q and k (and putting attention's 1/sqrt(d) into q) keeps a small
    P accurate; for large |x^T y| it grows like |x^T y|^{P+1} / (P + 1)!.
    """
    return taylor_features(x, coefficients_on(order, x.device), compressed=compressed)


def coefficients_on(order: int, device: torch.device) -> torch.Tensor:
    """``exp_coefficients(order)`` on ``device``, kept for the process (a copy from the host on every call
    waits for the GPU each time); built in the graph while torch.compile traces."""
    if torch.compiler.is_compiling():
        return exp_coefficients(order).to(device)
    return _coefficients_on(check_degree(order), str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _coefficients_on(order: int, device: str) -> torch.Tensor:
    with process_constant():
        return exp_coefficients(order).to(device)


def exp_feature_dim(d: int, order: int, *, compressed: bool = True) -> int:
    """Dimension of ``exp_features`` for inputs of dimension d >= 1: C(d + P, P), or sum_n d^n."""
    d, order = check_input_dim(d), check_degree(order)
    return math.comb(d + order, order) if compressed else sum(d ** n for n in range(order + 1))


def exp_kernel(order=None):
    """The kernel of phi* as a function of the score s = x^T y: exp(s) (``order=None``, exact phi*), or the
    degree-P Taylor polynomial sum_{n<=P} s^n / n! = phi*_P(x)^T phi*_P(y) (``order=P``, the features'
    own kernel, so a coefficient loop with it equals the matrix loop on ``exp_features(., P)``)."""
    if order is None:
        return torch.exp
    order = check_degree(order)

    def taylor(s):
        terms = torch.stack([s ** n for n in range(order + 1)], dim=-1)
        return terms @ coefficients_on(order, s.device).to(s.dtype)
    taylor.__name__ = f"exp_taylor_{order}"
    return taylor
