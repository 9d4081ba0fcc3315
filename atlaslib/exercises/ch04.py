"""Checks for chapter 4's exercises (exercises/ch04_omega.ipynb): the Omega rule.

Each check draws fresh random inputs, runs the learner's function and compares it with
``atlaslib`` (the monomial map ``core.monomial_features``, the window gradient of the
per-token definition ``omega.recurrent.window_gradient``, the banded gate matrix
``omega.chunk.band_gates`` and the chunk weights ``omega.chunk.window_weights``, the
frozen-gradient oracle ``omega.omega_frozen_seq``), then shows a verdict. Use in a
notebook as::

    from atlaslib.exercises import ch04 as check
    check.omega_step(omega_step)
"""
from __future__ import annotations

import math

import torch

from ..core import monomial_features
from ..core.testing import random_gate, random_qkv
from ..omega import omega_frozen_seq
from ..core.windows import band_gates
from ..omega.chunk import window_weights
from ..omega.recurrent import window_gradient
from .ch01 import clones, triton_setup
from .checking import (NAN_HINT, CheckFailed, Registry, call, case, check_guards, compare, compare_features,
                       compare_kernel_output, compare_number, guarded, guarded_output, uneven_norms,
                       unpack, with_resets)

EXERCISES = Registry("ch04")

# fp32 inputs; a correct answer agrees to ~1e-6, a wrong one is off by far more than this.
TOL = 1e-4

# the library's Omega rule, its chunkwise forms and its per-token forms: what the exercises that write one may not call
OMEGA_RULE = ("atlaslib.omega.omega_rule",)
CHUNK_FORMS = ("atlaslib.omega.chunk.omega_chunk", "atlaslib.omega.chunk.windowed_chunk",
               "atlaslib.omega.recurrent.omega_frozen_seq")
PER_TOKEN = ("atlaslib.omega.recurrent.omega_recurrent", "atlaslib.omega.recurrent.omega_step")


@EXERCISES.check("monomials", title="The polynomial feature map and its dimension", points=2,
                  functions=("monomials", "feature_dim"),
                  forbidden=("atlaslib.core.featuremaps.monomial_features",
                             "atlaslib.core.featuremaps.monomial_dim"))
def monomials(features_fn, dim_fn, gen):
    """features_fn(x [..., d], p) -> [..., C(d+p, p)] (all monomials of degree <= p);  dim_fn(d, p) -> int.

    The order of the monomials is free: the check compares the Gram matrix
    phi(X) phi(Y)^T = sum_{|b| <= p} x^b y^b, which does not depend on it.
    """
    cases = [(3, 2, (5,)), (4, 1, (2, 3)), (4, 3, (7,)), (2, 4, (2, 2, 3)), (5, 0, (4,)), (1, 3, (6,))]  # (d, p, lead)
    for d, p, lead in cases:
        x = torch.randn(*lead, d, generator=gen, dtype=torch.float64)
        y = torch.randn(*lead, d, generator=gen, dtype=torch.float64)
        D = math.comb(d + p, p)
        with case(f"phi(x) with x of shape {list(x.shape)}, degree p={p}"):
            fx, fy = call(features_fn, x.clone(), p), call(features_fn, y.clone(), p)
            for name, f in (("phi(x)", fx), ("phi(y)", fy)):
                if not isinstance(f, torch.Tensor):
                    raise CheckFailed(f"{name} should be a torch.Tensor, got {type(f).__name__}")
                if tuple(f.shape[:-1]) != tuple(lead) or f.shape[-1] != D:
                    raise CheckFailed(f"{name} has shape {list(f.shape)}, expected {list(lead) + [D]} "
                                      f"(one feature per monomial of degree <= {p})")
            gram = torch.einsum("...i,...i->...", fx.to(torch.float64), fy.to(torch.float64))
            ref = torch.einsum("...i,...i->...", monomial_features(x, p), monomial_features(y, p))
            compare_features("sum over monomials of x^b y^b", gram, ref, (fx, fy), x.dtype)
    for d, p in [(4, 2), (16, 2), (128, 2), (4, 3), (7, 1), (3, 0)]:
        with case(f"feature_dim(d={d}, p={p})"):
            compare_number("your answer", call(dim_fn, d, p), math.comb(d + p, p))
    return "the map has C(d+p, p) features with the right inner products, and the dimension formula is right"


