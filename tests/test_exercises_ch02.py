"""Chapter 2's graded exercises: every check passes a correct answer and rejects typical mistakes,
and the grader gives the solutions full marks, the student copy zero, and a planted wrong
answer exactly its exercise's points less.

The correct answers here are written from the math or the library, not copied from
exercises/solutions/ch02_delta.ipynb. TRITON_INTERPRET=1 is set by conftest.py before
triton is imported.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from atlaslib.delta import delta_rule
from atlaslib.delta.chunk import chunk_step as library_chunk_step
from atlaslib.exercises import ch02, registry
from grading_helpers import (TIMEOUT, assert_full_marks, assert_planted_loses_its_points, assert_student_scores_zero,
                             chapter_notebooks)

SOLUTION, STUDENT = chapter_notebooks("ch02_delta")
POINTS = {e.name: e.points for e in registry("ch02")}


def mv(M, x):
    """M x for M [B,H,V,K], x [B,H,K]."""
    return torch.einsum("bhvk,bhk->bhv", M, x)


def outer(a, b):
    return a[..., :, None] * b[..., None, :]


# ---- exercise 1: the delta rule as a gradient step -----------------------------------------

def gradient_ok(M, k, v):
    return outer(mv(M, k) - v, k)


def step_ok(M, k, v, beta, alpha):   # the library's other backend, on one token
    _, M_t = delta_rule(k[:, :, None], k[:, :, None], v[:, :, None], beta[:, :, None], alpha=alpha[:, :, None],
                        initial_state=M, output_final_state=True, backend="chunk")
    return M_t


def step_explicit(M, k, v, beta, alpha):   # with I - beta k k^T formed explicitly
    K = k.shape[-1]
    b, a = beta[:, :, None, None], alpha[:, :, None, None]
    return a * M @ (torch.eye(K) - b * outer(k, k)) + b * outer(v, k)


def test_delta_step_passes_correct_answers():
    for step in (step_ok, step_explicit):
        v = ch02.delta_step.evaluate(gradient_ok, step)
        assert v.status == "passed" and v.earned == v.points == 2, v.message


@pytest.mark.parametrize("wrong, where", [
    (lambda M, k, v: outer(v - mv(M, k), k), "gradient"),          # sign of the error
    (lambda M, k, v: 2 * outer(mv(M, k) - v, k), "gradient"),      # the loss without its 1/2
])
def test_delta_step_rejects_wrong_gradients(wrong, where):
    v = ch02.delta_step.evaluate(wrong, step_explicit)
    assert v.status == "failed" and where in v.message and "loss_gradient" in v.message


def left_multiplied(M, k, v, beta, alpha):
    """(I - beta k k^T) alpha M + beta v k^T: acts on value space; only defined when K = V."""
    b, a = beta[:, :, None, None], alpha[:, :, None, None]
    return (torch.eye(k.shape[-1]) - b * outer(k, k)) @ (a * M) + b * outer(v, k)


def left_multiplied_when_square(M, k, v, beta, alpha):
    return left_multiplied(M, k, v, beta, alpha) if M.shape[-1] == M.shape[-2] else step_explicit(M, k, v, beta, alpha)


@pytest.mark.parametrize("wrong", [
    lambda M, k, v, beta, alpha: step_explicit(M, k, v, beta, torch.ones_like(alpha)),          # no decay
    lambda M, k, v, beta, alpha: alpha[:, :, None, None] * M
    - beta[:, :, None, None] * outer(mv(M, k) - v, k),                    # gradient at M, not alpha M
    lambda M, k, v, beta, alpha: alpha[:, :, None, None] * step_explicit(M, k, v, beta,
                                                                         torch.ones_like(alpha)),  # decay last
    lambda M, k, v, beta, alpha: step_explicit(M, k, v, -beta, alpha),                           # ascent
    left_multiplied_when_square,
], ids=["no_decay", "gradient_at_M", "decay_after", "sign", "left_multiplied"])
def test_delta_step_rejects_wrong_steps(wrong):
    v = ch02.delta_step.evaluate(gradient_ok, wrong)
    assert v.status == "failed" and "M_t: relative RMSE" in v.message, v.message


def test_delta_step_left_multiplication_fails_on_shape_when_k_differs_from_v():
    v = ch02.delta_step.evaluate(gradient_ok, left_multiplied)
    assert v.status == "error" and "K=5, V=7" in v.message


# ---- exercise 2: the UT transform -----------------------------------------------------------

def ut_forward_substitution(M0, k, v, beta, alpha):
    """Row by row: u_t = beta_t (v_t - A_t M0 k_t - sum_{j<t} (A_t/A_j) (k_j.k_t) u_j), A_t/A_j = e^{g_t - g_j}."""
    g = torch.log(alpha).clamp_min(-60.0).cumsum(dim=-1)
    U = []
    for t in range(k.shape[2]):
        r = v[:, :, t] - torch.exp(g[:, :, t, None]) * mv(M0, k[:, :, t])
        for j in range(t):
            w = torch.exp(g[:, :, t] - g[:, :, j]) * (k[:, :, j] * k[:, :, t]).sum(-1)
            r = r - w[..., None] * U[j]
        U.append(beta[:, :, t, None] * r)
    return torch.stack(U, dim=2)


def ut_variant(diagonal=False, gates=True, transposed=False, rhs_decay=True, rhs_beta=True):
    def solve(M0, k, v, beta, alpha):
        n = k.shape[2]
        g = torch.log(alpha).clamp_min(-60.0).cumsum(-1) if gates else torch.zeros_like(alpha)
        diff = g[..., :, None] - g[..., None, :]
        Gamma = torch.exp((-diff if transposed else diff).tril(0 if diagonal else -1)).tril(0 if diagonal else -1)
        system = torch.eye(n) + beta[..., None] * Gamma * (k @ k.transpose(-1, -2))
        decay = torch.exp(torch.log(alpha).clamp_min(-60.0).cumsum(-1)) if rhs_decay else torch.ones_like(alpha)
        rhs = v - decay[..., None] * (k @ M0.transpose(-1, -2))
        rhs = beta[..., None] * rhs if rhs_beta else rhs
        return torch.linalg.solve(system, rhs)
    return solve


def test_ut_solve_passes_correct_answers():
    for fn in (ut_forward_substitution, ut_variant()):
        v = ch02.ut_solve.evaluate(fn)
        assert v.status == "passed" and v.earned == 3, v.message


@pytest.mark.parametrize("kw", [dict(diagonal=True), dict(gates=False), dict(transposed=True),
                                dict(rhs_decay=False), dict(rhs_beta=False)],
                         ids=["diagonal_kept", "no_gates_in_Gamma", "Gamma_transposed", "no_A_on_M0", "no_beta_on_rhs"])
def test_ut_solve_rejects_typical_mistakes(kw):
    v = ch02.ut_solve.evaluate(ut_variant(**kw))
    assert v.status == "failed" and "U: relative RMSE" in v.message and "chunk length b=" in v.message


def test_ut_solve_rejects_gamma_masked_after_the_exponential_or_built_from_products():
    """The statement: Gamma_tj = e^{g_t - g_j}, masked before exponentiating. A 0/1 mask after exp, or A_t / A_j
    from the running products, is right until a chunk of strong gates overflows (inf * 0) or underflows (0 / 0)."""
    def solve(gamma):
        def ut(M0, k, v, beta, alpha):
            b = k.shape[2]
            system = torch.eye(b) + beta[..., None] * gamma(alpha, b) * (k @ k.transpose(-1, -2))
            rhs = v - torch.exp(torch.log(alpha).clamp_min(-60.0).cumsum(-1))[..., None] * (k @ M0.transpose(-1, -2))
            return torch.linalg.solve(system, beta[..., None] * rhs)      # reads the upper triangle too
        return ut

    def strict(b):
        return torch.ones(b, b, dtype=torch.bool).tril(-1)

    def masked_before(alpha, b):
        g = torch.log(alpha).clamp_min(-60.0).cumsum(-1)
        return torch.exp((g[..., :, None] - g[..., None, :]).masked_fill(~strict(b), -math.inf))

    def masked_after(alpha, b):
        g = torch.log(alpha).cumsum(-1)
        return torch.exp(g[..., :, None] - g[..., None, :]) * strict(b)

    def ratio_of_products(alpha, b):
        A = torch.cumprod(alpha, -1)
        return A[..., :, None] / A[..., None, :] * strict(b)

    assert ch02.ut_solve.evaluate(solve(masked_before)).status == "passed"
    for wrong in (masked_after, ratio_of_products):
        v = ch02.ut_solve.evaluate(solve(wrong))
        assert v.status == "failed" and "NaN" in v.message and "gates in [0.01, 0.05]" in v.message, v.message


# ---- exercise 3: the chunkwise pass ----------------------------------------------------------

def chunkwise_library(q, k, v, beta, alpha, chunk_size):
    return delta_rule(q, k, v, beta, alpha=alpha, output_final_state=True, backend="chunk", chunk_size=chunk_size)


def chunkwise_by_steps(global_gate=False, reset_state=False):
    """A chunk loop over the library's chunk_step, optionally with a planted mistake."""
    def run(q, k, v, beta, alpha, chunk_size):
        B, H, T, K = q.shape
        M = q.new_zeros(B, H, v.shape[-1], K)
        logs = None if alpha is None else torch.log(alpha).clamp_min(-60.0)
        outs = []
        for s in range(0, T, chunk_size):
            e = min(s + chunk_size, T)
            g = None if logs is None else (logs.cumsum(-1)[:, :, s:e] if global_gate else logs[:, :, s:e].cumsum(-1))
            o, M_next = library_chunk_step(M, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e], g)
            M = torch.zeros_like(M_next) if reset_state else M_next
            outs.append(o)
        return torch.cat(outs, 2), M_next
    return run


