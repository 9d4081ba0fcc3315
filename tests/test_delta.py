"""Chapter 2: the delta rule family (DeltaNet, Gated DeltaNet, KDA, Longhorn).

The per-token loop is checked against an independent literal form (the matrices
Diag(alpha_t) and I - beta_t k_t k_t^T written out), Longhorn against a linear solve of
its proximal problem, and the store/overwrite behaviour against orthonormal keys. The
chunk form (UT transform) and the Triton kernel (interpreter on CPU) are then checked
against the loop on fresh random inputs, odd shapes, all three gate modes and extreme
gates.
"""
import pytest
import torch

from atlaslib.core import assert_close, poisoned_outputs, random_gate, random_qkv
from atlaslib.delta import BETA_MAX, delta_rule, longhorn_beta
from test_linear import mixed_channel_gates

MODES = [None, "scalar", "channel"]


def make_inputs(gen, B, H, T, K, V, mode, dtype=torch.float32, low=0.5, high=1.0, h0=True,
                beta_high=1.0):
    q, k, v = random_qkv(B, H, T, K, V, dtype=dtype, generator=gen)
    beta = (beta_high * torch.rand(B, H, T, generator=gen)).to(dtype)
    alpha = None if mode is None else random_gate(B, H, T, K if mode == "channel" else None,
                                                  low=low, high=high, dtype=dtype, generator=gen)
    state = torch.randn(B, H, V, K, generator=gen, dtype=dtype) if h0 else None
    return q, k, v, beta, alpha, state


