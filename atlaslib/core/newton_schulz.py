"""Newton–Schulz orthogonalisation: the map Muon and ATLAS apply to a momentum matrix.

For a matrix G = U Σ V^T (thin SVD) the *polar factor* U V^T is the semi-orthogonal
matrix closest to G: every singular value is set to 1, the singular vectors are kept.
Newton–Schulz reaches it (or comes near it) with matrix products only, which is why it
runs well on a GPU where an SVD does not:

    X_0     = G / (||G||_F + eps)                      (all singular values now in [0, 1])
    X_{j+1} = p(X_j X_j^T) X_j,   p(A) = p0 I + p1 A + p2 A^2 + ...

An odd polynomial x -> x p(x^2) acts on each singular value separately and leaves the
singular vectors alone, so J steps give U f_J(Σ) V^T with f_J the J-fold composition.
The coefficient sets (``COEFFICIENTS``):

    "cubic"    (3/2, -1/2)            the classical iteration; converges to 1, slowly from near 0
    "quintic"  (15/8, -10/8, 3/8)     the convergent quintic; converges to 1 (third order near 1)
    "muon"     (3.4445, -4.7750, 2.0315)   Muon's (Jordan et al. 2024, modded-nanogpt): a steep
               slope at 0 (3.4445) lifts small singular values fast, but the fixed point is *not* 1:
               the values end up oscillating in a band around it (about [0.68, 1.13]). Five steps
               bring a spectrum spanning two decades into the band; at three decades the smallest
               value is still about 0.37 after 5 steps and enters the band at the sixth (book ch. 5).
               Do not expect U V^T from it. The same slope amplifies rounding: iterated inside a recurrence
               in fp32 (ATLAS's deep memories), outputs drift from fp64 by 1e-5 to 1e-4 relative over a few
               hundred tokens.

A user tuple (p0, p1[, p2, ...]) gives p's coefficients in the same order.

Conventions taken from Muon: eps = 1e-7 in the pre-normalisation; a matrix with more rows
than columns is transposed first (so that X X^T is the smaller Gram matrix) and back at the
end; the arithmetic runs in fp32 by default (fp64 input stays fp64) and in bf16 on request
(``dtype=torch.bfloat16``, as Muon runs it on a GPU). Any leading dims are a batch: every
[..., m, n] matrix is normalised and iterated on its own.

``ns_steps=0`` is the identity (G returned unchanged, not normalised): "no Newton–Schulz".
The normalisation belongs to the iteration and is skipped with it, so ``ns_steps=0``
switches orthogonalisation off in ATLAS (which then is Titans / OmegaNet with eta outside
the momentum, book ch. 5).

``polar(G)`` = U V^T by SVD is the exact reference the convergent sets are tested against.

This lives in ``core`` because two chapters use it: chapter 3's optimizer axis (the Muon
optimizer of the MIRAS engine) and chapter 5 (ATLAS), which re-exports it.
"""
from __future__ import annotations

import math
import numbers

import torch

from .validation import check_int

COEFFICIENTS = {
    "muon": (3.4445, -4.7750, 2.0315),
    "cubic": (1.5, -0.5),
    "quintic": (15 / 8, -10 / 8, 3 / 8),
}

NORM_EPS = 1e-7          # X_0 = G / (||G||_F + NORM_EPS), as Muon


def ns_coefficients(ns_coeffs) -> tuple:
    """The polynomial coefficients (a, b, ...) of ``ns_coeffs``: a name from ``COEFFICIENTS`` or a tuple.

    A tuple (or list) needs at least one finite real number; (a,) alone is allowed (X -> a X).
    """
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in COEFFICIENTS:
            raise ValueError(f"ns_coeffs must be one of {sorted(COEFFICIENTS)} or a tuple (p0, p1[, p2, ...]) of the "
                             f"polynomial p(A) = p0 I + p1 A + p2 A^2, got {ns_coeffs!r}")
        return COEFFICIENTS[ns_coeffs]
    if not isinstance(ns_coeffs, (tuple, list)) or len(ns_coeffs) == 0:
        raise TypeError(f"ns_coeffs must be a name ({', '.join(sorted(COEFFICIENTS))}) or a non-empty tuple "
                        f"(p0, p1[, p2, ...]) of numbers, got {ns_coeffs!r}")
    for c in ns_coeffs:
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(float(c)):
            raise ValueError(f"ns_coeffs must hold finite real numbers (p0, p1[, p2, ...]), got {ns_coeffs!r}")
    return tuple(float(c) for c in ns_coeffs)


def check_ns_steps(ns_steps) -> int:
    """The number of Newton–Schulz steps k: an int >= 0 (0: no orthogonalisation)."""
    return check_int("ns_steps", ns_steps, 0, " (0 switches Newton-Schulz off)")


def _check_matrix(name, G):
    if not isinstance(G, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(G).__name__}")
    if G.dim() < 2:
        raise ValueError(f"{name} must have shape [..., m, n] (a matrix or a batch of them), got {list(G.shape)}")
    if not G.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {G.dtype}")


def newton_schulz(G: torch.Tensor, ns_steps: int = 5, ns_coeffs="muon",
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """NS_J(G): ``ns_steps`` Newton–Schulz steps on every matrix [..., m, n] of G (see the module docstring).

    Args:
        G: [..., m, n], any leading batch dims.
        ns_steps: J >= 0; 0 returns G itself (no normalisation either).
        ns_coeffs: "muon" (default), "cubic", "quintic", or a tuple (p0, p1[, p2, ...]).
        dtype: the arithmetic's dtype. None: fp32, or fp64 for fp64 input. torch.bfloat16 runs
            it as Muon does.

    Returns:
        A tensor of G's shape and dtype.
    """
    _check_matrix("G", G)
    ns_steps = check_ns_steps(ns_steps)
    a, *rest = ns_coefficients(ns_coeffs)
    if dtype is None:
        dtype = torch.float64 if G.dtype == torch.float64 else torch.float32
    elif not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating torch.dtype, got {dtype!r}")
    if ns_steps == 0:
        return G
    X = G.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:                                               # iterate on the wide one: X X^T is the small Gram
        X = X.transpose(-1, -2)
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + NORM_EPS)
    eye = torch.eye(X.shape[-2], dtype=dtype, device=X.device) if len(rest) > 1 else None
    for _ in range(ns_steps):
        A = X @ X.transpose(-1, -2)
        if not rest:                                       # p(A) = a I
            X = a * X
            continue
        P = rest[-1] * A                                   # Horner: P = b A + c A^2 + ... = (b I + (c I + ...) A) A
        for c in reversed(rest[:-1]):
            P = (P + c * eye) @ A
        X = a * X + P @ X
    if tall:
        X = X.transpose(-1, -2)
    return X.to(G.dtype)


def polar(G: torch.Tensor) -> torch.Tensor:
    """U V^T from the thin SVD G = U Σ V^T, for every matrix [..., m, n] of G (the exact reference).

    It is the semi-orthogonal matrix nearest to G in the Frobenius norm; unique when G has full
    rank min(m, n). Computed in G's dtype (fp64 for an exact reference).
    """
    _check_matrix("G", G)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    return U @ Vh


__all__ = ["newton_schulz", "polar", "ns_coefficients", "check_ns_steps", "COEFFICIENTS", "NORM_EPS"]
