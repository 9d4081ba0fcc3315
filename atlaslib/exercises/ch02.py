"""Checks for chapter 2's exercises (exercises/ch02_delta.ipynb): the delta rule family.

Each check draws fresh random inputs, runs the learner's function and compares it with
``atlaslib.delta`` (the per-token loop ``delta_rule(..., backend="recurrent")``, Longhorn's
step ``longhorn_beta``, the chunk matrices of ``atlaslib.delta.chunk``), then shows a
verdict. Use in a notebook as::

    from atlaslib.exercises import ch02 as check
    check.delta_step(loss_gradient, delta_step)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.testing import random_gate, random_qkv
from ..delta import delta_rule, longhorn_beta
from ..delta.chunk import decayed_products
from .ch01 import clones, triton_setup
from .checking import (NAN_HINT, Registry, call, case, check_guards, compare, compare_kernel_output, guarded,
                       guarded_output, uneven_norms, unpack, with_resets)

EXERCISES = Registry("ch02")

# fp32 inputs; a correct answer agrees to ~1e-6, a wrong one is off by far more than this.
TOL = 1e-4


def recurrent(q, k, v, beta, alpha=None, initial_state=None, longhorn=False):
    """The library's per-token loop: (o, final state)."""
    return delta_rule(q, k, v, beta, alpha=alpha, initial_state=initial_state, longhorn=longhorn,
                      output_final_state=True, backend="recurrent")


def random_beta(B, H, T, gen, low=0.1, high=1.5):
    return low + (high - low) * torch.rand(B, H, T, generator=gen)


# the library's delta rule, its chunkwise forms and its per-token forms: what the exercises that write one may not call
DELTA_RULE = ("atlaslib.delta.delta_rule",)
CHUNK_FORMS = ("atlaslib.delta.chunk.chunk_step", "atlaslib.delta.chunk.delta_rule_chunk")
PER_TOKEN = ("atlaslib.delta.recurrent.delta_rule_recurrent", "atlaslib.delta.recurrent.delta_rule_step")
# autograd in each of its forms (torch.func and .backward() end in these): for the exercises that derive a gradient
AUTOGRAD = ("torch.autograd.grad", "torch.autograd.backward", "torch.autograd.forward_ad.make_dual")


@EXERCISES.check("delta_step", title="The delta rule as one gradient step", points=2,
                  functions=("loss_gradient", "delta_step"),
                  forbidden=DELTA_RULE + PER_TOKEN + AUTOGRAD)
def delta_step(grad_fn, step_fn, gen):
    """grad_fn(M, k, v) -> dL/dM of 1/2||M k - v||^2;  step_fn(M, k, v, beta, alpha) -> M_t.

    M [B,H,V,K], k [B,H,K], v [B,H,V], beta and alpha [B,H].
    """
    # K != V first: a left-multiplied (I - beta k k^T) M fails on shape there, and on values when K = V
    cases = [(2, 3, 5, 7, 0.3), (1, 2, 6, 6, 0.3), (2, 1, 16, 3, 0.6), (1, 2, 4, 4, 1.0)]  # (B, H, K, V, lowest gate)
    for B, H, K, V, low in cases:
        q, k, v = random_qkv(B, H, 1, K, V, generator=gen)
        q, k = uneven_norms(gen, q, k)
        M = torch.randn(B, H, V, K, generator=gen)
        beta = random_beta(B, H, 1, gen)
        alpha = random_gate(B, H, 1, low=low, generator=gen)
        label = f"B={B}, H={H}, K={K}, V={V}, gates in [{low}, 1]"
        with case(f"loss_gradient, {label}"):
            M_var = M.clone().requires_grad_(True)
            loss = 0.5 * (torch.einsum("bhvk,bhk->bhv", M_var, k[:, :, 0]) - v[:, :, 0]).square().sum()
            (grad_ref,) = torch.autograd.grad(loss, M_var)
            compare("gradient", call(grad_fn, *clones(M, k[:, :, 0], v[:, :, 0])), grad_ref, TOL)
        with case(f"delta_step, {label}"):
            _, M_ref = recurrent(q, k, v, beta, alpha, initial_state=M)
            got = call(step_fn, *clones(M, k[:, :, 0], v[:, :, 0], beta[:, :, 0], alpha[:, :, 0]))
            compare("M_t", got, M_ref, TOL)
    return f"the gradient matches autograd and M_t matches atlaslib.delta on {len(cases)} random cases"


