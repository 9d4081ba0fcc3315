"""Chapter 5's graded exercises: every check passes a correct answer and rejects typical mistakes,
and the grader gives the solutions full marks, the student copy zero, and a planted wrong
answer exactly its exercise's points less.

The correct answers here are written from the math or the library, not copied from
exercises/solutions/ch05_atlas.ipynb. TRITON_INTERPRET=1 is set by conftest.py before
triton is imported.
"""

import pytest
import torch
import triton
import triton.language as tl

from atlaslib.atlas import atlas_step, newton_schulz, start_state
from atlaslib.exercises import ch05, registry
from grading_helpers import (TIMEOUT, assert_full_marks, assert_planted_loses_its_points, assert_student_scores_zero,
                             chapter_notebooks)

SOLUTION, STUDENT = chapter_notebooks("ch05_atlas")
POINTS = {e.name: e.points for e in registry("ch05")}


def test_registered_with_at_least_four_exercises():
    assert list(POINTS) == ["ns_step", "ns_polynomial", "atlas_step", "momenta", "triton_ns_step"]
    assert sum(POINTS.values()) == 12


# ---- exercise 1: one Newton-Schulz step -----------------------------------------------------------

def ns_step_right_gram(G, coeffs, norm=None, batch_norm=False, gram_left=False, eps=1e-7):
    """X -> a X + b X (X^T X) + c X (X^T X)^2 (the other Gram matrix: the same map), with switchable slips."""
    a, b, c = coeffs
    if batch_norm:
        scale = G.norm()                                                   # one norm for the whole batch
    elif norm == "spectral":
        scale = torch.linalg.matrix_norm(G, ord=2, keepdim=True)
    elif norm == "none":
        scale = 1.0
    else:
        scale = torch.linalg.matrix_norm(G, keepdim=True) + eps
    X = G / scale
    if gram_left:                                                          # (X^T X) X: only square matrices
        A = X.transpose(-1, -2) @ X
        return a * X + (b * A + c * A @ A) @ X
    A = X.transpose(-1, -2) @ X
    return a * X + X @ (b * A + c * A @ A)


def test_ns_step_passes_correct_answers():
    for fn in (lambda G, c: newton_schulz(G, 1, c), ns_step_right_gram):
        v = ch05.ns_step.evaluate(fn)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("kw", [dict(batch_norm=True), dict(norm="spectral"), dict(norm="none")],
                         ids=["one_norm_per_batch", "spectral_norm", "no_normalisation"])
def test_ns_step_rejects_wrong_normalisation(kw):
    v = ch05.ns_step.evaluate(lambda G, c: ns_step_right_gram(G, c, **kw))
    assert v.status == "failed" and "NS_1(G): relative RMSE" in v.message, v.message


def test_ns_step_rejects_a_normalisation_without_eps():
    """Invisible on matrices of norm 0.6 to 60; the check's all-zero matrix makes it 0/0."""
    v = ch05.ns_step.evaluate(lambda G, c: ns_step_right_gram(G, c, eps=0.0))
    assert v.status == "failed" and "is all zero" in v.message and "||X||_F + eps" in v.message, v.message


def test_ns_step_rejects_reversed_coefficients_and_the_wrong_gram():
    v = ch05.ns_step.evaluate(lambda G, c: ns_step_right_gram(G, c[::-1]))
    assert v.status == "failed" and "relative RMSE" in v.message, v.message
    v = ch05.ns_step.evaluate(lambda G, c: ns_step_right_gram(G, c, gram_left=True))
    assert v.status == "error" and "5 x 7 (wide)" in v.message, v.message       # shapes do not match


# ---- exercise 2: the polynomial on the singular values ----------------------------------------------

def singular_values_by_library(sigma, steps, coeffs):
    """NS_J of diag(sigma) itself: its diagonal holds the answer, in order."""
    return torch.diagonal(newton_schulz(torch.diag(sigma), steps, coeffs))


def singular_values_scalar(sigma, steps, coeffs, norm="frobenius", even=False, always_once=False,
                           normalise_at_zero=False, eps=1e-7):
    a, b, c = coeffs
    if steps == 0 and not normalise_at_zero:
        return sigma
    s = sigma / (sigma.max() if norm == "max" else sigma.square().sum().sqrt() + eps)
    for _ in range(1 if always_once else steps):
        s = (a + b * s**2 + c * s**4) if even else (a * s + b * s**3 + c * s**5)
    return s