def test_chunkwise_passes_correct_answers():
    for fn in (chunkwise_library, chunkwise_by_steps()):
        v = ch02.chunkwise.evaluate(fn)
        assert v.status == "passed" and v.earned == 3, v.message


def test_chunkwise_rejects_gate_not_restarted_and_state_not_carried():
    v = ch02.chunkwise.evaluate(chunkwise_by_steps(global_gate=True))
    assert v.status == "failed" and "scalar gates in " in v.message and "chunk_size=" in v.message
    v = ch02.chunkwise.evaluate(chunkwise_by_steps(reset_state=True))
    assert v.status == "failed" and "chunk_size=" in v.message


def test_chunkwise_rejects_hebbian_writes_and_missing_none_case():
    from atlaslib.linear import linear_attention

    def hebbian(q, k, v, beta, alpha, chunk_size):        # writes beta v k^T: linear attention, not the delta rule
        return linear_attention(q, k, v * beta[..., None], alpha=alpha, output_final_state=True)
    assert ch02.chunkwise.evaluate(hebbian).status == "failed"

    def gates_required(q, k, v, beta, alpha, chunk_size):
        return chunkwise_library(q, k, v, beta, alpha.clone(), chunk_size)
    v = ch02.chunkwise.evaluate(gates_required)
    assert v.status == "error" and "alpha=None" in v.message and "AttributeError" in v.message