def window_rows(B, H, c, D, V, gen):
    _, k, v = random_qkv(B, H, c, D, V, generator=gen)
    return uneven_norms(gen, k), v


@EXERCISES.check("omega_step", title="One Omega step with gates", points=2,
                  functions=("omega_step",),
                  forbidden=OMEGA_RULE + PER_TOKEN)
def omega_step(fn, gen):
    """fn(M [B,H,V,D], k_win [B,H,c,D], v_win [B,H,c,V], gamma [B,H,c], alpha [B,H], eta [B,H]) -> M_t.

    Window rows are the last c pairs, oldest first; gamma[..., j] weighs row j.
    """
    cases = [(2, 3, 4, 5, 7), (1, 2, 1, 6, 6), (2, 1, 3, 6, 6), (1, 2, 8, 16, 4), (2, 2, 5, 3, 3)]  # (B, H, c, D, V)
    for B, H, c, D, V in cases:
        k, v = window_rows(B, H, c, D, V, gen)
        M = torch.randn(B, H, V, D, generator=gen)
        gamma = random_gate(B, H, c, low=0.0, generator=gen)
        alpha = random_gate(B, H, 1, low=0.3, generator=gen)[:, :, 0]
        eta = (0.1 + 0.9 * torch.rand(B, H, generator=gen)) / c
        # the library's definition: every gradient of the window at the current memory M
        M_ref = alpha[..., None, None] * M - eta[..., None, None] * window_gradient(M, k, v, gamma)
        with case(f"B={B}, H={H}, window c={c}, D={D}, V={V}"):
            compare("M_t", call(fn, *clones(M, k, v, gamma, alpha, eta)), M_ref, TOL)
    return f"M_t matches the Omega rule of atlaslib.omega on {len(cases)} random windows"


@EXERCISES.check("band", title="The banded gate matrix of a chunk", points=2,
                  functions=("band",),
                  forbidden=("atlaslib.omega.chunk.band_gates",))
def band(fn, gen):
    """fn(G [B,H,b,c]) -> Gamma [B,H,b,b+c-1] with Gamma[t, col] = G[t, t + c - 1 - col] inside the band, else 0."""
    cases = [(2, 2, 4, 3), (1, 1, 1, 5), (1, 2, 3, 7), (2, 1, 6, 1), (1, 3, 5, 5), (1, 1, 8, 2)]  # (B, H, b, c)
    for B, H, b, c in cases:
        G = 0.1 + 0.9 * torch.rand(B, H, b, c, generator=gen)
        label = f"chunk b={b}, window c={c}" + (" (c > b: the band reaches past the chunk)" if c > b else "")
        with case(label):
            got = call(fn, G.clone())
            if isinstance(got, torch.Tensor) and tuple(got.shape) != (B, H, b, b + c - 1):
                hint = " (a chunk-sized b x b mask cuts every window at the chunk start)" \
                    if tuple(got.shape[-2:]) == (b, b) else ""
                raise CheckFailed(f"Gamma has shape {list(got.shape)}, expected [{B}, {H}, {b}, {b + c - 1}]: "
                                  f"one column per window row, b + c - 1 = {b + c - 1}{hint}")
            compare("Gamma", got, band_gates(G, c), TOL)
    return f"Gamma matches atlaslib.omega on {len(cases)} chunks, windows shorter and longer than the chunk"


@EXERCISES.check("chunkwise", title="The chunkwise Omega rule (frozen gradients)", points=3,
                  functions=("omega_chunkwise",),
                  forbidden=OMEGA_RULE + CHUNK_FORMS + PER_TOKEN)