def test_ns_polynomial_passes_correct_answers():
    for fn in (singular_values_by_library, singular_values_scalar):
        v = ch05.ns_polynomial.evaluate(fn)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("kw, where", [
    (dict(norm="max"), "the singular values: relative RMSE"),            # sigma_max, not the Frobenius norm
    (dict(even=True), "the singular values: relative RMSE"),             # p(sigma^2) without the odd factor
    (dict(always_once=True), "J=5"),                                      # one step whatever J
    (dict(normalise_at_zero=True), "J=0"),                                # NS_0 is the identity
], ids=["max_norm", "even_polynomial", "one_step", "normalised_at_J0"])
def test_ns_polynomial_rejects_typical_mistakes(kw, where):
    v = ch05.ns_polynomial.evaluate(lambda s, k, c: singular_values_scalar(s, k, c, **kw))
    assert v.status == "failed" and where in v.message, v.message


def test_ns_polynomial_names_a_missing_epsilon():
    """Dividing by ||sigma|| alone moves every value by about 1e-7, over the 1e-8 tolerance: say why."""
    v = ch05.ns_polynomial.evaluate(lambda s, k, c: singular_values_scalar(s, k, c, eps=0.0))
    assert v.status == "failed" and "divides by ||G||_F + eps with eps = 1e-7" in v.message, v.message
    v = ch05.ns_polynomial.evaluate(lambda s, k, c: singular_values_scalar(s, k, c, norm="max"))
    assert "eps = 1e-7" not in v.message, v.message                      # other mistakes: no such hint


@pytest.mark.parametrize("eps", [0.0, 1e-8, 1e-6])
def test_ns_polynomial_blames_the_epsilon_not_float32(eps):
    """Another eps moves the values by about float32's rounding: the message names the eps it found, and not
    a float32 tensor the answer never made."""
    v = ch05.ns_polynomial.evaluate(lambda s, k, c: singular_values_scalar(s, k, c, eps=eps))
    used = "sigma / ||sigma||" if eps == 0 else f"sigma / (||sigma|| + {eps:g})"
    assert v.status == "failed" and f"polynomial on {used} exactly" in v.message, v.message
    assert "float32 tensor" not in v.message, v.message


def test_ns_polynomial_names_a_second_normalisation():
    """Normalising the spectrum twice moves every value by about 1e-7, as float32 would: say which it is."""
    def twice(sigma, steps, coeffs):
        once = sigma / (sigma.norm() + 1e-7)
        return singular_values_scalar(once, steps, coeffs) if steps else sigma
    v = ch05.ns_polynomial.evaluate(twice)
    assert v.status == "failed" and "normalised twice" in v.message, v.message
    assert "float32 tensor" not in v.message, v.message


def test_ns_polynomial_rejects_sorted_values():
    v = ch05.ns_polynomial.evaluate(lambda s, k, c: singular_values_scalar(s, k, c).sort(descending=True).values)
    assert v.status == "failed", v.message


# ---- exercise 3: one ATLAS step -------------------------------------------------------------------

def step_by_library(M, S, k, v, alpha, eta, theta, ns_steps):
    state, _ = atlas_step(start_state(M, S), k, k, v, 1, None, alpha, eta, theta, ns_steps)
    return state.M, state.S


def step_by_autograd(M, S, k, v, alpha, eta, theta, ns_steps, sign=1.0, grad_at_alpha_M=False,
                     ns_on_gradient=False, eta_inside=False):
    e = lambda x: x[..., None, None]                                      # noqa: E731  [B, H] -> factor of [B, H, V, D]
    at = (e(alpha) * M if grad_at_alpha_M else M).clone().requires_grad_(True)
    loss = 0.5 * (torch.einsum("bhvd,bhd->bhv", at, k) - v).square().sum()
    (grad,) = torch.autograd.grad(loss, at)
    if eta_inside:                                                        # Titans' buffer, then NS erases eta
        S_t = e(theta) * S - e(eta) * grad
        return e(alpha) * M + newton_schulz(S_t, ns_steps), S_t
    S_t = e(theta) * S + sign * grad
    direction = newton_schulz(grad if ns_on_gradient else S_t, ns_steps)
    return e(alpha) * M - e(eta) * direction, S_t


