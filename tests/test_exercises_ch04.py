"""Chapter 4's graded exercises: every check passes a correct answer and rejects typical mistakes,
and the grader gives the solutions full marks, the student copy zero, and a planted wrong
answer exactly its exercise's points less.

The correct answers here are written from the math or the library, not copied from
exercises/solutions/ch04_omega.ipynb. TRITON_INTERPRET=1 is set by conftest.py before
triton is imported.
"""
import itertools
import math

import pytest
import torch
import triton
import triton.language as tl

from atlaslib.core import TaylorFeatures, monomial_features, tensor_power
from atlaslib.exercises import ch04, registry
from grading_helpers import (TIMEOUT, assert_full_marks, assert_planted_loses_its_points, assert_student_scores_zero,
                             chapter_notebooks)
from atlaslib.omega import omega_chunk, omega_rule
from atlaslib.core.windows import band_gates

SOLUTION, STUDENT = chapter_notebooks("ch04_omega")
POINTS = {e.name: e.points for e in registry("ch04")}


def test_registered_with_at_least_four_exercises():
    assert list(POINTS) == ["monomials", "omega_step", "band", "chunkwise", "triton_window_weights"]
    assert sum(POINTS.values()) == 12


# ---- exercise 1: the polynomial map -----------------------------------------------------------

def dim_ok(d, p):
    return math.comb(d + p, p)


def monomials_by_loop(x, p):
    """Every exponent vector beta with |beta| <= p, in a different order than the library's."""
    d = x.shape[-1]
    feats = []
    for beta in itertools.product(range(p + 1), repeat=d):
        if sum(beta) <= p:
            feats.append(torch.prod(x ** torch.tensor(beta, dtype=x.dtype), dim=-1))
    return torch.stack(feats, dim=-1)


def test_monomials_passes_correct_answers():
    for fn in (monomial_features, monomials_by_loop, lambda x, p: monomial_features(x, p).flip(-1)):
        v = ch04.monomials.evaluate(fn, dim_ok)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("wrong, where", [
    (tensor_power, "expected"),                                                          # x^{(x)p}: d^p entries
    (lambda x, p: monomial_features(x, p)[..., 1:], "expected"),                         # no constant
    (lambda x, p: torch.cat([monomial_features(x, p), x], -1), "expected"),              # a degree listed twice
    (lambda x, p: TaylorFeatures(p, compressed=True)(x).detach(), "relative RMSE"),      # weighted monomials
    (lambda x, p: 2 * monomial_features(x, p), "relative RMSE"),
])
def test_monomials_rejects_wrong_maps(wrong, where):
    v = ch04.monomials.evaluate(wrong, dim_ok)
    assert v.status == "failed" and where in v.message, v.message


@pytest.mark.parametrize("wrong", [lambda d, p: d ** p, lambda d, p: math.comb(d + p - 1, p),
                                   lambda d, p: sum(d ** i for i in range(p + 1))])
def test_monomials_rejects_wrong_dimensions(wrong):
    v = ch04.monomials.evaluate(monomial_features, wrong)
    assert v.status == "failed" and "feature_dim" in v.message, v.message


def test_monomials_in_float32_names_the_dtype():
    v = ch04.monomials.evaluate(lambda x, p: monomials_by_loop(x, p).float(), dim_ok)
    assert v.status == "failed" and "torch.float32" in v.message and "inputs are torch.float64" in v.message, \
        v.message


# ---- exercise 2: one Omega step ------------------------------------------------------------------

def step_by_autograd(M, k_win, v_win, gamma, alpha, eta):
    Mv = M.clone().requires_grad_(True)
    pred = torch.einsum("bhvd,bhcd->bhcv", Mv, k_win)
    loss = (gamma * 0.5 * (pred - v_win).square().sum(-1)).sum()
    (grad,) = torch.autograd.grad(loss, Mv)
    return alpha[..., None, None] * M - eta[..., None, None] * grad


