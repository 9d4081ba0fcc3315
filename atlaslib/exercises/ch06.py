"""Checks for chapter 6's exercises (exercises/ch06_deep.ipynb): phi*, the kernel trick, DOT and softmax.

Each check draws fresh random inputs, runs the learner's function and compares it with
``atlaslib`` (the truncated feature map ``deep.exp_features`` and its dimension; the kernel-trick
read of ``deep.recurrent.coefficient_recurrent``; DOT's per-token definition
``deep.recurrent.dot_coefficient_recurrent``; causal softmax attention ``core.softmax_attention``),
then shows a verdict. Use in a notebook as::

    from atlaslib.exercises import ch06 as check
    check.dot_step(dot_step)
"""
from __future__ import annotations

import math

import torch

from ..core import softmax_attention
from ..core.testing import random_gate, random_qkv
from ..deep import coefficient_recurrent, dot_coefficient_recurrent, exp_features
from .ch01 import clones, triton_setup
from .checking import (NAN_HINT, CheckFailed, Registry, call, case, check_guards, check_shape, compare,
                       compare_features, compare_finite, compare_kernel_output, compare_number, dtype_hint, guarded,
                       guarded_output)

EXERCISES = Registry("ch06")

# fp32 inputs unless stated; a correct answer agrees to ~1e-6, a wrong one is off by far more.
TOL = 1e-4

# Everything in the library that reads the exp kernel for the learner (exercises 2, 4 and 5)
KERNEL_READS = ("atlaslib.deep.deep_transformer", "atlaslib.deep.recurrent.coefficient_recurrent",
                "atlaslib.deep.chunk.masked_chunk", "atlaslib.deep.chunk.kernel_weights",
                "atlaslib.deep.kernel.deep_kernel_triton")


MASK_HINT = (" Here the scores above the diagonal are 100, where exp overflows fp32: mask the scores to -inf "
             "before the exponential, not its result after it (inf * 0 is NaN).")


@EXERCISES.check("phi_star", title="The truncated exponential feature map and its dimension", points=2,
                  functions=("phi_star", "phi_star_dim"),
                  forbidden=("atlaslib.deep.features.exp_features", "atlaslib.deep.features.exp_feature_dim",
                             "atlaslib.core.featuremaps.taylor_features"))