def test_atlas_step_passes_correct_answers():
    for fn in (step_by_library, step_by_autograd):
        v = ch05.atlas_step.evaluate(fn)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("kw, where", [
    (dict(sign=-1.0), "S_t: relative RMSE"),                              # [A] Table 1: gradient ascent
    (dict(grad_at_alpha_M=True), "S_t: relative RMSE"),                   # the gradient after the decay
    (dict(ns_on_gradient=True), "M_t: relative RMSE"),                    # NS as a preconditioner, momentum unused
    (dict(eta_inside=True), "relative RMSE"),                             # eta inside NS: erased
], ids=["table1_ascent", "gradient_at_alpha_M", "ns_on_gradient", "eta_inside"])
def test_atlas_step_rejects_typical_mistakes(kw, where):
    v = ch05.atlas_step.evaluate(lambda *a: step_by_autograd(*a, **kw))
    assert v.status == "failed" and where in v.message, v.message


def test_atlas_step_rejects_transposed_gradient_and_fp32():
    def transposed(M, S, k, v, alpha, eta, theta, ns_steps):              # k (Mk - v)^T: [D, V]
        grad = k[..., :, None] * (torch.einsum("bhvd,bhd->bhv", M, k) - v)[..., None, :]
        S_t = theta[..., None, None] * S + grad
        return alpha[..., None, None] * M - eta[..., None, None] * newton_schulz(S_t, ns_steps), S_t
    v = ch05.atlas_step.evaluate(transposed)
    assert v.status == "error" and "D=5, V=7" in v.message, v.message

    def in_fp32(M, S, k, v, alpha, eta, theta, ns_steps):
        out = step_by_library(*(x.float() for x in (M, S, k, v, alpha, eta, theta)), ns_steps)
        return tuple(x.double() for x in out)
    assert ch05.atlas_step.evaluate(in_fp32).status == "failed"


def test_atlas_step_names_a_float32_newton_schulz():
    """S_t exact, only Newton-Schulz run in float32 and cast back: the dtype is right, M_t is off by float32's
    rounding (about 1e-7), which the 1e-8 of the check must catch and name."""
    def ns_in_float32(M, S, k, v, alpha, eta, theta, ns_steps):
        e = lambda x: x[..., None, None]                                  # noqa: E731
        S_t = e(theta) * S + (torch.einsum("bhvd,bhd->bhv", M, k) - v)[..., :, None] * k[..., None, :]
        return e(alpha) * M - e(eta) * newton_schulz(S_t.float(), ns_steps).double(), S_t
    v = ch05.atlas_step.evaluate(ns_in_float32)
    assert v.status == "failed" and "M_t: relative RMSE" in v.message and "float32's rounding" in v.message, v.message


def test_atlas_step_names_another_epsilon_in_newton_schulz():
    """All in float64, Newton-Schulz normalised by ||S_t|| + 1e-5: the hint names the eps as a possible cause."""
    def other_eps(M, S, k, v, alpha, eta, theta, ns_steps):
        e = lambda x: x[..., None, None]                                  # noqa: E731
        S_t = e(theta) * S + (torch.einsum("bhvd,bhd->bhv", M, k) - v)[..., :, None] * k[..., None, :]
        n = S_t.square().sum(dim=(-2, -1), keepdim=True).sqrt()
        X = S_t * (n + 1e-7) / (n + 1e-5)                                 # NS_J(X) = NS_J(S_t / (||S_t|| + 1e-5))
        return e(alpha) * M - e(eta) * newton_schulz(X, ns_steps), S_t
    v = ch05.atlas_step.evaluate(other_eps)
    assert v.status == "failed" and "M_t: relative RMSE" in v.message, v.message
    assert "something other than ||S_t||_F + 1e-7" in v.message, v.message


# ---- exercise 4: the chunk's momenta ----------------------------------------------------------------

def momenta_loop(S0, grad, theta):
    S, out = S0, []
    for t in range(grad.shape[1]):
        S = theta[:, t, None, None] * S + grad[:, t]
        out.append(S)
    return torch.stack(out, 1)