def step_closed_form(M, k_win, v_win, gamma, alpha, eta, sign=1.0, decay_first=False, left=False):
    """M (alpha I - eta sum gamma k k^T) + sign * eta sum gamma v k^T, with switchable slips."""
    D = k_win.shape[-1]
    a, e = alpha[..., None, None], eta[..., None, None]
    KK = (gamma[..., None] * k_win).transpose(-1, -2) @ k_win                    # sum gamma k k^T [D, D]
    W = (gamma[..., None] * v_win).transpose(-1, -2) @ k_win                     # sum gamma v k^T [V, D]
    if decay_first:                                                              # gradient at alpha M
        return a * M @ (torch.eye(D) - e * KK) + e * W
    if left:                                                                     # (alpha I - eta KK) M
        return (a * torch.eye(D) - e * KK) @ M + e * W
    return M @ (a * torch.eye(D) - e * KK) + sign * e * W


def omega_rule_last_step(M, k_win, v_win, gamma, alpha, eta):
    """The library's per-token rule run on the window only: gates zero on every step but the last."""
    B, H, c, D = k_win.shape
    off = torch.zeros(B, H, c)
    off[:, :, -1] = 1
    G = torch.zeros(B, H, c, c)
    G[:, :, -1] = gamma.flip(-1)                  # offset j of the last step is window row c - 1 - j
    return omega_rule(k_win, k_win, v_win, window=c, gamma=G, alpha=torch.where(off > 0, alpha[..., None], 1.0),
                      eta=eta[..., None] * off, initial_state=M, output_final_state=True, backend="recurrent")[1].memory


def test_omega_step_passes_correct_answers():
    for fn in (step_by_autograd, step_closed_form, omega_rule_last_step):
        v = ch04.omega_step.evaluate(fn)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("kw", [dict(sign=-1.0), dict(decay_first=True)], ids=["eq11_sign", "gradient_at_alpha_M"])
def test_omega_step_rejects_typical_mistakes(kw):
    v = ch04.omega_step.evaluate(lambda *a: step_closed_form(*a, **kw))
    assert v.status == "failed" and "M_t: relative RMSE" in v.message, v.message


def test_omega_step_rejects_left_multiplication_and_ignored_gates():
    v = ch04.omega_step.evaluate(lambda *a: step_closed_form(*a, left=True))
    assert v.status == "error" and "D=5, V=7" in v.message, v.message       # shapes do not match when D != V
    v = ch04.omega_step.evaluate(lambda M, k, vv, g, a, e: step_closed_form(M, k, vv, torch.ones_like(g), a, e))
    assert v.status == "failed", v.message
    v = ch04.omega_step.evaluate(lambda M, k, vv, g, a, e: step_closed_form(M, k[:, :, -1:], vv[:, :, -1:],
                                                                           g[:, :, -1:], a, e))   # the delta rule
    assert v.status == "failed" and "window c=4" in v.message, v.message


# ---- exercise 3: the banded gate matrix ----------------------------------------------------------

def band_by_loops(G):
    B, H, n, c = G.shape
    out = torch.zeros(B, H, n, n + c - 1)
    for t in range(n):
        for i in range(t - c + 1, t + 1):                # window of token t, chunk-local (negative: previous chunk)
            out[:, :, t, i + c - 1] = G[:, :, t, t - i]
    return out


def test_band_passes_correct_answers():
    for fn in (band_by_loops, lambda G: band_gates(G, G.shape[-1])):
        v = ch04.band.evaluate(fn)
        assert v.status == "passed" and v.earned == 2, v.message


def band_chunk_only(G):
    """A b x b mask: the window is cut at the chunk start (no look-back)."""
    B, H, n, c = G.shape
    return band_by_loops(G)[..., c - 1:]


def test_band_rejects_the_chunk_sized_mask():
    v = ch04.band.evaluate(band_chunk_only)
    assert v.status == "failed" and "b x b mask" in v.message, v.message


