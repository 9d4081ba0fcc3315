"""Chapter 6's graded exercises: every check passes a correct answer and rejects typical mistakes,
and the grader gives the solutions full marks, the student copy zero, and a planted wrong
answer exactly its exercise's points less.

The correct answers here are written from the math or the library, not copied from
exercises/solutions/ch06_deep.ipynb. TRITON_INTERPRET=1 is set by conftest.py before
triton is imported.
"""
import itertools
import math

import pytest
import torch
import triton
import triton.language as tl

from atlaslib.core.featuremaps import monomial_features
from atlaslib.deep import deep_transformer, exp_features
from atlaslib.exercises import ch06, registry
from grading_helpers import (TIMEOUT, assert_full_marks, assert_planted_loses_its_points, assert_student_scores_zero,
                             chapter_notebooks)

SOLUTION, STUDENT = chapter_notebooks("ch06_deep")
POINTS = {e.name: e.points for e in registry("ch06")}


def test_registered_with_five_exercises():
    assert list(POINTS) == ["phi_star", "kernel_read", "dot_step", "normaliser", "triton_exp_read"]
    assert sum(POINTS.values()) == 12


# ---- exercise 1: phi*_P and its dimension ---------------------------------------------------------

def phi_by_exponents(x, P, weight="exp", top=None):
    """One feature x^b per exponent vector b with |b| <= P (listed by itertools.product), weighted by
    1/sqrt(b!) (exp's Taylor weights), sqrt(|b|! / b!) (the multinomial only) or 1."""
    d = x.shape[-1]
    top = P if top is None else top
    features = []
    for b in itertools.product(range(top + 1), repeat=d):
        if sum(b) > top:
            continue
        b_fact = math.prod(math.factorial(e) for e in b)
        w = {"exp": 1 / math.sqrt(b_fact), "multinomial": math.sqrt(math.factorial(sum(b)) / b_fact), "none": 1.0}
        features.append(w[weight] * torch.prod(x ** torch.tensor(b, dtype=x.dtype), dim=-1))
    return torch.stack(features, dim=-1)


def comb(d, P):
    return math.factorial(d + P) // (math.factorial(d) * math.factorial(P))


def test_phi_star_passes_correct_answers():
    for features in (phi_by_exponents, exp_features):
        v = ch06.phi_star.evaluate(features, comb)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("features, where", [
    (lambda x, P: phi_by_exponents(x, P, weight="multinomial"), "relative RMSE"),   # the 1/sqrt(n!) forgotten
    (lambda x, P: phi_by_exponents(x, P, weight="none"), "relative RMSE"),          # chapter 4's plain monomials
    (lambda x, P: monomial_features(x, P), "relative RMSE"),
    (lambda x, P: phi_by_exponents(x, P, top=P + 1), "has shape"),                  # one degree too many
    (lambda x, P: phi_by_exponents(x, max(P - 1, 0)), "has shape"),                 # one degree too few
    (lambda x, P: exp_features(x, P, compressed=False), "tensor-power form"),       # sum d^n entries
    (lambda x, P: phi_by_exponents(x.abs(), P), "phi*_P(x) . phi*_P(y)"),          # right norms, wrong signs
], ids=["no_factorials", "unweighted", "ch04_monomials", "P_plus_1", "P_minus_1", "tensor_powers", "of_abs_x"])
def test_phi_star_rejects_wrong_features(features, where):
    v = ch06.phi_star.evaluate(features, comb)
    assert v.status == "failed" and where in v.message, v.message


@pytest.mark.parametrize("dim", [
    lambda d, P: sum(d ** n for n in range(P + 1)),                                  # the tensor-power count
    lambda d, P: comb(d, P - 1) if P else 1,                                         # off by one in P
    lambda d, P: comb(d - 1, P),                                                     # the constant forgotten
    lambda d, P: d ** P,
], ids=["sum_d_n", "P_minus_1", "d_minus_1", "d_to_P"])
def test_phi_star_rejects_wrong_dimensions(dim):
    v = ch06.phi_star.evaluate(exp_features, dim)
    assert v.status == "failed" and "phi_star_dim" in v.message and "is not right" in v.message, v.message


