"""Chapter 5: Newton–Schulz, the Muon optimizer and ATLAS.

Newton–Schulz is checked against the SVD's polar factor (the convergent coefficient sets reach
it, Muon's settles in a band around 1, which is measured). ATLAS's per-token loop is checked
against an independent oracle (autograd for the windowed gradient, NS applied to the
momentum, eta outside it). Then the equalities the chapter claims (book ch. 5):
chunk(b) == frozen_seq(b) for every b, memory and window; chunk(1) == recurrent;
chunk(b > 1) != recurrent; the linear rooms == chapter 3's engine with optimizer "muon";
and with Newton–Schulz off (ns_steps=0) the exact reductions to Titans (after moving eta
back inside the momentum), to DeltaNet / Gated DeltaNet (theta = 0, c = 1) and to OmegaNet.
"""
import math

import pytest
import torch

from atlaslib.atlas import atlas, atlas_config, atlas_frozen_seq, newton_schulz, polar
from atlaslib.core import assert_close, poisoned_outputs, random_gate, random_qkv, rel_rmse
from atlaslib.core.testing import assert_within_rounding, window_l2_grad
from atlaslib.core.windows import window_gates
from atlaslib.delta import delta_rule
from atlaslib.miras import MirasState, make_config, miras
from atlaslib.omega import omega_rule

F64 = torch.float64


# ---------------------------------------------------------------------------- Newton–Schulz

def ill_conditioned(gen, m, n, cond, batch=()):
    """U diag(s) V^T with random singular vectors and singular values log-spaced from 1 down to 1/cond."""
    r = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(*batch, m, r, generator=gen, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(*batch, n, r, generator=gen, dtype=F64))
    s = torch.logspace(0, -math.log10(cond), r, dtype=F64)
    return U @ torch.diag_embed(s.expand(*batch, r)) @ V.transpose(-1, -2)


def test_polar_is_the_nearest_semi_orthogonal_matrix(gen):
    G = torch.randn(3, 6, 9, generator=gen, dtype=F64)
    P = polar(G)
    assert_close(P @ P.transpose(-1, -2), torch.eye(6, dtype=F64).expand(3, 6, 6), name="P P^T")
    sym = P.transpose(-1, -2) @ G                      # = V Σ V^T: symmetric, positive semi-definite
    assert_close(sym, sym.transpose(-1, -2), name="P^T G symmetric")
    assert torch.linalg.eigvalsh(sym).min() > -1e-10
    Pt = polar(G.transpose(-1, -2))                    # tall: the transpose of the wide one's
    assert_close(Pt, P.transpose(-1, -2), name="polar of the transpose")


# Measured (fp64, 16 x 32, singular values log-spaced over a condition number of 100, any seed):
# |NS_J(G) - U V^T|_max < 1e-5 from J = 16 (cubic) and J = 10 (quintic); 11 / 7 at condition
# 10, 21 / 14 at 1000. The tests take a few steps of margin, and check that far fewer do not suffice.
@pytest.mark.parametrize("coeffs, enough, too_few", [("cubic", 20, 10), ("quintic", 13, 6),
                                                     ((1.5, -0.5), 20, 10), ((15 / 8, -10 / 8, 3 / 8), 13, 6)])
def test_convergent_coefficients_reach_the_polar_factor(gen, coeffs, enough, too_few):
    G = ill_conditioned(gen, 16, 32, 100.0)
    P = polar(G)
    assert (newton_schulz(G, enough, coeffs) - P).abs().max() < 1e-5
    assert (newton_schulz(G, too_few, coeffs) - P).abs().max() > 1e-5


# Measured (fp64, 16 x 32, any seed): Muon's coefficients put the singular values in
# [0.682, 1.134] after 5 steps at condition 100 ([0.683, 1.132] at 10; at 1000 the smallest is
# still 0.37 after 5 steps and joins the band by step 10), and they stay in [0.682, 1.134] after
# 30 steps: a band around 1, not convergence (measured: about [0.68, 1.20] after 5 steps on ill-conditioned
# inputs, [0.68, 1.13] after 30).
def muon_on_a_singular_value(s, steps):
    """Muon's quintic a s + b s^3 + c s^5 iterated on one number: Newton–Schulz maps every singular value of
    G / ||G||_F through it (the reference the bands below are measured against)."""
    for _ in range(steps):
        s = 3.4445 * s - 4.7750 * s**3 + 2.0315 * s**5
    return s


def test_muon_coefficients_settle_in_a_band(gen):
    G = ill_conditioned(gen, 16, 32, 100.0, batch=(4,))
    s5 = torch.linalg.svdvals(newton_schulz(G, 5, "muon"))
    s0 = torch.linalg.svdvals(G) / torch.linalg.matrix_norm(G)[..., None]
    for steps, s in ((5, s5), (30, torch.linalg.svdvals(newton_schulz(G, 30, "muon")))):
        scalar = muon_on_a_singular_value(s0, steps).sort(-1, descending=True).values
        assert_close(s.sort(-1, descending=True).values, scalar, tol=1e-5,      # NORM_EPS: 1e-7 relative
                     name=f"NS_{steps} on each singular value")
    scalar5 = muon_on_a_singular_value(s0, 5).sort(-1, descending=True).values
    assert_close(torch.linalg.svdvals(newton_schulz(G)), scalar5, tol=1e-5,       # the book calls it so (ch. 5)
                 name="newton_schulz(G) with its defaults is NS_5 with Muon's coefficients")
    assert s5.min() > 0.66 and s5.max() < 1.2, (s5.min().item(), s5.max().item())
    s30 = torch.linalg.svdvals(newton_schulz(G, 30, "muon"))
    assert s30.min() > 0.66 and s30.max() < 1.15
    assert s30.max() > 1.1 and s30.min() < 0.7, "Muon's coefficients do not converge to U V^T"
    gauss = torch.linalg.svdvals(newton_schulz(torch.randn(8, 16, 32, generator=gen, dtype=F64), 5))
    assert gauss.min() > 0.66 and gauss.max() < 1.2
    assert (newton_schulz(G, 30, "muon") - polar(G)).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_newton_schulz_iterates_16_bit_inputs_in_fp32(gen, dtype):
    """dtype=None runs a bf16/fp16 G's steps in fp32 (only the result is rounded to G's dtype): within twice
    the output's own rounding of the fp64 iteration on the same rounded G (iterating in bf16 costs 20x)."""
    G = torch.randn(8, 32, 48, generator=gen).to(dtype)
    ref = newton_schulz(G.double(), 5, "muon")
    own = rel_rmse(ref.to(dtype).double(), ref)
    out = newton_schulz(G, 5, "muon")
    assert out.dtype == dtype
    assert rel_rmse(out.double(), ref) <= 2 * own
    assert torch.equal(out, newton_schulz(G, 5, "muon", dtype=torch.float32))


