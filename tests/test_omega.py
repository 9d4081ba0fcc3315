"""Chapter 4: the Omega rule and SWLA (linear memory; deep memories through chapter 3's engine).

The per-token loop is checked against an independent brute-force oracle: at every step
the windowed loss sum_i gamma_i^{(t)} 1/2 ||M phi(k_i) - v_i||^2 is differentiated by
autograd at M_{t-1} (or, for the frozen-gradient variant, at the chunk-start state).
Then the equalities of book ch. 4 §8 (with §1 and §9) are asserted:
chunk(b) == frozen_seq(b) for every b and window, chunk(1) == recurrent, triton == chunk,
c = 1 (alpha = 1) == the delta rule; and chunk(b > 1) != recurrent, so the frozen-gradient
approximation is real. SWLA is exact for every chunk size.
"""
import pytest
import torch

from atlaslib.core import TaylorFeatures, assert_close, poisoned_outputs, random_gate, random_qkv, rel_rmse
from atlaslib.core.testing import assert_within_rounding, window_gate, window_l2_grad
from atlaslib.delta import delta_rule
from atlaslib.linear import linear_attention
from atlaslib.core.windows import window_gates
from atlaslib.omega import omega_frozen_seq, omega_rule, swla

GAMMAS = [None, "source", "offset"]


def make_inputs(gen, B, H, T, K, V, window, gmode, *, gates=True, h0=True, dtype=torch.float32, eta_scale=1.0):
    """Unit keys and eta <= eta_scale / window keep every step a contraction (stable for any T)."""
    q, k, v = random_qkv(B, H, T, K, V, dtype=dtype, generator=gen)
    if gmode is None:
        gamma = None
    elif gmode == "source":
        gamma = torch.rand(B, H, T, generator=gen).to(dtype)
    else:
        gamma = torch.rand(B, H, T, window, generator=gen).to(dtype)
    alpha = random_gate(B, H, T, low=0.6, dtype=dtype, generator=gen) if gates else None
    eta = (eta_scale * (0.3 + 0.7 * torch.rand(B, H, T, generator=gen)) / window).to(dtype) if gates else None
    state = torch.randn(B, H, V, K, generator=gen).to(dtype) if h0 else None
    return q, k, v, gamma, alpha, eta, state


def autograd_oracle(q, k, v, window, gamma, alpha, eta, h0, chunk_size=1):
    """M_t = alpha_t M_{t-1} - eta_t * autograd of the windowed l2 loss, in fp64.

    The loss is differentiated at M_{t-1} (chunk_size = 1: the Omega rule) or at the state
    after the previous chunk of ``chunk_size`` tokens (the frozen-gradient rule).
    """
    B, H, T, K = q.shape
    f = lambda x: None if x is None else x.double()          # noqa: E731
    q, k, v, gamma, alpha, eta = map(f, (q, k, v, gamma, alpha, eta))
    M = torch.zeros(B, H, v.shape[-1], K, dtype=torch.float64) if h0 is None else h0.double()
    outs = []
    for t in range(T):
        if t % chunk_size == 0:
            anchor = M
        grad = window_l2_grad(anchor, k, v, t, window, gamma)
        a_t = 1.0 if alpha is None else alpha[:, :, t, None, None]
        e_t = 1.0 if eta is None else eta[:, :, t, None, None]
        M = a_t * M - e_t * grad
        outs.append((M @ q[:, :, t, :, None])[..., 0])
    return torch.stack(outs, dim=2), M


def run(backend, q, k, v, gamma, alpha, eta, h0, window, **kw):
    """(o, M): the linear memory's final state is MirasState(M, None)."""
    o, state = omega_rule(q, k, v, window=window, gamma=gamma, alpha=alpha, eta=eta, initial_state=h0,
                          output_final_state=True, backend=backend, **kw)
    assert state.momentum is None
    return o, state.memory


def frozen(q, k, v, gamma, alpha, eta, h0, window, chunk_size):
    """The sequential frozen-gradient oracle in fp64."""
    f = lambda x: None if x is None else x.double()          # noqa: E731
    return omega_frozen_seq(f(q), f(k), f(v), window, f(gamma), f(alpha), f(eta), f(h0), chunk_size)


# ------------------------------------------------------------------ the definition

@pytest.mark.parametrize("gmode", GAMMAS)
@pytest.mark.parametrize("window", [1, 3, 8])
def test_recurrent_matches_autograd_oracle(gen, gmode, window):
    inputs = make_inputs(gen, 2, 2, 13, 5, 3, window, gmode, dtype=torch.float64)
    o, s = run("recurrent", *inputs, window)
    ref_o, ref_s = autograd_oracle(*inputs[:3], window, *inputs[3:])
    assert_close(o, ref_o, tol=1e-12)
    assert_close(s, ref_s, tol=1e-12, name="final state")