# ---- exercise 4: KDA as a proximal step ------------------------------------------------------

def prox_least_squares(M_prev, k, v, alpha, eta):
    """The objective is 1/2 || M [k, I/sqrt(eta)] - [v, M'/sqrt(eta)] ||_F^2: a least-squares problem."""
    M_faded = M_prev * alpha[:, :, None, :]
    r = eta.rsqrt()[:, :, None, None]
    X = torch.cat([k[..., :, None], r * torch.eye(k.shape[-1]).expand(*k.shape[:2], -1, -1)], dim=-1)   # [B,H,K,K+1]
    Y = torch.cat([v[..., :, None], r * M_faded], dim=-1)                                            # [B,H,V,K+1]
    # M X = Y in the least-squares sense  <=>  X^T M^T = Y^T
    return torch.linalg.lstsq(X.transpose(-1, -2), Y.transpose(-1, -2)).solution.transpose(-1, -2)


def beta_ok(eta, k):
    return eta / (1 + eta * (k * k).sum(-1))


def blog_beta(eta, k):
    return eta / (1 + eta)


def kda_step_with(beta_fn):
    def step(M_prev, k, v, alpha, eta):
        M_faded = M_prev * alpha[:, :, None, :]
        b = beta_fn(eta, k)[:, :, None, None]
        return M_faded - b * outer(mv(M_faded, k) - v, k)
    return step


