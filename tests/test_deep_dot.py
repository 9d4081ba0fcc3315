"""Chapter 6: DOT (the Deep Omega Transformer) with a window c > 1 and window gates gamma.

References written here from the definition: the matrix memory on phi*_P features with the window
gradient sum_i gamma_i^{(t)} (M_{t-1} phi(k_i) - v_i) phi(k_i)^T summed pair by pair (fp64), the gates
read from either layout by hand. The kernel form (the coefficient loop) is checked against it through
kernel="dot" on the same features, and against the Taylor form as P grows on unit-norm inputs; the
kernel chunk form against its frozen-gradient oracle (and that oracle against chapter 4's).
"""
import math

import pytest
import torch

from atlaslib.core import assert_close, random_gate, random_qkv
from atlaslib.core.testing import window_gate
from atlaslib.deep import dot, dot_chunk, dot_coefficient_recurrent, dot_window_chunk, exp_features
from atlaslib.omega import omega_frozen_seq

F64 = torch.float64


def window_reference(fq, fk, v, c, gamma, alpha, eta):
    """M_t = alpha_t M_{t-1} - eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} (M_{t-1} phi(k_i) - v_i) phi(k_i)^T, fp64."""
    B, H, T, D = fq.shape
    M = torch.zeros(B, H, v.shape[-1], D, dtype=F64)
    out = []
    for t in range(T):
        grad = torch.zeros_like(M)
        for i in range(max(0, t - c + 1), t + 1):
            err = torch.einsum("bhvd,bhd->bhv", M, fk[:, :, i]) - v[:, :, i]
            g = window_gate(gamma, t, i)
            g = g[..., None, None] if isinstance(g, torch.Tensor) else g
            grad = grad + g * err[..., None] * fk[:, :, i, None, :]
        a = 1.0 if alpha is None else alpha[:, :, t, None, None]
        M = a * M - eta[:, :, t, None, None] * grad
        out.append(torch.einsum("bhvd,bhd->bhv", M, fq[:, :, t]))
    return torch.stack(out, 2)


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def inputs(gen, T=14, K=3, V=2, c=3, layout="offset", unit_norm=True):
    q, k, v = random_qkv(2, 2, T, K, V, dtype=F64, generator=gen)
    if unit_norm:
        q, k = unit(q), unit(k)
    alpha = random_gate(2, 2, T, low=0.7, dtype=F64, generator=gen)
    eta = (0.05 + 0.6 * torch.rand(2, 2, T, generator=gen, dtype=F64)) / (c * math.e)   # stable: eta c e <= 2
    shape = {"source": (2, 2, T), "offset": (2, 2, T, c)}.get(layout)
    gamma = None if shape is None else torch.rand(*shape, generator=gen, dtype=F64)
    return q, k, v, alpha, eta, gamma


@pytest.mark.parametrize("log_alpha", [-1.0, -59.0, -70.0, -300.0])
def test_one_pair_taylor_with_tiny_gates_is_the_definition(gen, log_alpha):
    """c = 1 on the features runs chapter 2's rule with beta = eta / alpha on alpha v; every form floors the
    gate at e^-60 alike, so a gate far below it still gives the definition (to e^-60) on every backend."""
    q, k, v, _, eta, _ = inputs(gen, T=20, c=1, layout=None)
    la = torch.full(q.shape[:3], log_alpha, dtype=F64)
    fq, fk = exp_features(q, 2), exp_features(k, 2)
    want = window_reference(fq, fk, v, 1, None, la.exp(), eta)
    for backend in ("recurrent", "chunk"):
        got, _ = dot(q, k, v, log_alpha=la, eta=eta, phi_star=("taylor", 2), backend=backend, chunk_size=8)
        assert_close(got, want, tol=1e-10, name=f"log_alpha={log_alpha} {backend}")


