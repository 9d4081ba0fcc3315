"""Chapter 3's graded exercises: every check passes a correct answer and rejects typical mistakes,
and the grader gives the solutions full marks, the student copy zero, and a planted wrong
answer exactly its exercise's points less.

The correct answers here are written from the math (autograd oracles, plain loops) or the
library, not copied from exercises/solutions/ch03_miras.ipynb. TRITON_INTERPRET=1 is set
by conftest.py before triton is imported.
"""

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atlaslib.exercises import ch03, registry
from grading_helpers import (TIMEOUT, assert_full_marks, assert_planted_loses_its_points, assert_student_scores_zero,
                             chapter_notebooks)
from atlaslib.core.chunking import causal_decay
from atlaslib.miras import miras

SOLUTION, STUDENT = chapter_notebooks("ch03_miras")
POINTS = {e.name: e.points for e in registry("ch03")}


def test_registered_with_at_least_five_exercises():
    assert list(POINTS) == ["ttt_mlp_grads", "yaad_step", "memora_loop", "momentum_chunk", "triton_decay_product"]
    assert sum(POINTS.values()) == 12


def passes(exercise, *fns):
    v = exercise.evaluate(*fns)
    assert v.status == "passed" and v.earned == v.points, v.message


def fails(exercise, *fns, status="failed", where=""):
    v = exercise.evaluate(*fns)
    assert v.status == status and v.earned == 0 and where in v.message, v.message
    return v


# ---- exercise 1: TTT-MLP gradients ----------------------------------------------------------------

def grads_by_autograd(W1, W2, k, v):
    W1, W2 = W1.clone().requires_grad_(True), W2.clone().requires_grad_(True)
    pred = torch.einsum("nvh,nh->nv", W2, F.gelu(torch.einsum("nhk,nk->nh", W1, k)))
    return torch.autograd.grad(0.5 * (pred - v).square().sum(), (W1, W2))


def grads_by_hand(W1, W2, k, v, act_prime=True, sign=1.0, transpose_w1=False):
    """grad_W2 = -r h^T, grad_W1 = -[(W2^T r) * gelu'(u)] k^T, with switchable slips."""
    u = (W1 @ k[..., None])[..., 0]
    h = F.gelu(u)
    r = v - (W2 @ h[..., None])[..., 0]
    d_act = 0.5 * (1 + torch.erf(u / math.sqrt(2))) + u * torch.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)
    back = (W2.transpose(-1, -2) @ r[..., None])[..., 0]
    if act_prime:
        back = back * d_act
    g1 = -sign * back[..., :, None] * k[..., None, :]
    g2 = -sign * r[..., :, None] * h[..., None, :]
    return (g1.transpose(-1, -2) if transpose_w1 else g1), g2


def test_ttt_mlp_grads_passes_correct_answers():
    passes(ch03.ttt_mlp_grads, grads_by_hand)


@pytest.mark.library_rules
def test_ttt_mlp_grads_refuses_autograd():
    """The statement asks for the gradients without autograd: the right numbers from autograd score 0."""
    fails(ch03.ttt_mlp_grads, grads_by_autograd, where="torch.autograd.grad")

    def forward_mode(W1, W2, k, v):             # forward-mode AD (torch.func.jacfwd) is autograd too
        def loss(W1, W2):
            pred = torch.einsum("nvh,nh->nv", W2, F.gelu(torch.einsum("nhk,nk->nh", W1, k)))
            return 0.5 * (pred - v).square().sum()
        return torch.func.jacfwd(loss, argnums=(0, 1))(W1, W2)
    fails(ch03.ttt_mlp_grads, forward_mode, where="make_dual")

    def graph_walk(W1, W2, k, v):               # .backward() is torch.autograd.backward
        W1, W2 = W1.clone().requires_grad_(True), W2.clone().requires_grad_(True)
        pred = torch.einsum("nvh,nh->nv", W2, F.gelu(torch.einsum("nhk,nk->nh", W1, k)))
        (0.5 * (pred - v).square().sum()).backward()
        return W1.grad, W2.grad
    fails(ch03.ttt_mlp_grads, graph_walk, where="torch.autograd.backward")