def test_kda_beta_passes_correct_answers():
    for prox in (prox_least_squares, kda_step_with(beta_ok)):
        v = ch02.kda_beta.evaluate(prox, beta_ok)
        assert v.status == "passed" and v.earned == 2, v.message


def test_kda_beta_rejects_the_unit_key_formula():
    v = ch02.kda_beta.evaluate(prox_least_squares, blog_beta)
    assert v.status == "failed" and "kda_beta, " in v.message and "key norms in [0.5, 3.0]" in v.message
    v = ch02.kda_beta.evaluate(kda_step_with(blog_beta), beta_ok)
    assert v.status == "failed" and "prox_step, " in v.message and "M: relative RMSE" in v.message


@pytest.mark.parametrize("wrong", [
    lambda M_prev, k, v, alpha, eta: prox_least_squares(M_prev, k, v, torch.ones_like(alpha), eta),     # no decay
    lambda M_prev, k, v, alpha, eta: prox_least_squares(M_prev, k, v, alpha, 1 / eta),                  # eta inverted
    lambda M_prev, k, v, alpha, eta: prox_least_squares(M_prev, k, v, alpha.mean(-1, keepdim=True).expand_as(alpha),
                                                        eta),                                           # a scalar gate
], ids=["no_decay", "eta_inverted", "scalar_gate"])
def test_kda_beta_rejects_wrong_proximal_steps(wrong):
    v = ch02.kda_beta.evaluate(wrong, beta_ok)
    assert v.status == "failed" and "prox_step" in v.message


# ---- exercise 5: the Triton kernel ----------------------------------------------------------

@triton.jit
def chunk_matrix_variants(k_ptr, beta_ptr, g_ptr, out_ptr, n, K, BT: tl.constexpr, BK: tl.constexpr,
                          MASK_LOADS: tl.constexpr, MASK_STORE: tl.constexpr, DIAGONAL: tl.constexpr,
                          BETA_OF_COLUMN: tl.constexpr, LOWER_STORE_ONLY: tl.constexpr, EXP_THEN_MASK: tl.constexpr):
    """A written without tl.dot (broadcast and sum), with switchable mistakes."""
    i = tl.program_id(0).to(tl.int64)
    r, c = tl.arange(0, BT), tl.arange(0, BK)
    if MASK_LOADS:
        m_r, m_c = r < n, c < K
    else:
        m_r, m_c = r < BT, c < BK
    k = tl.load(k_ptr + i * n * K + r[:, None] * K + c[None, :], mask=m_r[:, None] & m_c[None, :], other=0.0)
    g = tl.load(g_ptr + i * n + r, mask=r < n, other=0.0)
    beta = tl.load(beta_ptr + i * n + r, mask=r < n, other=0.0)
    kk = tl.sum(k[:, None, :] * k[None, :, :], axis=2)
    if DIAGONAL:
        below = r[:, None] >= r[None, :]
    else:
        below = r[:, None] > r[None, :]
    if EXP_THEN_MASK:                                   # exp overflows above the diagonal: inf * 0 = NaN
        A = kk * (tl.exp(g[:, None] - g[None, :]) * below)
    else:
        A = tl.where(below, kk * tl.exp(tl.where(below, g[:, None] - g[None, :], 0.0)), 0.0)
    if BETA_OF_COLUMN:
        A = A * beta[None, :]
    else:
        A = A * beta[:, None]
    if MASK_STORE:
        m_out = (r < n)[:, None] & (r < n)[None, :]
    else:
        m_out = (r < n)[:, None] & (r < BT)[None, :]
    if LOWER_STORE_ONLY:
        m_out = m_out & (r[:, None] > r[None, :])
    tl.store(out_ptr + i * n * n + r[:, None] * n + r[None, :], A, mask=m_out)


