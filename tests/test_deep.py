"""Chapter 6 (library part): phi*, the linear DeepTransformer and SWDT.

Every form is compared with references written here from the definitions, on fresh random
inputs: the Taylor kernel with sum_n (x.y)^n / n!, the kernel trick with softmax attention and
unnormalised attention written out, every backend and option with one dense masked sum whose
decays are products of the gates (not logs), and the gradients of chunk vs recurrent.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from atlaslib.core import assert_close, random_gate, random_qkv, rel_rmse, softmax_attention
from atlaslib.core.testing import largest_tensor
from atlaslib.delta import delta_rule
from atlaslib.deep import (MAX_EXPONENT, deep_transformer, dot, dot_coefficient_recurrent, exp_feature_dim,
                           exp_features)
from atlaslib.linear import linear_attention

F64 = torch.float64


def taylor_exp(s, P):
    return sum(s ** n / math.factorial(n) for n in range(P + 1))


# ----------------------------------------------------------------------------- phi*_P

@pytest.mark.parametrize("d, P", [(1, 3), (3, 0), (3, 2), (4, 3), (5, 4)])
@pytest.mark.parametrize("compressed", [True, False])
def test_exp_features_kernel_values(gen, d, P, compressed):
    x, y = torch.randn(6, d, generator=gen, dtype=F64), torch.randn(6, d, generator=gen, dtype=F64)
    fx, fy = exp_features(x, P, compressed=compressed), exp_features(y, P, compressed=compressed)
    want_dim = math.comb(d + P, P) if compressed else sum(d ** n for n in range(P + 1))
    assert fx.shape == (6, want_dim) and exp_feature_dim(d, P, compressed=compressed) == want_dim
    assert_close((fx * fy).sum(-1), taylor_exp((x * y).sum(-1), P), tol=1e-13)


def test_exp_features_dimensions():
    # sum_{n <= P} d^n at d = 3 (chapter 6 §1 prints the sizes for d = 5 and d = 64)
    assert [exp_feature_dim(3, P, compressed=False) for P in (1, 2, 3, 4, 6, 8)] == [4, 13, 40, 121, 1093, 9841]
    assert exp_feature_dim(128, 2) == 8385


def test_taylor_truncation_error_on_unit_vectors(gen):
    """|phi*_P(x).phi*_P(y) - exp(x.y)| <= e / (P + 1)! for |x.y| <= 1, and it really shrinks with P."""
    x = torch.nn.functional.normalize(torch.randn(200, 3, generator=gen, dtype=F64), dim=-1)
    y = torch.nn.functional.normalize(torch.randn(200, 3, generator=gen, dtype=F64), dim=-1)
    exact = torch.exp((x * y).sum(-1))
    errors = []
    for P in (1, 2, 3, 4, 6, 8):
        err = ((exp_features(x, P) * exp_features(y, P)).sum(-1) - exact).abs().max().item()
        assert err <= math.e / math.factorial(P + 1)
        errors.append(err)
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[0] > 0.05                                      # the check can fail: P = 1 is visibly wrong


# ----------------------------------------------------------------------------- references

def dense_reference(q, k, v, alpha, eta, window, kappa, normalize, h0=None, fq=None):
    """y_t = A_t M_0 phi(q_t) + sum_{i in window(t)} eta_i (alpha_{i+1} ... alpha_t) kappa(q_t, k_i) v_i, fp64,
    with the decay a plain product of the gates; normalised: divided by the same sum with v = 1."""
    B, H, T, _ = q.shape
    q, k, v = q.double(), k.double(), v.double()
    one = torch.ones(B, H, T, dtype=F64)
    alpha = one if alpha is None else alpha.double()
    eta = one if eta is None else eta.double()
    out = torch.zeros(B, H, T, v.shape[-1], dtype=F64)
    for t in range(T):
        num = torch.zeros(B, H, v.shape[-1], dtype=F64)
        den = torch.zeros(B, H, dtype=F64)
        for i in range(0 if window is None else max(0, t - window + 1), t + 1):
            w = eta[:, :, i] * torch.prod(alpha[:, :, i + 1:t + 1], dim=-1) * kappa(q[:, :, t], k[:, :, i])
            num, den = num + w[..., None] * v[:, :, i], den + w
        if h0 is not None:
            start = torch.prod(alpha[:, :, :t + 1], dim=-1)[..., None, None] * h0.double()
            read = (start @ fq[:, :, t, :, None].double())[..., 0]
            num, den = num + read[..., :-1] if normalize else num + read, den + read[..., -1] if normalize else den
        out[:, :, t] = num / den[..., None] if normalize else num
    return out


def kappa_of(phi_star):
    if phi_star == "kernel":
        return lambda x, y: torch.exp((x * y).sum(-1))
    return lambda x, y: taylor_exp((x * y).sum(-1), phi_star[1])


def make_inputs(gen, B=2, H=2, T=37, K=5, V=3, gates=True):
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    alpha = random_gate(B, H, T, low=0.7, dtype=F64, generator=gen) if gates else None
    eta = (0.2 + torch.rand(B, H, T, generator=gen, dtype=F64)) if gates else None
    return q, k, v, alpha, eta


# ----------------------------------------------------------------------------- exact reductions

@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_kernel_normalised_is_softmax_attention(gen, backend):
    """alpha = eta = 1, phi* exact, with the normaliser: causal softmax attention (1/sqrt(d) folded into q)."""
    B, H, T, K, V = 2, 3, 41, 7, 5
    q, k, v = (torch.randn(s, generator=gen, dtype=F64) for s in ((B, H, T, K), (B, H, T, K), (B, H, T, V)))
    scale = 1 / math.sqrt(K)
    s = (q @ k.mT) * scale
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    want = s.softmax(-1) @ v                                     # written here, in fp64
    got, _ = deep_transformer(q * scale, k, v, phi_star="kernel", normalize=True, backend=backend, chunk_size=8)
    assert_close(got, want, tol=1e-12)
    got32, _ = deep_transformer((q * scale).float(), k.float(), v.float(), normalize=True, backend=backend)
    assert_close(got32, softmax_attention(q.float(), k.float(), v.float()), tol=1e-5)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_kernel_unnormalised_is_exp_attention(gen, backend):
    q, k, v, _, _ = make_inputs(gen, gates=False)
    T = q.shape[2]
    want = (torch.exp(q @ k.mT) * torch.ones(T, T, dtype=F64).tril()) @ v
    got, _ = deep_transformer(q, k, v, phi_star="kernel", backend=backend, chunk_size=6)
    assert_close(got, want, tol=1e-12)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_sliding_window_softmax(gen, backend):
    q, k, v, _, _ = make_inputs(gen, gates=False)
    got, _ = deep_transformer(q, k, v, normalize=True, window=6, backend=backend, chunk_size=4)
    assert_close(got, softmax_attention(q, k, v, window=6, scale=1.0), tol=1e-12)
    assert_close(got, dense_reference(q, k, v, None, None, 6, kappa_of("kernel"), True), tol=1e-12)


@pytest.mark.parametrize("phi_star", ["kernel", ("taylor", 2)])
def test_window_at_least_T_is_the_deep_transformer(gen, phi_star):
    q, k, v, alpha, eta = make_inputs(gen, T=19)
    full, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=phi_star)
    for c in (19, 50):
        windowed, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=phi_star, window=c)
        assert_close(windowed, full, tol=1e-12)
    short, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=phi_star, window=3)
    assert (short - full).abs().max() > 1e-3                     # the window does drop pairs


def test_taylor_converges_to_kernel(gen):
    """On unit q, k the truncated model approaches the exact one; the error stays within the kernel bound."""
    q, k, v, alpha, eta = make_inputs(gen, T=23)
    exact, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star="kernel")
    scale = dense_reference(q, k, v.abs(), alpha, eta, None, kappa_of("kernel"), False)
    errors = []
    for P in (1, 2, 4, 6):
        approx, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P))
        err = (approx - exact).abs().max().item()
        # each kernel value is off by at most e/(P+1)! relative to exp(.) >= 1/e
        assert err <= math.e ** 2 / math.factorial(P + 1) * scale.abs().max().item()
        errors.append(err)
    assert all(a > b for a, b in zip(errors, errors[1:])) and errors[-1] < 1e-3 * errors[0]


# ----------------------------------------------------------------------------- every form, every option

@pytest.mark.parametrize("phi_star", ["kernel", ("taylor", 2), ("taylor", 3)])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("window", [None, 1, 5])
def test_recurrent_and_chunk_match_the_dense_reference(gen, phi_star, normalize, window):
    q, k, v, alpha, eta = make_inputs(gen, B=1, H=2, T=37, K=5, V=3)
    want = dense_reference(q, k, v, alpha, eta, window, kappa_of(phi_star), normalize)
    for backend, b in (("recurrent", 64), ("chunk", 1), ("chunk", 8), ("chunk", 64)):
        got, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=phi_star, normalize=normalize,
                                  window=window, backend=backend, chunk_size=b)
        assert_close(got, want, tol=1e-11, name=f"{backend}({b})")


def test_log_alpha_and_numbers(gen):
    q, k, v, alpha, eta = make_inputs(gen, T=13)
    for phi_star in ("kernel", ("taylor", 2)):
        a, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=phi_star)
        b, _ = deep_transformer(q, k, v, log_alpha=alpha.log(), eta=eta, phi_star=phi_star)
        assert_close(b, a, tol=1e-12)
        c, _ = deep_transformer(q, k, v, alpha=0.9, eta=0.5, phi_star=phi_star, backend="recurrent")
        d, _ = deep_transformer(q, k, v, alpha=torch.full_like(alpha, 0.9), eta=torch.full_like(eta, 0.5),
                                phi_star=phi_star)
        assert_close(c, d, tol=1e-12)


@pytest.mark.parametrize("normalize", [False, True])
def test_taylor_state_in_and_out(gen, normalize):
    """The matrix memory on phi*_P: start state read at every step, final state = the sum written out."""
    P = 2
    q, k, v, alpha, eta = make_inputs(gen, T=29, K=4, V=3)
    D = exp_feature_dim(4, P)
    Vs = 4 if normalize else 3
    h0 = 0.1 * torch.randn(2, 2, Vs, D, generator=gen, dtype=F64)
    if normalize:
        h0[:, :, -1] = exp_features(torch.zeros(4, dtype=F64), P)     # a positive z_0 (z_0.phi(q) = 1 for all q)
    fq, fk = exp_features(q, P), exp_features(k, P)
    want = dense_reference(q, k, v, alpha, eta, None, kappa_of(("taylor", P)), normalize, h0=h0, fq=fq)
    vv = torch.cat([v, torch.ones_like(v[..., :1])], -1) if normalize else v
    A = torch.prod(alpha, -1)
    tail = torch.stack([torch.prod(alpha[:, :, i + 1:], -1) for i in range(29)], -1)   # alpha_{i+1} ... alpha_T
    M_T = A[..., None, None] * h0 + torch.einsum("bht,bhtv,bhtd->bhvd", tail * eta, vv, fk)
    for backend, b in (("recurrent", 64), ("chunk", 5)):
        o, state = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P), normalize=normalize,
                                    initial_state=h0, output_final_state=True, backend=backend, chunk_size=b)
        assert_close(o, want, tol=1e-11, name=backend)
        assert_close(state.memory, M_T, tol=1e-11, name=f"{backend} state")


@pytest.mark.parametrize("phi_star, normalize, window", [("kernel", True, None), ("kernel", False, 4),
                                                         (("taylor", 2), False, None), (("taylor", 2), True, 3)])
def test_gradients_chunk_vs_recurrent(gen, phi_star, normalize, window):
    q, k, v, alpha, eta = make_inputs(gen, B=1, H=2, T=17, K=3, V=2)
    grads = []
    for backend in ("recurrent", "chunk"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, alpha, eta)]
        o, _ = deep_transformer(xs[0], xs[1], xs[2], alpha=xs[3], eta=xs[4], phi_star=phi_star, normalize=normalize,
                                window=window, backend=backend, chunk_size=5)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(0), dtype=F64)
        grads.append(torch.autograd.grad((o * w).sum(), xs))
    for name, a, b in zip("q k v alpha eta".split(), *grads):
        assert_close(a, b, tol=1e-10, name=f"d/d{name}")
        assert b.abs().sum() > 0


def test_fp32_inputs(gen):
    q, k, v, alpha, eta = make_inputs(gen, T=33)
    for phi_star in ("kernel", ("taylor", 2)):
        want, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=phi_star, normalize=True)
        for backend in ("recurrent", "chunk"):
            got, _ = deep_transformer(q.float(), k.float(), v.float(), alpha=alpha.float(), eta=eta.float(),
                                      phi_star=phi_star, normalize=True, backend=backend)
            assert got.dtype == torch.float32
            assert_close(got, want.float(), tol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
def test_strong_decays_in_fp32(gen, window):
    """Gates in [0.05, 0.3]: the exponents of old keys fall hundreds below exp's range, where the chunk
    forms flush the weights to 0 (``exp_flushed``); the outputs still match the fp64 definition."""
    q, k, v = random_qkv(1, 2, 90, 5, 3, dtype=F64, generator=gen)
    alpha = random_gate(1, 2, 90, low=0.05, high=0.3, dtype=F64, generator=gen)
    eta = 0.2 + 0.8 * torch.rand(1, 2, 90, generator=gen, dtype=F64)          # eta <= 1 + alpha (DOT's check)
    assert torch.log(alpha).sum(-1).max() < -100                    # old keys reach the flushed range
    for normalize in (False, True):
        want = dense_reference(q, k, v, alpha, eta, window, kappa_of("kernel"), normalize)
        for b in (1, 16, 64):
            got, _ = deep_transformer(q.float(), k.float(), v.float(), alpha=alpha.float(), eta=eta.float(),
                                      normalize=normalize, window=window, backend="chunk", chunk_size=b)
            assert_close(got, want.float(), tol=1e-5, name=f"chunk({b})")
    want, _ = dot(q, k, v, alpha=alpha, eta=eta, backend="recurrent")
    for b in (1, 16, 64):
        got, _ = dot(q.float(), k.float(), v.float(), alpha=alpha.float(), eta=eta.float(), backend="chunk",
                     chunk_size=b)
        assert_close(got, want.float(), tol=1e-5, name=f"dot chunk({b})")


def decayed_attention_from_logs(q, k, v, log_alpha, normalize):
    """y_t = sum_{i<=t} e^{sum_{i<j<=t} log alpha_j} exp(k_i . q_t) v_i (over the same sum of weights with
    normalize), every decay summed afresh over (i, t] in fp64."""
    T = q.shape[2]
    L = log_alpha.double()
    decay = torch.full((*L.shape[:2], T, T), float("-inf"), dtype=F64)
    for t in range(T):
        for i in range(t + 1):
            decay[:, :, t, i] = L[:, :, i + 1:t + 1].sum(-1)
    W = torch.exp(decay + q.double() @ k.double().mT)
    y = W @ v.double()
    return y / W.sum(-1, keepdim=True) if normalize else y


@pytest.mark.parametrize("normalize", [False, True])
def test_decays_after_a_long_strong_run_keep_their_digits_in_fp32(gen, normalize):
    """fp32 inputs: 128 tokens of log alpha = -60 push the running log-decay g to -7680, where fp32 steps
    by 5e-4; the last 50 tokens decay gently, so their weights depend on differences of g that an fp32
    running sum would round by up to 2.5e-4 per token (g is summed in fp64). The strong run ends on a
    block boundary of both chunk sizes: a strong decay inside a block costs digits (``split_decay``)."""
    B, H, T, K, V = 1, 2, 178, 4, 3
    q, k = (0.5 * torch.randn(2, B, H, T, K, generator=gen)).unbind(0)
    v = torch.randn(B, H, T, V, generator=gen)
    log_alpha = -0.3 * torch.rand(B, H, T, generator=gen)
    log_alpha[..., :128] = -60.0
    want = decayed_attention_from_logs(q, k, v, log_alpha, normalize)
    for b in (16, 64):
        got, _ = deep_transformer(q, k, v, log_alpha=log_alpha, normalize=normalize, backend="chunk", chunk_size=b)
        assert got.dtype == torch.float32
        assert_close(got[:, :, 128:], want[:, :, 128:].float(), tol=1e-5, name=f"chunk({b}), gentle tokens")


def test_exp_flushed_zeroes_only_below_the_normal_range():
    from atlaslib.deep.chunk import exp_flushed
    for dtype in (torch.float32, F64):
        tiny = torch.finfo(dtype).tiny
        S = torch.tensor([0.0, 3.5, -1.0, -80.0, math.log(tiny) + 1.5, math.log(tiny) + 0.5, math.log(tiny),
                          -200.0, -1000.0, -math.inf], dtype=dtype)
        want = torch.exp(S.double())
        want[want < math.e * tiny] = 0
        got = exp_flushed(S.clone())
        assert torch.equal(got == 0, want == 0) and int((want == 0).sum()) >= 4      # -inf, and below the edge
        assert_close(got.double(), want, tol=1e-6 if dtype == torch.float32 else 1e-14)


@pytest.mark.parametrize("B, H, T, K, V", [(1, 1, 1, 3, 2), (1, 3, 2, 1, 4), (3, 1, 9, 6, 1)])
def test_odd_shapes(gen, B, H, T, K, V):
    """T = 1, T < chunk, K = 1, V = 1, B*H > 1: recurrent == chunk for both models and both phi*."""
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    alpha = random_gate(B, H, T, low=0.7, dtype=F64, generator=gen)
    for phi_star in ("kernel", ("taylor", 2)):
        for fn, kw in ((deep_transformer, {"normalize": True, "window": 2}), (deep_transformer, {}),
                       (dot, {"eta": 0.5})):
            a, _ = fn(q, k, v, alpha=alpha, phi_star=phi_star, backend="recurrent", **kw)
            b, _ = fn(q, k, v, alpha=alpha, phi_star=phi_star, backend="chunk", chunk_size=2, **kw)
            assert a.shape == (B, H, T, V)
            assert_close(b, a, tol=1e-12, name=f"{fn.__name__} {phi_star} {kw}")


def test_bf16_inputs_compute_in_fp32(gen):
    q, k, v, alpha, eta = make_inputs(gen, T=21)
    for phi_star in ("kernel", ("taylor", 2)):
        bf = [x.bfloat16() for x in (q, k, v)]
        want, _ = deep_transformer(*[x.double() for x in bf], alpha=alpha, eta=eta, phi_star=phi_star,
                                   normalize=True)
        got, _ = deep_transformer(*bf, alpha=alpha.float(), eta=eta.float(), phi_star=phi_star, normalize=True)
        assert got.dtype == torch.bfloat16
        assert_close(got, want.bfloat16(), tol=2e-2)
        got, _ = dot(*bf, alpha=alpha.float(), eta=0.5 * eta.float(), phi_star=phi_star)
        want, _ = dot(*[x.double() for x in bf], alpha=alpha, eta=0.5 * eta, phi_star=phi_star)
        assert got.dtype == torch.bfloat16
        assert_close(got, want.bfloat16(), tol=2e-2)


# ----------------------------------------------------------------------------- overflow and bad input

def test_large_scores(gen):
    """Scores far above exp's range: refused unnormalised, exact with the normaliser (row-max shift)."""
    q, k, v, _, _ = make_inputs(gen, T=21)
    q, k = 40 * q, 40 * k                                         # k.q up to 1600: exp overflows even fp64
    with pytest.raises(ValueError, match="overflow"):
        deep_transformer(q, k, v)
    s = (q @ k.mT).masked_fill(~torch.ones(21, 21, dtype=torch.bool).tril(), -math.inf)
    for backend in ("recurrent", "chunk"):
        got, _ = deep_transformer(q, k, v, normalize=True, backend=backend, chunk_size=4)
        assert torch.isfinite(got).all()
        assert_close(got, s.softmax(-1) @ v, tol=1e-12)
        got32, _ = deep_transformer(q.float(), k.float(), v.float(), normalize=True, backend=backend)
        assert_close(got32, (s.softmax(-1) @ v).float(), tol=1e-4)
    small, _ = deep_transformer(q / 40, k / 40, v)                    # unit q, k: allowed
    assert torch.isfinite(small).all() and MAX_EXPONENT == 80.0


