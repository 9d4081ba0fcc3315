"""Capacity probes for a linear associative memory (book ch. 1 §6, Proposition 1 of ATLAS).

Store m pairs (k_i, v_i) in one matrix M [d_v, d_k] so that M k_i ~ v_i. Keys are the
rows of K [m, d_k], values the rows of V [m, d_v]; in matrix form we want K M^T = V.

* ``least_squares_memory``: the minimiser of the l2 loss 1/2 sum ||M k_i - v_i||^2 with
  the smallest norm, M = V^T (K^T)^+ (written V K^+ in the book, keys as columns).
  It recalls every pair exactly iff the keys are linearly independent, so at most d_k
  generic pairs; beyond that the residual is positive.
* ``hebbian_memory``: linear attention's sum of outer products, M = sum_i v_i k_i^T.
  With unit keys, reading key j returns v_j plus cross-talk sum_{i != j} (k_i . k_j) v_i,
  whose size grows like sqrt((m-1)/d_k) relative to ||v_j||.
* ``gd_memory``: plain gradient descent on the l2 loss from M = 0. Every step adds
  something of the form (.) K, so M stays in the row space of K and GD converges to the
  min-norm interpolant V K^+, *not* to V K^T (see book/errata.md, Proposition 1).

Computations run in float64 so that "zero" residuals really look like zero.
"""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..core.validation import check_int, check_positive_number


def _check_pairs(K, V):
    if not isinstance(K, torch.Tensor) or not isinstance(V, torch.Tensor):
        raise TypeError("K and V must be torch.Tensors of shapes [m, d_k] and [m, d_v]")
    if K.dim() != 2 or V.dim() != 2:
        raise ValueError(f"K must be [m, d_k] and V [m, d_v], got {list(K.shape)} and {list(V.shape)}")
    if K.shape[0] != V.shape[0]:
        raise ValueError(f"K and V must hold the same number of pairs m, got {K.shape[0]} and {V.shape[0]}")
    if not K.is_floating_point() or K.dtype != V.dtype or K.device != V.device:
        raise ValueError(f"K and V must be floating tensors of one dtype on one device, got {K.dtype} on {K.device} "
                         f"and {V.dtype} on {V.device}")


def random_pairs(m: int, d_k: int, d_v: int, *, unit_keys: bool = False, generator=None,
                 dtype=torch.float64):
    """m Gaussian keys [m, d_k] (optionally scaled to unit norm) and Gaussian values [m, d_v]."""
    K = torch.randn(m, d_k, generator=generator, dtype=dtype)
    V = torch.randn(m, d_v, generator=generator, dtype=dtype)
    if unit_keys:
        K = K / K.norm(dim=1, keepdim=True)
    return K, V


def least_squares_memory(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Min-norm least-squares memory M = V^T (K^T)^+, shape [d_v, d_k]."""
    _check_pairs(K, V)
    return (torch.linalg.pinv(K) @ V).T


def hebbian_memory(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Hebbian (linear-attention) memory M = sum_i v_i k_i^T = V^T K, shape [d_v, d_k]."""
    _check_pairs(K, V)
    return V.T @ K


def gd_memory(K: torch.Tensor, V: torch.Tensor, *, steps: int = 2000, lr: float | None = None) -> torch.Tensor:
    """Full-batch GD on 1/2 sum_i ||M k_i - v_i||^2 starting from M = 0.

    The gradient is (M K^T - V^T) K. ``lr`` defaults to 1 / sigma_max(K)^2, the largest
    step that overshoots in no direction of this quadratic (GD converges for any step below 2 / sigma_max^2).
    """
    _check_pairs(K, V)
    check_int("steps", steps, 0)
    if lr is None:
        sigma = torch.linalg.matrix_norm(K, ord=2).item()
        if sigma == 0:
            raise ValueError("K is zero: no step size 1 / sigma_max(K)^2 (pass lr, or keys that are not all zero)")
        lr = 1.0 / sigma ** 2
    else:
        check_positive_number("lr", lr, "the GD step; None: 1 / sigma_max(K)^2")
    M = K.new_zeros(V.shape[1], K.shape[1])
    for _ in range(steps):
        M = M - lr * (M @ K.T - V.T) @ K
    return M


def recall_error(M: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> float:
    """Relative recall error ||K M^T - V||_F / ||V||_F over all stored pairs."""
    _check_pairs(K, V)
    if M.shape != (V.shape[1], K.shape[1]):
        raise ValueError(f"M must have shape [d_v, d_k] = [{V.shape[1]}, {K.shape[1]}], got {list(M.shape)}")
    return ((K @ M.T - V).norm() / V.norm()).item()


def capacity_sweep(d_k: int, d_v: int, ms, trials: int = 20, seed: int = 0, *, progress: bool = False):
    """Store m pairs for each m in ``ms``; average the recall errors over ``trials`` draws.

    Returns a list of dicts, one per m, with
      ``ls_residual``   least-squares recall error (Gaussian keys): ~0 for m <= d_k,
                        about sqrt((m - d_k) / m) beyond (the part of V outside the
                        d_k-dimensional column space of K);
      ``hebbian_error`` Hebbian recall error with unit-norm keys: about sqrt((m-1)/d_k);
      ``hebbian_theory`` sqrt((m - 1) / d_k), for comparison.
    """
    for name, value, low in (("d_k", d_k, 1), ("d_v", d_v, 1), ("trials", trials, 1), ("seed", seed, 0)):
        check_int(name, value, low)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for m in tqdm(list(ms), desc="capacity sweep", disable=None if progress else True):     # None: not into a log file
        check_int("every m", m, 1)
        ls, hebb = 0.0, 0.0
        for _ in range(trials):
            K, V = random_pairs(m, d_k, d_v, generator=gen)
            ls += recall_error(least_squares_memory(K, V), K, V)
            Ku = K / K.norm(dim=1, keepdim=True)
            hebb += recall_error(hebbian_memory(Ku, V), Ku, V)
        rows.append({"m": m, "ls_residual": ls / trials, "hebbian_error": hebb / trials,
                     "hebbian_theory": math.sqrt((m - 1) / d_k)})
    return rows