def test_newton_schulz_batch_tall_dtypes(gen):
    G = torch.randn(2, 3, 7, 5, generator=gen, dtype=F64)                 # tall: transposed inside
    X = newton_schulz(G, 5)
    assert X.shape == G.shape and X.dtype == F64
    one_by_one = torch.stack([torch.stack([newton_schulz(G[i, j], 5) for j in range(3)]) for i in range(2)])
    assert_close(X, one_by_one, name="batch vs one matrix at a time")
    assert_close(newton_schulz(G.transpose(-1, -2), 5), X.transpose(-1, -2), name="NS(G^T) = NS(G)^T")
    assert_close(newton_schulz(3.7 * G, 5), X, tol=1e-6, name="scale invariance (up to eps)")
    assert newton_schulz(G, 0) is G, "steps=0 is the identity, no normalisation"
    g32 = G.float()
    assert newton_schulz(g32, 5).dtype == torch.float32
    bf = newton_schulz(g32, 5, dtype=torch.bfloat16)                   # as Muon runs it
    assert bf.dtype == torch.float32 and rel_rmse(bf, newton_schulz(g32, 5)) < 0.1      # measured: up to 0.056
    assert (newton_schulz(torch.zeros(2, 3, 4), 5) == 0).all()


def ns_by_powers(G, steps, coeffs):
    """X_0 = G / (||G||_F + 1e-7); X_{j+1} = sum_i c_i (X X^T)^i X, with matrix powers (no transpose for a
    tall G: an odd polynomial has p(X X^T) X = X p(X^T X))."""
    X = G / (torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = sum(c * torch.linalg.matrix_power(A, i) @ X for i, c in enumerate(coeffs))
    return X


@pytest.mark.parametrize("coeffs", [(0.9,), (1.5, -0.5), (2.0, -1.5, 0.6, -0.1), (1.9, -1.2, 0.5, -0.2, 0.05)])
@pytest.mark.parametrize("shape", [(3, 4, 7), (2, 6, 3)])
def test_newton_schulz_polynomials_of_any_length(gen, coeffs, shape):
    """A coefficient tuple of any length is the odd polynomial sum_i c_i X (X^T X)^i (one coefficient:
    X -> c X; four and more: the order of Horner's loop matters)."""
    G = torch.randn(*shape, generator=gen, dtype=F64)
    for steps in (1, 3):
        assert_close(newton_schulz(G, steps, coeffs), ns_by_powers(G, steps, coeffs),
                     name=f"NS_{steps} with {len(coeffs)} coefficients")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ns_steps=-1), ValueError, "must be >= 0"),
    (dict(ns_steps=2.0), TypeError, "ns_steps must be a non-negative int"),
    (dict(ns_steps=True), TypeError, "ns_steps must be a non-negative int"),
    (dict(ns_coeffs="septic"), ValueError, "coeffs must be one of"),
    (dict(ns_coeffs=()), TypeError, "non-empty tuple"),
    (dict(ns_coeffs=(1.0, "b")), ValueError, "finite real"),
    (dict(ns_coeffs=(1.0, float("nan"))), ValueError, "finite real"),
    (dict(dtype="bf16"), TypeError, "dtype"),
])
def test_newton_schulz_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        newton_schulz(torch.randn(3, 4), **kwargs)
    with pytest.raises(ValueError, match=r"\[..., m, n\]"):
        newton_schulz(torch.randn(4))


# ---------------------------------------------------------------------------- ATLAS: the per-token rule

def make_inputs(gen, B=1, H=2, T=37, K=6, V=5, *, window=1, gmode=None, h0=True, dtype=F64):
    """Unit keys; eta in [0.05, 0.3] (NS_J(S) has norm about 1 whatever S is, so this is the step);
    alpha in [0.6, 1], theta in [0, 0.9]; an initial memory and momentum."""
    q, k, v = random_qkv(B, H, T, K, V, dtype=dtype, generator=gen)
    gamma = None
    if gmode == "source":
        gamma = torch.rand(B, H, T, generator=gen).to(dtype)
    elif gmode == "offset":
        gamma = torch.rand(B, H, T, window, generator=gen).to(dtype)
    alpha = random_gate(B, H, T, low=0.6, dtype=dtype, generator=gen)
    eta = random_gate(B, H, T, low=0.05, high=0.3, dtype=dtype, generator=gen)
    theta = random_gate(B, H, T, low=0.0, high=0.9, dtype=dtype, generator=gen)
    state = None
    if h0:
        state = MirasState(0.3 * torch.randn(B, H, V, K, generator=gen).to(dtype),
                           0.3 * torch.randn(B, H, V, K, generator=gen).to(dtype))
    return q, k, v, dict(window=window, gamma=gamma, alpha=alpha, eta=eta, theta=theta, initial_state=state)