@pytest.mark.parametrize("gmode", GAMMAS)
@pytest.mark.parametrize("window,chunk_size", [(3, 4), (6, 2), (2, 5)])
def test_frozen_seq_matches_autograd_oracle(gen, gmode, window, chunk_size):
    inputs = make_inputs(gen, 1, 2, 14, 4, 3, window, gmode, dtype=torch.float64)
    o, s = omega_frozen_seq(*inputs[:3], window, *inputs[3:], chunk_size=chunk_size)
    ref_o, ref_s = autograd_oracle(*inputs[:3], window, *inputs[3:], chunk_size=chunk_size)
    assert_close(o, ref_o, tol=1e-12)
    assert_close(s, ref_s, tol=1e-12, name="final state")


def test_value_term_is_added_eq11_sign(gen):
    """One step from M = 0 with c pairs writes +eta sum gamma v k^T ([A] eq. 11 subtracts it)."""
    q, k, v, gamma, _, _, _ = make_inputs(gen, 1, 1, 4, 6, 3, 4, "source", gates=False, h0=False)
    _, s = run("recurrent", q[:, :, :1], k[:, :, :1], v[:, :, :1], gamma[:, :, :1], None, None, None, 4)
    assert_close(s, gamma[0, 0, 0] * v[:, :, 0, :, None] * k[:, :, 0, None, :], tol=1e-6)


# ------------------------------------------------------------------ chunk form

SHAPES = [(2, 2, 1, 12, 10), (1, 3, 37, 12, 10), (2, 1, 75, 20, 7)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gmode", GAMMAS)
@pytest.mark.parametrize("h0", [False, True])
@pytest.mark.parametrize("window", [1, 4, 40])
def test_chunk_matches_frozen_seq(gen, shape, gmode, h0, window):
    """Exact for every chunk size b, including windows longer than the chunk (c > b)."""
    inputs = make_inputs(gen, *shape, window, gmode, h0=h0)
    for chunk_size in (1, 5, 16, 64):
        ref, ref_s = frozen(*inputs, window, chunk_size)
        with poisoned_outputs():
            o, s = run("chunk", *inputs, window, chunk_size=chunk_size)
        assert_close(o, ref, name=f"o (chunk_size={chunk_size})")
        assert_close(s, ref_s, name=f"final state (chunk_size={chunk_size})")


@pytest.mark.parametrize("gmode", GAMMAS)
@pytest.mark.parametrize("window", [1, 3, 10])
def test_chunk_size_one_is_the_per_token_rule(gen, gmode, window):
    inputs = make_inputs(gen, 2, 2, 37, 12, 10, window, gmode, dtype=torch.float64)
    ref, ref_s = run("recurrent", *inputs, window)
    o, s = run("chunk", *inputs, window, chunk_size=1)
    assert_close(o, ref, tol=1e-12)
    assert_close(s, ref_s, tol=1e-12, name="final state")


@pytest.mark.parametrize("window", [1, 3, 10])
def test_frozen_gradients_are_an_approximation(gen, window):
    """chunk(b > 1) is a different model from the per-token rule: the gap is far above rounding."""
    inputs = make_inputs(gen, 2, 2, 64, 12, 10, window, "offset", dtype=torch.float64, eta_scale=1.5)
    ref, _ = run("recurrent", *inputs, window)
    gaps = []
    for chunk_size in (2, 8, 32):
        o, _ = run("chunk", *inputs, window, chunk_size=chunk_size)
        gaps.append(rel_rmse(o, ref))
        assert gaps[-1] > 1e-3, f"chunk_size={chunk_size}: relative gap {gaps[-1]:.2e} is suspiciously small"
    assert gaps[-1] > gaps[0], f"staler gradients should drift further, got {gaps}"


def test_extreme_gates(gen):
    """alpha = 0 (full reset each step), alpha = 1, gamma = 0 (no write: M_t = A_t M_0)."""
    q, k, v, gamma, alpha, eta, h0 = make_inputs(gen, 1, 2, 40, 8, 6, 5, "source")
    for a in (torch.zeros_like(alpha), torch.ones_like(alpha), torch.full_like(alpha, 1e-3)):
        ref, ref_s = frozen(q, k, v, gamma, a, eta, h0, 5, 16)
        o, s = run("chunk", q, k, v, gamma, a, eta, h0, 5, chunk_size=16)
        assert torch.isfinite(o).all()
        assert_close(o, ref, tol=1e-5)
        assert_close(s, ref_s, tol=1e-5, name="final state")
    for backend in ("recurrent", "chunk"):
        o, s = run(backend, q, k, v, torch.zeros_like(gamma), alpha, eta, h0, 5, chunk_size=16)
        A = torch.cumprod(alpha.double(), dim=2)
        assert_close(o, A[..., None] * torch.einsum("bhvk,bhtk->bhtv", h0.double(), q.double()), name=backend)
        assert_close(s, A[:, :, -1, None, None] * h0.double(), name=f"{backend} final state")


# ------------------------------------------------------------------ Triton kernel (interpreter on CPU)

TRITON_CASES = [  # (shape, window, chunk_size): T = 1, c = 1, c > b, b not a power of two
    ((2, 2, 1, 12, 10), 3, 16),
    ((1, 3, 37, 12, 10), 1, 16),
    ((1, 2, 37, 12, 10), 20, 7),
    ((2, 1, 75, 20, 7), 4, 32),
]


@pytest.mark.parametrize("case", TRITON_CASES)
@pytest.mark.parametrize("gmode", GAMMAS)
def test_triton_matches_frozen_seq(gen, case, gmode):
    shape, window, chunk_size = case
    inputs = make_inputs(gen, *shape, window, gmode)
    ref, ref_s = frozen(*inputs, window, chunk_size)
    with poisoned_outputs():
        o, s = run("triton", *inputs, window, chunk_size=chunk_size)
    assert_close(o, ref)
    assert_close(s, ref_s, name="final state")


@pytest.mark.parametrize("rule", ["omega", "swla"])
def test_triton_wide_features_keep_the_chunk_size_of_the_model(gen, rule):
    """D = 256 fp32 at chunk_size 64: SWLA's kernel runs chunks of 32 (exact at every chunk length, and a
    chunk of 64 would not fit an A100's shared memory), but the Omega rule's chunk size is part of its model
    (frozen gradients within a chunk), so its kernel keeps 64 and matches the fp64 frozen_seq at b = 64."""
    B, H, T, D, V = 1, 1, 80, 256, 4
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, T, D, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, V, generator=gen)
    eta = 0.5 * torch.rand(B, H, T, generator=gen)
    call = omega_rule if rule == "omega" else swla
    ref_backend = "frozen_seq" if rule == "omega" else "recurrent"
    o, s = call(q, k, v, window=1, eta=eta, chunk_size=64, backend="triton", output_final_state=True)
    ref, ref_s = call(q.double(), k.double(), v.double(), window=1, eta=eta.double(), chunk_size=64,
                      backend=ref_backend, output_final_state=True)
    memory = lambda x: getattr(x, "memory", x)                     # noqa: E731  (SWLA's state is the matrix)
    assert rel_rmse(o.double(), ref) < 1e-5
    assert rel_rmse(memory(s).double(), memory(ref_s)) < 1e-5