@pytest.mark.parametrize("wrong", [
    lambda G: band_by_loops(G.flip(-1)),                                                  # offsets reversed
    lambda G: torch.roll(band_by_loops(G), 1, dims=-1),                                   # band off by one
    lambda G: band_by_loops(torch.ones_like(G)),                                          # the mask without gates
    lambda G: torch.nn.functional.pad(band_chunk_only(G), (G.shape[-1] - 1, 0)),          # look-back zeroed
], ids=["reversed_offsets", "shifted", "no_gates", "no_look_back"])
def test_band_rejects_wrong_entries(wrong):
    v = ch04.band.evaluate(wrong)
    assert v.status == "failed" and "Gamma: relative RMSE" in v.message, v.message


def test_band_rejects_windows_cut_at_the_chunk_length():
    """Right while c <= b; a window longer than the chunk must still reach c - 1 tokens back."""
    def cut(G):
        B, H, n, c = G.shape
        out = torch.zeros(B, H, n, n + c - 1)
        for t in range(n):
            for i in range(t - min(n, c) + 1, t + 1):
                out[:, :, t, i + c - 1] = G[:, :, t, t - i]
        return out
    v = ch04.band.evaluate(cut)
    assert v.status == "failed" and "c > b" in v.message and "Gamma: relative RMSE" in v.message, v.message


# ---- exercise 4: the chunkwise pass --------------------------------------------------------------

def chunkwise_library(q, k, v, gamma, alpha, eta, chunk_size):
    return omega_chunk(q, k, v, gamma.shape[-1], gamma, alpha, eta, None, chunk_size)