def literal_delta_rule(q, k, v, beta, alpha, h0):
    """M_t = M_{t-1} Diag(alpha_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T with every matrix formed, fp64."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    q, k, v, beta = q.double(), k.double(), v.double(), beta.double()
    M = torch.zeros(B, H, V, K, dtype=torch.float64) if h0 is None else h0.double().clone()
    eye = torch.eye(K, dtype=torch.float64)
    out = torch.zeros(B, H, T, V, dtype=torch.float64)
    for t in range(T):
        if alpha is None:
            decay = eye.expand(B, H, K, K)
        elif alpha.dim() == 3:
            decay = alpha[:, :, t, None, None].double() * eye
        else:
            decay = torch.diag_embed(alpha[:, :, t].double())
        kt, b = k[:, :, t], beta[:, :, t, None, None]
        householder = eye - b * kt[..., :, None] * kt[..., None, :]
        M = M @ decay @ householder + b * v[:, :, t, :, None] * kt[..., None, :]
        out[:, :, t] = (M @ q[:, :, t, :, None])[..., 0]
    return out, M


def run(backend, q, k, v, beta, alpha, h0, **kw):
    return delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, output_final_state=True,
                      backend=backend, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_recurrent_matches_literal_form(gen, mode):
    q, k, v, beta, alpha, h0 = make_inputs(gen, 2, 2, 11, 5, 3, mode, dtype=torch.float64, beta_high=BETA_MAX)
    o, s = run("recurrent", q, k, v, beta, alpha, h0)
    ref_o, ref_s = literal_delta_rule(q, k, v, beta, alpha, h0)
    assert_close(o, ref_o, tol=1e-12)
    assert_close(s, ref_s, tol=1e-12, name="final state")


SHAPES = [(2, 2, 1, 60, 100), (1, 3, 63, 60, 100), (2, 1, 75, 60, 100), (1, 2, 200, 16, 24)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("h0", [False, True])
def test_chunk_matches_recurrent(gen, shape, mode, h0):
    q, k, v, beta, alpha, state = make_inputs(gen, *shape, mode, h0=h0)
    ref, ref_state = run("recurrent", q, k, v, beta, alpha, state)
    for chunk_size in (1, 7, 16, 64):
        with poisoned_outputs():
            o, s = run("chunk", q, k, v, beta, alpha, state, chunk_size=chunk_size)
        assert_close(o, ref, name=f"o (chunk_size={chunk_size})")
        assert_close(s, ref_state, name=f"final state (chunk_size={chunk_size})")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_triton_matches_recurrent(gen, shape, mode):
    q, k, v, beta, alpha, state = make_inputs(gen, *shape, mode)
    ref, ref_state = run("recurrent", q, k, v, beta, alpha, state)
    with poisoned_outputs():
        o, s = run("triton", q, k, v, beta, alpha, state)
    assert_close(o, ref)
    assert_close(s, ref_state, name="final state")


@pytest.mark.parametrize("mode", MODES)
def test_triton_without_initial_state(gen, mode):
    q, k, v, beta, alpha, _ = make_inputs(gen, 2, 1, 40, 60, 100, mode, h0=False)
    ref, ref_state = run("recurrent", q, k, v, beta, alpha, None)
    with poisoned_outputs():
        o, s = run("triton", q, k, v, beta, alpha, None)
    assert_close(o, ref)
    assert_close(s, ref_state, name="final state")


@pytest.mark.parametrize("mode", ["scalar", "channel"])
@pytest.mark.parametrize("gate", ["one", "tiny", "zero"])
def test_extreme_gates(gen, mode, gate):
    """Gates exactly 1 (no decay hides indexing bugs) and near/at 0 (cumulative products underflow)."""
    value = {"one": 1.0, "tiny": 1e-3, "zero": 0.0}[gate]
    q, k, v, beta, alpha, h0 = make_inputs(gen, 1, 2, 75, 60, 100, mode, low=value, high=value)
    ref, ref_state = run("recurrent", q, k, v, beta, alpha, h0)
    for backend in ("chunk", "triton"):
        with poisoned_outputs():
            o, s = run(backend, q, k, v, beta, alpha, h0)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert_close(o, ref, name=f"o ({backend})")
        assert_close(s, ref_state, name=f"final state ({backend})")


@pytest.mark.parametrize("mode", MODES)
def test_full_beta_range(gen, mode):
    """beta up to its cap 2, where I - beta k k^T reflects instead of shrinking."""
    q, k, v, beta, alpha, h0 = make_inputs(gen, 1, 2, 70, 16, 24, mode, beta_high=BETA_MAX)
    beta = beta.clamp(max=BETA_MAX)
    ref, ref_state = run("recurrent", q.double(), k.double(), v.double(), beta.double(),
                         None if alpha is None else alpha.double(), h0.double())
    for backend in ("recurrent", "chunk", "triton"):
        o, s = run(backend, q, k, v, beta, alpha, h0)
        assert_close(o, ref, name=f"o ({backend})")
        assert_close(s, ref_state, name=f"final state ({backend})")


@pytest.mark.parametrize("mode", MODES)
def test_triton_low_precision(gen, mode):
    q, k, v, beta, alpha, h0 = make_inputs(gen, 1, 2, 40, 32, 16, mode)
    ref, _ = run("recurrent", q, k, v, beta, alpha, h0)
    for dtype in (torch.bfloat16, torch.float16):
        cast = [x.to(dtype) for x in (q, k, v)]
        o, _ = run("triton", *cast, beta, alpha, h0)
        assert o.dtype == dtype
        assert_close(o.float(), ref, tol=3e-2, name=str(dtype))


def weighted_loss(o, s):
    w = torch.cos(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)
    return (o * w).sum() + s.square().sum()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("longhorn", [False, True])
def test_gradients_chunk_vs_recurrent(gen, mode, longhorn):
    inputs = make_inputs(gen, 1, 2, 21, 6, 5, mode, dtype=torch.float64)
    grads = []
    for backend in ("recurrent", "chunk"):
        leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs]
        o, s = run(backend, *leaves, chunk_size=8, longhorn=longhorn)
        weighted_loss(o, s).backward()
        grads.append([x.grad for x in leaves if x is not None])
    names = [n for n, x in zip(["q", "k", "v", "beta", "alpha", "h0"], inputs) if x is not None]
    for name, g_chunk, g_rec in zip(names, grads[1], grads[0]):
        assert_close(g_chunk, g_rec, tol=1e-9, name=f"grad {name}")


@pytest.mark.parametrize("mode", MODES)
def test_gradients_triton_vs_recurrent(gen, mode):
    inputs = make_inputs(gen, 1, 2, 33, 16, 16, mode)
    grads = []
    for backend in ("recurrent", "triton"):
        leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs]
        o, s = run(backend, *leaves)
        weighted_loss(o, s).backward()
        grads.append([x.grad for x in leaves if x is not None])
    for g_tri, g_rec in zip(grads[1], grads[0]):
        assert_close(g_tri, g_rec, tol=1e-4, name="gradient")


BACKENDS = ["recurrent", "chunk", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_alpha_one_is_deltanet(gen, backend):
    q, k, v, beta, _, h0 = make_inputs(gen, 2, 2, 20, 8, 6, None)
    plain, plain_s = run("recurrent", q, k, v, beta, None, h0)
    for alpha in (torch.ones(2, 2, 20), torch.ones(2, 2, 20, 8)):
        o, s = run(backend, q, k, v, beta, alpha, h0, chunk_size=8)
        assert_close(o, plain, name=f"alpha=1 {tuple(alpha.shape)}")
        assert_close(s, plain_s, name="final state")


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_channels_are_scalar_gate(gen, backend):
    q, k, v, beta, alpha, h0 = make_inputs(gen, 2, 2, 20, 8, 6, "scalar", low=0.3)
    o_s, s_s = run(backend, q, k, v, beta, alpha, h0, chunk_size=8)
    o_c, s_c = run(backend, q, k, v, beta, alpha[..., None].expand(2, 2, 20, 8).contiguous(), h0, chunk_size=8)
    assert_close(o_c, o_s, name="KDA with equal channels vs Gated DeltaNet")
    assert_close(s_c, s_s, name="final state")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_beta_zero_only_decays(gen, backend, mode):
    """beta = 0 writes nothing: M_t = M_0 Diag(prod_{j<=t} alpha_j), so y_t = M_0 (A_t * q_t)."""
    q, k, v, _, alpha, h0 = make_inputs(gen, 2, 1, 30, 12, 7, mode, low=0.7)
    beta = torch.zeros(2, 1, 30)
    o, s = run(backend, q, k, v, beta, alpha, h0, chunk_size=16)
    if alpha is None:
        A = torch.ones(2, 1, 30, 12)
    else:
        a = alpha.double() if alpha.dim() == 4 else alpha.double()[..., None].expand(2, 1, 30, 12)
        A = torch.cumprod(a, dim=2)
    expect_o = torch.einsum("bhvk,bhtk->bhtv", h0.double(), A * q.double())
    assert_close(o, expect_o, name="y = M_0 (A_t q_t)")
    assert_close(s, h0.double() * A[:, :, -1, None, :], name="final state M_0 Diag(A_T)")
    if alpha is None:                                       # nothing decays, nothing is written
        assert torch.equal(s, h0), "beta = 0 without gates must leave the state bit-for-bit unchanged"


@pytest.mark.parametrize("backend", BACKENDS)
def test_orthonormal_keys_store_values_exactly(gen, backend):
    """DeltaNet with beta = 1 and orthonormal keys overwrites: M k_i = v_i for each key's latest write."""
    B, H, T, K, V, n_keys = 1, 2, 50, 16, 5, 10
    basis = torch.linalg.qr(torch.randn(B, H, K, K, generator=gen))[0].transpose(-1, -2)   # rows orthonormal
    which = torch.randint(0, n_keys, (T,), generator=gen)
    k = basis[:, :, which]                                            # [B, H, T, K], keys repeat
    v = torch.randn(B, H, T, V, generator=gen)
    h0 = torch.randn(B, H, V, K, generator=gen)
    o, s = delta_rule(k, k, v, torch.ones(B, H, T), initial_state=h0, output_final_state=True,
                      backend=backend, chunk_size=16)
    assert_close(o, v, tol=1e-5, name="reading the key just written returns its value")
    for i in range(n_keys):
        used = (which == i).nonzero()
        if len(used):
            latest = used[-1, 0]
            assert_close(s @ basis[:, :, i, :, None], v[:, :, latest, :, None], tol=1e-5,
                         name=f"M k_{i} after its last write")
        else:                                                         # never written: M_0 untouched there
            assert_close(s @ basis[:, :, i, :, None], h0 @ basis[:, :, i, :, None], tol=1e-5,
                         name=f"M k_{i} for a key never written")