def chunk_matrix_launcher(mask_loads=True, mask_store=True, diagonal=False, beta_of_column=False,
                          lower_store_only=False, exp_then_mask=False):
    def launch(k, beta, g, out):
        N, n, K = k.shape
        BT, BK = (max(16, triton.next_power_of_2(x)) for x in (n, K))
        chunk_matrix_variants[(N,)](k, beta, g, out, n, K, BT=BT, BK=BK, MASK_LOADS=mask_loads, MASK_STORE=mask_store,
                                    DIAGONAL=diagonal, BETA_OF_COLUMN=beta_of_column, LOWER_STORE_ONLY=lower_store_only,
                                    EXP_THEN_MASK=exp_then_mask)
        return out
    return launch


def test_triton_check_passes_a_correct_kernel():
    v = ch02.triton_chunk_matrix.evaluate(chunk_matrix_launcher())
    assert v.status == "passed" and v.earned == 3, v.message


def test_triton_check_catches_unmasked_loads():
    v = ch02.triton_chunk_matrix.evaluate(chunk_matrix_launcher(mask_loads=False))
    assert v.status == "failed" and "loaded" in v.message and "mask every load" in v.message


def test_triton_check_catches_stores_past_the_end():
    v = ch02.triton_chunk_matrix.evaluate(chunk_matrix_launcher(mask_store=False))
    assert v.status == "failed" and "wrote" in v.message


def test_triton_check_catches_zeros_never_written():
    v = ch02.triton_chunk_matrix.evaluate(chunk_matrix_launcher(lower_store_only=True))
    assert v.status == "failed" and "NaN" in v.message and "never stored" in v.message, v.message
    assert "0/0" not in v.message, v.message          # a kernel's output: the torch-code guess does not apply


@pytest.mark.parametrize("kw", [dict(diagonal=True), dict(beta_of_column=True)], ids=["diagonal", "beta_of_column"])
def test_triton_check_catches_wrong_entries(kw):
    v = ch02.triton_chunk_matrix.evaluate(chunk_matrix_launcher(**kw))
    assert v.status == "failed" and "relative RMSE" in v.message


def test_triton_check_catches_a_mask_applied_after_exp():
    """A 0/1 mask multiplied after tl.exp: with strong gates exp(g_t - g_j) overflows above the diagonal."""
    v = ch02.triton_chunk_matrix.evaluate(chunk_matrix_launcher(exp_then_mask=True))
    assert v.status == "failed" and "NaN" in v.message and "before tl.exp" in v.message, v.message


# ---- exercise 6: the backward of the WY solve -----------------------------------------------

def wy_by_inverse(L, beta, Z, dX):
    """From the explicit inverse R: dZ = R^T dX, dL = -tril(Diag(beta) dZ X^T, -1), dbeta_t = -dz_t.(L X)_t."""
    R = torch.linalg.inv(torch.eye(L.shape[-1]) + beta[..., None] * L)
    X = R @ Z
    dZ = R.transpose(-1, -2) @ dX
    return -(beta[..., None] * dZ @ X.transpose(-1, -2)).tril(-1), -(dZ * (L @ X)).sum(-1), dZ