def oracle(q, k, v, window, gamma, alpha, eta, theta, initial_state, ns_steps=5, coeffs="muon", chunk_size=1):
    """ATLAS written independently: the windowed l2 loss differentiated by autograd at M_{t-1}
    (or at the chunk-start state), S_t = theta_t S_{t-1} + grad, M_t = alpha_t M_{t-1} - eta_t NS(S_t)."""
    B, H, T, K = q.shape
    M, S = initial_state
    outs = []
    for t in range(T):
        if t % chunk_size == 0:
            anchor = M
        grad = window_l2_grad(anchor, k, v, t, window, gamma)
        S = theta[:, :, t, None, None] * S + grad
        M = alpha[:, :, t, None, None] * M - eta[:, :, t, None, None] * newton_schulz(S, ns_steps, coeffs)
        outs.append((M @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, dim=2), M, S


@pytest.mark.parametrize("window, gmode, chunk_size", [(1, None, 1), (3, "offset", 1), (3, "source", 4),
                                                       (1, None, 5)])
def test_recurrent_and_frozen_seq_match_the_oracle(gen, window, gmode, chunk_size):
    q, k, v, kw = make_inputs(gen, T=19, window=window, gmode=gmode)
    backend = "recurrent" if chunk_size == 1 else "frozen_seq"
    o, st = atlas(q, k, v, backend=backend, chunk_size=chunk_size, output_final_state=True, **kw)
    o_ref, M_ref, S_ref = oracle(q, k, v, window, kw["gamma"], kw["alpha"], kw["eta"], kw["theta"],
                                 kw["initial_state"], chunk_size=chunk_size)
    assert_close(o, o_ref)
    assert_close(st.memory, M_ref, name="M_T")
    assert_close(st.momentum, S_ref, name="S_T")


def test_eta_sits_outside_newton_schulz(gen):
    """NS normalises its input: scaling every gradient (or S) changes nothing, eta scales the step."""
    q, k, v, kw = make_inputs(gen, T=9, h0=False)
    kw.update(alpha=None, theta=None)
    M1 = atlas(q, k, v, backend="recurrent", output_final_state=True, **{**kw, "eta": 0.1})[1].memory
    M2 = atlas(q, k, v, backend="recurrent", output_final_state=True, **{**kw, "eta": 0.2})[1].memory
    # after one token from M_0 = 0 the step is -eta NS(grad), so M_1 doubles with eta
    o1 = atlas(q[:, :, :1], k[:, :, :1], v[:, :, :1], eta=0.1, output_final_state=True)[1].memory
    o2 = atlas(q[:, :, :1], k[:, :, :1], 10 * v[:, :, :1], eta=0.2, output_final_state=True)[1].memory
    assert_close(o2, 2 * o1, tol=1e-6, name="NS erases the gradient's scale")
    assert rel_rmse(M1, M2) > 1e-2


# ---------------------------------------------------------------------------- chunkwise exactness

@pytest.mark.parametrize("chunk_size", [1, 3, 16])
@pytest.mark.parametrize("window, gmode", [(1, None), (3, "offset"), (2, "source")])
def test_chunk_matches_frozen_seq(gen, chunk_size, window, gmode):
    q, k, v, kw = make_inputs(gen, T=37, window=window, gmode=gmode)            # 37: a partial last chunk
    o_c, s_c = atlas(q, k, v, backend="chunk", chunk_size=chunk_size, output_final_state=True, **kw)
    o_f, s_f = atlas(q, k, v, backend="frozen_seq", chunk_size=chunk_size, output_final_state=True, **kw)
    assert_close(o_c, o_f)
    assert_close(s_c.memory, s_f.memory, name="M_T")
    assert_close(s_c.momentum, s_f.momentum, name="S_T")


@pytest.mark.parametrize("window, gmode", [(1, None), (3, "offset")])
def test_chunk_one_is_the_per_token_rule_and_larger_chunks_are_not(gen, window, gmode):
    q, k, v, kw = make_inputs(gen, T=21, window=window, gmode=gmode)
    o_r, s_r = atlas(q, k, v, backend="recurrent", output_final_state=True, **kw)
    o_1, s_1 = atlas(q, k, v, backend="chunk", chunk_size=1, output_final_state=True, **kw)
    assert_close(o_1, o_r)
    assert_close(s_1.momentum, s_r.momentum, name="S_T")
    o_4 = atlas(q, k, v, backend="chunk", chunk_size=4, **kw)[0]
    assert rel_rmse(o_4, o_r) > 1e-3, "frozen gradients are an approximation for b > 1"


def test_without_gates_state_or_momentum(gen):
    q, k, v = random_qkv(2, 1, 13, 4, 7, dtype=F64, generator=gen)
    for b in (1, 5):
        assert_close(atlas(q, k, v, chunk_size=b)[0], atlas(q, k, v, backend="frozen_seq", chunk_size=b)[0])
    o_r = atlas(q, k, v, backend="recurrent", theta=0.0, alpha=1.0, eta=1.0)[0]
    assert_close(atlas(q, k, v, chunk_size=1)[0], o_r, name="theta None == 0, alpha None == 1, eta None == 1")


def test_linear_rooms_are_the_miras_engine(gen):
    """The linear memory's own rooms compute the engine's optimizer 'muon' exactly."""
    q, k, v, kw = make_inputs(gen, T=12, window=2, gmode="offset")
    cfg = atlas_config("linear", window=2)
    for backend, b in (("recurrent", 16), ("chunk", 1), ("chunk", 5)):
        o, s = atlas(q, k, v, backend=backend, chunk_size=b, output_final_state=True, **kw)
        kw_m = {n: x for n, x in kw.items() if n != "window"}
        o_m, s_m = miras(q, k, v, config=cfg, backend=backend, chunk_size=b, output_final_state=True, **kw_m)
        assert_close(o, o_m, name=f"{backend}({b})")
        assert_close(s.momentum, s_m.momentum, name=f"{backend}({b}) S_T")


@pytest.mark.parametrize("memory", ["mlp", "residual", "gated"])
def test_deep_memories_chunk_matches_frozen_seq(gen, memory):
    """Deep memories run on chapter 3's engine: Muon's ``updates`` (a chunk's momenta as a batch,
    NS per weight matrix) against the per-token loop with frozen gradients."""
    q, k, v, kw = make_inputs(gen, T=11, K=4, V=4, window=2, gmode="offset", h0=False)
    o_r = atlas(q, k, v, memory=memory, backend="recurrent", **kw)[0]
    for b in (1, 4):
        o_c, s_c = atlas(q, k, v, memory=memory, backend="chunk", chunk_size=b, output_final_state=True, **kw)
        o_f, s_f = atlas(q, k, v, memory=memory, backend="frozen_seq", chunk_size=b, output_final_state=True, **kw)
        assert_close(o_c, o_f, name=f"chunk({b}) vs frozen_seq({b})")
        for name in s_c.momentum:
            assert_close(s_c.momentum[name], s_f.momentum[name], name=f"S_T[{name}]")
        if b == 1:
            assert_close(o_c, o_r, name="chunk(1) vs recurrent")
        else:
            assert rel_rmse(o_c, o_r) > 1e-4


def deep_memory(memory, W, x):
    """Chapter 3's deep memories written out for x [B, H, K] (GELU): the residual MLP x + W1 gelu(W2 x)
    and the gated one x + W1 (gelu(W2 x) * (W3 x))."""
    mv = lambda name, y: (W[name] @ y[..., None])[..., 0]              # noqa: E731  [B, H, out, in] x [B, H, in]
    hidden = torch.nn.functional.gelu(mv("W2", x))
    return x + mv("W1", hidden * mv("W3", x) if memory == "gated" else hidden)


def deep_oracle(memory, q, k, v, window, alpha, eta, theta, W0):
    """ATLAS with a deep memory, written independently of the engine: per token, the gradient of the window's
    l2 loss sum_i 1/2 ||M_{t-1}(k_i) - v_i||^2 by autograd, and per weight matrix S = theta S + grad,
    W = alpha W - eta NS(S); the output is M_t(q_t)."""
    T = q.shape[2]
    W = {n: w.clone() for n, w in W0.items()}
    S = {n: torch.zeros_like(w) for n, w in W0.items()}
    outs = []
    for t in range(T):
        params = {n: w.detach().requires_grad_(True) for n, w in W.items()}
        loss = sum(0.5 * (deep_memory(memory, params, k[:, :, i]) - v[:, :, i]).square().sum()
                   for i in range(max(0, t - window + 1), t + 1))
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        for n in W:
            S[n] = theta[:, :, t, None, None] * S[n] + grads[n]
            W[n] = alpha[:, :, t, None, None] * W[n] - eta[:, :, t, None, None] * newton_schulz(S[n], 5, "muon")
        outs.append(deep_memory(memory, W, q[:, :, t]))
    return torch.stack(outs, dim=2), W, S


@pytest.mark.parametrize("memory, window", [("residual", 1), ("residual", 3), ("gated", 2)])
def test_deep_memories_match_an_independent_oracle(gen, memory, window):
    """The deep memories' per-token rule (Muon on each weight matrix, chapter 3's engine) against a loop
    written from the update rule, with autograd for the gradients of the window's loss."""
    q, k, v, kw = make_inputs(gen, T=9, K=4, V=4, h0=False)
    names = ("W1", "W2", "W3") if memory == "gated" else ("W1", "W2")
    shapes = {"W1": (4, 16), "W2": (16, 4), "W3": (16, 4)}
    W0 = {n: torch.randn(1, 2, *shapes[n], generator=gen, dtype=F64) / math.sqrt(shapes[n][1]) for n in names}
    o, st = atlas(q, k, v, memory=memory, window=window, alpha=kw["alpha"], eta=kw["eta"], theta=kw["theta"],
                  initial_state=W0, backend="recurrent", output_final_state=True)
    o_ref, W_ref, S_ref = deep_oracle(memory, q, k, v, window, kw["alpha"], kw["eta"], kw["theta"], W0)
    assert_close(o, o_ref)
    for n in names:
        assert_close(st.memory[n], W_ref[n], name=f"{n}_T")
        assert_close(st.momentum[n], S_ref[n], name=f"S_T[{n}]")


def test_state_continues_the_sequence(gen):
    q, k, v, kw = make_inputs(gen, T=20, window=2, gmode="offset", h0=False)
    cut = lambda x, s: x[:, :, s]                                      # noqa: E731
    kw1 = {n: (cut(x, slice(0, 8)) if torch.is_tensor(x) else x) for n, x in kw.items()}
    kw2 = {n: (cut(x, slice(8, 20)) if torch.is_tensor(x) else x) for n, x in kw.items()}
    kw1.update(window=1, gamma=None)
    kw2.update(window=1, gamma=None)
    o1, st1 = atlas(q[:, :, :8], k[:, :, :8], v[:, :, :8], chunk_size=4, output_final_state=True, **kw1)
    o2, st2 = atlas(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], chunk_size=4, output_final_state=True,
                    **{**kw2, "initial_state": st1})
    full, stf = atlas(q, k, v, chunk_size=4, output_final_state=True, **{**kw, "window": 1, "gamma": None})
    assert_close(torch.cat([o1, o2], dim=2), full)
    assert_close(st2.memory, stf.memory, name="M_T")
    assert_close(st2.momentum, stf.momentum, name="S_T")