@pytest.mark.parametrize("layout", [None, "source", "offset"])
@pytest.mark.parametrize("c", [2, 4])
def test_window_matches_the_matrix_definition(gen, layout, c):
    P = 2
    q, k, v, alpha, eta, gamma = inputs(gen, c=c, layout=layout)
    fq, fk = exp_features(q, P), exp_features(k, P)
    want = window_reference(fq, fk, v, c, gamma, alpha, eta)
    coeffs, _ = dot_coefficient_recurrent(fq, fk, v, alpha, eta, kernel="dot", window=c, gamma=gamma)
    assert_close(coeffs, want, tol=1e-10, name="coefficient loop on features")
    for backend, b in (("recurrent", 16), ("chunk", 1)):
        got, _ = dot(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, phi_star=("taylor", P), backend=backend,
                     chunk_size=b)
        assert_close(got, want, tol=1e-10, name=f"taylor {backend}({b})")
    assert (want - window_reference(fq, fk, v, c - 1, None, alpha, eta)).abs().max() > 1e-4   # c matters


def test_taylor_chunk_is_the_frozen_gradient_approximation(gen):
    P, c, b = 2, 3, 5
    q, k, v, alpha, eta, gamma = inputs(gen, T=17, c=c)
    fq, fk = exp_features(q, P), exp_features(k, P)
    got, _ = dot(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, phi_star=("taylor", P), backend="chunk",
                 chunk_size=b)
    frozen, _ = omega_frozen_seq(fq, fk, v, c, gamma, alpha, eta, chunk_size=b)
    assert_close(got, frozen, tol=1e-10)
    exact = window_reference(fq, fk, v, c, gamma, alpha, eta)
    assert (got - exact).abs().max() > 1e-8                          # an approximation for b > 1