def chunkwise(fn, gen):
    """fn(q, k, v, gamma [B,H,T,c], alpha None or [B,H,T], eta [B,H,T], chunk_size) -> (o [B,H,T,V], M_T [B,H,V,D]).

    The window length is c = gamma.shape[-1]; the reference is ``omega_frozen_seq``.
    """
    cases = [  # (B, H, T, D, V, c, gated, chunk sizes)
        (2, 2, 13, 5, 4, 3, True, (1, 4, 5, 13, 20)),
        (1, 2, 14, 6, 3, 6, False, (1, 2, 4, 7)),       # c > chunk: windows reach into the previous chunk
        (1, 1, 24, 8, 8, 1, True, (3, 8)),              # c = 1: the delta rule with frozen gradients
        (1, 2, 1, 4, 3, 2, True, (1, 4)),
        (1, 1, 40, 4, 3, 3, (0.01, 0.05), (32,)),   # strong gates: e^{g_t - g_s} above the diagonal overflows
        (1, 2, 20, 4, 3, 3, (0.5, 1.0, "resets"), (1, 6, 20)),   # gates of exactly 0: log 0 = -inf
    ]
    for B, H, T, D, V, c, gated, sizes in cases:
        q, k, v = random_qkv(B, H, T, D, V, generator=gen)
        q, k = uneven_norms(gen, q, k)
        gamma = random_gate(B, H, T, c, low=0.2, generator=gen)
        low, high, *resets = gated if isinstance(gated, tuple) else (0.5, 1.0)
        alpha = random_gate(B, H, T, low=low, high=high, generator=gen) if gated else None
        alpha = with_resets(alpha) if resets else alpha
        eta = (0.2 + 0.8 * torch.rand(B, H, T, generator=gen)) / c
        kind = f"scalar gates in [{low}, {high}]" if gated else "alpha=None"
        kind += ", gates of 0 (resets) at t = 3, 10, 17" if resets else ""
        for b in sizes:
            o_ref, M_ref = omega_frozen_seq(q, k, v, c, gamma, alpha, eta, None, b)
            with case(f"B={B}, H={H}, T={T}, D={D}, V={V}, window c={c}, {kind}, chunk_size={b}"):
                o, M_T = unpack(call(fn, *clones(q, k, v, gamma, alpha, eta), b), ("o", "M_T"))
                compare("o", o, o_ref, TOL)
                compare("M_T", M_T, M_ref, TOL)
    n = sum(len(c[-1]) for c in cases)
    return (f"matches the frozen-gradient oracle for {n} (sequence, chunk size) pairs, "
            "windows longer than chunks included")


# strong gates make g_t - g_s large and positive above the diagonal
OVERFLOW_HINT = (" With gates this strong, NaN also comes from inf * 0: exp(g_t - g_s) overflows fp32 above the "
                 "diagonal, so a 0/1 mask multiplied after tl.exp gives NaN; select the differences with "
                 "tl.where(s <= t, g_t - g_s, -inf) before tl.exp.")


@EXERCISES.check("triton_window_weights", title="A Triton kernel for the chunk's window weights C", points=3,
                  functions=("window_weights",),
                  forbidden=("atlaslib.omega.chunk.window_weights",), needs_launch=True)
def triton_window_weights(fn, gen):
    """fn(G [N,b,c], eta [N,b], g [N,b], out [N,b,b+c-1]) -> out = (D diag(eta)) Gamma,
    D[t,s] = e^{g_t-g_s} (s <= t)."""
    device, tol = triton_setup(TOL)
    # (N, b, c, gates in [low, high]); with the last case's gates exp(g_t - g_s) overflows fp32 above the diagonal
    cases = [(2, 5, 3, 0.5, 1.0), (1, 16, 8, 0.5, 1.0), (3, 7, 11, 0.3, 1.0), (1, 1, 4, 0.5, 1.0),
             (2, 9, 1, 1.0, 1.0), (2, 30, 4, 0.001, 0.05)]
    for N, b, c, low, high in cases:
        G = random_gate(N, 1, b, c, low=0.1, generator=gen)
        eta = 0.1 + 0.9 * torch.rand(N, 1, b, generator=gen)
        g = torch.log(random_gate(N, 1, b, low=low, high=high, generator=gen)).cumsum(dim=-1)
        C_ref = window_weights(G, eta, g, c)[:, 0]
        ins = [guarded(x[:, 0].contiguous().to(device)) for x in (G, eta, g)]
        out = guarded_output((N, b, b + c - 1), device=device)
        with case(f"N={N}, b={b}, window c={c}, gates in [{low:g}, {high:g}]"):
            call(fn, *ins, out)
            if device == "cuda":
                torch.cuda.synchronize()
            check_guards("out", out)
            hint = NAN_HINT + OVERFLOW_HINT if high < 0.1 else NAN_HINT
            compare_kernel_output("out", out, C_ref.to(device), tol, hint)
    # the same text on CPU and GPU, so the stored output is valid on both
    return (f"the kernel matches atlaslib.omega on {len(cases)} odd-sized cases, strong gates included, "
            "with no stray loads or stores")


__all__ = ["EXERCISES", "monomials", "omega_step", "band", "chunkwise", "triton_window_weights"]