def test_one_token_steps_are_the_forward_pass(gen):
    """atlas_step carries (M, S, the last c - 1 pairs): token by token it is the per-token rule, checked against
    the independent ``oracle`` (``backend="recurrent"`` is itself a loop over atlas_step)."""
    from atlaslib.atlas import atlas_step, start_state
    q, k, v, kw = make_inputs(gen, T=9, window=3, gmode="offset")
    o, M_T, S_T = oracle(q, k, v, 3, kw["gamma"], kw["alpha"], kw["eta"], kw["theta"], kw["initial_state"])
    state = start_state(*kw["initial_state"])
    G = window_gates(kw["gamma"], 1, 2, 9, 3, F64, q.device)
    ys = []
    for t in range(9):
        state, y = atlas_step(state, q[:, :, t], k[:, :, t], v[:, :, t], 3, G[:, :, t], kw["alpha"][:, :, t],
                              kw["eta"][:, :, t], kw["theta"][:, :, t])
        ys.append(y)
        assert state.window.keys.shape[2] == min(t + 1, 2), "the window keeps c - 1 pairs"
    assert_close(torch.stack(ys, dim=2), o)
    assert_close(state.M, M_T, name="M_T")
    assert_close(state.S, S_T, name="S_T")


def test_log_alpha_and_dtypes(gen):
    q, k, v, kw = make_inputs(gen, T=10, h0=False)
    a = kw.pop("alpha")
    o = atlas(q, k, v, alpha=a, chunk_size=4, **kw)[0]
    assert_close(atlas(q, k, v, log_alpha=torch.log(a), chunk_size=4, **kw)[0], o, name="log_alpha")
    f32 = {n: (x.float() if torch.is_tensor(x) else x) for n, x in kw.items()}
    o32, st = atlas(q.float(), k.float(), v.float(), alpha=a.float(), chunk_size=4, output_final_state=True, **f32)
    assert o32.dtype == torch.float32 and st.memory.dtype == torch.float32
    assert_close(o32, o.float(), tol=1e-4, name="fp32 vs fp64")