def test_phi_star_and_kernel_read_in_float32_name_the_dtype():
    for exercise, fn in ((ch06.phi_star, lambda x, P: phi_by_exponents(x, P).float()),
                         (ch06.kernel_read, lambda u, k, q: read_loop(u, k, q).float())):
        fns = (fn, comb) if exercise is ch06.phi_star else (fn,)
        v = exercise.evaluate(*fns)
        assert v.status == "failed" and "torch.float32" in v.message and "inputs are torch.float64" in v.message, \
            v.message


# ---- exercise 2: the kernel-trick read ------------------------------------------------------------

def read_loop(u, k, q, causal="<=", transpose=False, exp=True):
    T = q.shape[2]
    out = []
    for t in range(T):
        seen = {"<=": range(t + 1), "<": range(t), "all": range(T)}[causal]
        y = torch.zeros_like(u[:, :, 0])
        for j in seen:
            s = (k[:, :, t] * q[:, :, j]).sum(-1) if transpose else (k[:, :, j] * q[:, :, t]).sum(-1)
            y = y + (torch.exp(s) if exp else s)[..., None] * u[:, :, j]
        out.append(y)
    return torch.stack(out, dim=2)


def test_kernel_read_passes_correct_answers():
    by_library = lambda u, k, q: deep_transformer(q, k, u, phi_star="kernel", backend="chunk")[0]   # noqa: E731
    for fn in (read_loop, by_library):
        v = ch06.kernel_read.evaluate(fn)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("kw", [dict(causal="all"), dict(causal="<"), dict(transpose=True), dict(exp=False)],
                         ids=["not_causal", "strictly_causal", "transposed", "no_exp"])
def test_kernel_read_rejects_typical_mistakes(kw):
    v = ch06.kernel_read.evaluate(lambda u, k, q: read_loop(u, k, q, **kw))
    assert v.status == "failed" and "y: relative RMSE" in v.message, v.message


# ---- exercise 3: one DOT step ---------------------------------------------------------------------

def dot_step_math(U, keys, k, v, alpha, eta, sign=1.0, decay=True, error_after_decay=False, new_first=False):
    """u_j <- alpha u_j, u_t = eta (v - sum_j u_j exp(k_j.k_t)), written per coefficient, with switchable slips."""
    t = U.shape[2]
    decayed = alpha[:, :, None, None] * U if decay else U
    source = decayed if error_after_decay else U
    recall = torch.zeros_like(v)
    for j in range(t):
        recall = recall + torch.exp((keys[:, :, j] * k).sum(-1))[..., None] * source[:, :, j]
    u_t = (eta[..., None] * sign * (v - recall))[:, :, None]
    return torch.cat([u_t, decayed] if new_first else [decayed, u_t], dim=2)


def dot_step_matrix(U, keys, k, v, alpha, eta):
    """The same step on the Gram matrix of the keys: exp(keys k) U is M_{t-1} phi*(k_t)."""
    gram = torch.exp(keys @ k[..., None]).transpose(-1, -2)              # [B, H, 1, t]
    u_t = eta[..., None, None] * (v[:, :, None] - gram @ U)
    return torch.cat([U * alpha[..., None, None], u_t], dim=2)


def test_dot_step_passes_correct_answers():
    for fn in (dot_step_math, dot_step_matrix):
        v = ch06.dot_step.evaluate(fn)
        assert v.status == "passed" and v.earned == 3, v.message


@pytest.mark.parametrize("kw", [dict(sign=-1.0), dict(decay=False), dict(error_after_decay=True),
                                dict(new_first=True)],
                         ids=["paper_sign", "no_alpha", "error_after_decay", "new_coefficient_first"])
