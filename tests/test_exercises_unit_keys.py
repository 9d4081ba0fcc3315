"""The checks draw keys (and queries) of uneven norms: an answer that is right only for unit keys fails.

Chapters 1-4 build the rules from arbitrary keys (the mixers normalise theirs before the rule, not in it), so
normalising k inside an answer, dividing by ||k||^2, or using k k^T k = k is a mistake the checks must see.
TRITON_INTERPRET=1 is set by conftest.py.
"""
import torch
import torch.nn.functional as F

from atlaslib.atlas import newton_schulz
from atlaslib.exercises import ch01, ch02, ch03, ch04, ch05
from atlaslib.exercises.checking import uneven_norms


def mv(M, x):
    return torch.einsum("bhvk,bhk->bhv", M, x)


def outer(a, b):
    return a[..., :, None] * b[..., None, :]


def unit(k):
    return F.normalize(k, dim=-1)


def hebbian(M, q, k, v, alpha):
    M_t = alpha[..., None, None] * M + outer(v, k)
    return M_t, mv(M_t, q)


def delta_gradient(M, k, v):
    return outer(mv(M, k) - v, k)


def delta_step(M, k, v, beta, alpha):
    A = alpha[..., None, None] * M
    return A - beta[..., None, None] * outer(mv(A, k) - v, k)


def yaad_step(M, k, v, alpha, eta, delta, scale=lambda k: 1.0):
    e = mv(M, k) - v
    psi = torch.where(e.norm(dim=-1, keepdim=True) <= delta[..., None], e, delta[..., None] * torch.sign(e))
    return alpha[..., None, None] * M - eta[..., None, None] * outer(psi, k) * scale(k)


def omega_step(M, k_win, v_win, gamma, alpha, eta, per_row=lambda k: 1.0):
    errors = k_win @ M.transpose(-1, -2) - v_win                      # [B, H, c, V]
    weighted = gamma[..., None] * errors * per_row(k_win)
    return alpha[..., None, None] * M - eta[..., None, None] * (weighted.transpose(-1, -2) @ k_win)


def atlas_step(M, S, k, v, alpha, eta, theta, ns_steps, key=lambda k: k):
    k = key(k)
    S_t = theta[..., None, None] * S + outer(mv(M, k) - v, k)
    return alpha[..., None, None] * M - eta[..., None, None] * newton_schulz(S_t, ns_steps), S_t


def test_uneven_norms_spreads_the_norms_and_keeps_dtype_and_directions():
    gen = torch.Generator().manual_seed(0)
    k = unit(torch.randn(4, 3, 50, 8, dtype=torch.float64))
    out = uneven_norms(gen, k)
    norms = out.norm(dim=-1)
    assert out.dtype == k.dtype and norms.min() >= 0.6 - 1e-12 and norms.max() <= 1.15 + 1e-12
    assert norms.max() - norms.min() > 0.4                      # not one common scale
    torch.testing.assert_close(unit(out), k)


def test_correct_answers_still_pass():
    assert ch01.hebbian_step.evaluate(hebbian).status == "passed"
    assert ch02.delta_step.evaluate(delta_gradient, delta_step).status == "passed"
    assert ch03.yaad_step.evaluate(yaad_step).status == "passed"
    assert ch04.omega_step.evaluate(omega_step).status == "passed"
    assert ch05.atlas_step.evaluate(atlas_step).status == "passed"


def test_answers_that_assume_unit_keys_fail():
    def normalised(fn, position):
        def answer(*args):
            args = list(args)
            args[position] = unit(args[position])
            return fn(*args)
        return answer

    wrong = {
        "ch01 hebbian_step, k normalised": ch01.hebbian_step.evaluate(normalised(hebbian, 2)),
        # (M - v k^T) k k^T: the gradient (Mk - v) k^T only when ||k|| = 1
        "ch02 gradient factored": ch02.delta_step.evaluate(lambda M, k, v: (M - outer(v, k)) @ outer(k, k),
                                                           delta_step),
        "ch02 delta_step, k normalised": ch02.delta_step.evaluate(delta_gradient, normalised(delta_step, 1)),
        "ch03 yaad_step over ||k||": ch03.yaad_step.evaluate(
            lambda *a: yaad_step(*a, scale=lambda k: 1 / k.norm(dim=-1)[..., None, None])),
        "ch04 omega_step over ||k_i||^2": ch04.omega_step.evaluate(
            lambda *a: omega_step(*a, per_row=lambda k: 1 / k.square().sum(-1, keepdim=True))),
        "ch05 atlas_step, k normalised": ch05.atlas_step.evaluate(lambda *a: atlas_step(*a, key=unit)),
    }
    for name, verdict in wrong.items():
        assert verdict.status == "failed", (name, verdict.message)
    # an O(1) difference: not taken for float32's rounding
    assert "float32" not in wrong["ch05 atlas_step, k normalised"].message