@pytest.mark.parametrize("layout", [None, "source", "offset"])
def test_kernel_window_converges_to_taylor(gen, layout):
    c = 3
    q, k, v, alpha, eta, gamma = inputs(gen, T=12, c=c, layout=layout)
    exact, _ = dot(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, backend="recurrent")
    errors = [(dot(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, phi_star=("taylor", P),
                   backend="recurrent")[0] - exact).abs().max().item() for P in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    # every kernel entry is off by at most e / (P + 1)! for |k.q| <= 1; the stable steps keep the sum small
    scale = exact.abs().max().item()
    assert errors[0] > 1e-3 * scale and errors[-1] < 100 * math.e / math.factorial(9) * scale, errors


def test_kernel_window_by_hand(gen):
    """Two tokens with c = 2 written out in coefficients: u_0 = eta_0 g(0,0) v_0; then u_0 <- alpha_1 u_0 +
    eta_1 g(1,0) (v_0 - u_0 e^{k0.k0}), u_1 = eta_1 g(1,1) (v_1 - u_0 e^{k0.k1}) with the old u_0."""
    q, k, v, alpha, eta, gamma = inputs(gen, T=2, c=2, layout="offset")
    y, _ = dot(q, k, v, window=2, gamma=gamma, alpha=alpha, eta=eta, backend="recurrent")
    E = lambda a, b: torch.exp((a * b).sum(-1))[..., None]   # noqa: E731
    u0 = (eta[:, :, 0] * gamma[:, :, 0, 0])[..., None] * v[:, :, 0]
    assert_close(y[:, :, 0], u0 * E(k[:, :, 0], q[:, :, 0]), tol=1e-13)
    err0 = v[:, :, 0] - u0 * E(k[:, :, 0], k[:, :, 0])                      # pair 0 at M_0, offset 1
    new0 = alpha[:, :, 1, None] * u0 + (eta[:, :, 1] * gamma[:, :, 1, 1])[..., None] * err0
    u1 = (eta[:, :, 1] * gamma[:, :, 1, 0])[..., None] * (v[:, :, 1] - u0 * E(k[:, :, 0], k[:, :, 1]))
    assert_close(y[:, :, 1], new0 * E(k[:, :, 0], q[:, :, 1]) + u1 * E(k[:, :, 1], q[:, :, 1]), tol=1e-13)


@pytest.mark.parametrize("phi_star", ["kernel", ("taylor", 2)])
@pytest.mark.parametrize("layout", ["source", "offset"])
def test_window_one_is_todays_dot(gen, phi_star, layout):
    """c = 1: gamma_t^{(t)} scales the step; still the exact delta-rule forms (chunk(b) == recurrent)."""
    q, k, v, alpha, eta, gamma = inputs(gen, T=19, c=1, layout=layout)
    plain = gamma if layout == "source" else gamma[..., 0]
    want, _ = dot(q, k, v, alpha=alpha, eta=eta * plain, phi_star=phi_star, backend="recurrent")
    for backend, b in (("recurrent", 64), ("chunk", 6)):
        got, _ = dot(q, k, v, window=1, gamma=gamma, alpha=alpha, eta=eta, phi_star=phi_star, backend=backend,
                     chunk_size=b)
        assert_close(got, want, tol=1e-11, name=f"{backend}({b})")
    loop, _ = dot_coefficient_recurrent(q, k, v, alpha, eta, window=1, gamma=gamma)
    chunk, _ = dot_chunk(q, k, v, alpha, eta * plain, chunk_size=5)
    assert_close(loop, chunk, tol=1e-11, name="window loop at c = 1 vs the c = 1 chunk form")
    if phi_star != "kernel":
        fq, fk = exp_features(q, 2), exp_features(k, 2)
        assert_close(want, window_reference(fq, fk, v, 1, gamma, alpha, eta), tol=1e-10)


@pytest.mark.parametrize("phi_star", ["kernel", ("taylor", 2)])
def test_window_at_least_T(gen, phi_star):
    T = 9
    q, k, v, alpha, eta, gamma = inputs(gen, T=T, c=T + 4, layout="source")
    run = lambda c, g: dot(q, k, v, window=c, gamma=g, alpha=alpha, eta=eta, phi_star=phi_star,  # noqa: E731
                           backend="recurrent")[0]
    full = run(T, gamma)
    assert_close(run(T + 4, gamma), full, tol=1e-13)
    offset = torch.rand(2, 2, T, T + 4, generator=gen, dtype=F64)
    assert_close(run(T + 4, offset), run(T, offset[..., :T].clone()), tol=1e-13)
    if phi_star != "kernel":
        fq, fk = exp_features(q, 2), exp_features(k, 2)
        assert_close(full, window_reference(fq, fk, v, T, gamma, alpha, eta), tol=1e-10)


def test_kernel_window_gradients_match_taylor(gen):
    """Gradients flow through the window loop; at P = 10 on unit inputs they are the Taylor form's."""
    q, k, v, alpha, eta, gamma = inputs(gen, T=7, K=2, c=3, layout="source")
    grads = []
    for phi_star in ("kernel", ("taylor", 10)):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, gamma)]
        o, _ = dot(xs[0], xs[1], xs[2], window=3, gamma=xs[3], alpha=alpha, eta=eta, phi_star=phi_star,
                   backend="recurrent")
        grads.append(torch.autograd.grad(o.square().sum(), xs))
    for name, a, b in zip("q k v gamma".split(), *grads):
        assert_close(a, b, tol=1e-5, name=f"d/d{name}")
        assert a.abs().sum() > 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"window": 0}, ValueError, "window"),
    ({"window": -2}, ValueError, "window"),
    ({"window": 2.0}, TypeError, "window"),
    ({"window": 3, "gamma": torch.ones(2, 2, 8, 2)}, ValueError, "gamma must have shape"),
    ({"window": 3, "gamma": torch.ones(2, 2, 7)}, ValueError, "gamma must have shape"),
    ({"window": 1, "gamma": torch.ones(2, 2, 8, 3)}, ValueError, "gamma must have shape"),
    ({"window": 2, "gamma": 1.5 * torch.ones(2, 2, 8)}, ValueError, "gamma must lie"),
    ({"window": 2, "gamma": 1.5}, ValueError, "gamma must lie"),   # a number: one weight for all
    ({"window": 2, "backend": "triton"}, ValueError, "backend='recurrent'"),
    ({"window": 2, "backend": "fast"}, ValueError, "backend"),
    ({"window": 2, "phi_star": ("taylor", 2), "backend": "fast"}, ValueError, "backend"),
    ({"window": 2, "alpha": 0.0}, ValueError, "alpha"),
])
def test_bad_window_input(gen, kwargs, error, match):
    q, k, v = random_qkv(2, 2, 8, 4, 3, dtype=F64, generator=gen)
    with pytest.raises(error, match=match):
        dot(q, k, v, **kwargs)


