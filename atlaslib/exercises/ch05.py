"""Checks for chapter 5's exercises (exercises/ch05_atlas.ipynb): Newton–Schulz, Muon and ATLAS.

Each check draws fresh random inputs, runs the learner's function and compares it with
``atlaslib`` (Newton–Schulz ``atlas.newton_schulz``, for one step, and for J steps on a
matrix of known singular vectors; one token of ``atlas.atlas_step``; the per-token momentum
of the Muon optimizer, ``miras.optimizer.build_optimizer`` on ``atlas.atlas_config``), then
shows a verdict. Use in a notebook as::

    from atlaslib.exercises import ch05 as check
    check.ns_step(ns_step)
"""
from __future__ import annotations

import torch

from ..atlas import COEFFICIENTS, atlas_config, newton_schulz, start_state
from ..atlas import atlas_step as one_token
from ..core.testing import random_gate, random_qkv
from ..miras.optimizer import build_optimizer
from .ch01 import clones, triton_setup
from .checking import (NAN_HINT, CheckFailed, Registry, call, case, check_guards, check_shape, compare,
                       compare_kernel_output, float32_hint, guarded, guarded_output, uneven_norms, unpack)

EXERCISES = Registry("ch05", helpers={"atlaslib.atlas": ("newton_schulz",)})   # what the notebook may import

# fp32 inputs unless stated; a correct answer agrees to ~1e-6, a wrong one is off by far more.
TOL = 1e-4

# (p0, p1, p2) of p(sigma) = p0 sigma + p1 sigma^3 + p2 sigma^5: Muon's, the cubic (p2 = 0), the convergent quintic
COEFFS = {"muon": COEFFICIENTS["muon"], "cubic": (*COEFFICIENTS["cubic"], 0.0), "quintic": COEFFICIENTS["quintic"]}

# Everything that computes Newton-Schulz for the learner
NEWTON_SCHULZ = ("atlaslib.core.newton_schulz.newton_schulz", "atlaslib.atlas.kernel.newton_schulz_triton")


def _coeffs(name, gen):
    if name == "random":      # a made-up odd polynomial: no answer may assume a named set
        draw = 1.0 + torch.rand(3, generator=gen) * torch.tensor([2.0, -3.0, 1.5])
        return tuple(round(x, 4) for x in draw.tolist())
    return COEFFS[name]


def _batch_of_scales(B, H, m, n, gen, dtype=torch.float32):
    """Random matrices [B, H, m, n] whose sizes differ by up to 100x from one matrix to the next."""
    scale = 10.0 ** (2 * torch.rand(B, H, 1, 1, generator=gen) - 1)
    return (scale * torch.randn(B, H, m, n, generator=gen)).to(dtype)


ZERO_HINT = " An all-zero matrix has the norm 0: divide by ||X||_F + eps, as the statement says (0/0 is NaN)."


@EXERCISES.check("ns_step", title="One Newton-Schulz step", points=2,
                  functions=("ns_step",), forbidden=NEWTON_SCHULZ)
def ns_step(fn, gen):
    """fn(G [B,H,m,n], coeffs (p0, p1, p2)) -> NS_1(G): each matrix normalised by its own Frobenius norm, then
    X -> p0 X + p1 (X X^T) X + p2 (X X^T)^2 X (tall matrices may be transposed: the result is the same)."""
    # (B, H, m, n, coefficients, the matrix [b, h] made all zero or None): a zero matrix's norm is 0, and its step
    # 0 only with the statement's eps
    cases = [(2, 3, 5, 7, "muon", None), (1, 2, 9, 4, "quintic", None), (2, 1, 6, 6, "random", None),
             (1, 1, 1, 5, "muon", None), (3, 2, 7, 3, "cubic", None), (1, 3, 16, 33, "muon", None),
             (2, 2, 4, 6, "muon", (1, 0))]
    for B, H, m, n, name, zero in cases:
        G = _batch_of_scales(B, H, m, n, gen)
        if zero is not None:
            G[zero] = 0.0
        coeffs = _coeffs(name, gen)
        ref = newton_schulz(G, 1, coeffs)
        shape = "tall" if m > n else ("square" if m == n else "wide")
        label = f"B={B}, H={H}, {m} x {n} ({shape}), coefficients {name} {coeffs}"
        label += f" (matrix {list(zero)} is all zero)" if zero is not None else ""
        with case(label):
            got = call(fn, G.clone(), coeffs)
            check_shape("NS_1(G)", got, G.shape)
            compare("NS_1(G)", got, ref, TOL, explain=ZERO_HINT if zero is not None else "")
    return f"NS_1(G) matches atlaslib.atlas.newton_schulz on {len(cases)} batches (wide, square and tall matrices)"