# ---------------------------------------------------------------------------- reductions with NS off

def test_ns_off_window_one_is_titans(gen):
    """ns_steps=0, c = 1: S_t = theta_t S_{t-1} + grad, M_t = alpha_t M_{t-1} - eta_t S_t. With
    S'_t = -eta_t S_t this is Titans, S'_t = theta'_t S'_{t-1} - eta_t grad, M_t = alpha_t M_{t-1} + S'_t,
    exactly when theta'_t = theta_t eta_t / eta_{t-1} (and S'_0 = -eta_0 S_0 for any eta_0 > 0):
    with a constant eta the momentum decays are equal, otherwise they must be rescaled."""
    for memory in ("linear", "mlp"):
        q, k, v, kw = make_inputs(gen, T=17, K=4, V=4, h0=(memory == "linear"))
        kw["eta"] = random_gate(1, 2, 17, low=0.15, high=0.3, dtype=F64, generator=gen)
        kw["theta"] = 0.5 * kw["theta"]                       # theta' <= 0.45 * 0.3 / 0.15 < 1 (eta_0 = 0.2 too)
        eta, theta = kw["eta"], kw["theta"]
        eta0 = 0.2                                                       # the eta "before" token 0
        eta_prev = torch.cat([torch.full_like(eta[:, :, :1], eta0), eta[:, :, :-1]], dim=2)
        theta_titans = theta * eta / eta_prev
        assert theta_titans.max() <= 1
        init = kw.pop("initial_state")
        titans_init = None if init is None else MirasState(init.memory, -eta0 * init.momentum)
        for backend, b in (("recurrent", 16), ("chunk", 5)):
            o, s = atlas(q, k, v, memory=memory, ns_steps=0, backend=backend, chunk_size=b, initial_state=init,
                         output_final_state=True, **kw)
            o_t, s_t = miras(q, k, v, preset="titans", memory=memory, alpha=kw["alpha"], eta=eta,
                             theta=theta_titans, initial_state=titans_init, backend=backend, chunk_size=b,
                             output_final_state=True)
            assert_close(o, o_t, name=f"{memory} {backend}")
            mom = s.momentum if memory == "linear" else s.momentum["W1"]
            mom_t = s_t.momentum if memory == "linear" else s_t.momentum["W1"]
            assert_close(-eta[:, :, -1, None, None] * mom, mom_t, name="S'_T = -eta_T S_T")
            naive = miras(q, k, v, preset="titans", memory=memory, alpha=kw["alpha"], eta=eta, theta=theta,
                          initial_state=titans_init, backend=backend, chunk_size=b)[0]
            assert rel_rmse(naive, o) > 1e-6, "without rescaling theta the two differ"


@pytest.mark.parametrize("theta", [None, 0.0])
def test_ns_off_no_momentum_window_one_is_the_delta_rule(gen, theta):
    """theta = 0, c = 1, NS off: M_t = alpha_t M_{t-1} - eta_t (M_{t-1} k - v) k^T, GD with retention.
    With alpha = 1 it is DeltaNet with beta = eta. With alpha < 1 the decay comes *after* the gradient:
    alpha M (I - (eta / alpha) k k^T) + eta v k^T, which is Gated DeltaNet (decay first) with
    beta = eta / alpha on the values alpha v."""
    q, k, v, kw = make_inputs(gen, T=23)
    alpha, eta, M0 = kw["alpha"], kw["eta"], kw["initial_state"].memory
    for backend in ("recurrent", "chunk"):
        o, s = atlas(q, k, v, eta=eta, theta=theta, ns_steps=0, initial_state=M0, backend=backend, chunk_size=1,
                     output_final_state=True)
        o_d, M_d = delta_rule(q, k, v, eta, initial_state=M0, output_final_state=True)
        assert_close(o, o_d, name=f"DeltaNet ({backend})")
        assert_close(s.memory, M_d, name="M_T")
        o, s = atlas(q, k, v, alpha=alpha, eta=eta, theta=theta, ns_steps=0, initial_state=M0, backend=backend,
                     chunk_size=1, output_final_state=True)
        o_g, M_g = delta_rule(q, k, alpha[..., None] * v, eta / alpha, alpha=alpha, initial_state=M0,
                              output_final_state=True)
        assert_close(o, o_g, name=f"Gated DeltaNet ({backend})")
        assert_close(s.memory, M_g, name="M_T")
        o_plain = delta_rule(q, k, v, eta, alpha=alpha, initial_state=M0)[0]
        assert rel_rmse(o, o_plain) > 1e-4, "decay after the gradient is not Gated DeltaNet with beta = eta"