def test_long_vectors_with_small_scores_are_allowed(gen):
    """|q| |k| = 900 fails the cheap bound (max|q| max|k| <= MAX_EXPONENT), so the exact check decides:
    q along e_1, k along e_2, every score k_i^T q_t small; allowed, and exact. Turned to e_1, refused."""
    q, k, v, _, _ = make_inputs(gen, T=15, K=5)
    q[..., 0], k[..., 1] = 30.0, 30.0
    q[..., 1], k[..., 0] = 0.0, 0.0
    s = (q @ k.mT).masked_fill(~torch.ones(15, 15, dtype=torch.bool).tril(), -math.inf)
    assert s.max() < 5 and s.tril().abs().max() < 5
    for backend in ("recurrent", "chunk"):
        got, _ = deep_transformer(q, k, v, backend=backend, chunk_size=4)
        assert_close(got, s.exp() @ v, tol=1e-12)
    k[..., 0] = 30.0                                                  # scores near 900
    with pytest.raises(ValueError, match="overflow"):
        deep_transformer(q, k, v)


@pytest.mark.parametrize("window", [None, 5])
def test_exponent_check_memory_does_not_grow_as_T_squared(gen, window):
    """Long q and k whose scores are all 0 fail the norm bound, so the exact check runs: its largest
    tensor stays far below one [B, H, T, T] score matrix. A visible score above MAX_EXPONENT is still
    refused with the same message; with a window, one outside it is not."""
    from atlaslib.deep.validation import check_exponents
    B, H, T, K = 1, 2, 2048, 4
    q = torch.zeros(B, H, T, K, dtype=torch.float32)
    k = torch.zeros(B, H, T, K, dtype=torch.float32)
    q[..., 0], k[..., 1] = 30.0, 30.0                                 # |q| |k| = 900, every score 0
    most = largest_tensor(check_exponents, q, k, window)
    assert most <= B * H * T * T // 4, most
    k[:, :, T - 1, 0] = 30.0                                          # k_{T-1} . q_{T-1} = 900
    with pytest.raises(ValueError, match="phi_star='kernel' without normalize: a score .* exceeds 80"):
        check_exponents(q, k, window)
    k[:, :, T - 1, 0], k[:, :, 100, 0] = 0.0, 30.0                     # seen by t >= 100 only
    if window is None:
        with pytest.raises(ValueError, match="overflow"):
            check_exponents(q, k, window)
    else:
        q[:, :, 100:105] = 0.0                                        # the rows whose window holds key 100
        check_exponents(q, k, window)