def proximal_step(M_prev, k, v, beta):
    """argmin_M 1/2 ||v - M k||^2 + 1/(2 beta) ||M - M_prev||^2, from its normal equations.

    Setting the gradient (M k - v) k^T + (M - M_prev)/beta to zero gives
    (k k^T + I/beta) M^T = k v^T + M_prev^T / beta, a symmetric K x K system.
    """
    K = k.shape[-1]
    lhs = k[..., :, None] * k[..., None, :] + torch.eye(K, dtype=k.dtype) / beta[..., None, None]
    rhs = k[..., :, None] * v[..., None, :] + M_prev.transpose(-1, -2) / beta[..., None, None]
    return torch.linalg.solve(lhs, rhs).transpose(-1, -2)


@pytest.mark.parametrize("mode", MODES)
def test_longhorn_is_the_proximal_minimiser(gen, mode):
    """Longhorn (implicit GD) with un-normalised keys and large beta, solved token by token."""
    B, H, T, K, V = 1, 2, 24, 6, 4
    q, k, v = random_qkv(B, H, T, K, V, dtype=torch.float64, normalize_keys=False, generator=gen)
    beta = 5.0 * torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    alpha = None if mode is None else random_gate(B, H, T, K if mode == "channel" else None, low=0.5,
                                                  dtype=torch.float64, generator=gen)
    h0 = torch.randn(B, H, V, K, generator=gen, dtype=torch.float64)
    M, outs = h0, []
    for t in range(T):
        if alpha is not None:                               # the proximal point is the decayed state
            a = alpha[:, :, t]
            M = M * (a[..., None, None] if a.dim() == 2 else a[..., None, :])
        M = proximal_step(M, k[:, :, t], v[:, :, t], beta[:, :, t])
        outs.append((M @ q[:, :, t, :, None])[..., 0])
    expect = torch.stack(outs, dim=2)
    for backend in ("recurrent", "chunk"):
        o, s = run(backend, q, k, v, beta, alpha, h0, longhorn=True, chunk_size=5)
        assert_close(o, expect, tol=1e-10, name=f"o ({backend})")
        assert_close(s, M, tol=1e-10, name=f"final state ({backend})")
    f = lambda x: None if x is None else x.float()        # noqa: E731
    o, s = run("triton", f(q), f(k), f(v), f(beta), f(alpha), f(h0), longhorn=True)
    assert_close(o, expect, tol=1e-5, name="o (triton)")
    # the helper, and the claim that beta/(1+beta) is right only for unit keys
    step = longhorn_beta(beta, k)
    assert_close(step, beta / (1 + beta * (k * k).sum(-1)), tol=1e-15, name="longhorn_beta")
    assert (step * (k * k).sum(-1) < 1).all()