@pytest.mark.parametrize("kw, where", [
    (dict(act_prime=False), "grad_W1: relative RMSE"),          # the activation's derivative forgotten
    (dict(sign=-1.0), "grad_W2: relative RMSE"),                 # r = v - y taken as the gradient of the error
    (dict(transpose_w1=True), "grad_W1 has shape"),
], ids=["no_activation_derivative", "ascent", "transposed"])
def test_ttt_mlp_grads_rejects_typical_mistakes(kw, where):
    fails(ch03.ttt_mlp_grads, lambda *a: grads_by_hand(*a, **kw), where=where)


def test_ttt_mlp_grads_rejects_a_single_return_value():
    fails(ch03.ttt_mlp_grads, lambda *a: grads_by_hand(*a)[0], where="expected a tuple (grad_W1, grad_W2)")


def test_ttt_mlp_grads_in_float32_names_the_dtype():
    # buffers made with torch.zeros(...) are float32: right to ~1e-7, which looks equal in the message
    v = fails(ch03.ttt_mlp_grads, lambda *a: tuple(g.float() for g in grads_by_hand(*a)), where="relative RMSE")
    assert "torch.float32" in v.message and "inputs are torch.float64" in v.message, v.message


# ---- exercise 2: Yaad's step ----------------------------------------------------------------------

def yaad_by_autograd(M, k, v, alpha, eta, delta):
    """alpha M - eta grad of the switch loss (1/2||e||^2 if ||e|| <= delta, else delta ||e||_1) at M."""
    X = M.clone().requires_grad_(True)
    e = torch.einsum("bhvk,bhk->bhv", X, k) - v
    loss = torch.where(e.norm(dim=-1) <= delta, 0.5 * e.square().sum(-1), delta * e.abs().sum(-1))
    (g,) = torch.autograd.grad(loss.sum(), X)
    return alpha[..., None, None] * M - eta[..., None, None] * g


def yaad_by_formula(M, k, v, alpha, eta, delta, minus_delta_sq=False, no_delta=False, coordinatewise=False,
                    at_decayed=False):
    a, lr, d = alpha[..., None], eta[..., None, None], delta[..., None]
    X = a[..., None] * M if at_decayed else M
    e = torch.einsum("bhvk,bhk->bhv", X, k) - v
    if coordinatewise:                                   # Huber (i), per coordinate
        psi = torch.where(e.abs() <= d, e, d * torch.sign(e))
    else:
        l1 = torch.sign(e) if no_delta else d * torch.sign(e)
        psi = torch.where(e.norm(dim=-1, keepdim=True) <= d, e, l1)
    g = psi[..., :, None] * k[..., None, :]
    if minus_delta_sq:                                   # [M] eqs 6 and 9: a scalar -delta^2 inside the update
        g = g - d[..., None] ** 2
    return a[..., None] * M - lr * g


def test_yaad_step_passes_correct_answers():
    passes(ch03.yaad_step, yaad_by_autograd)
    passes(ch03.yaad_step, yaad_by_formula)


@pytest.mark.parametrize("kw", [dict(minus_delta_sq=True), dict(no_delta=True), dict(coordinatewise=True),
                                dict(at_decayed=True)],
                         ids=["minus_delta_squared", "l1_branch_without_delta", "huber_i", "gradient_at_alpha_M"])
def test_yaad_step_rejects_typical_mistakes(kw):
    fails(ch03.yaad_step, lambda *a: yaad_by_formula(*a, **kw), where="M_t: relative RMSE")


def test_yaad_step_rejects_plain_l2():
    def l2_step(M, k, v, alpha, eta, delta):
        return yaad_by_formula(M, k, v, alpha, eta, torch.full_like(delta, 1e9))
    fails(ch03.yaad_step, l2_step, where="M_t: relative RMSE")


# ---- exercise 3: Memora in the log domain ---------------------------------------------------------

def memora_naive(Z0, q, k, v, alpha, eta, c, log_domain=True, per_column=False, scale=True, read_before=False):
    """W_t = c softmax(alpha_t log W_{t-1} - eta_t grad) ([M] eq 31), with switchable slips."""
    def read(Z):
        if per_column:
            return c * torch.softmax(Z, dim=-2)
        return (c if scale else 1.0) * torch.softmax(Z.flatten(-2), dim=-1).view_as(Z)
    W = read(Z0.double())
    q, k, v, alpha, eta = (x.double() for x in (q, k, v, alpha, eta))
    outs = []
    for t in range(q.shape[2]):
        e = torch.einsum("bhvk,bhk->bhv", W, k[:, :, t]) - v[:, :, t]
        g = e[..., :, None] * k[:, :, t, None, :]
        prev = torch.log(W) if log_domain else W
        W_new = read(alpha[:, :, t, None, None] * prev - eta[:, :, t, None, None] * g)
        outs.append(torch.einsum("bhvk,bhk->bhv", W if read_before else W_new, q[:, :, t]))
        W = W_new
    return torch.stack(outs, 2).float(), W.float()