@pytest.mark.parametrize("memory", ["linear", "mlp"])
def test_overflow_refusal_names_the_score_and_no_normalize(gen, memory):
    """dot (and the deep memory) write through exp(k_i^T k_t) and have no normaliser: the refusal names the
    score that overflows, and does not offer normalize=True, which they do not take."""
    q, k, v = random_qkv(1, 2, 8, 4, 3, dtype=F64, generator=gen)
    for scale_q, scale_k, score in ((100.0, 100.0, r"k_i\^T q_t"), (0.01, 10.0, r"k_i\^T k_t")):
        with pytest.raises(ValueError, match=f"a score {score} = .* exceeds 80") as refused:
            dot(scale_q * q, scale_k * k, v, memory=memory)
        assert "normalize" not in str(refused.value)


@pytest.mark.parametrize("layout", [None, "source", "offset"])
@pytest.mark.parametrize("c", [2, 5])
def test_kernel_chunk_matches_its_frozen_oracle(gen, layout, c):
    """dot_window_chunk(b) == the coefficient loop with errors frozen per chunk, for every b; b = 1 is the
    definition; on features that oracle is chapter 4's omega_frozen_seq; b > 1 is an approximation."""
    q, k, v, alpha, eta, gamma = inputs(gen, T=17, c=c, layout=layout)
    exact, _ = dot(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, backend="recurrent")
    for b in (1, 4, 7, 32):
        want, _ = dot_coefficient_recurrent(q, k, v, alpha, eta, "exp", c, gamma, chunk_size=b)
        got, _ = dot(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, backend="chunk", chunk_size=b)
        assert_close(got, want, tol=1e-11, name=f"chunk({b}) vs oracle")
        if b == 1:
            assert_close(got, exact, tol=1e-11, name="chunk(1) vs recurrent")
        else:
            assert (got - exact).abs().max() > 1e-9, f"chunk({b}) should differ from the per-token rule"
    fq, fk = exp_features(q, 2), exp_features(k, 2)
    for b in (1, 6):
        oracle, _ = dot_coefficient_recurrent(fq, fk, v, alpha, eta, "dot", c, gamma, chunk_size=b)
        frozen, _ = omega_frozen_seq(fq, fk, v, c, gamma, alpha, eta, chunk_size=b)
        assert_close(oracle, frozen, tol=1e-10, name=f"oracle on features vs omega_frozen_seq({b})")
        on_features, _ = dot_window_chunk(fq, fk, v, alpha, eta, "dot", c, gamma, chunk_size=b)
        assert_close(on_features, frozen, tol=1e-10, name=f"chunk on features vs omega_frozen_seq({b})")


def test_kernel_chunk_converges_to_taylor_chunk(gen):
    c, b = 3, 5
    q, k, v, alpha, eta, gamma = inputs(gen, T=15, c=c, layout="offset")
    exact, _ = dot(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, chunk_size=b)        # auto: chunk
    errors = [(dot(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, phi_star=("taylor", P), chunk_size=b)[0]
               - exact).abs().max().item() for P in (1, 3, 8)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-4 * exact.abs().max().item(), errors


def test_kernel_chunk_gradients_match_its_oracle(gen):
    q, k, v, alpha, eta, gamma = inputs(gen, T=9, K=2, c=3, layout="offset")
    grads = []
    for run in ("chunk", "oracle"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, alpha, eta, gamma)]
        if run == "chunk":
            o, _ = dot(xs[0], xs[1], xs[2], window=3, gamma=xs[5], alpha=xs[3], eta=xs[4], backend="chunk",
                       chunk_size=4)
        else:
            o, _ = dot_coefficient_recurrent(xs[0], xs[1], xs[2], xs[3], xs[4], "exp", 3, xs[5], chunk_size=4)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
        grads.append(torch.autograd.grad((o * w).sum(), xs))
    for name, a, b in zip("q k v alpha eta gamma".split(), *grads):
        assert_close(a, b, tol=1e-10, name=f"d/d{name}")
        assert a.abs().sum() > 0