def _orthonormal(m, r, gen):
    """m x r with orthonormal columns (fp64)."""
    Q, R = torch.linalg.qr(torch.randn(m, r, generator=gen, dtype=torch.float64))
    return Q * torch.sign(torch.diagonal(R))


def _epsilon_hint(got, sigma, steps, coeffs) -> str:
    """Added when the answer is the polynomial on sigma / (||sigma|| + e) with an e other than Muon's 1e-7
    (none at all, or another constant), or on a spectrum normalised twice: against norms near 1 either moves
    the values by more than the check's tolerance, by about what float32's rounding would, and this says
    which it is."""
    if steps == 0 or not isinstance(got, torch.Tensor) or got.shape != sigma.shape:
        return ""
    def polynomial(s):
        for _ in range(steps):
            s = coeffs[0] * s + coeffs[1] * s**3 + coeffs[2] * s**5
        return s

    def matches(s):
        return torch.allclose(got.detach().double(), polynomial(s), rtol=1e-10, atol=1e-12)

    for eps in (0.0, 1e-12, 1e-10, 1e-9, 1e-8, 1e-6, 1e-5, 1e-4):
        if matches(sigma / (sigma.norm() + eps)):
            used = "sigma / ||sigma||" if eps == 0 else f"sigma / (||sigma|| + {eps:g})"
            return (f". Your values are the polynomial on {used} exactly: the normalisation of Exercise 1 "
                    "divides by ||G||_F + eps with eps = 1e-7, and so must this one")
    once = sigma / (sigma.norm() + 1e-7)
    if matches(once / (once.norm() + 1e-7)):
        return (". Your values are the polynomial on a spectrum normalised twice: NS_J normalises once, "
                "before its first step (a second division by ||sigma|| + 1e-7 moves every value by about 1e-7)")
    return ""


@EXERCISES.check("ns_polynomial", title="The polynomial acting on the singular values", points=2,
                  functions=("ns_singular_values",), forbidden=NEWTON_SCHULZ)
def ns_polynomial(fn, gen):
    """fn(sigma [r] fp64, steps, coeffs (p0, p1, p2)) -> [r]: the singular values of NS_J(G), G = U Diag(sigma) V^T.

    The reference is the library's NS_J on such a G, read on the known singular vectors
    (U^T NS_J(G) V is diagonal), so order and sign are kept.
    """
    cases = [  # (m, n, spectrum, steps, coefficients)
        (6, 9, "random", 1, "muon"),
        (16, 32, "ill-conditioned, 1e-3 to 1", 5, "muon"),
        (12, 7, "random", 3, "quintic"),
        (8, 8, "random, two of them 0 (rank-deficient)", 4, "cubic"),
        (5, 5, "random", 2, "random"),
        (9, 4, "random", 0, "muon"),                    # NS_0 is the identity: no normalisation either
        (1, 3, "random", 5, "muon"),                    # one singular value: NS_J(G) = f^J(1)
    ]
    for m, n, spectrum, steps, name in cases:
        r = min(m, n)
        if spectrum.startswith("ill"):
            sigma = torch.logspace(-3, 0, r, dtype=torch.float64)[torch.randperm(r, generator=gen)]
        else:
            sigma = 0.1 + 5 * torch.rand(r, generator=gen, dtype=torch.float64)
            if "rank" in spectrum:
                sigma[torch.randperm(r, generator=gen)[:2]] = 0.0
        coeffs = _coeffs(name, gen)
        U, Vm = _orthonormal(m, r, gen), _orthonormal(n, r, gen)
        G = U @ torch.diag(sigma) @ Vm.T
        ref = torch.diagonal(U.T @ newton_schulz(G, steps, coeffs) @ Vm)
        with case(f"{m} x {n}, {spectrum} singular values, J={steps}, coefficients {name} {coeffs}"):
            got = call(fn, sigma.clone(), steps, coeffs)
            check_shape("the singular values", got, sigma.shape)
            compare("the singular values", got, ref, 1e-8, explain=_epsilon_hint(got, sigma, steps, coeffs))
    return (f"the singular values of NS_J(G) match atlaslib.atlas.newton_schulz on {len(cases)} spectra "
            "(J = 0 to 5, rank-deficient and ill-conditioned included)")