def memora_normalised_logits(Z0, q, k, v, alpha, eta, c):
    """The log-domain recursion with the logits re-centred (log-softmax) every step: same weights."""
    out, Z = [], Z0
    for t in range(q.shape[2]):
        W = c * torch.softmax(Z.flatten(-2), -1).view_as(Z)
        e = torch.einsum("bhvk,bhk->bhv", W, k[:, :, t]) - v[:, :, t]
        Z = alpha[:, :, t, None, None] * Z - eta[:, :, t, None, None] * e[..., :, None] * k[:, :, t, None, :]
        Z = torch.log_softmax(Z.flatten(-2), -1).view_as(Z)
        out.append(torch.einsum("bhvk,bhk->bhv", c * Z.exp(), q[:, :, t]))
    return torch.stack(out, 2), c * Z.exp()


def test_memora_loop_passes_correct_answers():
    passes(ch03.memora_loop, memora_naive)
    passes(ch03.memora_loop, memora_normalised_logits)


@pytest.mark.parametrize("kw", [dict(log_domain=False), dict(per_column=True), dict(scale=False),
                                dict(read_before=True)],
                         ids=["weights_as_logits", "per_column_softmax", "missing_scale_c", "read_before_update"])
def test_memora_loop_rejects_typical_mistakes(kw):
    fails(ch03.memora_loop, lambda *a: memora_naive(*a, **kw), where="relative RMSE")


def test_memora_loop_rejects_the_logits_for_the_weights():
    """Every output right, but log W_T (the log-domain state) returned for W_T = c softmax(Z_T)."""
    def logits(*a):
        o, W_T = memora_naive(*a)
        return o, torch.log(W_T)
    fails(ch03.memora_loop, logits, where="W_T: relative RMSE")


# ---- exercise 4: Titans' momentum over a chunk ----------------------------------------------------

def momentum_loop(M0, S0, G, alpha, theta, eta):
    M, S, out = M0, S0, []
    for t in range(G.shape[1]):
        S = theta[:, t, None, None] * S - eta[:, t, None, None] * G[:, t]
        M = alpha[:, t, None, None] * M + S
        out.append(M)
    return torch.stack(out, 1), S


def momentum_masked(M0, S0, G, alpha, theta, eta, ratio="right", order="AB", carry=True, alpha_ratio="log"):
    """M_t = A_t M0 + c_t S0 - sum_i (D_A D_B)[t, i] eta_i G_i, with D_B[t, i] = B_t / B_i (i <= t) by default."""
    N, n = alpha.shape
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    la, lb = torch.log(alpha).cumsum(-1), torch.log(theta).cumsum(-1)
    DA = causal_decay(la[None], causal)[0]
    if alpha_ratio == "quotient":                                # A_t / A_m as a quotient of cumulative products
        A = alpha.cumprod(-1)
        DA = (A[:, :, None] / A[:, None, :]).masked_fill(~causal, 0.0)
    elif alpha_ratio == "mask_after":                            # exp of every difference, then a 0/1 mask
        DA = torch.exp(la[:, :, None] - la[:, None, :]) * causal
    if ratio == "right":                                         # theta_{i+1} ... theta_t
        DB = causal_decay(lb[None], causal)[0]
    elif ratio == "inclusive":                                   # theta_i ... theta_t: one factor too many
        DB = causal_decay(lb[None], causal)[0] * theta[:, None, :]
    elif ratio == "quotient":                                    # B_t / B_i as a quotient of cumulative products
        B = theta.cumprod(-1)
        DB = (B[:, :, None] / B[:, None, :]).masked_fill(~causal, 0.0)
    else:                                                        # B_i / B_t
        DB = causal_decay(-lb[None], causal)[0]
    W = DA @ DB if order == "AB" else DB @ DA
    c = DA @ lb.exp()[..., None]
    M = la.exp()[..., None, None] * M0[:, None] - torch.einsum("nti,nivk->ntvk", W * eta[:, None, :], G)
    if carry:
        M = M + c[..., None] * S0[:, None]
    S = lb.exp()[:, -1, None, None] * S0 - torch.einsum("ni,nivk->nvk", DB[:, -1] * eta, G)
    return M, S