def corrected_values(M0, k, v, beta, alpha):
    """u_t = beta_t (v_t - alpha_t M_{t-1} k_t) from the library's per-token loop.

    The loop is run with the queries shifted by one token (query t = key t+1), so that its
    read y_t = M_t k_{t+1} is exactly what token t+1 needs; token 1 reads M0 directly.
    """
    q_next = torch.cat([k[:, :, 1:], k[:, :, :1]], dim=2)
    y, _ = recurrent(q_next, k, v, beta, alpha, initial_state=M0)
    first = torch.einsum("bhvk,bhk->bhv", M0, k[:, :, 0])[:, :, None]
    previous_reads = torch.cat([first, y[:, :, :-1]], dim=2)          # M_{t-1} k_t, t = 1..b
    return beta[..., None] * (v - alpha[..., None] * previous_reads)


@EXERCISES.check("ut_solve", title="The UT transform: one triangular solve per chunk", points=3,
                  functions=("ut_solve",),
                  forbidden=DELTA_RULE + CHUNK_FORMS)
def ut_solve(fn, gen):
    """fn(M0 [B,H,V,K], k [B,H,b,K], v [B,H,b,V], beta [B,H,b], alpha [B,H,b]) -> U [B,H,b,V]."""
    cases = [  # (B, H, b, K, V, gates' range)
        (2, 2, 1, 5, 3, (0.5, 1.0)),
        (1, 2, 6, 6, 4, (0.5, 1.0)),
        (2, 1, 9, 7, 5, (1.0, 1.0)),       # gates exactly 1: DeltaNet
        (1, 1, 16, 16, 8, (0.3, 1.0)),
        (1, 3, 12, 4, 6, (0.8, 1.0)),      # b > K: the keys are linearly dependent
        (1, 1, 32, 4, 3, (0.01, 0.05)),    # strong gates: e^{g_t - g_j} above the diagonal overflows
        (1, 2, 12, 5, 3, (0.5, 1.0, "resets")),    # gates of exactly 0 at t = 3, 10: log 0 = -inf
    ]
    for B, H, b, K, V, (low, high, *resets) in cases:
        _, k, v = random_qkv(B, H, b, K, V, generator=gen)
        k = uneven_norms(gen, k)
        beta = random_beta(B, H, b, gen)
        alpha = random_gate(B, H, b, low=low, high=high, generator=gen)
        alpha = with_resets(alpha) if resets else alpha
        M0 = torch.randn(B, H, V, K, generator=gen)
        U_ref = corrected_values(M0, k, v, beta, alpha)
        gates = f"gates in [{low}, {high}]" + (", gates of 0 (resets) at t = 3, 10" if resets else "")
        with case(f"B={B}, H={H}, chunk length b={b}, K={K}, V={V}, {gates}"):
            compare("U", call(fn, *clones(M0, k, v, beta, alpha)), U_ref, TOL)
    return f"U matches the per-token corrected values on {len(cases)} random chunks"


@EXERCISES.check("chunkwise", title="The chunkwise delta rule over a whole sequence", points=3,
                  functions=("chunkwise",),
                  forbidden=DELTA_RULE + CHUNK_FORMS + PER_TOKEN)
def chunkwise(fn, gen):
    """fn(q, k, v, beta, alpha, chunk_size) -> (o [B,H,T,V], M_T [B,H,V,K]); alpha None or [B,H,T]."""
    cases = [  # (B, H, T, K, V, gates' range or None, chunk sizes)
        (2, 2, 13, 5, 4, (0.5, 1.0), (1, 3, 4, 13, 20)),
        (1, 2, 13, 6, 3, None, (1, 5, 16)),
        (1, 1, 32, 8, 8, (0.5, 1.0), (8, 16, 7)),
        (1, 2, 1, 4, 3, (0.5, 1.0), (1, 4)),
        (1, 1, 40, 4, 3, (0.01, 0.05), (32,)),   # strong gates: e^{g_t - g_j} above the diagonal overflows
        (1, 2, 20, 5, 4, (0.5, 1.0, "resets"), (1, 6, 20)),   # gates of exactly 0: log 0 = -inf
    ]
    for B, H, T, K, V, gates, sizes in cases:
        q, k, v = random_qkv(B, H, T, K, V, generator=gen)
        q, k = uneven_norms(gen, q, k)
        beta = random_beta(B, H, T, gen, high=1.0)
        alpha = random_gate(B, H, T, low=gates[0], high=gates[1], generator=gen) if gates else None
        alpha = with_resets(alpha) if gates and len(gates) > 2 else alpha
        o_ref, M_ref = recurrent(q, k, v, beta, alpha)
        kind = f"scalar gates in [{gates[0]}, {gates[1]}]" if gates else "alpha=None"
        kind += ", gates of 0 (resets) at t = 3, 10, 17" if gates and len(gates) > 2 else ""
        for c in sizes:
            with case(f"B={B}, H={H}, T={T}, K={K}, V={V}, {kind}, chunk_size={c}"):
                o, M_T = unpack(call(fn, *clones(q, k, v, beta, alpha), c), ("o", "M_T"))
                compare("o", o, o_ref, TOL)
                compare("M_T", M_T, M_ref, TOL)
    n = sum(len(c[-1]) for c in cases)
    return f"matches the per-token loop for {n} (sequence, chunk size) pairs, with and without gates"