def chunkwise_chunk_only_windows(q, k, v, gamma, alpha, eta, chunk_size):
    """The b x b mask: gates whose source token lies in an earlier chunk are dropped."""
    B, H, T, c = gamma.shape
    t = torch.arange(T)[:, None]
    source = t - torch.arange(c)[None, :]
    inside = source >= (t // chunk_size) * chunk_size
    return chunkwise_library(q, k, v, gamma * inside, alpha, eta, chunk_size)


def chunkwise_per_token(q, k, v, gamma, alpha, eta, chunk_size):
    """The exact per-token rule: right only at chunk size 1."""
    o, state = omega_rule(q, k, v, window=gamma.shape[-1], gamma=gamma, alpha=alpha, eta=eta,
                          output_final_state=True, backend="recurrent")
    return o, state.memory


def test_chunkwise_passes_a_correct_answer():
    v = ch04.chunkwise.evaluate(chunkwise_library)
    assert v.status == "passed" and v.earned == 3, v.message


def test_chunkwise_rejects_the_chunk_sized_mask():
    v = ch04.chunkwise.evaluate(chunkwise_chunk_only_windows)
    assert v.status == "failed" and "chunk_size=" in v.message, v.message


def chunkwise_masked_after_exp(q, k, v, gamma, alpha, eta, chunk_size):
    """The chunk's D = e^{g_t - g_s} times a 0/1 causal mask, from the Exercise's formulas; right on mild gates."""
    B, H, T, D = q.shape
    c = gamma.shape[-1]
    M = q.new_zeros(B, H, v.shape[-1], D)
    log_alpha = torch.log(alpha) if alpha is not None else torch.zeros(B, H, T)
    outs = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        b = e - s
        g = log_alpha[:, :, s:e].cumsum(-1)
        Dm = torch.exp(g[..., :, None] - g[..., None, :]) * torch.ones(b, b).tril()
        # window rows s - c + 1 .. e - 1 (zero before the sequence) and the banded gates Gamma [b, b + c - 1]
        src = torch.arange(s - c + 1, e)
        valid = (src >= 0).to(q.dtype)
        idx = src.clamp(min=0)
        KW, VW = k[:, :, idx] * valid[:, None], v[:, :, idx] * valid[:, None]
        Gam = q.new_zeros(B, H, b, b + c - 1)
        for t in range(b):
            for j in range(c):                                   # gamma[t, j] weighs row t - j
                col = t + c - 1 - j
                if s + t - j >= 0:
                    Gam[:, :, t, col] = gamma[:, :, s + t, j]
        C = Dm @ (eta[:, :, s:e, None] * Gam)
        E = KW @ M.transpose(-1, -2) - VW
        outs.append(torch.exp(g)[..., None] * (q[:, :, s:e] @ M.transpose(-1, -2))
                    - (C * (q[:, :, s:e] @ KW.transpose(-1, -2))) @ E)
        M = torch.exp(g[..., -1])[..., None, None] * M - (C[:, :, -1, :, None] * E).transpose(-1, -2) @ KW
    return torch.cat(outs, 2), M


def test_chunkwise_rejects_a_mask_applied_after_the_exponential():
    """Right wherever e^{g_t - g_s} stays finite above the diagonal (checked against the library at mild gates);
    the check's chunk of strong gates overflows it, and inf * 0 is NaN."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 13, n, generator=gen) for n in (4, 4, 3))
    gamma = torch.rand(1, 2, 13, 3, generator=gen)
    alpha, eta = 0.5 + 0.5 * torch.rand(1, 2, 13, generator=gen), 0.1 * torch.rand(1, 2, 13, generator=gen)
    for mine, ref in zip(chunkwise_masked_after_exp(q, k, v, gamma, alpha, eta, 5),
                         chunkwise_library(q, k, v, gamma, alpha, eta, 5)):
        torch.testing.assert_close(mine, ref)
    v = ch04.chunkwise.evaluate(chunkwise_masked_after_exp)
    assert v.status == "failed" and "NaN" in v.message and "scalar gates in [0.01, 0.05]" in v.message, v.message


def test_chunkwise_rejects_the_per_token_rule():
    """Frozen gradients are a different model: the exact rule fails for chunk sizes above 1."""
    v = ch04.chunkwise.evaluate(chunkwise_per_token)
    assert v.status == "failed" and "chunk_size=4]" in v.message, v.message


def test_chunkwise_rejects_missing_none_case_and_wrong_sign():
    def gates_required(q, k, v, gamma, alpha, eta, chunk_size):
        return chunkwise_library(q, k, v, gamma, alpha.clone(), eta, chunk_size)
    v = ch04.chunkwise.evaluate(gates_required)
    assert v.status == "error" and "alpha=None" in v.message and "AttributeError" in v.message

    def ascent(q, k, v, gamma, alpha, eta, chunk_size):        # eq. 11's sign: -eta sum gamma v k^T
        return chunkwise_library(q, k, -v, gamma, alpha, eta, chunk_size)
    assert ch04.chunkwise.evaluate(ascent).status == "failed"


# ---- exercise 5: the Triton kernel ---------------------------------------------------------------

@triton.jit
def weights_variants(G_ptr, eta_ptr, g_ptr, out_ptr, n, c, BT: tl.constexpr, BW: tl.constexpr,
                     MASK_LOADS: tl.constexpr, MASK_STORE: tl.constexpr, LOOK_BACK: tl.constexpr,
                     ETA_OF_ROW: tl.constexpr, DECAY: tl.constexpr, EXP_THEN_MASK: tl.constexpr):
    """C = (D diag(eta)) Gamma written with broadcast-and-sum (no tl.dot), with switchable mistakes."""
    i = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BT)
    w = tl.arange(0, BW)
    W = n + c - 1
    if MASK_LOADS:
        m_r = r < n
    else:
        m_r = r < BT
    eta = tl.load(eta_ptr + i * n + r, mask=m_r, other=0.0)
    g = tl.load(g_ptr + i * n + r, mask=m_r, other=0.0)
    j = r[:, None] + (c - 1) - w[None, :]
    band = m_r[:, None] & (w[None, :] < W) & (j >= 0) & (j < c)
    if not LOOK_BACK:
        band = band & (w[None, :] >= c - 1)
    gam = tl.load(G_ptr + i * n * c + r[:, None] * c + j, mask=band, other=0.0)
    causal = r[:, None] >= r[None, :]
    if EXP_THEN_MASK:                                   # exp overflows above the diagonal: inf * 0 = NaN
        decay = tl.exp(g[:, None] - g[None, :]) * causal
    elif DECAY:
        decay = tl.exp(tl.where(causal, g[:, None] - g[None, :], float("-inf")))
    else:
        decay = tl.where(causal, 1.0, 0.0)
    if ETA_OF_ROW:
        weight = decay * eta[:, None]
    else:
        weight = decay * eta[None, :]
    C = tl.sum(weight[:, :, None] * gam[None, :, :], axis=1)
    if MASK_STORE:
        m_out = (r < n)[:, None] & (w < W)[None, :]
    else:
        m_out = (r < n)[:, None] & (w < BW)[None, :]
    tl.store(out_ptr + i * n * W + r[:, None] * W + w[None, :], C, mask=m_out)


def weights_launcher(mask_loads=True, mask_store=True, look_back=True, eta_of_row=False, decay=True,
                     exp_then_mask=False):
    def launch(G, eta, g, out):
        N, n, c = G.shape
        BT, BW = max(16, triton.next_power_of_2(n)), max(16, triton.next_power_of_2(n + c - 1))
        weights_variants[(N,)](G, eta, g, out, n, c, BT=BT, BW=BW, MASK_LOADS=mask_loads, MASK_STORE=mask_store,
                               LOOK_BACK=look_back, ETA_OF_ROW=eta_of_row, DECAY=decay, EXP_THEN_MASK=exp_then_mask)
        return out
    return launch


def test_triton_check_passes_a_correct_kernel():
    v = ch04.triton_window_weights.evaluate(weights_launcher())
    assert v.status == "passed" and v.earned == 3, v.message


def test_triton_check_catches_unmasked_loads():
    v = ch04.triton_window_weights.evaluate(weights_launcher(mask_loads=False))
    assert v.status == "failed" and "loaded" in v.message and "mask every load" in v.message, v.message


def test_triton_check_catches_stores_past_the_end():
    v = ch04.triton_window_weights.evaluate(weights_launcher(mask_store=False))
    assert v.status == "failed" and "wrote" in v.message, v.message


@pytest.mark.parametrize("kw", [dict(look_back=False), dict(eta_of_row=True), dict(decay=False)],
                         ids=["no_look_back", "eta_of_row", "no_decay"])
def test_triton_check_catches_wrong_entries(kw):
    v = ch04.triton_window_weights.evaluate(weights_launcher(**kw))
    assert v.status == "failed" and "relative RMSE" in v.message, v.message


def test_triton_check_catches_a_mask_applied_after_exp():
    """A 0/1 mask multiplied after tl.exp: with strong gates exp(g_t - g_s) overflows above the diagonal."""
    v = ch04.triton_window_weights.evaluate(weights_launcher(exp_then_mask=True))
    assert v.status == "failed" and "NaN" in v.message and "before tl.exp" in v.message, v.message


# ---- the grader on chapter 4 -----------------------------------------------------------------------

def test_solutions_score_full_marks():
    assert_full_marks(SOLUTION, POINTS, TIMEOUT)


def test_untouched_student_notebook_scores_zero_via_cli():
    assert_student_scores_zero(STUDENT, POINTS, TIMEOUT)


def test_planted_eq11_sign_loses_exactly_its_points(tmp_path):
    body = ("return alpha[..., None, None] * M - eta[..., None, None] * "
            "(gamma[..., None] * (k_win @ M.transpose(-1, -2) + v_win)).transpose(-1, -2) @ k_win")
    assert_planted_loses_its_points(SOLUTION, tmp_path, "omega_step", body, POINTS)