@pytest.mark.parametrize("backend", ["recurrent", "frozen_seq", "chunk"])
def test_gates_of_another_dtype_follow_the_inputs(gen, backend):
    """fp32 q, k, v with fp64 or bf16 alpha and eta: the gates are cast to the compute dtype, so the result
    is the all-fp64 run's to fp32 rounding (of the gates as given), and the state stays fp32."""
    B, H, T, K, V = 1, 2, 9, 6, 5
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    alpha = random_gate(B, H, T, low=0.6, generator=gen).double()
    eta = 0.5 * torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    for gdt in (torch.float64, torch.bfloat16):
        a, e = alpha.to(gdt), eta.to(gdt)
        o, s = omega_rule(q, k, v, window=2, alpha=a, eta=e, backend=backend, chunk_size=1, output_final_state=True)
        ref, _ = omega_rule(q.double(), k.double(), v.double(), window=2, alpha=a.double(), eta=e.double(),
                            backend=backend, chunk_size=1, output_final_state=True)
        assert o.dtype == torch.float32 and s.memory.dtype == torch.float32, (gdt, o.dtype, s.memory.dtype)
        assert rel_rmse(o.double(), ref) < 1e-5, gdt


def test_triton_without_gates_or_state(gen):
    inputs = make_inputs(gen, 2, 1, 40, 12, 10, 2, None, gates=False, h0=False)
    ref, ref_s = frozen(*inputs, 2, 16)
    with poisoned_outputs():
        o, s = run("triton", *inputs, 2, chunk_size=16)
    assert_close(o, ref)
    assert_close(s, ref_s, name="final state")


def test_triton_low_precision(gen):
    inputs = make_inputs(gen, 1, 2, 40, 32, 16, 4, "offset")
    ref, _ = run("chunk", *inputs, 4, chunk_size=16)
    q, k, v = inputs[:3]
    for dtype in (torch.bfloat16, torch.float16):
        o, _ = run("triton", q.to(dtype), k.to(dtype), v.to(dtype), *inputs[3:], 4, chunk_size=16)
        assert o.dtype == dtype
        assert_close(o.float(), ref, tol=3e-2, name=str(dtype))