def phi_star(features_fn, dim_fn, gen):
    """features_fn(x [..., d], P) -> [..., C(d+P, P)] with phi(x).phi(y) = sum_{n<=P} (x.y)^n / n!;
    dim_fn(d, P) -> int.

    The order of the features is free: the check compares inner products, which do not depend on it.
    """
    cases = [(3, 2, (5,)), (4, 1, (2, 3)), (2, 4, (6,)), (5, 0, (4,)), (1, 5, (6,)), (3, 3, (2, 2, 3))]  # (d, P, lead)
    for d, P, lead in cases:
        x = torch.randn(*lead, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
        y = torch.randn(*lead, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
        D = math.comb(d + P, P)
        with case(f"phi*_P(x) with x of shape {list(x.shape)}, P={P}"):
            fx, fy = call(features_fn, x.clone(), P), call(features_fn, y.clone(), P)
            for name, f in (("phi*_P(x)", fx), ("phi*_P(y)", fy)):
                if not isinstance(f, torch.Tensor):
                    raise CheckFailed(f"{name} should be a torch.Tensor, got {type(f).__name__}")
                if tuple(f.shape[:-1]) != tuple(lead) or f.shape[-1] != D:
                    tensor_power = sum(d ** n for n in range(P + 1))
                    hint = (" (that is the tensor-power form, one entry per ordered index tuple: keep one feature "
                            "per distinct monomial)" if f.shape[-1] == tensor_power and tensor_power != D else
                            f" (one feature per monomial of degree <= {P}: C(d+P, P) = {D})")
                    raise CheckFailed(f"{name} has shape {list(f.shape)}, expected {list(lead) + [D]}{hint}")
            fx_ref, fy_ref = exp_features(x, P), exp_features(y, P)
            for name, a, b, a_ref, b_ref in (("phi*_P(x) . phi*_P(y)", fx, fy, fx_ref, fy_ref),
                                             ("|phi*_P(x)|^2", fx, fx, fx_ref, fx_ref)):
                got = torch.einsum("...i,...i->...", a.to(torch.float64), b.to(torch.float64))
                compare_features(name, got, torch.einsum("...i,...i->...", a_ref, b_ref), (a, b), x.dtype)
    for d, P in [(4, 2), (16, 2), (64, 2), (3, 4), (7, 1), (5, 0), (1, 6)]:
        with case(f"phi_star_dim(d={d}, P={P})"):
            compare_number("your answer", call(dim_fn, d, P), math.comb(d + P, P))
    return ("the features have C(d+P, P) entries whose inner products are the degree-P Taylor polynomial of "
            "exp(x.y), and the dimension formula is right")


def _queries(B, H, T, K, gen, spread=2.0):
    """Unit keys and queries of norm up to ``spread``: scores k.q in [-spread, spread], where exp is far from linear."""
    q, k, _ = random_qkv(B, H, T, K, 1, generator=gen, dtype=torch.float64)
    return q * spread * torch.rand(B, H, T, 1, generator=gen, dtype=torch.float64), k


@EXERCISES.check("kernel_read", title="The kernel-trick read", points=2,
                  functions=("kernel_read",), forbidden=KERNEL_READS)
def kernel_read(fn, gen):
    """fn(u [B,H,T,V], k [B,H,T,K], q [B,H,T,K]) -> y [B,H,T,V], y_t = sum_{j<=t} u_j exp(k_j.q_t).

    The reference is the library's per-token loop in coefficient space, with u as the written values.
    """
    cases = [(2, 3, 7, 5, 4), (1, 2, 1, 6, 3), (1, 1, 16, 8, 8), (2, 2, 9, 3, 1), (1, 2, 33, 4, 5)]  # (B,H,T,K,V)
    for B, H, T, K, V in cases:
        q, k = _queries(B, H, T, K, gen)
        u = torch.randn(B, H, T, V, generator=gen, dtype=torch.float64)
        ref, _ = coefficient_recurrent(q, k, u)
        with case(f"B={B}, H={H}, T={T}, K={K}, V={V}"):
            got = call(fn, *clones(u, k, q))
            check_shape("y", got, ref.shape)
            compare("y", got, ref, 1e-8)
    return f"y matches atlaslib.deep's kernel-trick read on {len(cases)} random sequences"


@EXERCISES.check("dot_step", title="One DOT step in coefficient space", points=3,
                  functions=("dot_step",),
                  forbidden=("atlaslib.deep.dot", "atlaslib.deep.recurrent.dot_coefficient_recurrent",
                             "atlaslib.deep.chunk.dot_chunk", "atlaslib.deep.chunk.dot_window_chunk"))
def dot_step(fn, gen):
    """fn(U [B,H,t,V], keys [B,H,t,K], k [B,H,K], v [B,H,V], alpha [B,H], eta [B,H]) -> U_t [B,H,t+1,V].

    The check runs the learner's step over a whole sequence from no coefficients, reads the memory
    after every token (y_t = sum_j u_j exp(k_j.x)) at the model's query and at two more, and compares
    the reads with the library's DOT (c = 1, linear memory, exact phi*) run on the same queries.
    """
    cases = [(2, 2, 9, 4, 3), (1, 3, 12, 6, 5), (1, 1, 1, 3, 2), (2, 1, 10, 2, 1)]   # (B, H, T, K, V)
    for B, H, T, K, V in cases:
        _, k, v = random_qkv(B, H, T, K, V, generator=gen, dtype=torch.float64)    # unit keys: |phi*(k)|^2 = e
        probes = [_queries(B, H, T, K, gen)[0] for _ in range(3)]
        alpha = random_gate(B, H, T, low=0.5, generator=gen, dtype=torch.float64)
        eta = 0.05 + 0.45 * torch.rand(B, H, T, generator=gen, dtype=torch.float64)   # eta e <= e/2 < 1 + alpha
        refs = [dot_coefficient_recurrent(x, k, v, alpha, eta, "exp")[0] for x in probes]
        with case(f"B={B}, H={H}, T={T}, K={K}, V={V}"):
            U = v.new_zeros(B, H, 0, V)
            reads, dtypes = [[] for _ in probes], set()
            for t in range(T):
                with case(f"token t={t}"):
                    U = call(fn, *clones(U, k[:, :, :t], k[:, :, t], v[:, :, t], alpha[:, :, t], eta[:, :, t]))
                    if not isinstance(U, torch.Tensor):
                        raise CheckFailed(f"U_t should be a torch.Tensor, got {type(U).__name__}")
                    check_shape("U_t", U, (B, H, t + 1, V), " (one coefficient per key so far, the new one last)")
                    dtypes.add(U.dtype)
                    U = U.to(torch.float64)
                    for x, out in zip(probes, reads):
                        weights = torch.exp(k[:, :, :t + 1] @ x[:, :, t, :, None])[..., 0]   # exp(k_j.x_t)
                        out.append(torch.einsum("bhj,bhjv->bhv", weights, U))
            for i, (out, ref) in enumerate(zip(reads, refs)):
                name = "y_t = M_t phi*(q_t)" if i == 0 else "M_t phi*(x) at another query"
                try:
                    compare(name, torch.stack(out, dim=2), ref, 1e-8)
                except CheckFailed as e:          # the reads are made in float64: name a coarser U_t
                    coarse = sorted((d for d in dtypes if d != torch.float64), key=str)
                    raise CheckFailed(f"{e}{dtype_hint(coarse[0], torch.float64) if coarse else ''}") from None
    return f"the memory your steps build matches atlaslib.deep's DOT, token by token, on {len(cases)} random sequences"


@EXERCISES.check("normaliser", title="The normaliser that makes it softmax attention", points=2,
                  functions=("softmax_by_normaliser",),
                  forbidden=(*KERNEL_READS, "atlaslib.core.attention.softmax_attention"))
def normaliser(fn, gen):
    """fn(q [B,H,T,K], k, v [B,H,T,V]) -> causal softmax attention with scale 1/sqrt(K), as y_t / (z_t^T phi*(q_t))."""
    cases = [(2, 2, 8, 4, 3, 1.0), (1, 3, 17, 16, 5, 1.0), (1, 1, 1, 6, 2, 1.0), (2, 1, 12, 8, 4, 2.0),
             (1, 2, 20, 4, 6, 4.0)]             # (B, H, T, K, V, size of q and k; the last has a score of 120)
    for B, H, T, K, V, size in cases:
        q = size * torch.randn(B, H, T, K, generator=gen)
        k = size * torch.randn(B, H, T, K, generator=gen)
        v = torch.randn(B, H, T, V, generator=gen)
        if size > 3:        # the last query meets the first key at q.k/sqrt(K) = 120: exp overflows fp32 there
            q[:, :, -1] = k[:, :, 0] * (120 * math.sqrt(K) / k[:, :, 0].square().sum(-1, keepdim=True))
            # the first query sees its own key at a score of 0 and meets the last (future) key at 120: masking
            # after exp (inf * 0) or shifting by the largest score of all keys (e^-120 = 0 in fp32) gives NaN
            k0, k1 = k[:, :, 0], k[:, :, -1]
            d = k1 - k0 * ((k1 * k0).sum(-1, keepdim=True) / k0.square().sum(-1, keepdim=True))   # d . k_0 = 0
            q[:, :, 0] = d * (120 * math.sqrt(K) / (d * k1).sum(-1, keepdim=True))
        ref = softmax_attention(q, k, v)
        label = "" if size <= 3 else " (a score q.k/sqrt(K) of 120, and one of a future key: exp(120) overflows fp32)"
        with case(f"B={B}, H={H}, T={T}, K={K}, V={V}{label}"):
            got = call(fn, *clones(q, k, v))
            check_shape("o", got, ref.shape)
            compare_finite("o", got, ref, TOL, ": exp of a large score overflowed, or a shift by a future key's "
                                               "score underflowed every visible term to 0 (0/0); mask the future "
                                               "keys to -inf and subtract each row's largest visible score before "
                                               "exp (the factor cancels in the quotient)")
    return (f"y_t / (z_t^T phi*(q_t)) matches causal softmax attention on {len(cases)} random cases, "
            "large scores included")


@EXERCISES.check("triton_exp_read", title="A Triton kernel for the causal exp-kernel read of a tile", points=3,
                  functions=("exp_read_triton",), forbidden=KERNEL_READS, needs_launch=True)
def triton_exp_read(fn, gen):
    """fn(q [N,T,K], k [N,T,K], v [N,T,V], out [N,T,V]) -> out[i, t] = sum_{j<=t} exp(q_t.k_j) v_j, in fp32."""
    device, tol = triton_setup(TOL)
    # (N, T, K, V): odd sizes; the third case has scores of 100 above the diagonal (q_t.k_j = 100 for j > t),
    # where exp overflows fp32: masking after the exponential gives inf * 0 = NaN
    cases = [(2, 5, 7, 3), (1, 16, 16, 16), (3, 13, 17, 9), (1, 1, 4, 2), (2, 37, 20, 6)]
    for N, T, K, V in cases:
        q, k = (x[:, 0].float() for x in _queries(N, 1, T, K, gen))
        if K >= T > 1 and (N, T, K) == (3, 13, 17):
            ahead = 100.0 * (torch.arange(T)[None, :] > torch.arange(T)[:, None]).float()   # [t, d]: d > t
            q[:, :, :T] = ahead                                  # q_t . k_j = 100 [j > t] + 0 for j <= t
            k[:, :, :T] = torch.eye(T)
        v = torch.randn(N, T, V, generator=gen)
        ref = coefficient_recurrent(q[:, None], k[:, None], v[:, None])[0][:, 0]
        ins = [guarded(x.to(device)) for x in (q, k, v)]
        out = guarded_output((N, T, V), device=device)
        with case(f"N={N}, T={T}, K={K}, V={V}"):
            call(fn, *ins, out)
            if device == "cuda":
                torch.cuda.synchronize()
            check_guards("out", out)
            hint = NAN_HINT + MASK_HINT if (N, T, K) == (3, 13, 17) else NAN_HINT
            compare_kernel_output("out", out, ref.to(device), tol, hint, on=("NaN", "finite"))
    # the same text on CPU and GPU, so the stored output is valid on both
    return (f"the kernel matches atlaslib.deep's kernel-trick read on {len(cases)} odd-sized cases, "
            "with no stray loads or stores")


__all__ = ["EXERCISES", "phi_star", "kernel_read", "dot_step", "normaliser", "triton_exp_read"]