def wy_by_back_substitution(L, beta, Z, dX):
    """Row by row, last row first: the transposed system (I + Diag(beta) L)^T dZ = dX is upper-triangular."""
    A = beta[..., None] * L                                  # strictly lower
    X = []
    for t in range(L.shape[-1]):                             # forward substitution for X
        earlier = (A[..., t, j, None] * X[j] for j in range(t))
        X.append(Z[..., t, :] - sum(earlier, torch.zeros_like(Z[..., t, :])))
    X = torch.stack(X, dim=-2)
    n = L.shape[-1]
    dZ = [None] * n
    for t in reversed(range(n)):                             # dz_t = dx_t - sum_{i>t} A_it dz_i
        later = (A[..., i, t, None] * dZ[i] for i in range(t + 1, n))
        dZ[t] = dX[..., t, :] - sum(later, torch.zeros_like(dX[..., t, :]))
    dZ = torch.stack(dZ, dim=-2)
    dL = torch.zeros_like(L)
    for t in range(n):
        for j in range(t):
            dL[..., t, j] = -beta[..., t] * (dZ[..., t, :] * X[..., j, :]).sum(-1)
    return dL, -(dZ * (L @ X)).sum(-1), dZ


def test_wy_backward_passes_correct_answers():
    for fn in (wy_by_inverse, wy_by_back_substitution):
        v = ch02.wy_backward.evaluate(fn)
        assert v.status == "passed" and v.earned == v.points == 3, v.message


def wy_variant(transposed_solve=True, beta_in_dL=True, masked=True, dL_transposed=False, dbeta_sign=-1.0,
               dbeta_of_X=False):
    def backward(L, beta, Z, dX):
        system = torch.eye(L.shape[-1]) + beta[..., None] * L
        X = torch.linalg.solve_triangular(system, Z, upper=False, unitriangular=True)
        if transposed_solve:
            dZ = torch.linalg.solve_triangular(system.transpose(-1, -2), dX, upper=True, unitriangular=True)
        else:                                                # R dX instead of R^T dX
            dZ = torch.linalg.solve_triangular(system, dX, upper=False, unitriangular=True)
        outer = X @ dZ.transpose(-1, -2) if dL_transposed else dZ @ X.transpose(-1, -2)
        dL = -(beta[..., None] * outer if beta_in_dL else outer)
        dL = dL.tril(-1) if masked else dL
        dbeta = dbeta_sign * (dZ * (X if dbeta_of_X else L @ X)).sum(-1)
        return dL, dbeta, dZ
    return backward


def test_wy_variant_with_no_mistake_passes():
    assert ch02.wy_backward.evaluate(wy_variant()).status == "passed"


@pytest.mark.parametrize("kw, where", [
    (dict(transposed_solve=False), "dZ"),
    (dict(beta_in_dL=False), "dL"),
    (dict(masked=False), "dL"),
    (dict(dL_transposed=True), "dL"),
    (dict(dbeta_sign=1.0), "dbeta"),
    (dict(dbeta_of_X=True), "dbeta"),
], ids=["R_not_RT", "no_beta_in_dL", "dL_not_masked", "dL_transposed", "dbeta_sign", "dbeta_without_L"])
def test_wy_backward_rejects_typical_mistakes(kw, where):
    v = ch02.wy_backward.evaluate(wy_variant(**kw))
    assert v.status == "failed" and f"{where}: relative RMSE" in v.message and "chunk length b=" in v.message, v.message