@EXERCISES.check("atlas_step", title="One ATLAS step", points=2,
                  functions=("atlas_step",),
                  forbidden=("atlaslib.atlas.atlas", "atlaslib.atlas.recurrent.atlas_step",
                             "atlaslib.atlas.recurrent.atlas_recurrent", "atlaslib.atlas.recurrent.atlas_frozen_seq",
                             "atlaslib.atlas.chunk.atlas_chunk", "atlaslib.miras.miras"))
def atlas_step(fn, gen):
    """fn(M [B,H,V,D], S [B,H,V,D], k [B,H,D], v [B,H,V], alpha, eta, theta [B,H], ns_steps) -> (M_t, S_t).

    Linear memory, l2 loss, window 1, Muon's coefficients: the library's ``atlas_step``.
    """
    cases = [(2, 3, 5, 7, 5), (1, 2, 6, 6, 1), (2, 1, 4, 9, 0), (1, 1, 16, 8, 5), (2, 2, 3, 1, 2)]  # (B, H, D, V, k)
    for B, H, D, V, steps in cases:
        _, k, v = random_qkv(B, H, 1, D, V, generator=gen, dtype=torch.float64)
        k = uneven_norms(gen, k)
        k, v = k[:, :, 0], v[:, :, 0]
        M = torch.randn(B, H, V, D, generator=gen, dtype=torch.float64)
        S = torch.randn(B, H, V, D, generator=gen, dtype=torch.float64)
        alpha = random_gate(B, H, 1, low=0.5, generator=gen, dtype=torch.float64)[:, :, 0]
        eta = 0.01 + 0.2 * torch.rand(B, H, generator=gen, dtype=torch.float64)
        theta = random_gate(B, H, 1, low=0.3, generator=gen, dtype=torch.float64)[:, :, 0]
        state, _ = one_token(start_state(M, S), k, k, v, 1, None, alpha, eta, theta, steps)
        with case(f"B={B}, H={H}, D={D}, V={V}, ns_steps={steps}"):
            M_t, S_t = unpack(call(fn, *clones(M, S, k, v, alpha, eta, theta), steps), ("M_t", "S_t"))
            check_shape("M_t", M_t, M.shape)
            check_shape("S_t", S_t, S.shape)
            for name, got in (("S_t", S_t), ("M_t", M_t)):
                if isinstance(got, torch.Tensor) and got.dtype != M.dtype:
                    raise CheckFailed(f"{name} has dtype {got.dtype}, but the inputs are {M.dtype}: keep the "
                                      "inputs' dtype (a tensor made without dtype=..., or a .float(), turns the "
                                      "result into float32, which cannot reach the 1e-8 this check asks)")
            compare("S_t", S_t, state.S, 1e-8)
            # S_t is right: an M_t off by float32's rounding may as well be another eps in NS_J's normalisation
            compare("M_t", M_t, state.M, 1e-8, explain=float32_hint(M_t, state.M) and (
                ". The error is about float32's rounding: a float32 tensor was made on the way (torch.zeros/"
                "eye without dtype=, a .float()), or NS_J normalises by something other than ||S_t||_F + 1e-7 "
                "(Exercise 1's eps)"))
    return f"S_t and M_t match atlaslib.atlas.atlas_step on {len(cases)} random cases (ns_steps 0 to 5)"


@EXERCISES.check("momenta", title="A chunk's momenta by one masked matmul", points=3,
                  functions=("chunk_momenta",),
                  forbidden=("atlaslib.atlas.atlas", "atlaslib.atlas.chunk.atlas_chunk", "atlaslib.miras.miras",
                             "atlaslib.atlas.recurrent.atlas_recurrent", "atlaslib.atlas.recurrent.atlas_frozen_seq",
                             "atlaslib.core.chunking.chunk_decay", "atlaslib.core.chunking.causal_decay"))