def momenta_masked(S0, grad, theta, quotients=False, clamp=True, shift=False, no_start=False):
    N, n, V, D = grad.shape
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if quotients:                                                         # B_t / B_i from cumulative products
        Bc = theta.cumprod(-1)
        ratios = (Bc[:, :, None] / Bc[:, None, :]) * causal
        start = Bc
    else:
        h = torch.log(theta.clamp_min(1e-26) if clamp else theta).cumsum(-1)
        if shift:                                                         # theta_i counted in its own term
            ratios = torch.exp((h[:, :, None] - h[:, None, :] + torch.log(theta.clamp_min(1e-26))[:, None, :])
                               .masked_fill(~causal, float("-inf")))
        else:
            ratios = torch.exp((h[:, :, None] - h[:, None, :]).masked_fill(~causal, float("-inf")))
        start = torch.exp(h)
    S = torch.einsum("nti,nivd->ntvd", ratios, grad)
    return S if no_start else S + start[:, :, None, None] * S0[:, None]


def test_momenta_passes_correct_answers():
    for fn in (momenta_loop, momenta_masked):
        v = ch05.momenta.evaluate(fn)
        assert v.status == "passed" and v.earned == 3, v.message


@pytest.mark.parametrize("kw, where", [
    (dict(quotients=True), "NaN"),                                      # 0/0: a reset, or products that underflow
    (dict(clamp=False), "exactly 0"),                                    # log 0 - log 0 = NaN
    (dict(shift=True), "S: relative RMSE"),                              # B_t / B_{i-1}
    (dict(no_start=True), "S: relative RMSE"),                           # the carried momentum forgotten
], ids=["quotients", "log_zero", "off_by_one", "no_S0"])
def test_momenta_rejects_typical_mistakes(kw, where):
    v = ch05.momenta.evaluate(lambda *a: momenta_masked(*a, **kw))
    assert v.status == "failed" and where in v.message, v.message


def test_momenta_asks_for_every_momentum():
    v = ch05.momenta.evaluate(lambda S0, grad, theta: momenta_loop(S0, grad, theta)[:, -1])
    assert v.status == "failed" and "that is one momentum" in v.message, v.message


# ---- exercise 5: the Triton kernel ------------------------------------------------------------------

@triton.jit
def ns_variants(x_ptr, o_ptr, R, C, a, b, c, BR: tl.constexpr, BC: tl.constexpr, MASK_LOADS: tl.constexpr,
                MASK_STORE: tl.constexpr, NORMALISE: tl.constexpr, NORM_OF_ROWS: tl.constexpr, EPS: tl.constexpr):
    """One NS step written with broadcast-and-sum (no tl.dot), with switchable mistakes."""
    i = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BR)
    s = tl.arange(0, BC)
    if MASK_LOADS:
        m = (r < R)[:, None] & (s < C)[None, :]
    else:
        m = (r < BR)[:, None] & (s < BC)[None, :]
    x = tl.load(x_ptr + i * R * C + r[:, None] * C + s[None, :], mask=m, other=0.0)
    if NORMALISE:
        if NORM_OF_ROWS:                                                 # each row on its own
            x = x / (tl.sqrt(tl.sum(x * x, axis=1))[:, None] + 1e-7)
        else:
            x = x / (tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0)) + EPS)
    A = tl.sum(x[:, None, :] * x[None, :, :], axis=2)                     # X X^T [BR, BR]
    A2 = tl.sum(A[:, :, None] * A[None, :, :], axis=1)
    P = b * A + c * A2
    y = a * x + tl.sum(P[:, :, None] * x[None, :, :], axis=1)
    if MASK_STORE:
        m_out = (r < R)[:, None] & (s < C)[None, :]
    else:
        m_out = (r < R)[:, None] & (s < BC)[None, :]
    tl.store(o_ptr + i * R * C + r[:, None] * C + s[None, :], y, mask=m_out)


def ns_launcher(mask_loads=True, mask_store=True, normalise=True, norm_of_rows=False, eps=1e-7):
    def launch(X, out, coeffs):
        N, R, C = X.shape
        BR, BC = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(C))
        ns_variants[(N,)](X, out, R, C, *coeffs, BR=BR, BC=BC, MASK_LOADS=mask_loads, MASK_STORE=mask_store,
                          NORMALISE=normalise, NORM_OF_ROWS=norm_of_rows, EPS=eps)
        return out
    return launch