def test_exponent_and_step_checks_on_an_accelerator_assert_on_the_device(monkeypatch):
    """The branch CUDA tensors take (declared here for CPU tensors, where torch._assert_async raises at
    once): the exponent check still tiles, and both checks fail on the device with their message."""
    import atlaslib.deep as deep
    from atlaslib.deep import validation as problem
    monkeypatch.setattr(problem, "_value_check", lambda x: "device")
    monkeypatch.setattr(deep, "_value_check", lambda x: "device")
    B, H, T, K = 1, 2, 2048, 4
    q, k = torch.zeros(B, H, T, K), torch.zeros(B, H, T, K)
    q[..., 0], k[..., 1] = 30.0, 30.0
    assert largest_tensor(problem.check_exponents, q, k, None) <= B * H * T * T // 4
    k[:, :, 5, 0] = 30.0
    with pytest.raises(RuntimeError, match="a score k_i\\^T q_t exceeds 80"):
        problem.check_exponents(q, k, None)
    deep.check_dot_step(torch.full((B, H, T), 1.2), torch.full((B, H, T), 0.2))
    with pytest.raises(RuntimeError, match=r"dot: eta must be at most 1 \+ alpha"):
        deep.check_dot_step(torch.full((B, H, T), 1.3), torch.full((B, H, T), 0.2))
    deep.check_positive_alpha(torch.full((B, H, T), 0.5))
    alpha = torch.full((B, H, T), 0.5)
    alpha[0, 1, 7] = 0.0                                       # passed unchecked on a GPU (host branch only)
    with pytest.raises(RuntimeError, match=r"dot: alpha must lie in \(0, 1\]"):
        deep.check_positive_alpha(alpha)