def test_triton_fp16_gate_matrix_costs_about_the_outputs_rounding(gen):
    """With decays, the gate matrix C = D Diag(eta) Gamma weighs every output, and for fp16 inputs it is one
    TF32 product, as long as fp16's mantissa: o is off fp64 by 2.81x what rounding it to fp16 costs
    (interpreter, T = 512, D = V = 64, c = 8). Three TF32 products ("tf32x3") gave 1.66x, but their builds
    spilled 1.8-2.8 KB a thread at 64-token chunks (0.4-1.1 KB with TF32), so TF32 stays."""
    c, b = 8, 16
    q, k, v, gamma, _, eta, _ = make_inputs(gen, 1, 2, 512, 64, 64, c, "offset", h0=False)
    q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    alpha = 0.9 + 0.1 * torch.rand(1, 2, 512, generator=gen)
    q, k, v = q.half(), k.half(), v.half()
    ref_o, _ = frozen(q, k, v, gamma, alpha, eta, None, c, b)
    o, _ = run("triton", q, k, v, gamma, alpha, eta, None, c, chunk_size=b)
    assert_within_rounding(o.double(), ref_o, torch.float16, 3.3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", ["omega", "swla"])
def test_triton_16_bit_products_cost_about_the_outputs_rounding(gen, dtype, rule):
    """bf16/fp16 inputs: every product takes 16-bit operands (the memory rounded), the memory and sums stay
    fp32. Against fp64 on the same inputs, o and M_T are off by a small multiple of what rounding o to that
    dtype costs (in the interpreter, which rounds as a card does: o 1.7x-2.1x, M_T 0.9x-1.1x over six seeds;
    a memory kept in 16 bits between chunks gives M_T 2.4x-3.2x). No decay: the memory keeps its errors."""
    c, b = 4, 16
    q, k, v, gamma, _, eta, _ = make_inputs(gen, 1, 2, 256, 32, 32, c, "offset", h0=False, eta_scale=0.5)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if rule == "omega":
        ref_o, ref_M = frozen(q, k, v, gamma, None, eta, None, c, b)
    else:
        f = lambda x: x.double()          # noqa: E731
        ref_o, ref_M = swla(f(q), f(k), f(v), window=c, gamma=f(gamma), eta=f(eta), output_final_state=True,
                            backend="recurrent")
    o, M_T = run("triton", q, k, v, gamma, None, eta, None, c, chunk_size=b) if rule == "omega" else \
        swla(q, k, v, window=c, gamma=gamma, eta=eta, output_final_state=True, backend="triton", chunk_size=b)
    own = rel_rmse(ref_o.to(dtype).double(), ref_o)        # what rounding o to the dtype costs
    assert_within_rounding(o.double(), ref_o, dtype, 2.5)
    assert_close(M_T.double(), ref_M, tol=1.8 * own, name="M_T")


# ------------------------------------------------------------------ gradients

def weighted_loss(o, s):
    w = torch.cos(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)
    return (o * w).sum() + s.square().sum()


NAMES = ["q", "k", "v", "gamma", "alpha", "eta", "h0"]


@pytest.mark.parametrize("gmode", ["source", "offset"])
def test_gradients_chunk_vs_frozen_seq(gen, gmode):
    window, chunk_size = 3, 4
    inputs = make_inputs(gen, 1, 2, 15, 5, 4, window, gmode, dtype=torch.float64)
    grads = []
    for fn in ("frozen_seq", "chunk"):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        if fn == "frozen_seq":
            o, s = omega_frozen_seq(*leaves[:3], window, *leaves[3:], chunk_size=chunk_size)
        else:
            o, s = run("chunk", *leaves, window, chunk_size=chunk_size)
        weighted_loss(o, s).backward()
        grads.append([x.grad for x in leaves])
    for name, g_chunk, g_seq in zip(NAMES, grads[1], grads[0]):
        assert_close(g_chunk, g_seq, tol=1e-10, name=f"grad {name}")


def test_gradients_triton_vs_frozen_seq(gen):
    window, chunk_size = 5, 16
    inputs = make_inputs(gen, 1, 2, 33, 16, 16, window, "offset")
    grads = []
    for fn in ("frozen_seq", "triton"):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        if fn == "frozen_seq":
            o, s = omega_frozen_seq(*leaves[:3], window, *leaves[3:], chunk_size=chunk_size)
        else:
            o, s = run("triton", *leaves, window, chunk_size=chunk_size)
        weighted_loss(o, s).backward()
        grads.append([x.grad for x in leaves])
    for name, g_tri, g_seq in zip(NAMES, grads[1], grads[0]):
        assert_close(g_tri, g_seq, tol=1e-4, name=f"grad {name}")


# ------------------------------------------------------------------ reductions

@pytest.mark.parametrize("gmode", GAMMAS)
def test_window_one_is_the_delta_rule(gen, gmode):
    """c = 1, alpha = 1: M_t = M_{t-1} + eta_t gamma_t (v_t - M_{t-1} k_t) k_t^T = delta rule, beta = eta * gamma."""
    q, k, v, gamma, _, eta, h0 = make_inputs(gen, 2, 2, 21, 12, 10, 1, gmode)
    beta = eta if gamma is None else eta * (gamma if gamma.dim() == 3 else gamma[..., 0])
    ref, ref_s = delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True, backend="chunk")
    ones = torch.ones_like(eta)
    for backend, b, alpha in (("recurrent", 64, None), ("recurrent", 64, ones), ("chunk", 1, None),
                              ("chunk", 1, ones), ("triton", 1, ones)):
        o, s = run(backend, q, k, v, gamma, alpha, eta, h0, 1, chunk_size=b)
        assert_close(o, ref, name=f"{backend} (chunk_size={b})")
        assert_close(s, ref_s, name=f"{backend} final state")
    # with b > 1 the chunk form freezes the gradients: no longer the delta rule
    o, _ = run("chunk", q, k, v, gamma, None, eta, h0, 1, chunk_size=16)
    assert rel_rmse(o, ref) > 1e-3