def test_momentum_chunk_passes_correct_answers():
    passes(ch03.momentum_chunk, momentum_loop)
    passes(ch03.momentum_chunk, momentum_masked)


@pytest.mark.parametrize("kw", [dict(ratio="inclusive"), dict(ratio="inverted"), dict(order="BA"), dict(carry=False)],
                         ids=["ratio_with_theta_i", "ratio_inverted", "D_B_D_A", "momentum_not_carried"])
def test_momentum_chunk_rejects_typical_mistakes(kw):
    fails(ch03.momentum_chunk, lambda *a: momentum_masked(*a, **kw), where="relative RMSE")


def test_momentum_chunk_rejects_quotients_of_cumulative_products():
    # right in exact arithmetic, and on mild gates; 0/0 once the products underflow fp32
    fails(ch03.momentum_chunk, lambda *a: momentum_masked(*a, ratio="quotient"), where="theta in [0.02, 0.2]")


@pytest.mark.parametrize("alpha_ratio", ["quotient", "mask_after"])
def test_momentum_chunk_stresses_the_retention_ratios_too(alpha_ratio):
    """The statement's rule holds for D_alpha as for D_theta: a chunk of strong retention gates has them underflow
    (0/0) or overflow above the diagonal (inf * 0)."""
    fails(ch03.momentum_chunk, lambda *a: momentum_masked(*a, alpha_ratio=alpha_ratio),
          where="retention alpha in [0.02, 0.2]")


def test_momentum_chunk_names_the_division_by_zero():
    v = fails(ch03.momentum_chunk, lambda *a: momentum_masked(*a, ratio="quotient"), where="a division by zero")
    assert "never wrote" not in v.message and "log-gates" in v.message, v.message


def test_momentum_chunk_rejects_gd_without_momentum():
    def no_momentum(M0, S0, G, alpha, theta, eta):
        return momentum_loop(M0, torch.zeros_like(S0), G, alpha, torch.zeros_like(theta), eta)
    fails(ch03.momentum_chunk, no_momentum, where="relative RMSE")


# ---- exercise 5: the Triton kernel ----------------------------------------------------------------

@triton.jit
def product_variants(la_ptr, lb_ptr, out_ptr, n, BT: tl.constexpr, MASK_LOADS: tl.constexpr,
                     MASK_STORE: tl.constexpr, VALID_PAIRS: tl.constexpr, EXP_FIRST: tl.constexpr,
                     SWAP: tl.constexpr):
    """D_A D_B by broadcast-and-sum (no tl.dot), with switchable mistakes."""
    i = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BT)
    valid = r < n
    if MASK_LOADS:
        la = tl.load(la_ptr + i * n + r, mask=valid, other=0.0)
        lb = tl.load(lb_ptr + i * n + r, mask=valid, other=0.0)
    else:
        la = tl.load(la_ptr + i * n + r)
        lb = tl.load(lb_ptr + i * n + r)
    keep = r[:, None] >= r[None, :]
    if VALID_PAIRS:
        keep = keep & valid[:, None] & valid[None, :]
    if EXP_FIRST:                                                   # exp of every difference, then a 0/1 mask
        DA = tl.exp(la[:, None] - la[None, :]) * tl.where(keep, 1.0, 0.0)
        DB = tl.exp(lb[:, None] - lb[None, :]) * tl.where(keep, 1.0, 0.0)
    else:
        DA = tl.exp(tl.where(keep, la[:, None] - la[None, :], float("-inf")))
        DB = tl.exp(tl.where(keep, lb[:, None] - lb[None, :], float("-inf")))
    if SWAP:
        W = tl.sum(DB[:, :, None] * DA[None, :, :], axis=1)
    else:
        W = tl.sum(DA[:, :, None] * DB[None, :, :], axis=1)
    if MASK_STORE:
        m = valid[:, None] & valid[None, :]
    else:
        m = (r[:, None] < BT) & (r[None, :] < BT)
    tl.store(out_ptr + i * n * n + r[:, None] * n + r[None, :], W, mask=m)


def product_launcher(mask_loads=True, mask_store=True, valid_pairs=True, exp_first=False, swap=False):
    def launch(la, lb, out):
        N, n = la.shape
        product_variants[(N,)](la, lb, out, n, BT=max(16, triton.next_power_of_2(n)), MASK_LOADS=mask_loads,
                               MASK_STORE=mask_store, VALID_PAIRS=valid_pairs, EXP_FIRST=exp_first, SWAP=swap)
        return out
    return launch