@pytest.mark.parametrize("gmode", ["source", "offset"])
def test_ns_off_no_momentum_is_omeganet(gen, gmode):
    """[A] Table 6's 'w/o Muon' row: theta = 0 and NS off leave the Omega rule."""
    q, k, v, kw = make_inputs(gen, T=26, window=3, gmode=gmode)
    kw.pop("theta")
    M0 = kw.pop("initial_state").memory
    for backend, b in (("recurrent", 16), ("chunk", 1), ("chunk", 7)):
        o, s = atlas(q, k, v, ns_steps=0, initial_state=M0, backend=backend, chunk_size=b, output_final_state=True,
                     **kw)
        o_w, M_w = omega_rule(q, k, v, initial_state=M0, backend=backend, chunk_size=b, output_final_state=True,
                              **kw)
        assert_close(o, o_w, name=f"{backend}({b})")
        assert_close(s.memory, M_w.memory, name="M_T")


# ---------------------------------------------------------------------------- gradients

def test_gradients_chunk_vs_recurrent_and_frozen_seq(gen):
    q, k, v, kw = make_inputs(gen, T=11, K=4, V=3, window=2, gmode="offset")
    leaves = [q, k, v, kw["alpha"], kw["eta"], kw["theta"], kw["gamma"]]
    for x in leaves:
        x.requires_grad_(True)
    w = torch.randn(1, 2, 11, 3, generator=gen, dtype=F64)

    def grads(backend, b):
        o, s = atlas(q, k, v, backend=backend, chunk_size=b, output_final_state=True, **kw)
        loss = (o * w).sum() + s.memory.square().sum() + s.momentum.sum()
        return torch.autograd.grad(loss, leaves)
    names = ["q", "k", "v", "alpha", "eta", "theta", "gamma"]
    for (a, b_), (ref, b_ref) in ((("chunk", 1), ("recurrent", 1)), (("chunk", 4), ("frozen_seq", 4))):
        for name, g, g_ref in zip(names, grads(a, b_), grads(ref, b_ref)):
            assert_close(g, g_ref, tol=1e-8, name=f"d/d{name}: {a}({b_}) vs {ref}({b_ref})")


def test_gradients_deep_memory_chunk_vs_frozen_seq(gen):
    q, k, v, kw = make_inputs(gen, T=9, K=4, V=4, h0=False)
    for x in (q, v, kw["eta"], kw["theta"]):
        x.requires_grad_(True)
    g_c = torch.autograd.grad(atlas(q, k, v, memory="mlp", chunk_size=4, **kw)[0].square().sum(),
                              (q, v, kw["eta"], kw["theta"]))
    g_f = torch.autograd.grad(atlas(q, k, v, memory="mlp", backend="frozen_seq", chunk_size=4, **kw)[0]
                              .square().sum(), (q, v, kw["eta"], kw["theta"]))
    for g, g_ref in zip(g_c, g_f):
        assert_close(g, g_ref, tol=1e-8)


# ---------------------------------------------------------------------------- the kernel (Triton's interpreter)

@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 2, 9, 4), (4, 16, 16), (1, 33, 70), (2, 128, 20), (1, 64, 64)])
@pytest.mark.parametrize("coeffs", ["muon", "quintic", (1.5, -0.5)])
def test_newton_schulz_kernel(gen, shape, coeffs):
    from atlaslib.atlas.kernel import newton_schulz_triton
    G = torch.randn(*shape, generator=gen)
    with poisoned_outputs():
        X = newton_schulz_triton(G, 5, coeffs)
    assert_close(X, newton_schulz(G, 5, coeffs), tol=1e-5)
    Gt = G.transpose(-1, -2)                                            # a non-contiguous view
    assert_close(newton_schulz_triton(Gt, 3, coeffs), newton_schulz(Gt, 3, coeffs), tol=1e-5, name="view")
    assert newton_schulz_triton(G, 0) is G


def test_newton_schulz_kernel_defaults_and_zero_matrices(gen):
    """newton_schulz_triton(G) is NS_5 with Muon's coefficients (documented as newton_schulz's defaults): its
    singular values are Muon's quintic iterated 5 times on those of G / ||G||_F. A zero matrix (a momentum of 0:
    zero values and memory) gives 0, as newton_schulz does ((||G|| + eps) in the normalisation), not 0 / 0."""
    from atlaslib.atlas.kernel import newton_schulz_triton
    G = torch.randn(3, 8, 16, generator=gen)
    s0 = torch.linalg.svdvals(G.double()) / torch.linalg.matrix_norm(G.double())[..., None]
    scalar = muon_on_a_singular_value(s0, 5).sort(-1, descending=True).values
    assert_close(torch.linalg.svdvals(newton_schulz_triton(G).double()), scalar, tol=1e-5, name="defaults")
    for shape in ((2, 3, 4), (2, 4, 3)):                                   # wide and tall (transposed inside)
        assert (newton_schulz_triton(torch.zeros(shape), 5) == 0).all(), shape
    mixed = torch.stack([G[0], torch.zeros_like(G[0])])                    # one zero matrix in a batch
    X = newton_schulz_triton(mixed, 5)
    assert (X[1] == 0).all()
    assert_close(X[0], newton_schulz(G[0].double(), 5).float(), tol=1e-5, name="the other matrix")
    q, k, _ = random_qkv(1, 2, 9, 4, 4, generator=gen)
    v = torch.zeros_like(q)                     # no initial state, zero values: every momentum and memory is 0
    o, s = atlas(q, k, v, backend="triton", chunk_size=4, output_final_state=True)
    assert (o == 0).all() and (s.memory == 0).all() and (s.momentum == 0).all()