def test_window_one_with_retention_is_not_gated_deltanet(gen):
    """Omega decays after the gradient step at M_{t-1}; Gated DeltaNet steps at alpha_t M_{t-1}."""
    q, k, v, _, alpha, eta, h0 = make_inputs(gen, 1, 2, 30, 8, 6, 1, None, dtype=torch.float64)
    o, _ = run("recurrent", q, k, v, None, alpha, eta, h0, 1)
    gated, _ = delta_rule(q, k, v, eta, alpha=alpha, initial_state=h0, backend="recurrent")
    rescaled, _ = delta_rule(q, k, v, eta / alpha, alpha=alpha, initial_state=h0, backend="recurrent")
    assert rel_rmse(o, gated) > 1e-3
    # alpha M - eta (M k - v) k^T = alpha M (I - (eta/alpha) k k^T) + eta v k^T: the writes differ too
    assert rel_rmse(o, rescaled) > 1e-3


# ------------------------------------------------------------------ SWLA

@pytest.mark.parametrize("gmode", GAMMAS)
@pytest.mark.parametrize("window", [1, 4, 20])
def test_swla_chunk_is_exact(gen, gmode, window):
    inputs = make_inputs(gen, 2, 1, 37, 12, 10, window, gmode)
    ref, ref_s = swla(*inputs[:3], window=window, gamma=inputs[3], alpha=inputs[4], eta=inputs[5],
                      initial_state=inputs[6], output_final_state=True, backend="recurrent")
    for backend, b in (("chunk", 1), ("chunk", 5), ("chunk", 16), ("triton", 7)):
        with poisoned_outputs():
            o, s = swla(*inputs[:3], window=window, gamma=inputs[3], alpha=inputs[4], eta=inputs[5],
                        initial_state=inputs[6], output_final_state=True, backend=backend, chunk_size=b)
        assert_close(o, ref, name=f"{backend} (chunk_size={b})")
        assert_close(s, ref_s, name=f"{backend} final state")


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_swla_is_not_sliding_window_attention(gen, backend):
    """alpha = gamma = 1: M_t = sum_{i<=t} min(c, t - i + 1) v_i k_i^T; old pairs are never evicted."""
    c, T = 4, 19
    q, k, v = random_qkv(1, 2, T, 6, 5, dtype=torch.float64, generator=gen)
    o, s = swla(q, k, v, window=c, output_final_state=True, backend=backend, chunk_size=5)
    t = torch.arange(T)
    weight = torch.minimum(torch.tensor(c), t[:, None] - t[None, :] + 1).clamp_min(0).tril().double()  # [t, i]
    expect_o = torch.einsum("ti,bhti,bhiv->bhtv", weight, q @ k.transpose(-1, -2), v)
    assert_close(o, expect_o, tol=1e-12)
    assert_close(s, torch.einsum("i,bhiv,bhik->bhvk", weight[-1], v, k), tol=1e-12, name="final state")
    window_only = torch.einsum("ti,bhti,bhiv->bhtv", ((t[:, None] - t[None, :]).abs() < c).tril().double(),
                               q @ k.transpose(-1, -2), v)
    assert rel_rmse(o, window_only) > 0.1, "SWLA must differ from a linear attention restricted to the window"


def test_swla_window_one_is_linear_attention(gen):
    q, k, v, gamma, alpha, eta, h0 = make_inputs(gen, 2, 2, 37, 12, 10, 1, "source")
    o, s = swla(q, k, v, window=1, gamma=gamma, alpha=alpha, eta=eta, initial_state=h0, output_final_state=True)
    ref, ref_s = linear_attention(q, k, (eta * gamma)[..., None] * v, alpha=alpha, initial_state=h0,
                                  output_final_state=True, backend="recurrent")
    assert_close(o, ref)
    assert_close(s, ref_s, name="final state")


# ------------------------------------------------------------------ feature maps inside the rule

def test_polynomial_features_in_the_rule(gen):
    """phi = TaylorFeatures(2): state [B, H, V, D] with D = 1 + K + K^2, and a_i train through every backend."""
    window, K = 3, 4
    q, k, v, gamma, alpha, eta, _ = make_inputs(gen, 1, 2, 20, K, 3, window, "offset")
    phi = TaylorFeatures(2)
    D = phi.feature_dim(K)
    ref, ref_s = run("recurrent", q, k, v, gamma, alpha, eta, None, window, phi=phi)
    assert ref_s.shape == (1, 2, 3, D) == (1, 2, 3, 21)
    fq, fk = phi(q).detach(), phi(k).detach()
    manual, _ = run("recurrent", fq, fk, v, gamma, alpha, eta, None, window)
    assert_close(ref, manual, name="phi applied to q and k")
    grads = []
    for backend in ("chunk", "triton"):
        phi.zero_grad()
        o, s = run(backend, q, k, v, gamma, alpha, eta, None, window, phi=phi, chunk_size=1)
        assert_close(o, ref, name=f"{backend} at chunk_size=1")
        weighted_loss(o, s).backward()
        grads.append(phi.raw.grad.clone())
    assert grads[0].abs().sum() > 0
    assert_close(grads[1], grads[0], tol=1e-4, name="grad of the Taylor coefficients")
    o, _ = run("chunk", q, k, v, gamma, alpha, eta, None, window, phi="elu+1")
    assert o.shape == v.shape