@pytest.mark.parametrize("window", [None, 1, 4, 40])
def test_exponent_check_tiles_find_the_largest_visible_score(gen, window, monkeypatch):
    """The tiled maximum (forced into many small tiles) against the dense masked maximum."""
    from atlaslib.deep import validation as problem
    monkeypatch.setattr(problem, "TILE_ELEMENTS", 2 * 3 * 37 * 3)     # 3 rows per tile
    q, k = (torch.randn(2, 3, 37, 5, generator=gen, dtype=F64) * 4 for _ in range(2))
    t, i = torch.arange(37)[:, None], torch.arange(37)[None, :]
    ok = (i <= t) & ((i > t - window) if window is not None else True)
    want = (q @ k.mT).masked_fill(~ok, -math.inf).amax()
    assert_close(problem._top_score(q, k, window), want.float(), tol=1e-6)


def test_windowed_exponent_check_costs_linear_in_the_length():
    """With a window each tile of query rows sees rows + window - 1 keys, so the tiles are sized by that
    span: four times the length is about four times the ops (tiles sized by T gave sixteen)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from atlaslib.deep import validation as problem

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def ops(T):
        q = k = torch.ones(1, 2, T, 4)
        with CountOps() as mode:
            mode.n = 0
            problem._top_score(q, k, 16)
        return mode.n

    assert ops(4096) < 5 * ops(1024), (ops(1024), ops(4096))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"memory": "residual"}, ValueError, "memory"),
    ({"phi_star": ("taylor", -1)}, ValueError, "phi_star"),
    ({"phi_star": ("taylor", 2.0)}, TypeError, "phi_star"),
    ({"phi_star": "exp"}, ValueError, "phi_star"),
    ({"window": 0}, ValueError, "window"),
    ({"window": 2.5}, TypeError, "window"),
    ({"alpha": 1.5}, ValueError, "alpha"),
    ({"eta": -0.1}, ValueError, "eta"),
    ({"alpha": torch.ones(2, 2, 9)}, ValueError, "alpha"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"backend": "triton", "phi_star": ("taylor", 2), "window": 3}, ValueError, "Triton kernels take phi_star"),
    ({"backend": "triton", "phi_star": ("taylor", 2)}, TypeError, "float64"),
    ({"backend": "triton"}, TypeError, "float64"),              # these inputs are fp64; the kernel is fp32
    ({"backend": "fast"}, ValueError, "backend"),
    ({"output_final_state": True}, ValueError, "output_final_state"),
    ({"phi_star": ("taylor", 2), "window": 3, "output_final_state": True}, ValueError, "window"),
    ({"phi_star": ("taylor", 2), "initial_state": torch.zeros(2, 2, 3, 5)}, ValueError, "initial_state"),
])
def test_bad_input(gen, kwargs, error, match):
    q, k, v = random_qkv(2, 2, 8, 4, 3, dtype=F64, generator=gen)
    with pytest.raises(error, match=match):
        deep_transformer(q, k, v, **kwargs)


def test_bad_qkv_and_order(gen):
    q, k, v = random_qkv(2, 2, 8, 4, 3, generator=gen)
    with pytest.raises(ValueError, match="v must have shape"):
        deep_transformer(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="degree"):
        exp_features(q, -1)
    with pytest.raises(TypeError, match="x must be"):
        exp_features(torch.ones(3, dtype=torch.long), 2)


# ----------------------------------------------------------------------------- DOT (c = 1, linear memory)

def dot_matrix_reference(q, k, v, alpha, eta, P):
    """M_t = alpha_t M_{t-1} - eta_t (M_{t-1} phi(k_t) - v_t) phi(k_t)^T on phi*_P, y_t = M_t phi(q_t), fp64."""
    fq, fk = exp_features(q.double(), P), exp_features(k.double(), P)
    B, H, T, D = fq.shape
    M = torch.zeros(B, H, v.shape[-1], D, dtype=F64)
    out = []
    for t in range(T):
        err = (M @ fk[:, :, t, :, None])[..., 0] - v[:, :, t].double()
        M = alpha[:, :, t, None, None] * M - eta[:, :, t, None, None] * err[..., None] * fk[:, :, t, None, :]
        out.append((M @ fq[:, :, t, :, None])[..., 0])
    return torch.stack(out, 2)


def dot_inputs(gen, T=37, K=4, V=3):
    q, k, v = random_qkv(2, 2, T, K, V, dtype=F64, generator=gen)
    alpha = random_gate(2, 2, T, low=0.7, dtype=F64, generator=gen)
    eta = 0.1 + 0.5 * torch.rand(2, 2, T, generator=gen, dtype=F64)           # eta e <= 2: stable
    return q, k, v, alpha, eta


@pytest.mark.parametrize("P", [1, 2, 3])
def test_dot_taylor_matches_the_matrix_definition(gen, P):
    q, k, v, alpha, eta = dot_inputs(gen)
    want = dot_matrix_reference(q, k, v, alpha, eta, P)
    for backend, b in (("recurrent", 64), ("chunk", 1), ("chunk", 6), ("chunk", 64)):
        got, _ = dot(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P), backend=backend, chunk_size=b)
        assert_close(got, want, tol=1e-11, name=f"{backend}({b})")
    coeffs, _ = dot_coefficient_recurrent(exp_features(q, P), exp_features(k, P), v, alpha, eta, kernel="dot")
    assert_close(coeffs, want, tol=1e-11, name="coefficient form on features")


@pytest.mark.parametrize("numbers", [True, False])
def test_dot_step_is_checked_by_dots_own_condition(gen, numbers):
    """eta = 0.5, alpha = 0.2 is stable for DOT (eta |phi*(k)|^2 <= 1 + alpha for these keys) although
    eta / alpha exceeds the delta rule's cap of 2: both forms take it, and the Taylor form matches the
    matrix definition. eta > 1 + alpha overshoots for every key: both forms refuse it, naming eta and alpha."""
    B, H, T, K, V, P = 2, 2, 23, 4, 3, 2
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    k = 0.5 * k / k.norm(dim=-1, keepdim=True)                    # |phi*(k)|^2 = e^0.25 < 2.4
    def full(x):
        return torch.full((B, H, T), x, dtype=F64)
    eta, alpha = (0.5, 0.2) if numbers else (full(0.5), full(0.2))
    want = dot_matrix_reference(q, k, v, full(0.2), full(0.5), P)
    for backend in ("recurrent", "chunk"):
        got, _ = dot(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P), backend=backend)
        assert_close(got, want, tol=1e-11, name=backend)
    exact, _ = dot(q, k, v, alpha=alpha, eta=eta, backend="recurrent")
    chunk, _ = dot(q, k, v, alpha=alpha, eta=eta, backend="chunk")
    assert_close(chunk, exact, tol=1e-11)
    eta = 1.3 if numbers else full(0.5).index_put_((torch.tensor(1), torch.tensor(0), torch.tensor(7)),
                                                     torch.tensor(1.3, dtype=F64))
    for phi_star in (("taylor", P), "kernel"):
        with pytest.raises(ValueError, match=r"dot: eta must be at most 1 \+ alpha") as err:
            dot(q, k, v, alpha=alpha, eta=eta, phi_star=phi_star)
        assert "beta" not in str(err.value)


def test_dot_without_retention_is_the_delta_rule_on_features(gen):
    q, k, v, _, eta = dot_inputs(gen, T=29)
    P = 2
    want, _ = delta_rule(exp_features(q, P), exp_features(k, P), v, eta)
    got, _ = dot(q, k, v, eta=eta, phi_star=("taylor", P))
    assert_close(got, want, tol=1e-12)
    one, _ = dot(q, k, v, alpha=1.0, eta=eta, phi_star=("taylor", P), backend="recurrent")
    assert_close(one, want, tol=1e-12)


@pytest.mark.parametrize("gates", [False, True])
def test_dot_kernel_chunk_matches_recurrent(gen, gates):
    q, k, v, alpha, eta = dot_inputs(gen)
    alpha, eta = (alpha, eta) if gates else (None, 0.4)
    want, _ = dot(q, k, v, alpha=alpha, eta=eta, backend="recurrent")
    for b in (1, 5, 16, 64):
        got, _ = dot(q, k, v, alpha=alpha, eta=eta, backend="chunk", chunk_size=b)
        assert_close(got, want, tol=1e-11, name=f"chunk({b})")


def test_dot_taylor_converges_to_kernel(gen):
    q, k, v, alpha, eta = dot_inputs(gen, T=25)
    exact, _ = dot(q, k, v, alpha=alpha, eta=eta)
    errors = [(dot(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P))[0] - exact).abs().max().item()
              for P in (1, 2, 4, 6, 8)]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[0] > 1e-2 and errors[-1] < 1e-4 * exact.abs().max().item()


def test_dot_kernel_one_step_read(gen):
    """The corrected [A] eq. 30-31 at alpha = 1: y_t = M_{t-1} phi*(q_t) + eta_t (v_t - M_{t-1} phi*(k_t)) exp(k_t.q_t),
    checked against coefficients rebuilt token by token here and read with exp(k_j . q_t)."""
    q, k, v, _, eta = dot_inputs(gen, T=9)
    y, _ = dot(q, k, v, eta=eta, backend="chunk", chunk_size=4)
    # rebuild the coefficients token by token from the definition, independently of the library
    U = []
    for t in range(9):
        prev = lambda x: sum(u * torch.exp((k[:, :, j] * x).sum(-1))[..., None] for j, u in enumerate(U))  # noqa: E731
        pred_k = prev(k[:, :, t]) if U else torch.zeros_like(v[:, :, t])
        read_prev = prev(q[:, :, t]) if U else torch.zeros_like(v[:, :, t])
        step = eta[:, :, t, None] * (v[:, :, t] - pred_k)
        assert_close(y[:, :, t], read_prev + step * torch.exp((k[:, :, t] * q[:, :, t]).sum(-1))[..., None], tol=1e-12)
        U.append(step)


def test_dot_gradients_chunk_vs_recurrent(gen):
    q, k, v, alpha, eta = dot_inputs(gen, T=13, K=3, V=2)
    grads = []
    for backend in ("recurrent", "chunk"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, alpha, eta)]
        o, _ = dot(xs[0], xs[1], xs[2], alpha=xs[3], eta=xs[4], backend=backend, chunk_size=4)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
        grads.append(torch.autograd.grad((o * w).sum(), xs))
    for name, a, b in zip("q k v alpha eta".split(), *grads):
        assert_close(a, b, tol=1e-10, name=f"d/d{name}")
        assert b.abs().sum() > 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"window": 2, "gamma": torch.ones(2, 2, 8, 3)}, ValueError, "gamma"),
    ({"window": 0}, ValueError, "window"),
    ({"alpha": 0.0}, ValueError, "alpha"),
    ({"alpha": torch.zeros(2, 2, 8)}, ValueError, "alpha"),
    ({"eta": -1.0}, ValueError, "eta"),
    ({"memory": "residual"}, ValueError, "memory"),
    ({"phi_star": ("taylor", -2)}, ValueError, "phi_star"),
    ({"backend": "triton"}, TypeError, "float64"),             # these inputs are fp64; the kernel is fp32
    ({"backend": "triton", "phi_star": ("taylor", 2)}, TypeError, "float64"),   # chapter 2's kernel: fp32 too
    ({"chunk_size": 0}, ValueError, "chunk_size"),
])
def test_dot_bad_input(gen, kwargs, error, match):
    q, k, v = random_qkv(2, 2, 8, 4, 3, dtype=F64, generator=gen)
    with pytest.raises(error, match=match):
        dot(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="overflow"):
        dot(20 * q, 20 * k, v)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("model", ["linear_attention", "deep_transformer"])
def test_normalized_bf16_output_is_rounded_once(gen, model, backend):
    """With normalize=True the PyTorch forms keep numerator and denominator in fp32 and round the bf16 quotient
    once: within rounding of the exact quotient of the same bf16 inputs (linear attention's forms and the
    DeepTransformer's recurrent form rounded numerator and denominator first, about twice the error)."""
    B, H, T, K = 1, 2, 128, 8
    x = [torch.randn(B, H, T, K, generator=gen) for _ in range(3)]
    if model == "linear_attention":        # positive features for the normaliser
        fn, q, k = linear_attention, F.elu(x[0]) + 1, F.elu(x[1]) + 1
    else:
        fn, q, k = deep_transformer, F.normalize(x[0], dim=-1), F.normalize(x[1], dim=-1)
    q, k, v = q.bfloat16(), k.bfloat16(), x[2].bfloat16()
    exact = fn(q.double(), k.double(), v.double(), normalize=True, backend="chunk")[0]
    o = fn(q, k, v, normalize=True, backend=backend)[0]
    assert o.dtype == torch.bfloat16
    once = rel_rmse(exact.bfloat16().double(), exact)
    assert rel_rmse(o.double(), exact) <= 1.05 * once


@pytest.mark.parametrize("form", ["masked_chunk", "dot_chunk", "dot_window_chunk", "coefficient_recurrent",
                                  "dot_coefficient_recurrent"])
@pytest.mark.parametrize("kernel", ["Exp", "softmax"])
def test_kernel_forms_refuse_an_unknown_kernel(gen, form, kernel):
    """The coefficient forms take kernel="exp" or "dot"; any other name (a misspelling) is a ValueError,
    not the dot kernel run in its place."""
    import atlaslib.deep as deep
    q, k, v = random_qkv(1, 2, 5, 4, 3, generator=gen, dtype=F64)
    with pytest.raises(ValueError, match=f"kernel must be 'exp' or 'dot', got '{kernel}'"):
        getattr(deep, form)(q, k, v, kernel=kernel)