def keys_of_norm(B, H, K, gen, low, high):
    """Keys [B,H,K] with random directions and norms uniform in [low, high]."""
    return uneven_norms(gen, F.normalize(torch.randn(B, H, K, generator=gen), dim=-1), low=low, high=high)


@EXERCISES.check("kda_beta", title="KDA as a proximal step: the right beta", points=2,
                  functions=("prox_step", "kda_beta"),
                  forbidden=("atlaslib.delta.longhorn_beta",))
def kda_beta(prox_fn, beta_fn, gen):
    """prox_fn(M_prev, k, v, alpha, eta) -> M;  beta_fn(eta, k) -> beta.

    M_prev [B,H,V,K], k [B,H,K], v [B,H,V], alpha [B,H,K] (per key channel), eta [B,H].
    """
    cases = [  # (B, H, K, V, key norms)
        (2, 2, 5, 3, (1.0, 1.0)),       # unit keys: the blog's beta is right here
        (1, 3, 6, 6, (0.5, 3.0)),
        (2, 1, 16, 4, (1.5, 2.5)),
        (1, 2, 3, 7, (0.2, 0.8)),
    ]
    for B, H, K, V, (low, high) in cases:
        k = keys_of_norm(B, H, K, gen, low, high)
        v = torch.randn(B, H, V, generator=gen)
        M_prev = torch.randn(B, H, V, K, generator=gen)
        alpha = random_gate(B, H, 1, K, low=0.5, generator=gen)[:, :, 0]
        eta = 0.1 + 4.9 * torch.rand(B, H, generator=gen)
        label = f"B={B}, H={H}, K={K}, V={V}, key norms in [{low}, {high}]"
        with case(f"prox_step, {label}"):
            _, M_ref = recurrent(k[:, :, None], k[:, :, None], v[:, :, None], eta[:, :, None],
                                 alpha[:, :, None], initial_state=M_prev, longhorn=True)
            compare("M", call(prox_fn, *clones(M_prev, k, v, alpha, eta)), M_ref, TOL)
        with case(f"kda_beta, {label}"):
            beta_ref = longhorn_beta(eta[:, :, None], k[:, :, None])[:, :, 0]
            compare("beta", call(beta_fn, *clones(eta, k)), beta_ref, TOL)
    return f"the proximal step and its beta match atlaslib.delta (Longhorn) on {len(cases)} cases, unit keys or not"


# strong gates make g_t - g_j large and positive above the diagonal
OVERFLOW_HINT = (" With gates this strong, NaN also comes from inf * 0: exp(g_t - g_j) overflows fp32 above the "
                 "diagonal, so a 0/1 mask multiplied after tl.exp gives NaN; select the differences with "
                 "tl.where(j < t, g_t - g_j, -inf) before tl.exp.")


@EXERCISES.check("triton_chunk_matrix", title="A Triton kernel for the chunk's matrix Diag(beta) L", points=3,
                  functions=("chunk_matrix",),
                  forbidden=("atlaslib.delta.chunk.decayed_products",), needs_launch=True)