# ------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("gmode", GAMMAS)
@pytest.mark.parametrize("window", [1, 3, 5])
def test_window_gates_by_definition(gen, gmode, window):
    """G[t, j] is the weight gamma_{t-j}^{(t)} of the pair j tokens back, and 0 where that token t - j < 0
    does not exist (the first c - 1 tokens' windows reach before the sequence)."""
    B, H, T = 2, 3, 7
    _, _, _, gamma, *_ = make_inputs(gen, B, H, T, 2, 2, window, gmode, dtype=torch.float64)
    G = window_gates(gamma, B, H, T, window, torch.float64, "cpu")
    assert G.shape == (B, H, T, window)
    for t in range(T):
        for j in range(window):
            expect = window_gate(gamma, t, t - j) if t - j >= 0 else 0.0
            torch.testing.assert_close(G[:, :, t, j], torch.as_tensor(expect, dtype=torch.float64).expand(B, H),
                                       rtol=0, atol=0, msg=f"G[t={t}, j={j}]")


def test_bad_inputs():
    q, k, v = random_qkv(1, 2, 10, 4, 3, seed=0)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        omega_rule(q, k, v, window=0)
    with pytest.raises(TypeError, match="window must be a positive int"):
        omega_rule(q, k, v, window=2.0)
    with pytest.raises(TypeError, match="window must be a positive int"):
        swla(q, k, v, window=None)
    with pytest.raises(ValueError, match=r"gamma must have shape \[1, 2, 10\] or \[1, 2, 10, 3\], got \[1, 2, 10, 4\]"):
        omega_rule(q, k, v, window=3, gamma=torch.ones(1, 2, 10, 4))
    with pytest.raises(ValueError, match=r"gamma must have shape"):
        omega_rule(q, k, v, window=3, gamma=torch.ones(1, 2, 9))
    with pytest.raises(ValueError, match=r"gamma must lie in \[0.0, 1.0\]"):
        omega_rule(q, k, v, window=3, gamma=torch.full((1, 2, 10), 1.5))
    with pytest.raises(ValueError, match=r"eta must lie in \[0.0, inf\)"):
        omega_rule(q, k, v, window=3, eta=torch.full((1, 2, 10), -0.1))
    with pytest.raises(ValueError, match=r"alpha must have shape \[1, 2, 10\], got \[1, 2, 10, 4\]"):
        omega_rule(q, k, v, window=3, alpha=torch.ones(1, 2, 10, 4))
    with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
        swla(q, k, v, window=3, alpha=torch.full((1, 2, 10), 1.2))
    with pytest.raises(ValueError, match=r"memory must be one of \('linear', 'mlp', 'residual', 'gated'\)"):
        omega_rule(q, k, v, window=3, memory="conv")
    with pytest.raises(ValueError, match="kernel only for memory='linear'"):
        omega_rule(q, k, v, window=3, memory="mlp", backend="triton")
    with pytest.raises(ValueError, match="needs the key .* width to equal the value width"):
        omega_rule(q, k, v, window=3, memory="residual")          # K = 4, V = 3: no skip connection
    with pytest.raises(ValueError, match=r"initial_state must have shape \[1, 2, 3, 15\]"):
        omega_rule(q, k, v, window=3, phi=TaylorFeatures(2, compressed=True), initial_state=torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"phi must map \[B, H, T, K\] to \[B, H, T, D\]"):
        omega_rule(q, k, v, window=3, phi=lambda x: x[0])
    with pytest.raises(ValueError, match="unknown feature map"):
        omega_rule(q, k, v, window=3, phi="poly")
    with pytest.raises(ValueError, match="degree must be >= 0"):
        omega_rule(q, k, v, window=3, phi=TaylorFeatures(-1))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        omega_rule(q, k, v, window=3, chunk_size=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        omega_rule(q, k, v, window=3, backend="frozen")
    with pytest.raises(ValueError, match="v must have shape"):
        omega_rule(q, k, v[:, :, :5], window=3)
    with pytest.raises(TypeError, match="fp64"):
        omega_rule(q.double(), k.double(), v.double(), window=3, backend="triton")
    wide = random_qkv(1, 1, 4, 128, 3, seed=0)                   # D = 128: a 256 x 128 tile at b + c - 1 = 163
    with pytest.raises(ValueError, match=r"\[256, 128\] window tile"):
        omega_rule(*wide, window=100, chunk_size=64, backend="triton")
    from atlaslib.omega.kernel import kernel_supports            # "auto" on CUDA falls back to chunk there
    assert kernel_supports(64, 4, 64) and kernel_supports(64, 150, 16)
    assert not kernel_supports(128, 100, 64) and not kernel_supports(16, 2, 128)
    with pytest.raises(ValueError, match="chunk_size <= 64"):
        omega_rule(q, k, v, window=2, chunk_size=128, backend="triton")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    q, k, v = random_qkv(1, 1, 4, 4, 4, seed=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        omega_rule(q, k, v, window=2, backend="triton")


# ------------------------------------------------------------------ real GPU (skipped without CUDA)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,chunk_size", [(1, 64), (4, 64), (16, 32), (150, 16)])
def test_kernel_on_gpu(gen, dtype, window, chunk_size):
    inputs = [None if x is None else x.cuda() for x in make_inputs(gen, 2, 4, 1000, 64, 64, window, "offset")]
    ref, ref_s = run("chunk", *inputs, window, chunk_size=chunk_size)
    q, k, v = (x.to(dtype) for x in inputs[:3])
    with poisoned_outputs():
        o, s = run("triton", q, k, v, *inputs[3:], window, chunk_size=chunk_size)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close(o.float(), ref, tol=tol)
    assert_close(s, ref_s, tol=tol, name="final state")


# ------------------------------------------------------------------ deep memories (OmegaNet on chapter 3's engine)

def deep_oracle(q, k, v, window, gamma, alpha, eta, W0, chunk_size=1):
    """OmegaNet with the memory W2 gelu(W1 x), written out: autograd of the windowed l2 loss
    at W_{t-1} (chunk_size = 1) or at the chunk-start weights, W_t = alpha_t W_{t-1} - eta_t grad."""
    B, H, T, _ = q.shape
    W = {n: w.double() for n, w in W0.items()}
    mlp = lambda P, x: (P["W2"] @ torch.nn.functional.gelu(P["W1"] @ x[..., None]))[..., 0]   # noqa: E731
    outs = []
    for t in range(T):
        if t % chunk_size == 0:
            anchor = {n: w.detach().clone().requires_grad_(True) for n, w in W.items()}
        loss = 0.0
        for i in range(max(0, t - window + 1), t + 1):
            per_bh = 0.5 * (mlp(anchor, k[:, :, i]) - v[:, :, i]).square().sum(-1)
            loss = loss + (window_gate(gamma, t, i) * per_bh).sum()
        grads = torch.autograd.grad(loss, list(anchor.values()))
        a_t = 1.0 if alpha is None else alpha[:, :, t, None, None]
        W = {n: a_t * W[n] - eta[:, :, t, None, None] * g for n, g in zip(anchor, grads)}
        outs.append(mlp(W, q[:, :, t]))
    return torch.stack(outs, dim=2), W


@pytest.mark.parametrize("gmode", ["source", "offset"])
@pytest.mark.parametrize("window,chunk_size", [(1, 1), (3, 1), (3, 4), (2, 5)])
def test_deep_memory_matches_autograd_oracle(gen, gmode, window, chunk_size):
    """memory="mlp": recurrent (b = 1) and chunk(b) against the written-out oracle above."""
    from atlaslib.miras import init_state
    q, k, v, gamma, alpha, eta, _ = make_inputs(gen, 1, 2, 11, 4, 3, window, gmode, h0=False, dtype=torch.float64)
    W0 = init_state("ttt_mlp", 1, 2, 4, 3, generator=gen, dtype=torch.float64).memory
    ref_o, ref_W = deep_oracle(q, k, v, window, gamma, alpha, eta, W0, chunk_size)
    backends = ["recurrent", "chunk"] if chunk_size == 1 else ["chunk"]
    for backend in backends:
        o, state = omega_rule(q, k, v, window=window, gamma=gamma, alpha=alpha, eta=eta, memory="mlp",
                              initial_state=W0, output_final_state=True, backend=backend, chunk_size=chunk_size)
        assert_close(o, ref_o, tol=1e-10, name=f"{backend} output")
        for n in ref_W:
            assert_close(state.memory[n], ref_W[n], tol=1e-10, name=f"{backend} final {n}")
    if chunk_size > 1:                        # frozen gradients really change the deep model
        o_rec, _ = omega_rule(q, k, v, window=window, gamma=gamma, alpha=alpha, eta=eta, memory="mlp",
                              initial_state=W0, backend="recurrent")
        assert rel_rmse(o_rec, ref_o) > 1e-4


def test_a_deep_memory_takes_the_engines_memory_options(gen):
    """expansion, activation and layer_norm reach chapter 3's engine (as miras and dla take them); the
    linear memory has none, and an unknown option is a TypeError."""
    from atlaslib.atlas import atlas, atlas_config
    from atlaslib.miras import miras
    q, k, v = random_qkv(1, 2, 9, 8, 8, generator=gen, dtype=torch.float64)
    kw = dict(backend="chunk", chunk_size=1, output_final_state=True)
    o, s = omega_rule(q, k, v, window=2, eta=0.1, memory="mlp", expansion=2, activation="silu", **kw)
    ref, _ = miras(q, k, v, memory="mlp", bias="l2", optimizer="gd", retention="none", window=2, eta=0.1,
                   expansion=2, activation="silu", **kw)
    assert torch.equal(o, ref) and s.memory["W1"].shape == (1, 2, 16, 8)
    o, s = atlas(q, k, v, eta=0.1, theta=0.5, memory="residual", expansion=3, layer_norm=True, **kw)
    ref, _ = miras(q, k, v, config=atlas_config("residual", expansion=3, layer_norm=True), eta=0.1, theta=0.5, **kw)
    assert torch.equal(o, ref) and s.memory["W1"].shape == (1, 2, 8, 24)
    for call in (lambda: omega_rule(q, k, v, window=2, expansion=2), lambda: atlas(q, k, v, activation="silu")):
        with pytest.raises(ValueError, match="memory='linear' has none"):
            call()
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['width'\]"):
        atlas(q, k, v, memory="mlp", width=3)


STEP_B, STEP_H, STEP_K, STEP_V, STEP_C = 1, 2, 4, 3, 3
BAD_STEP_INPUTS = {                     # (argument, bad value): each one atlas_step already refuses
    "v_t as wide as k_t": ("v_t", torch.zeros(STEP_B, STEP_H, STEP_K)),
    "q_t one channel too many": ("q_t", torch.zeros(STEP_B, STEP_H, STEP_K + 1)),
    "k_t with a token axis": ("k_t", torch.zeros(STEP_B, STEP_H, 1, STEP_K)),
    "alpha_t without the batch": ("alpha_t", torch.ones(STEP_H)),
    "eta_t with a trailing axis": ("eta_t", torch.ones(STEP_B, STEP_H, 1)),
    "window gates for c + 1 offsets": ("gate", torch.ones(STEP_B, STEP_H, STEP_C + 1)),
    "window 0": ("window", 0),
}


@pytest.mark.parametrize("rule", ["omega", "swla"])
@pytest.mark.parametrize("case", list(BAD_STEP_INPUTS))
def test_window_steps_refuse_what_atlas_step_refuses(rule, case):
    """omega_step and swla_step check one token's shapes and the window as atlas_step does, with the same
    error (the window gates are gamma_t there, G_t in ATLAS) instead of a broadcast or a silent slice."""
    import re
    from atlaslib.atlas import atlas_step, start_state
    from atlaslib.omega.recurrent import omega_step, start_window, swla_step
    M = torch.zeros(STEP_B, STEP_H, STEP_V, STEP_K)
    good = dict(q_t=torch.randn(STEP_B, STEP_H, STEP_K), k_t=torch.randn(STEP_B, STEP_H, STEP_K),
                v_t=torch.randn(STEP_B, STEP_H, STEP_V), window=STEP_C)
    name, bad = BAD_STEP_INPUTS[case]
    with pytest.raises(ValueError) as atlas_error:
        atlas_step(start_state(M), **(good | {"G_t" if name == "gate" else name: bad}))
    step = omega_step if rule == "omega" else swla_step
    expected = str(atlas_error.value).replace("G_t", "gamma_t")
    with pytest.raises(ValueError, match=re.escape(expected)):
        step(start_window(M), **(good | {"gamma_t" if name == "gate" else name: bad}))


def test_kernel_limits_states_the_tile_rule():
    """The refusal names the rule kernel_supports applies: tile(chunk_size + window - 1) * tile(D) at most
    128 * 128 elements with tile(n) = max(16, next_pow2(n)) (not each side within 128), and the tiles given."""
    from atlaslib.omega.backends import kernel_limits
    tile = lambda n: max(16, 1 << (n - 1).bit_length())          # noqa: E731
    D, window, chunk_size = 128, 120, 16                              # 135 rows: a [256, 128] tile
    message = kernel_limits(torch.zeros(1, 1, 4, D), window, chunk_size)
    assert "tile(chunk_size + window - 1) * tile(D) <= 16384" in message
    assert "tile(n) = max(16, next_pow2(n))" in message
    assert f"{tile(chunk_size + window - 1)} * {tile(D)}" in message
    for D, window, chunk_size in ((200, 1, 64), (64, 120, 16)):      # a side over 128, the product within
        assert tile(chunk_size + window - 1) * tile(D) <= 128 * 128
        assert kernel_limits(torch.zeros(1, 1, 4, D), window, chunk_size) is None


@pytest.mark.parametrize("f", [swla, omega_rule])
def test_kernel_padding_rows_stay_finite_under_strong_decay(f):
    """The rows of a chunk's tile past its tokens read the log-gate 0; unmasked, their decays e^{0 - g_n}
    overflowed (inf, then inf * 0 = NaN in the weights' product). Never stored, but a card computes them too:
    the kernel masks them, and the interpreter raises no floating-point error."""
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 40, 8, generator=gen) for _ in range(3))
    log_alpha = torch.full((1, 1, 40), -0.1)
    log_alpha[..., ::3] = -30.0
    kw = dict(window=2, eta=0.5, gamma=0.7)
    with np.errstate(over="raise", invalid="raise"):
        o = f(q, k, v, log_alpha=log_alpha, backend="triton", **kw)[0]
    ref = f(q.double(), k.double(), v.double(), log_alpha=log_alpha.double(), backend="chunk", **kw)[0]
    assert rel_rmse(o, ref) < 1e-5