def test_kernel_window_auto_is_chunk(gen):
    q, k, v, alpha, eta, gamma = inputs(gen, T=8, c=3, layout="offset")
    a, _ = dot(q, k, v, window=3, gamma=gamma, alpha=alpha, eta=eta, chunk_size=3)
    b, _ = dot(q, k, v, window=3, gamma=gamma, alpha=alpha, eta=eta, backend="chunk", chunk_size=3)
    assert torch.equal(a, b)


def test_default_chunk_size_is_chapter_4s_where_it_is_part_of_the_model(gen):
    """With c > 1 the chunk size changes the model: dot's default must then be omega_rule's (and the
    frozen forms' b), while c = 1 (exact for every b) keeps the faster DEFAULT_CHUNK_SIZE."""
    from atlaslib.deep import DEFAULT_CHUNK_SIZE, FROZEN_CHUNK_SIZE
    from atlaslib.omega import OMEGA_CHUNK_SIZE, omega_rule
    assert FROZEN_CHUNK_SIZE == OMEGA_CHUNK_SIZE != DEFAULT_CHUNK_SIZE
    q, k, v = random_qkv(1, 2, 3 * OMEGA_CHUNK_SIZE + 5, 4, 3, generator=gen, dtype=F64)
    q, k = q / 2, k / 2
    eta = random_gate(1, 2, q.shape[2], low=0.02, high=0.1, generator=gen, dtype=F64)
    ours, _ = dot(q, k, v, window=3, eta=eta, phi_star=("taylor", 2), backend="chunk")
    fq, fk = exp_features(q, 2), exp_features(k, 2)
    theirs, _ = omega_rule(fq, fk, v, window=3, eta=eta, backend="chunk")
    assert_close(ours, theirs, tol=1e-12, name="dot(window=3) vs omega_rule on the features, default b")
    other, _ = dot(q, k, v, window=3, eta=eta, phi_star=("taylor", 2), backend="chunk", chunk_size=DEFAULT_CHUNK_SIZE)
    assert (other - ours).abs().max() > 1e-8, "b must change this model, or the test proves nothing"
    from atlaslib.deep import deep_transformer
    kw = dict(eta=eta, phi_star=("taylor", 2), memory="mlp", backend="chunk")
    default, _ = deep_transformer(q, k, v, **kw)
    assert_close(default, deep_transformer(q, k, v, chunk_size=OMEGA_CHUNK_SIZE, **kw)[0], tol=0,
                 name="deep_transformer(memory='mlp') default b")
    assert (default - deep_transformer(q, k, v, chunk_size=DEFAULT_CHUNK_SIZE, **kw)[0]).abs().max() > 1e-8


def test_a_log_gate_that_underflows_is_named(gen):
    """log_alpha = -120 is alpha = 0 in fp32 (exp underflows) but a fine gate in fp64: the refusal names
    log_alpha and the bound, not alpha."""
    q, k, v, _, eta, _ = inputs(gen, c=1, layout=None)
    with pytest.raises(ValueError, match="log_alpha must be > -inf and its exp must not underflow"):
        dot(q.float(), k.float(), v.float(), log_alpha=-120.0, eta=eta.float())
    assert torch.isfinite(dot(q, k, v, log_alpha=-120.0, eta=eta)[0]).all()