@pytest.mark.parametrize("n_coeffs", [1, 2, 3, 4, 5])
def test_kernel_supports_is_what_the_kernel_takes(gen, n_coeffs):
    """kernel_supports (which tells backend="auto" whether it may take the kernel) is True exactly where
    newton_schulz_triton runs, for any number of coefficients and matrices on both sides of the size limits;
    where it runs, it gives the odd polynomial of ns_by_powers."""
    from atlaslib.atlas.kernel import kernel_supports, newton_schulz_triton
    coeffs = tuple((1.9, -1.2, 0.5, -0.2, 0.05)[:n_coeffs])
    for m, n in ((4, 6), (6, 4), (64, 128), (128, 64), (65, 70), (4, 129), (129, 4)):
        G = torch.randn(m, n, generator=gen)
        try:
            X = newton_schulz_triton(G, 1, coeffs)
        except ValueError as e:
            assert not kernel_supports(m, n, coeffs), f"{m} x {n}, {n_coeffs} coefficients: the kernel refused ({e})"
            continue
        assert kernel_supports(m, n, coeffs), f"{m} x {n}, {n_coeffs} coefficients: the kernel took it"
        assert_close(X, ns_by_powers(G.double(), 1, coeffs).float(), tol=1e-5, name=f"{m} x {n}")