def test_bad_inputs():
    q, k, v = random_qkv(1, 2, 10, 4, 3, seed=0)
    beta = torch.full((1, 2, 10), 0.5)
    with pytest.raises(ValueError, match=r"beta must have shape \[1, 2, 10\]"):
        delta_rule(q, k, v, torch.full((1, 2, 9), 0.5))
    with pytest.raises(ValueError, match=r"beta must have shape \[1, 2, 10\], got \[1, 2, 10, 4\]"):
        delta_rule(q, k, v, torch.full((1, 2, 10, 4), 0.5))
    with pytest.raises(TypeError, match="beta must be a torch.Tensor"):
        delta_rule(q, k, v, "0.5")
    with pytest.raises(ValueError, match=r"beta must lie in \[0.0, 2.0\]"):      # a number: one step for every token
        delta_rule(q, k, v, 2.5)
    with pytest.raises(ValueError, match=r"beta must lie in \[0.0, 2.0\]"):
        delta_rule(q, k, v, torch.full((1, 2, 10), -0.1))
    with pytest.raises(ValueError, match=r"beta must lie in \[0.0, 2.0\]"):
        delta_rule(q, k, v, torch.full((1, 2, 10), 2.5))
    with pytest.raises(ValueError, match=r"beta must lie in \[0.0, inf\)"):
        delta_rule(q, k, v, torch.full((1, 2, 10), -1.0), longhorn=True)
    delta_rule(q, k, v, torch.full((1, 2, 10), 50.0), longhorn=True)       # any finite beta >= 0 is fine there
    with pytest.raises(ValueError, match=r"beta must lie in \[0.0, inf\)"):
        delta_rule(q, k, v, torch.full((1, 2, 10), float("inf")), longhorn=True)
    with pytest.raises(ValueError, match=r"beta must lie in \[0.0, inf\)"):
        delta_rule(q, k, v, float("inf"), longhorn=True)
    with pytest.raises(TypeError, match="beta is required"):
        delta_rule(q, k, v, None)
    with pytest.raises(ValueError, match="beta contains NaN"):
        delta_rule(q, k, v, torch.full((1, 2, 10), float("nan")))
    with pytest.raises(ValueError, match=r"alpha must have shape \[1, 2, 10\] or \[1, 2, 10, 4\]"):
        delta_rule(q, k, v, beta, alpha=torch.ones(1, 2, 10, 3))
    with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
        delta_rule(q, k, v, beta, alpha=torch.full((1, 2, 10), 1.01))
    with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
        delta_rule(q, k, v, beta, alpha=torch.full((1, 2, 10, 4), -0.01))
    with pytest.raises(ValueError, match=r"q must have shape \[B, H, T, K\]"):
        delta_rule(q[0], k, v, beta)
    with pytest.raises(ValueError, match="v must have shape"):
        delta_rule(q, k, v[:, :, :5], beta)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[1, 2, 3, 4\]"):
        delta_rule(q, k, v, beta, initial_state=torch.zeros(1, 2, 4, 3))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        delta_rule(q, k, v, beta, chunk_size=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        delta_rule(q, k, v, beta, backend="cuda")
    with pytest.raises(TypeError, match="fp64"):
        delta_rule(q.double(), k.double(), v.double(), beta, backend="triton")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    q, k, v = random_qkv(1, 1, 4, 4, 4, seed=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        delta_rule(q, k, v, torch.ones(1, 1, 4), backend="triton")


@pytest.mark.parametrize("T,chunk_size", [(75, 16), (200, 64)])
def test_kda_mixed_strong_and_mild_gates(gen, T, chunk_size):
    """Per-channel gates mild in most chunks and (almost) resetting in a few: chunks on both
    paths of channel_scores, outputs and gradients against the loop."""
    q, k, v, beta, _, h0 = make_inputs(gen, 1, 2, T, 12, 10, None, dtype=torch.float64)
    alpha = mixed_channel_gates(gen, 1, 2, T, 12, reset=1e-6)
    grads = []
    for backend in ("recurrent", "chunk"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, beta, alpha, h0)]
        o, s = run(backend, *leaves, chunk_size=chunk_size)
        weighted_loss(o, s).backward()
        grads.append((o.detach(), s.detach(), [x.grad for x in leaves]))
    assert_close(grads[1][0], grads[0][0], tol=1e-10, name="o")
    assert_close(grads[1][1], grads[0][1], tol=1e-10, name="final state")
    for name, g_chunk, g_rec in zip("q k v beta alpha h0".split(), grads[1][2], grads[0][2]):
        assert_close(g_chunk, g_rec, tol=1e-8, name=f"grad {name}")