def momenta(fn, gen):
    """fn(S0 [N,V,D], grad [N,b,V,D], theta [N,b]) -> S [N,b,V,D], all b momenta S_t = theta_t S_{t-1} + grad_t.

    The reference runs the Muon optimizer of the library token by token.
    """
    muon = build_optimizer(atlas_config("linear", ns_steps=0))
    # (N, b, V, D, theta in [low, high], kind); gates of exactly 0 restart the momentum (log 0 = -inf),
    # and the last chunk's cumulative products underflow fp32 for every draw (64 tokens of theta <= 0.2:
    # log of the product about -150 +- 5 against fp32's -103), where quotients of them give 0/0
    cases = [(2, 5, 3, 4, 0.3, 1.0, ""), (1, 16, 4, 6, 0.05, 1.0, ""), (3, 1, 2, 5, 0.5, 1.0, ""),
             (2, 9, 5, 2, 0.5, 1.0, "zeros"), (1, 64, 3, 3, 0.02, 0.2, "")]
    for N, b, V, D, low, high, kind in cases:
        S0 = torch.randn(N, V, D, generator=gen)
        grad = torch.randn(N, b, V, D, generator=gen)
        theta = random_gate(N, 1, b, low=low, high=high, generator=gen)[:, 0]
        if kind == "zeros":
            theta[:, torch.tensor([2, 6])] = 0.0
        S, states = {"M": S0}, []
        for t in range(b):                                             # the per-token definition
            _, S = muon.step(S, {"M": grad[:, t]}, torch.ones(N), theta[:, t])
            states.append(S["M"])
        ref = torch.stack(states, dim=1)
        label = "two of them exactly 0" if kind else f"in [{low}, {high}]"
        with case(f"N={N}, chunk b={b}, V={V}, D={D}, theta {label}"):
            got = call(fn, *clones(S0, grad, theta))
            if isinstance(got, torch.Tensor) and tuple(got.shape) == (N, V, D) and b > 1:
                raise CheckFailed(f"S has shape {list(got.shape)}: that is one momentum; return all b = {b} of "
                                  f"them, [{N}, {b}, {V}, {D}] (Newton-Schulz needs every S_t)")
            check_shape("S", got, ref.shape)
            if isinstance(got, torch.Tensor) and got.is_floating_point() and got.isnan().any() \
                    and not ref.isnan().any():
                zeros = " (log 0 = -inf, and -inf - (-inf) is NaN: clamp theta at a tiny floor before the log)" \
                    if kind == "zeros" else ""
                raise CheckFailed(f"S is NaN at {int(got.isnan().sum())} entries where the momenta are finite: "
                                  "a division by zero (0/0), inf - inf, or inf * 0. Over a long chunk the cumulative "
                                  "products of theta underflow to 0, and a gate of exactly 0 makes them 0, so their "
                                  "quotients are 0/0: build the decay matrix from products over each range (or "
                                  "differences of cumulative log-gates) instead; and mask before the exponential "
                                  "(exp of an unmasked difference above the diagonal overflows to inf, and a 0/1 mask "
                                  f"applied after it makes inf * 0 = NaN: select -inf there with torch.where){zeros}")
            compare("S", got, ref, TOL)
    return (f"all the chunk's momenta match the per-token recursion on {len(cases)} chunks "
            "(resets and underflow included)")


@EXERCISES.check("triton_ns_step", title="A Triton kernel for one Newton-Schulz step on a tile", points=3,
                  functions=("ns_step_triton",), forbidden=NEWTON_SCHULZ, needs_launch=True)
def triton_ns_step(fn, gen):
    """fn(X [N,R,C] (R <= C), out [N,R,C], coeffs (p0, p1, p2)) -> out = NS_1 of each matrix, in fp32."""
    device, tol = triton_setup(TOL)
    # (N, R, C, coefficients, the matrix made all zero or None): odd sizes on purpose; a zero matrix's norm is 0,
    # and its step 0 only with the statement's eps
    cases = [(2, 5, 7, "muon", None), (1, 16, 16, "quintic", None), (3, 3, 20, "random", 1),
             (1, 1, 4, "muon", None), (2, 9, 33, "cubic", None)]
    for N, R, C, name, zero in cases:
        X = _batch_of_scales(N, 1, R, C, gen)[:, 0]
        if zero is not None:
            X[zero] = 0.0
        coeffs = _coeffs(name, gen)
        ref = newton_schulz(X, 1, coeffs)
        x_in = guarded(X.to(device))
        out = guarded_output((N, R, C), device=device)
        label = f"N={N}, R={R}, C={C}, coefficients {name} {coeffs}"
        label += f" (matrix {zero} is all zero)" if zero is not None else ""
        hint = NAN_HINT + ZERO_HINT if zero is not None else NAN_HINT
        with case(label):
            call(fn, x_in, out, coeffs)
            if device == "cuda":
                torch.cuda.synchronize()
            check_guards("out", out)
            compare_kernel_output("out", out, ref.to(device), tol, hint)
    # the same text on CPU and GPU, so the stored output is valid on both
    return (f"the kernel matches atlaslib.atlas.newton_schulz on {len(cases)} odd-sized cases, "
            "with no stray loads or stores")


__all__ = ["EXERCISES", "ns_step", "ns_polynomial", "atlas_step", "momenta", "triton_ns_step"]