def test_triton_check_passes_a_correct_kernel():
    v = ch05.triton_ns_step.evaluate(ns_launcher())
    assert v.status == "passed" and v.earned == 3, v.message


def test_triton_check_requires_a_kernel_launch():
    v = ch05.triton_ns_step.evaluate(lambda X, out, coeffs: out.copy_(newton_schulz(X, 1, coeffs)))
    assert v.status == "failed" and "without launching a @triton.jit kernel" in v.message, v.message


def test_triton_check_catches_unmasked_loads():
    v = ch05.triton_ns_step.evaluate(ns_launcher(mask_loads=False))
    assert v.status == "failed" and "loaded" in v.message and "mask every load" in v.message, v.message


def test_triton_check_catches_stores_past_the_end():
    v = ch05.triton_ns_step.evaluate(ns_launcher(mask_store=False))
    assert v.status == "failed" and "wrote" in v.message, v.message


@pytest.mark.parametrize("kw", [dict(normalise=False), dict(norm_of_rows=True)], ids=["no_norm", "row_norms"])
def test_triton_check_catches_wrong_normalisation(kw):
    v = ch05.triton_ns_step.evaluate(ns_launcher(**kw))
    assert v.status == "failed" and "out: relative RMSE" in v.message, v.message


def test_triton_check_catches_a_norm_without_eps():
    """The norm of an all-zero matrix is 0: without eps its step is 0/0."""
    v = ch05.triton_ns_step.evaluate(ns_launcher(eps=0.0))
    assert v.status == "failed" and "NaN" in v.message and "all zero" in v.message, v.message


# ---- the rules: the library's Newton-Schulz is the answer of exercises 1, 2 and 5 ------------------

@pytest.mark.library_rules
def test_answers_that_call_newton_schulz_fail():
    import atlaslib.atlas as atlas_package           # as a notebook reaches it: through a module, not a closure
    v = ch05.ns_step.evaluate(lambda G, c: atlas_package.newton_schulz(G, 1, c))
    assert v.status == "failed" and "your answer calls atlaslib.core.newton_schulz.newton_schulz" in v.message
    v = ch05.ns_polynomial.evaluate(lambda s, k, c: torch.diagonal(atlas_package.newton_schulz(torch.diag(s), k, c)))
    assert v.status == "failed" and "your answer calls" in v.message, v.message
    assert ch05.atlas_step.evaluate(step_by_autograd).status == "passed"      # allowed (and needed) in exercise 3
    v = ch05.atlas_step.evaluate(lambda M, S, k, v, *gates: atlas_package.atlas_step(
        atlas_package.start_state(M, S), k, k, v, 1, None, *gates)[0][:2])
    assert v.status == "failed" and "atlaslib.atlas.recurrent.atlas_step" in v.message, v.message

    import atlaslib.core.chunking as chunking_module

    def momenta_from_library_ratios(S0, grad, theta):
        D, A = chunking_module.chunk_decay(torch.log(theta.clamp_min(1e-26)))
        return torch.einsum("nti,nivd->ntvd", D, grad) + A[..., None, None] * S0[:, None]
    v = ch05.momenta.evaluate(momenta_from_library_ratios)
    assert v.status == "failed" and "atlaslib.core.chunking.chunk_decay" in v.message, v.message


# ---- the grader on chapter 5 ------------------------------------------------------------------------

def test_solutions_score_full_marks():
    assert_full_marks(SOLUTION, POINTS, TIMEOUT)


def test_untouched_student_notebook_scores_zero_via_cli():
    assert_student_scores_zero(STUDENT, POINTS, TIMEOUT)


def test_planted_table1_ascent_loses_exactly_its_points(tmp_path):
    body = ("return (alpha[..., None, None] * M - eta[..., None, None] * newton_schulz(theta[..., None, None] * S - "
            "(torch.einsum('bhvd,bhd->bhv', M, k) - v)[..., :, None] * k[..., None, :], ns_steps), "
            "theta[..., None, None] * S - (torch.einsum('bhvd,bhd->bhv', M, k) - v)[..., :, None] * k[..., None, :])")
    assert_planted_loses_its_points(SOLUTION, tmp_path, "atlas_step", body, POINTS)


# ---- the rules hold however the answer reaches the library, and a kernel must compute the output ------