def test_dot_step_rejects_typical_mistakes(kw):
    v = ch06.dot_step.evaluate(lambda *a: dot_step_math(*a, **kw))
    assert v.status == "failed" and "relative RMSE" in v.message, v.message


def test_dot_step_names_a_float32_answer():
    # the check reads U_t in float64, so a float32 U_t fails the 1e-8 tolerance with values that print equal
    v = ch06.dot_step.evaluate(lambda *a: dot_step_math(*a).float())
    assert v.status == "failed" and "Your result is torch.float32, but the inputs are torch.float64" in v.message, \
        v.message


def test_dot_step_asks_for_every_coefficient():
    v = ch06.dot_step.evaluate(lambda *a: dot_step_math(*a)[:, :, -1:])
    assert v.status == "failed" and "U_t has shape" in v.message and "token t=1" in v.message, v.message


# ---- exercise 4: the normaliser -------------------------------------------------------------------

def softmax_masked(q, k, v, scale="q", causal_z=True, shift=True):
    K, T = q.shape[-1], q.shape[2]
    factor = {"q": 1 / math.sqrt(K), "both": 1 / K, "none": 1.0}[scale]
    s = factor * q.double() @ k.double().transpose(-1, -2)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if shift:
        e = torch.exp(s - s.masked_fill(~mask, -math.inf).amax(-1, keepdim=True))
    else:
        e = torch.exp(s.float()).double()                                # fp32 exp: overflows at a score of 120
    w = e.masked_fill(~mask, 0.0)
    z = (w if causal_z else e).sum(-1, keepdim=True)
    return (w @ v.double() / z).float()


def test_normaliser_passes_correct_answers():
    def by_library(q, k, v):
        return deep_transformer(q / math.sqrt(q.shape[-1]), k, v, phi_star="kernel", normalize=True, backend="chunk")[0]

    def by_softmax(q, k, v):
        T = q.shape[2]
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(),
                                                                            -math.inf)
        return torch.softmax(s, dim=-1) @ v
    for fn in (softmax_masked, by_library, by_softmax):
        v = ch06.normaliser.evaluate(fn)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("kw, where", [
    (dict(scale="none"), "o: relative RMSE"),
    (dict(scale="both"), "o: relative RMSE"),                              # 1/sqrt(K) in q and in k
    (dict(causal_z=False), "o: relative RMSE"),                            # the normaliser sums every key
    (dict(shift=False), "not finite"),                                     # exp(120) in fp32
], ids=["no_scale", "scale_twice", "non_causal_normaliser", "no_shift"])
def test_normaliser_rejects_typical_mistakes(kw, where):
    v = ch06.normaliser.evaluate(lambda q, k, v: softmax_masked(q, k, v, **kw))
    assert v.status == "failed" and where in v.message, v.message


def test_normaliser_rejects_the_unnormalised_read_at_large_scores():
    def two_reads(q, k, v):                  # numerator and normaliser as two unnormalised DeepTransformers
        q = q / math.sqrt(q.shape[-1])
        y = deep_transformer(q, k, v, phi_star="kernel", backend="chunk")[0]
        z = deep_transformer(q, k, torch.ones_like(v[..., :1]), phi_star="kernel", backend="chunk")[0]
        return y / z
    v = ch06.normaliser.evaluate(two_reads)
    assert v.status == "error" and "of 120" in v.message and "exceeds" in v.message, v.message


# ---- exercise 5: the Triton kernel ----------------------------------------------------------------