def test_auto_takes_the_kernel_only_where_it_runs(gen, monkeypatch):
    """On a (stand-in) GPU, backend="auto" chooses the kernel for at most three coefficients and momenta within
    64 x 128, and the chunk form otherwise (with a warning), rather than a kernel that raises."""
    import warnings

    import atlaslib.core.dispatch as dispatch

    class OnCuda:
        is_cuda = True
    choices = []
    real = dispatch.resolve_backend

    def as_if_on_cuda(backend, x, unsupported=None):
        choices.append(real(backend, OnCuda(), unsupported))
        return "chunk"                                      # then compute on the CPU
    monkeypatch.setattr(dispatch, "resolve_backend", as_if_on_cuda)
    q, k, v = random_qkv(1, 1, 5, 8, 8, generator=gen)
    for coeffs, want in (("muon", "triton"), ((2.0, -1.5, 0.6), "triton"), ((2.0, -1.5, 0.6, -0.1), "chunk")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            atlas(q, k, v, ns_coeffs=coeffs, backend="auto")
        assert choices[-1] == want, (coeffs, choices[-1])
        assert any("more than 3 coefficients" in str(w.message) for w in caught) == (want == "chunk")
    q, k, v = random_qkv(1, 1, 3, 65, 65, generator=gen)        # momenta 65 x 65: both sides over 64
    with pytest.warns(RuntimeWarning, match="does not take momenta of 65 x 65"):
        atlas(q, k, v, backend="auto")
    assert choices[-1] == "chunk"


def test_newton_schulz_kernel_refuses(gen):
    from atlaslib.atlas.kernel import newton_schulz_triton
    G = torch.randn(2, 4, 6, generator=gen)
    with pytest.raises(ValueError, match="at most three"):
        newton_schulz_triton(G, 5, (1.0, 0.1, 0.1, 0.1))
    with pytest.raises(ValueError, match="fp32"):
        newton_schulz_triton(G.double(), 5)
    with pytest.raises(ValueError, match="up to 64 x 128"):
        newton_schulz_triton(torch.randn(4, 129), 5)
    with pytest.raises(ValueError, match="up to 64 x 128"):
        newton_schulz_triton(torch.randn(65, 70), 5)


@pytest.mark.parametrize("window, gmode, chunk_size", [(1, None, 16), (3, "offset", 4), (2, "source", 1)])
def test_triton_matches_chunk(gen, window, gmode, chunk_size):
    q, k, v, kw = make_inputs(gen, T=21, window=window, gmode=gmode, dtype=torch.float32)
    o_t, s_t = atlas(q, k, v, backend="triton", chunk_size=chunk_size, output_final_state=True, **kw)
    o_c, s_c = atlas(q, k, v, backend="chunk", chunk_size=chunk_size, output_final_state=True, **kw)
    assert_close(o_t, o_c, tol=1e-4)                    # measured about 2e-6: NS amplifies fp32 rounding
    assert_close(s_t.momentum, s_c.momentum, tol=1e-4, name="S_T")
    assert_close(atlas(q, k, v, chunk_size=chunk_size, **kw)[0], o_c, name="auto on CPU is chunk")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_on_16_bit_inputs_costs_about_the_outputs_rounding(gen, dtype):
    """bf16 inputs: Newton-Schulz's products are TF32 on tensor cores (``ns_precision``), fp16 ones exact.
    Against fp64 on the same inputs, o is within a small multiple of what rounding it to that dtype costs
    (in the interpreter, which drops TF32's bits as a card does, over five seeds: bf16 1.1x-1.2x; fp16
    1.0x exact, 4.6x-5.0x had it taken TF32 too)."""
    q, k, v, kw = make_inputs(gen, T=96, K=32, V=32, h0=False, dtype=torch.float32)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kw.update(alpha=None)                               # no decay: the memory keeps every error
    o = atlas(q, k, v, backend="triton", chunk_size=16, **kw)[0]
    ref = atlas(q.double(), k.double(), v.double(), backend="chunk", chunk_size=16,
                **{n: x.double() if torch.is_tensor(x) else x for n, x in kw.items()})[0]
    assert_within_rounding(o.double(), ref, dtype, 1.6)


def test_triton_gradients_are_the_chunk_forms(gen):
    q, k, v, kw = make_inputs(gen, T=9, K=4, V=3, dtype=torch.float32)
    for x in (q, v, kw["eta"]):
        x.requires_grad_(True)
    g_t = torch.autograd.grad(atlas(q, k, v, backend="triton", chunk_size=4, **kw)[0].sum(), (q, v, kw["eta"]))
    g_c = torch.autograd.grad(atlas(q, k, v, backend="chunk", chunk_size=4, **kw)[0].sum(), (q, v, kw["eta"]))
    for g, g_ref in zip(g_t, g_c):
        assert_close(g, g_ref, tol=1e-5)
    with pytest.raises(ValueError, match="fp32"):
        atlas(q.double(), k.double(), v.double(), backend="triton")


# ---------------------------------------------------------------------------- one model, one default

def test_the_chunk_size_default_is_the_engines(gen):
    """ATLAS is a MIRAS model (optimizer "muon"): atlas() and miras() must give it the same default b."""
    import inspect

    import atlaslib.miras as miras_pkg
    from atlaslib.atlas import ATLAS_CHUNK_SIZE, atlas_chunk
    from atlaslib.atlas.kernel import atlas_triton
    default = lambda fn: inspect.signature(fn).parameters["chunk_size"].default     # noqa: E731
    assert default(atlas) is None and default(miras) is None        # None: the model's own default, which is
    assert default(atlas_chunk) == default(atlas_frozen_seq) == default(atlas_triton) \
        == ATLAS_CHUNK_SIZE == miras_pkg.DEFAULT_CHUNK_SIZE
    q, k, v, kw = make_inputs(gen, T=40, K=4, V=4, h0=False)
    o = atlas(q, k, v, memory="residual", **kw)[0]
    kw.pop("window")
    assert_close(o, miras(q, k, v, config=atlas_config("residual"), **kw)[0], name="atlas vs miras, defaults")
    other = miras(q, k, v, config=atlas_config("residual"), chunk_size=8, **kw)[0]
    assert rel_rmse(other, o) > 1e-4, "the chunk size must change this model, or the test proves nothing"


# ---------------------------------------------------------------------------- torch.compile

def compiled_equals_eager(fn, *args, tol=1e-5):
    """fn(*args) compiled with fullgraph=True (one graph, no host syncs) equals eager mode (as test_compile.py)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    try:
        got = torch.compile(fn, fullgraph=True, backend=counter)(*args)
    finally:
        torch._dynamo.reset()
    want = fn(*args)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs"
    for i, (a, b) in enumerate(zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want))):
        assert_close(a, b, tol=tol, name=f"output {i}")


def test_chunk_forms_compile_into_one_graph(gen):
    from atlaslib.atlas import atlas_chunk
    from atlaslib.miras import miras_chunk, prepare
    q, k, v, kw = make_inputs(gen, T=21, K=4, V=4, dtype=torch.float32, h0=False)
    gates = (kw["alpha"], kw["eta"], kw["theta"])
    compiled_equals_eager(lambda q, k, v, a, e, t: atlas_chunk(q, k, v, 2, None, a, e, t, chunk_size=8), q, k, v,
                          *gates)
    compiled_equals_eager(lambda q, k, v, a, e, t: atlas(q, k, v, window=2, alpha=a, eta=e, theta=t, chunk_size=8,
                                                         backend="chunk", output_final_state=True), q, k, v, *gates)
    problem = prepare(q, k, v, config=atlas_config("mlp", window=2), alpha=kw["alpha"], eta=kw["eta"],
                      theta=kw["theta"], backend="chunk", chunk_size=8)
    parts, *args = problem.args
    compiled_equals_eager(lambda *a: miras_chunk(parts, *a, chunk_size=8), *args)


# ---------------------------------------------------------------------------- configuration and bad input

def test_muon_on_the_optimizer_axis():
    cfg = make_config("titans", optimizer="muon", ns_steps=3, ns_coeffs=[1.5, -0.5])
    assert cfg.ns_coeffs == (1.5, -0.5) and cfg.ns_steps == 3
    assert atlas_config().memory == "residual" and atlas_config().optimizer == "muon"
    from atlaslib.miras.config import describe
    assert "NS3" in describe(cfg)["optimizer"]
    assert "NS off" in describe(cfg.replace(ns_steps=0))["optimizer"]


def test_bad_inputs(gen):
    q, k, v = random_qkv(1, 2, 5, 4, 4, generator=gen)
    q6, k6, v3 = random_qkv(1, 2, 5, 6, 3, generator=gen)
    bad = torch.full((1, 2, 5), 1.5)
    cases = [
        (ValueError, "ns_steps", lambda: atlas(q, k, v, ns_steps=-1)),
        (TypeError, "ns_steps", lambda: atlas(q, k, v, ns_steps=2.5)),
        (ValueError, "coeffs must be one of", lambda: atlas(q, k, v, ns_coeffs="septic")),
        (TypeError, "coeffs", lambda: atlas(q, k, v, ns_coeffs=())),
        (ValueError, "theta must lie in", lambda: atlas(q, k, v, theta=bad)),
        (ValueError, "theta must lie in", lambda: atlas(q, k, v, theta=-0.1)),
        (ValueError, "alpha must lie in", lambda: atlas(q, k, v, alpha=bad)),
        (ValueError, "eta must lie in", lambda: atlas(q, k, v, eta=-1.0)),
        (ValueError, "either as alpha or as log_alpha", lambda: atlas(q, k, v, alpha=0.5, log_alpha=-0.1)),
        (ValueError, "gamma must have shape", lambda: atlas(q, k, v, window=3, gamma=torch.ones(1, 2, 5, 2))),
        (ValueError, "window must be >= 1", lambda: atlas(q, k, v, window=0)),
        (ValueError, "memory must be one of", lambda: atlas(q, k, v, memory="transformer")),
        (ValueError, "linear' only", lambda: atlas(q, k, v, memory="mlp", backend="triton")),
        (ValueError, "backend must be one of", lambda: atlas(q, k, v, backend="fast")),
        (ValueError, "chunk_size must be >= 1", lambda: atlas(q, k, v, chunk_size=0)),
        (ValueError, "initial_state must have shape", lambda: atlas(q, k, v, initial_state=torch.zeros(1, 2, 4, 5))),
        (ValueError, "initial_state.momentum must have shape",
         lambda: atlas(q, k, v, initial_state=MirasState(torch.zeros(1, 2, 4, 4), torch.zeros(2, 2)))),
        (ValueError, "K=6 and V=3", lambda: atlas(q6, k6, v3, memory="residual")),
        (ValueError, "v must have shape", lambda: atlas(q, k, v[:, :, :4])),
        (TypeError, "output_final_state", lambda: atlas(q, k, v, output_final_state=1)),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