def test_momenta_names_the_division_by_zero_and_atlas_step_the_dtype():
    v = ch05.momenta.evaluate(lambda *a: momenta_masked(*a, quotients=True))
    assert v.status == "failed" and "a division by zero" in v.message and "never wrote" not in v.message, v.message

    def in_fp32(M, S, k, v, alpha, eta, theta, ns_steps):
        return step_by_library(*(x.float() for x in (M, S, k, v, alpha, eta, theta)), ns_steps)
    v = ch05.atlas_step.evaluate(in_fp32)
    assert v.status == "failed" and "torch.float32" in v.message and "torch.float64" in v.message, v.message


def test_momenta_without_the_clamp_is_told_to_clamp():
    # log-differences, but log 0 = -inf at a restart: -inf - (-inf) is NaN, not a quotient
    v = ch05.momenta.evaluate(lambda *a: momenta_masked(*a, clamp=False))
    assert v.status == "failed" and "clamp theta" in v.message, v.message


@pytest.mark.library_rules
def test_the_named_helper_is_forbidden_however_it_is_reached():
    import functools
    import types

    def by_default(G, coeffs, f=newton_schulz):
        return f(G, 1, coeffs)
    partial = functools.partial(newton_schulz, steps=1)
    held = [newton_schulz]
    copy = types.FunctionType(newton_schulz.__code__, newton_schulz.__globals__, "copy", newton_schulz.__defaults__)

    def make_closure():
        f = newton_schulz
        return lambda G, coeffs: f(G, 1, coeffs)
    answers = [by_default, lambda G, c: partial(G, coeffs=c), lambda G, c: held[0](G, 1, c), make_closure()]
    for answer in answers:
        v = ch05.ns_step.evaluate(answer)
        assert v.status == "failed" and "your answer calls atlaslib.core.newton_schulz.newton_schulz" in v.message, \
            v.message
    # a copy made from the code object runs the original code: only the grader's static rules stop it
    # (``types`` cannot be imported, ``__code__`` cannot be read), see test_grader.py
    assert ch05.ns_step.evaluate(lambda G, c: copy(G, 1, c)).status == "passed"


@triton.jit
def empty_kernel(x_ptr):
    pass


@pytest.mark.library_rules
def test_an_empty_kernel_with_a_torch_result_and_the_library_kernel_fail():
    def after(X, out, coeffs):
        empty_kernel[(1,)](X)
        out.copy_(ns_step_right_gram(X[:, None], coeffs)[:, 0])
        return out

    def before(X, out, coeffs):
        out.copy_(ns_step_right_gram(X[:, None], coeffs)[:, 0])
        empty_kernel[(1,)](X)
        return out
    for answer in (after, before):
        v = ch05.triton_ns_step.evaluate(answer)
        assert v.status == "failed" and "not stored by your @triton.jit kernel" in v.message, v.message

    def overwritten(X, out, coeffs):                 # the kernel computes, then torch replaces its result
        ns_launcher()(X, out, coeffs)
        out.copy_(ns_step_right_gram(X[:, None], coeffs)[:, 0])
        return out
    v = ch05.triton_ns_step.evaluate(overwritten)
    assert v.status == "failed" and "changed after your kernel stored it" in v.message, v.message

    from atlaslib.atlas.kernel import newton_schulz_triton

    def library_kernel(X, out, coeffs):
        out.copy_(newton_schulz_triton(X, 1, coeffs))
        return out
    v = ch05.triton_ns_step.evaluate(library_kernel)
    assert v.status == "failed" and "atlaslib.atlas.kernel.newton_schulz_triton" in v.message, v.message

    from atlaslib.atlas.kernel import newton_schulz_kernel

    def library_jit_kernel(X, out, coeffs):          # the library's @triton.jit kernel launched directly
        N, R, C = X.shape
        BR, BC = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(C))
        newton_schulz_kernel[(N,)](X, out, *X.stride(), *out.stride(), R, C, 1, *coeffs, 1e-7, BR=BR, BC=BC,
                                   PRECISION="ieee")
        return out
    v = ch05.triton_ns_step.evaluate(library_jit_kernel)
    assert v.status == "failed" and "launches the library's kernel" in v.message, v.message
    assert "atlaslib.atlas.kernel.newton_schulz_kernel" in v.message, v.message