@triton.jit
def exp_read_variants(q_ptr, k_ptr, v_ptr, o_ptr, T, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      MASK_LOADS: tl.constexpr, MASK_STORE: tl.constexpr, DIAGONAL: tl.constexpr,
                      CAUSAL: tl.constexpr, EXP: tl.constexpr, MULTIPLY: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    t, c, r = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    if MASK_LOADS:
        m_t, m_c, m_r = t < T, c < K, r < V
    else:
        m_t, m_c, m_r = t < BT, c < BK, r < BV
    q = tl.load(q_ptr + i * T * K + t[:, None] * K + c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
    k = tl.load(k_ptr + i * T * K + t[:, None] * K + c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
    v = tl.load(v_ptr + i * T * V + t[:, None] * V + r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                      # [BT, BT] scores
    w = tl.exp(s) if EXP else s
    if CAUSAL:
        if MULTIPLY:                                                       # after exp: inf * 0 = NaN
            w = w * (t[:, None] >= t[None, :]).to(tl.float32)
        elif DIAGONAL:
            w = tl.where(t[:, None] >= t[None, :], w, 0.0)
        else:
            w = tl.where(t[:, None] > t[None, :], w, 0.0)
    o = tl.sum(w[:, :, None] * v[None, :, :], axis=1)
    if MASK_STORE:
        m_out = (t < T)[:, None] & (r < V)[None, :]
    else:
        m_out = (t < T)[:, None] & (r < BV)[None, :]
    tl.store(o_ptr + i * T * V + t[:, None] * V + r[None, :], o, mask=m_out)


def exp_launcher(mask_loads=True, mask_store=True, diagonal=True, causal=True, exp=True, multiply=False):
    def launch(q, k, v, out):
        N, T, K = q.shape
        V = v.shape[-1]
        BT, BK, BV = (max(16, triton.next_power_of_2(x)) for x in (T, K, V))
        exp_read_variants[(N,)](q, k, v, out, T, K, V, BT=BT, BK=BK, BV=BV, MASK_LOADS=mask_loads,
                                MASK_STORE=mask_store, DIAGONAL=diagonal, CAUSAL=causal, EXP=exp, MULTIPLY=multiply)
        return out
    return launch


def test_triton_check_passes_a_correct_kernel():
    v = ch06.triton_exp_read.evaluate(exp_launcher())
    assert v.status == "passed" and v.earned == 3, v.message


def test_triton_check_requires_a_kernel_launch():
    def plain_torch(q, k, v, out):
        T = q.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        out.copy_(torch.exp((q @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf"))) @ v)
    v = ch06.triton_exp_read.evaluate(plain_torch)
    assert v.status == "failed" and "without launching a @triton.jit kernel" in v.message, v.message


def test_triton_check_catches_unmasked_loads():
    v = ch06.triton_exp_read.evaluate(exp_launcher(mask_loads=False))
    assert v.status == "failed" and "loaded" in v.message and "mask every load" in v.message, v.message


def test_triton_check_catches_stores_past_the_end():
    v = ch06.triton_exp_read.evaluate(exp_launcher(mask_store=False))
    assert v.status == "failed" and "wrote" in v.message, v.message


@pytest.mark.parametrize("kw", [dict(diagonal=False), dict(causal=False), dict(exp=False)],
                         ids=["strict_mask", "no_mask", "no_exp"])
def test_triton_check_catches_wrong_reads(kw):
    v = ch06.triton_exp_read.evaluate(exp_launcher(**kw))
    assert v.status == "failed" and "out: relative RMSE" in v.message, v.message


# ---- the rules: the library's answers are off limits ----------------------------------------------

@pytest.mark.library_rules
def test_answers_that_call_the_library_fail():
    import atlaslib.deep as deep_package             # as a notebook reaches it: through a module, not a closure
    v = ch06.phi_star.evaluate(lambda x, P: deep_package.exp_features(x, P), comb)
    assert v.status == "failed" and "your answer calls atlaslib.deep.features.exp_features" in v.message, v.message
    v = ch06.phi_star.evaluate(phi_by_exponents, lambda d, P: deep_package.exp_feature_dim(d, P))
    assert v.status == "failed" and "atlaslib.deep.features.exp_feature_dim" in v.message, v.message
    v = ch06.kernel_read.evaluate(lambda u, k, q: deep_package.deep_transformer(q, k, u, backend="chunk")[0])
    assert v.status == "failed" and "atlaslib.deep.deep_transformer" in v.message, v.message
    assert ch06.dot_step.evaluate(dot_step_matrix).status == "passed"
    v = ch06.normaliser.evaluate(lambda q, k, v: deep_package.deep_transformer(
        q / math.sqrt(q.shape[-1]), k, v, normalize=True, backend="chunk")[0])
    assert v.status == "failed" and "your answer calls" in v.message, v.message
    from atlaslib.core import attention
    v = ch06.normaliser.evaluate(lambda q, k, v: attention.softmax_attention(q, k, v))
    assert v.status == "failed" and "atlaslib.core.attention.softmax_attention" in v.message, v.message


# ---- the grader on chapter 6 ----------------------------------------------------------------------

def test_solutions_score_full_marks():
    assert_full_marks(SOLUTION, POINTS, TIMEOUT)


def test_untouched_student_notebook_scores_zero_via_cli():
    assert_student_scores_zero(STUDENT, POINTS, TIMEOUT)


def test_planted_paper_sign_loses_exactly_its_points(tmp_path):
    # [A] eqs. 28-31's sign: the step climbs the error instead of descending it
    body = ("return torch.cat([alpha[..., None, None] * U, (eta[..., None] * (torch.einsum('bhj,bhjv->bhv', "
            "torch.exp(torch.einsum('bhjk,bhk->bhj', keys, k)), U) - v))[:, :, None]], dim=2)")
    assert_planted_loses_its_points(SOLUTION, tmp_path, "dot_step", body, POINTS)


def test_triton_check_catches_masking_after_the_exponential():
    v = ch06.triton_exp_read.evaluate(exp_launcher(multiply=True))
    assert v.status == "failed" and "before the exponential" in v.message, v.message


# Exercise 4 (the normaliser): a shift over every key (future ones included), or the causal mask applied
# after exp, is right only while no future score is large; the check's large case has a query that sees
# its own key at 0 and meets a future key at 120, where both give NaN. Correct answer written from the math.

def _normaliser_scores(q, k):
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return (q / math.sqrt(q.shape[-1])) @ k.transpose(-1, -2), causal


def softmax_visible_shift(q, k, v):
    """Right: mask the future keys to -inf, then shift by the largest visible score of the row."""
    s, causal = _normaliser_scores(q, k)
    s = s.masked_fill(~causal, -math.inf)
    w = torch.exp(s - s.amax(-1, keepdim=True))
    return (w @ v) / w.sum(-1, keepdim=True)


def softmax_shift_over_all_keys(q, k, v):
    """Wrong: the shift is the row's largest score over every key, future ones included."""
    s, causal = _normaliser_scores(q, k)
    w = torch.exp(s - s.amax(-1, keepdim=True)).masked_fill(~causal, 0.0)
    return (w @ v) / w.sum(-1, keepdim=True)


def softmax_mask_after_exp(q, k, v):
    """Wrong: the right shift, but the mask multiplies the exponential instead of going before it."""
    s, causal = _normaliser_scores(q, k)
    m = s.masked_fill(~causal, -math.inf).amax(-1, keepdim=True)
    w = torch.exp(s - m) * causal
    return (w @ v) / w.sum(-1, keepdim=True)


def test_normaliser_passes_the_visible_shift():
    for _ in range(3):                                  # fresh inputs every time
        v = ch06.normaliser.evaluate(softmax_visible_shift)
        assert v.status == "passed" and v.earned == v.points, v.message


@pytest.mark.parametrize("wrong", [softmax_shift_over_all_keys, softmax_mask_after_exp],
                         ids=["shift_over_all_keys", "mask_after_exp"])
def test_normaliser_rejects_answers_that_break_on_a_large_future_score(wrong):
    for _ in range(3):                                  # the large case is built, not drawn: it fails every time
        v = ch06.normaliser.evaluate(wrong)
        assert v.status == "failed" and v.earned == 0, v.message
        assert "of a future key" in v.message and "not finite" in v.message, v.message