def wy_by_autograd(L, beta, Z, dX):
    L, beta, Z = (x.clone().requires_grad_(True) for x in (L, beta, Z))
    X = torch.linalg.solve_triangular(torch.eye(L.shape[-1]) + beta[..., None] * L.tril(-1), Z, upper=False,
                                      unitriangular=True)
    return torch.autograd.grad((X * dX).sum(), (L, beta, Z))


def wy_by_backward_call(L, beta, Z, dX):
    L, beta, Z = (x.clone().requires_grad_(True) for x in (L, beta, Z))
    X = torch.linalg.solve_triangular(torch.eye(L.shape[-1]) + beta[..., None] * L.tril(-1), Z, upper=False,
                                      unitriangular=True)
    (X * dX).sum().backward()
    return L.grad, beta.grad, Z.grad


@pytest.mark.library_rules
def test_wy_backward_refuses_autograd():
    for fn, name in ((wy_by_autograd, "torch.autograd.grad"), (wy_by_backward_call, "torch.autograd.backward")):
        v = ch02.wy_backward.evaluate(fn)
        assert v.status == "failed" and f"your answer calls {name}" in v.message, v.message
    x = torch.ones(2, requires_grad=True)                    # autograd works again after the check
    (g,) = torch.autograd.grad((x * x).sum(), x)
    assert torch.equal(g, 2 * torch.ones(2))
    assert ch02.wy_backward.evaluate(wy_by_inverse).status == "passed"


def wy_by_forward_mode(L, beta, Z, dX):
    """The vector-Jacobian product through forward-mode Jacobians (torch.func.jacfwd: make_dual inside)."""
    def loss(L, beta, Z):
        X = torch.linalg.solve_triangular(torch.eye(L.shape[-1]) + beta[..., None] * L.tril(-1), Z, upper=False,
                                          unitriangular=True)
        return (X * dX).sum()
    return torch.func.jacfwd(loss, argnums=(0, 1, 2))(L, beta, Z)


def gradient_by_autograd(M, k, v):
    M = M.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(0.5 * (mv(M, k) - v).square().sum(), M)
    return g


@pytest.mark.library_rules
def test_the_gradient_exercises_refuse_autograd_in_every_mode():
    """Forward mode (jacfwd) is autograd too, and the delta rule's gradient is derived by hand as well."""
    v = ch02.wy_backward.evaluate(wy_by_forward_mode)
    assert v.status == "failed" and "your answer calls torch.autograd.forward_ad.make_dual" in v.message, v.message
    v = ch02.delta_step.evaluate(gradient_by_autograd, step_explicit)
    assert v.status == "failed" and "your answer calls torch.autograd.grad" in v.message, v.message
    assert ch02.delta_step.evaluate(gradient_ok, step_explicit).status == "passed"


# ---- the grader on chapter 2 ------------------------------------------------------------------

def test_solutions_score_full_marks():
    assert_full_marks(SOLUTION, POINTS, TIMEOUT)


def test_untouched_student_notebook_scores_zero_via_cli():
    assert_student_scores_zero(STUDENT, POINTS, TIMEOUT)


def test_planted_unit_key_beta_loses_exactly_its_points(tmp_path):
    row = assert_planted_loses_its_points(SOLUTION, tmp_path, "kda_beta", "return eta / (1.0 + eta)", POINTS)
    assert "key norms" in row["verdict"], row


@pytest.mark.library_rules
def test_planted_autograd_answer_loses_exactly_its_points(tmp_path):
    body = ("L, beta, Z = (x.clone().requires_grad_(True) for x in (L, beta, Z))\n"
            "    X = torch.linalg.solve_triangular(torch.eye(L.shape[-1]) + beta[..., None] * L, Z, upper=False, "
            "unitriangular=True)\n"
            "    return torch.autograd.grad((X * dX).sum(), (L, beta, Z))")
    row = assert_planted_loses_its_points(SOLUTION, tmp_path, "wy_solve_backward", body, POINTS, exercise="wy_backward")
    assert "torch.autograd.grad" in row["verdict"], row