def test_triton_check_passes_a_correct_kernel():
    passes(ch03.triton_decay_product, product_launcher())


@pytest.mark.parametrize("valid_pairs", [False, True])
def test_triton_check_catches_unmasked_loads(valid_pairs):
    """Loads past the end read the NaN guard band. With every pair of a padding row masked away before
    tl.exp (valid_pairs) the NaN never reaches the output, and the load is caught by its address."""
    v = fails(ch03.triton_decay_product, product_launcher(mask_loads=False, valid_pairs=valid_pairs),
              where="past the end of argument")
    assert "your kernel product_variants loaded" in v.message and "mask every load" in v.message, v.message


def test_triton_check_catches_stores_past_the_end():
    fails(ch03.triton_decay_product, product_launcher(mask_store=False), where="compute their addresses")


@pytest.mark.parametrize("kw, where", [
    (dict(valid_pairs=False), "gates in [0.001, 0.05]"),     # padding rows: exp(0 - l_m) overflows, 0 * inf
    (dict(exp_first=True), "gates in [0.001, 0.05]"),        # exp before the mask: inf above the diagonal
    (dict(swap=True), "relative RMSE"),                      # D_B D_A
], ids=["padding_pairs", "exp_before_mask", "swapped_product"])
def test_triton_check_catches_wrong_entries(kw, where):
    v = fails(ch03.triton_decay_product, product_launcher(**kw), where=where)
    if "0.001" in where:        # NaN from inf * 0: the message says where such a NaN comes from
        assert "tl.where(keep, diff, -inf) before tl.exp" in v.message, v.message


def test_triton_check_names_the_load_not_an_overflow():
    """An unmasked load is reported as the load (on the first case, mild gates), not as the NaN of an overflow."""
    v = fails(ch03.triton_decay_product, product_launcher(mask_loads=False, valid_pairs=False), where="loaded")
    assert "gates in [0.5, 1.0]" in v.message and "inf * 0" not in v.message, v.message


# ---- the engine agrees with the answers above (the exercises ask for the library's model) ----------

def test_momentum_answer_is_titans_with_frozen_gradients(gen):
    """With G the chunk's frozen gradients e_i k_i^T, the chunk's memories are what the engine computes."""
    N, n, K, V = 2, 7, 5, 3
    q = F.normalize(torch.randn(N, n, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(N, n, K, generator=gen), dim=-1)
    v = torch.randn(N, n, V, generator=gen)
    M0, S0 = torch.randn(N, V, K, generator=gen), torch.randn(N, V, K, generator=gen)
    alpha, theta = 0.5 + 0.5 * torch.rand(N, n, generator=gen), 0.5 + 0.5 * torch.rand(N, n, generator=gen)
    eta = torch.rand(N, n, generator=gen)
    G = (torch.einsum("nvk,ntk->ntv", M0, k) - v)[..., None] * k[:, :, None, :]
    M, S = momentum_masked(M0, S0, G, alpha, theta, eta)
    o, state = miras(q[:, None], k[:, None], v[:, None], preset="titans", memory="linear", alpha=alpha[:, None],
                     theta=theta[:, None], eta=eta[:, None], initial_state=(M0[:, None], S0[:, None]),
                     output_final_state=True, backend="chunk", chunk_size=n)
    torch.testing.assert_close(torch.einsum("ntvk,ntk->ntv", M, q), o[:, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S, state.momentum[:, 0], rtol=1e-4, atol=1e-5)


# ---- the grader on chapter 3 -----------------------------------------------------------------------

def test_solutions_score_full_marks():
    assert_full_marks(SOLUTION, POINTS, TIMEOUT)


def test_untouched_student_notebook_scores_zero_via_cli():
    assert_student_scores_zero(STUDENT, POINTS, TIMEOUT)


def test_planted_minus_delta_squared_loses_exactly_its_points(tmp_path):
    body = ("e = torch.einsum('bhvk,bhk->bhv', M, k) - v; "
            "psi = torch.where(e.norm(dim=-1, keepdim=True) <= delta[..., None], e, delta[..., None] * torch.sign(e)); "
            "return alpha[..., None, None] * M - eta[..., None, None] * "
            "(psi[..., :, None] * k[..., None, :] - delta[..., None, None] ** 2)")
    assert_planted_loses_its_points(SOLUTION, tmp_path, "yaad_step", body, POINTS)