def triton_chunk_matrix(fn, gen):
    """fn(k [N,b,K], beta [N,b], g [N,b], out [N,b,b]) -> out = tril(beta_t e^{g_t - g_j} k_t.k_j, -1)."""
    device, tol = triton_setup(TOL)
    # (N, b, K, gates in [low, high]); with the last case's gates exp(g_t - g_j) overflows fp32 above the diagonal
    cases = [(2, 5, 6, 0.5, 1.0), (1, 16, 16, 0.5, 1.0), (3, 11, 20, 0.3, 1.0), (1, 1, 4, 0.5, 1.0),
             (2, 7, 3, 1.0, 1.0), (2, 30, 8, 0.001, 0.05)]
    for N, b, K, low, high in cases:
        _, k, _ = random_qkv(N, 1, b, K, 1, generator=gen)
        k = uneven_norms(gen, k)
        beta = random_beta(N, 1, b, gen)
        g = torch.log(random_gate(N, 1, b, low=low, high=high, generator=gen)).cumsum(dim=-1)
        _, L, *_ = decayed_products(k, k, g)             # strictly lower e^{g_t - g_j} k_t.k_j
        A_ref = (beta[..., None] * L)[:, 0]
        ins = [guarded(x[:, 0].to(device)) for x in (k, beta, g)]
        out = guarded_output((N, b, b), device=device)
        with case(f"N={N}, b={b}, K={K}, gates in [{low:g}, {high:g}]"):
            call(fn, *ins, out)
            if device == "cuda":
                torch.cuda.synchronize()
            check_guards("out", out)
            hint = NAN_HINT + OVERFLOW_HINT if high < 0.1 else NAN_HINT
            compare_kernel_output("out", out, A_ref.to(device), tol, hint)
    # the same text on CPU and GPU, so the stored output is valid on both
    return (f"the kernel matches atlaslib.delta on {len(cases)} odd-sized cases, strong gates included, "
            "with no stray loads or stores")


def wy_solve_reference(L, beta, Z, dX):
    """(dL, dbeta, dZ) for X = (I + Diag(beta) L)^{-1} Z and the loss <dX, X>, by autograd in fp64.

    L enters through its strictly lower part only (tril(L, -1)), so dL is zero on and above the diagonal.
    """
    b = L.shape[-1]
    L64, beta64, Z64 = (x.double().requires_grad_(True) for x in (L, beta, Z))
    system = torch.eye(b, dtype=torch.float64) + beta64[..., None] * L64.tril(-1)
    X = torch.linalg.solve_triangular(system, Z64, upper=False, unitriangular=True)
    grads = torch.autograd.grad((X * dX.double()).sum(), (L64, beta64, Z64))
    return tuple(g.float() for g in grads)


@EXERCISES.check("wy_backward", title="The backward of the WY solve", points=3,
                  functions=("wy_solve_backward",),
                  forbidden=AUTOGRAD)
def wy_backward(fn, gen):
    """fn(L [B,H,b,b] strictly lower, beta [B,H,b], Z [B,H,b,D], dX [B,H,b,D]) -> (dL, dbeta, dZ)."""
    cases = [  # (B, H, b, K of the keys behind L, D columns, lowest gate)
        (2, 2, 1, 4, 3, 0.5),       # one token: L is empty, X = Z
        (1, 2, 6, 8, 4, 0.5),
        (2, 1, 9, 5, 12, 1.0),      # more columns than tokens; gates exactly 1 (DeltaNet)
        (1, 1, 16, 16, 8, 0.3),
        (1, 3, 12, 4, 6, 0.8),      # b > K: the keys are linearly dependent
    ]
    for B, H, b, K, D, low in cases:
        _, k, _ = random_qkv(B, H, b, K, 1, generator=gen)
        k = uneven_norms(gen, k)
        g = torch.log(random_gate(B, H, b, low=low, generator=gen)).cumsum(dim=-1)
        _, L, *_ = decayed_products(k, k, g)                       # tril(Gamma * K K^T, -1), as in the chunk
        beta = 2 * torch.rand(B, H, b, generator=gen)              # beta in [0, 2]
        Z = torch.randn(B, H, b, D, generator=gen)
        dX = torch.randn(B, H, b, D, generator=gen)
        dL_ref, dbeta_ref, dZ_ref = wy_solve_reference(L, beta, Z, dX)
        with case(f"B={B}, H={H}, chunk length b={b}, K={K}, D={D} columns, beta in [0, 2]"):
            dL, dbeta, dZ = unpack(call(fn, *clones(L, beta, Z, dX)), ("dL", "dbeta", "dZ"))
            compare("dZ", dZ, dZ_ref, TOL)
            compare("dL", dL, dL_ref, TOL)
            compare("dbeta", dbeta, dbeta_ref, TOL)
    return f"dL, dbeta and dZ match autograd on {len(cases)} random chunks"
