"""Chapter 1: linear attention, its gated family, and the shared core helpers.

The per-token loop is checked against an independent closed form (products of gates
written out term by term); the chunk form and the Triton kernel are then checked
against the loop on fresh random inputs, odd shapes and all three gate modes.
"""
import math

import pytest
import torch

from atlaslib.core import (assert_close, elu_plus_one, get_feature_map, poisoned_outputs,
                           random_gate, random_qkv, rel_rmse, softmax_attention)
from atlaslib.linear import linear_attention
from atlaslib.core.chunking import log_gate
from atlaslib.linear.chunk import decayed_scores

MODES = [None, "scalar", "channel"]


def make_inputs(gen, B, H, T, K, V, mode, dtype=torch.float32, low=0.5, h0=True):
    q, k, v = random_qkv(B, H, T, K, V, dtype=dtype, generator=gen)
    alpha = None if mode is None else random_gate(B, H, T, K if mode == "channel" else None,
                                                  low=low, dtype=dtype, generator=gen)
    state = torch.randn(B, H, V, K, generator=gen, dtype=dtype) if h0 else None
    return q, k, v, alpha, state


def closed_form(q, k, v, alpha, h0):
    """y_t = M_0 Diag(prod_{j<=t} a_j) q_t + sum_{i<=t} v_i (k_i * prod_{i<j<=t} a_j)^T q_t, term by term."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    q, k, v = q.double(), k.double(), v.double()
    a = torch.ones(B, H, T, K, dtype=torch.float64) if alpha is None else alpha.double()
    if a.dim() == 3:
        a = a[..., None].expand(B, H, T, K)
    M0 = torch.zeros(B, H, V, K, dtype=torch.float64) if h0 is None else h0.double()
    out = torch.zeros(B, H, T, V, dtype=torch.float64)
    for t in range(T):
        decay0 = a[:, :, : t + 1].prod(dim=2)                       # [B,H,K]
        out[:, :, t] = torch.einsum("bhvk,bhk->bhv", M0, decay0 * q[:, :, t])
        for i in range(t + 1):
            decay = a[:, :, i + 1: t + 1].prod(dim=2)               # empty product = 1
            w = ((k[:, :, i] * decay) * q[:, :, t]).sum(-1)         # [B,H]
            out[:, :, t] += w[..., None] * v[:, :, i]
    return out


@pytest.mark.parametrize("mode", MODES)
def test_recurrent_matches_closed_form(gen, mode):
    q, k, v, alpha, h0 = make_inputs(gen, 2, 2, 9, 5, 3, mode, dtype=torch.float64)
    o, _ = linear_attention(q, k, v, alpha=alpha, initial_state=h0, backend="recurrent")
    assert_close(o, closed_form(q, k, v, alpha, h0), tol=1e-12)


SHAPES = [(1, 1, 1, 16, 16), (2, 3, 37, 12, 10), (1, 2, 75, 60, 100), (2, 1, 130, 16, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("h0", [False, True])
def test_chunk_matches_recurrent(gen, shape, mode, h0):
    q, k, v, alpha, state = make_inputs(gen, *shape, mode, h0=h0)
    ref, ref_state = linear_attention(q, k, v, alpha=alpha, initial_state=state,
                                      output_final_state=True, backend="recurrent")
    # The same sums on absolute values: the scale rounding errors are bounded by, even where
    # an output cancels to nearly zero (with T=1 it is one dot product q.k).
    scale, scale_state = linear_attention(q.abs(), k.abs(), v.abs(), alpha=alpha, output_final_state=True,
                                          initial_state=None if state is None else state.abs(), backend="recurrent")
    for chunk_size in (1, 7, 16, 64):
        o, s = linear_attention(q, k, v, alpha=alpha, initial_state=state, output_final_state=True,
                                backend="chunk", chunk_size=chunk_size)
        assert_close(o, ref, name=f"o (chunk_size={chunk_size})", scale=scale)
        assert_close(s, ref_state, name=f"final state (chunk_size={chunk_size})", scale=scale_state)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_triton_matches_recurrent(gen, shape, mode):
    q, k, v, alpha, state = make_inputs(gen, *shape, mode)
    ref, ref_state = linear_attention(q, k, v, alpha=alpha, initial_state=state,
                                      output_final_state=True, backend="recurrent")
    with poisoned_outputs():
        o, s = linear_attention(q, k, v, alpha=alpha, initial_state=state,
                                output_final_state=True, backend="triton")
    assert_close(o, ref)
    assert_close(s, ref_state, name="final state")


@pytest.mark.parametrize("mode", MODES)
def test_triton_low_precision(gen, mode):
    q, k, v, alpha, state = make_inputs(gen, 1, 2, 40, 32, 16, mode)
    ref, _ = linear_attention(q, k, v, alpha=alpha, initial_state=state, backend="recurrent")
    for dtype in (torch.bfloat16, torch.float16):
        a = None if alpha is None else alpha.to(dtype)
        o, _ = linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), alpha=a, initial_state=state,
                                backend="triton")
        assert o.dtype == dtype
        assert_close(o.float(), ref, tol=3e-2, name=str(dtype))


@pytest.mark.parametrize("mode", MODES)
def test_gradients_chunk_vs_recurrent(gen, mode):
    inputs = make_inputs(gen, 1, 2, 21, 6, 5, mode, dtype=torch.float64)
    grads = []
    for backend in ("recurrent", "chunk"):
        leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs]
        q, k, v, alpha, h0 = leaves
        o, s = linear_attention(q, k, v, alpha=alpha, initial_state=h0, output_final_state=True,
                                backend=backend, chunk_size=8)
        loss = (o * torch.cos(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)).sum() + (s ** 2).sum()
        loss.backward()
        grads.append([x.grad for x in leaves if x is not None])
    for name, g_chunk, g_rec in zip(["q", "k", "v", "alpha", "h0"], grads[1], grads[0]):
        assert_close(g_chunk, g_rec, tol=1e-9, name=f"grad {name}")


@pytest.mark.parametrize("mode", MODES)
def test_gradients_triton_vs_recurrent(gen, mode):
    inputs = make_inputs(gen, 1, 2, 33, 16, 16, mode)
    grads = []
    for backend in ("recurrent", "triton"):
        leaves = [x.clone().requires_grad_(True) for x in inputs if x is not None]
        q, k, v, *rest = leaves
        alpha = rest[0] if mode is not None else None
        h0 = rest[-1]
        o, s = linear_attention(q, k, v, alpha=alpha, initial_state=h0, output_final_state=True,
                                backend=backend)
        loss = (o * torch.sin(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)).sum() + s.square().sum()
        loss.backward()
        grads.append([x.grad for x in leaves])
    for g_tri, g_rec in zip(grads[1], grads[0]):
        assert_close(g_tri, g_rec, tol=1e-4, name="gradient")


@pytest.mark.parametrize("backend", ["recurrent", "chunk", "triton"])
def test_normalized(gen, backend):
    q, k, v, alpha, _ = make_inputs(gen, 2, 1, 29, 8, 4, "scalar", h0=False)
    q, k = elu_plus_one(q), elu_plus_one(k)
    o, s = linear_attention(q, k, v, alpha=alpha, normalize=True, output_final_state=True, backend=backend)
    num, _ = linear_attention(q, k, v, alpha=alpha, backend="recurrent")
    ones = torch.ones_like(v[..., :1])
    den, _ = linear_attention(q, k, ones, alpha=alpha, backend="recurrent")
    assert_close(o, num / den)
    assert s.shape == (2, 1, 5, 8)
    # The last state row is z_T = sum_i (prod of later gates) k_i: check it against that sum.
    a = alpha.double()
    z = sum(a[:, :, i + 1:].prod(-1)[..., None] * k[:, :, i].double() for i in range(29))
    assert_close(s[:, :, -1], z)


def test_special_gates(gen):
    q, k, v, _, h0 = make_inputs(gen, 2, 2, 20, 8, 6, None)
    plain, _ = linear_attention(q, k, v, initial_state=h0, backend="recurrent")
    ones = torch.ones(2, 2, 20)
    for backend in ("chunk", "triton"):
        o, _ = linear_attention(q, k, v, alpha=ones, initial_state=h0, backend=backend)
        assert_close(o, plain, name=f"alpha=1 ({backend})")
    # per-channel gates that are equal across channels are a scalar gate
    a = random_gate(2, 2, 20, low=0.3, generator=gen)
    for backend in ("chunk", "triton"):
        o_s, _ = linear_attention(q, k, v, alpha=a, initial_state=h0, backend=backend)
        o_c, _ = linear_attention(q, k, v, alpha=a[..., None].expand(2, 2, 20, 8).contiguous(),
                                  initial_state=h0, backend=backend)
        assert_close(o_c, o_s, name=f"channel == scalar ({backend})")
    # a gate of exactly 0 erases the past: y_t = (k_t . q_t) v_t
    zeros = torch.zeros(2, 2, 20)
    expect = (k * q).sum(-1, keepdim=True) * v
    for backend in ("recurrent", "chunk", "triton"):
        o, _ = linear_attention(q, k, v, alpha=zeros, initial_state=h0, backend=backend)
        assert_close(o, expect, tol=1e-5, name=f"alpha=0 ({backend})")


def test_strong_decay_is_stable(gen):
    """Gates near 0 over long chunks: cumulative products underflow, the chunk form must not."""
    q, k, v, _, h0 = make_inputs(gen, 1, 2, 200, 16, 16, None)
    for K in (None, 16):
        alpha = random_gate(1, 2, 200, K, low=1e-4, high=1e-2, generator=gen)
        ref, _ = linear_attention(q, k, v, alpha=alpha, initial_state=h0, backend="recurrent")
        for backend in ("chunk", "triton"):
            o, _ = linear_attention(q, k, v, alpha=alpha, initial_state=h0, backend=backend)
            assert torch.isfinite(o).all()
            assert_close(o, ref, name=backend)


def test_bad_inputs():
    q, k, v = random_qkv(1, 2, 10, 4, 3, seed=0)
    with pytest.raises(ValueError, match=r"q must have shape \[B, H, T, K\]"):
        linear_attention(q[0], k, v)
    with pytest.raises(ValueError, match="v must have shape"):
        linear_attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="q and k"):
        linear_attention(q, k[..., :3], v)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        linear_attention(q.numpy(), k, v)
    with pytest.raises(TypeError, match="floating"):
        linear_attention(q.long(), k, v)
    with pytest.raises(TypeError, match="share a dtype"):
        linear_attention(q.double(), k.double(), v)
    for i in range(3):                          # a meta tensor: on another device, with no values to read
        moved = [x.to("meta") if j == i else x for j, x in enumerate((q, k, v))]
        with pytest.raises(ValueError, match="q, k, v must be on one device, got "):
            linear_attention(*moved)
    for gate in ("alpha", "log_alpha"):
        with pytest.raises(ValueError, match=f"^{gate} must be on cpu like q, got meta"):
            linear_attention(q, k, v, **{gate: torch.zeros(1, 2, 10, device="meta")})
    with pytest.raises(ValueError, match="^initial_state must be on cpu like q, got meta"):
        linear_attention(q, k, v, initial_state=torch.zeros(1, 2, 3, 4, device="meta"))
    with pytest.raises(ValueError, match=r"alpha must have shape \[1, 2, 10\] or \[1, 2, 10, 4\]"):
        linear_attention(q, k, v, alpha=torch.ones(1, 2, 9))
    with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
        linear_attention(q, k, v, alpha=torch.full((1, 2, 10), 1.5))
    with pytest.raises(ValueError, match="alpha contains NaN"):
        linear_attention(q, k, v, alpha=torch.full((1, 2, 10), float("nan")))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[1, 2, 3, 4\]"):
        linear_attention(q, k, v, initial_state=torch.zeros(1, 2, 4, 3))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[1, 2, 4, 4\]"):
        linear_attention(q, k, v, normalize=True, initial_state=torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="initial_state contains NaN or inf"):
        linear_attention(q, k, v, initial_state=torch.full((1, 2, 3, 4), float("nan")))
    with pytest.raises(ValueError, match="initial_state contains NaN or inf"):
        linear_attention(q, k, v, initial_state=torch.full((1, 2, 3, 4), float("inf")))
    with pytest.raises(ValueError, match="must be non-empty"):                 # an empty batch, for every backend
        linear_attention(q[:0], k[:0], v[:0], backend="chunk")
    from atlaslib.linear.chunk import linear_attention_chunk            # the exported form, which reshapes it
    with pytest.raises(ValueError, match=r"initial_state \[B, H, V, K\] must have shape \[1, 2, 3, 4\]"):
        linear_attention_chunk(q, k, v, initial_state=torch.zeros(1, 2, 4, 3))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        linear_attention(q, k, v, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size must be a positive int"):
        linear_attention(q, k, v, chunk_size=2.5)
    with pytest.raises(ValueError, match="backend must be one of"):
        linear_attention(q, k, v, backend="cuda")


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    q, k, v = random_qkv(1, 1, 4, 4, 4, seed=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        linear_attention(q, k, v, backend="triton")


@pytest.mark.parametrize("T", [512, 515])
def test_sliding_window_attention_memory_grows_with_T_times_the_window(gen, T):
    """Softmax attention over a window of c keys holds [T, 2c] scores, not the [T, T] matrix of the whole
    sequence (masked to its band, which made SWA, MAG and MAL quadratic in T for any window)."""
    from atlaslib.core.testing import largest_tensor
    q, k, v = random_qkv(1, 2, T, 8, 8, generator=gen)
    most = largest_tensor(lambda: softmax_attention(q, k, v, window=16))
    assert most <= 2 * 2 * (T + 16) * 2 * 16, most


def test_softmax_attention_matches_loop(gen):
    q, k, v = random_qkv(1, 2, 13, 5, 3, generator=gen, normalize_keys=False)
    for window in (None, 1, 4, 6, 7, 13):        # 2 c < T: by blocks of c queries (13 = 3 * 4 + 1 = 2 * 6 + 1)
        o = softmax_attention(q, k, v, window=window)
        for t in range(13):
            lo = 0 if window is None else max(0, t - window + 1)
            s = (k[:, :, lo:t + 1] @ q[:, :, t, :, None]).squeeze(-1) / math.sqrt(5)
            expect = (s.softmax(-1)[..., None] * v[:, :, lo:t + 1]).sum(2)
            assert_close(o[:, :, t], expect, name=f"t={t}, window={window}")
    with pytest.raises(ValueError, match="window"):
        softmax_attention(q, k, v, window=0)
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    for window in (1, 4):
        torch.autograd.gradcheck(lambda *x: softmax_attention(*x, window=window), (q, k, v))
    for scale in (math.nan, "0.5", True):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            softmax_attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="one shape"):          # rel_rmse does not broadcast
        rel_rmse(o[..., :1], o)


def test_feature_maps(gen):
    x = torch.randn(100, generator=gen)
    assert (elu_plus_one(x) > 0).all()
    assert torch.allclose(elu_plus_one(x), torch.where(x > 0, x + 1, torch.exp(x)))
    assert get_feature_map("identity")(x) is x
    with pytest.raises(ValueError, match="unknown feature map"):
        get_feature_map("relu^2")


def test_rel_rmse_and_poison():
    a = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)
    assert rel_rmse(a, a) == 0
    assert abs(rel_rmse(a + torch.tensor([0.0, 0.0, 0.3], dtype=torch.float64), a) - 0.1) < 1e-12
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 1.0]))
    # against a reference of zeros (a gradient that must vanish) the error is the absolute one, not 0
    assert abs(rel_rmse(torch.ones(3), torch.zeros(3)) - 3 ** 0.5) < 1e-12
    with pytest.raises(AssertionError, match="relative RMSE"):
        assert_close(torch.ones(3), torch.zeros(3), name="dL")
    from atlaslib.core import empty
    with poisoned_outputs():
        assert torch.isnan(empty(3)).all()
        assert not empty(3, dtype=torch.int64).isnan().any()
    from atlaslib.core import alloc
    assert alloc.allocate is torch.empty                           # restored after the block


def test_assert_close_against_a_scale(gen):
    """A dot product of terms of about 1e3 that cancels to about 0, summed in fp32: its error is rounding of
    the terms, so judged against the sum of their magnitudes it passes; an error of 1e-3 of that sum fails."""
    a = torch.randn(4, 512, generator=gen, dtype=torch.float64) * 1e3
    b = torch.randn(4, 512, generator=gen, dtype=torch.float64)
    b -= (a * b).sum(-1, keepdim=True) / (a * a).sum(-1, keepdim=True) * a            # a . b = 0 up to rounding
    exact, scale = (a * b).sum(-1), (a.abs() * b.abs()).sum(-1)
    fp32 = (a.float() * b.float()).sum(-1).double()
    with pytest.raises(AssertionError):              # against the result itself the rounding is no small error
        assert_close(fp32, exact, tol=1e-5)
    assert_close(fp32, exact, tol=1e-5, scale=scale)
    with pytest.raises(AssertionError, match="against the scale"):
        assert_close(exact + 1e-3 * scale, exact, tol=1e-5, scale=scale)


class _Shifted(torch.nn.Module):
    """y_t = W x_{t + shift}: shift -1 reads only earlier tokens (token T - 1 changes nothing), +1 the next one."""

    def __init__(self, d, shift):
        super().__init__()
        self.lin, self.shift = torch.nn.Linear(d, d), shift

    def forward(self, x):
        y = self.lin(x)
        if self.shift < 0:
            return torch.nn.functional.pad(y, (0, 0, 1, 0))[:, :-1]
        return torch.nn.functional.pad(y, (0, 0, 0, 1))[:, 1:]


def test_assert_causal_mixer_refuses_a_mixer_that_ignores_or_leaks_a_token(gen):
    from atlaslib.core.testing import assert_causal_mixer
    x = torch.randn(2, 6, 4, generator=gen, requires_grad=True)
    with pytest.raises(AssertionError, match="token 5 changed no output"):
        assert_causal_mixer(_Shifted(4, -1), x, t=5, generator=gen)
    with pytest.raises(AssertionError, match="token 3 changed an earlier output"):
        assert_causal_mixer(_Shifted(4, 1), x, t=3, generator=gen)


def test_assert_within_rounding():
    """The error against fp64, as a multiple of what rounding the reference to the dtype costs: passes
    within the bound, fails past it naming the multiple, refuses a reference the dtype holds exactly."""
    from atlaslib.core.testing import assert_within_rounding
    want = torch.linspace(0.1, 1.0, 50, dtype=torch.float64) / 3
    assert_within_rounding(want.bfloat16().double(), want, torch.bfloat16, 1.0)
    with pytest.raises(AssertionError, match=r"times the torch.bfloat16 rounding"):
        assert_within_rounding(want.bfloat16().double() * (1 + 2 ** -6), want, torch.bfloat16, 2.0)
    with pytest.raises(ValueError, match="exact in torch.bfloat16"):
        assert_within_rounding(torch.ones(4), torch.ones(4, dtype=torch.float64), torch.bfloat16, 2.0)


def test_poisoned_fixture(poisoned):
    """The fixture swaps the kernels' allocation hook for the whole test; the library never does."""
    from atlaslib.core import alloc, empty
    assert torch.isnan(empty(2, 3)).all() and alloc.allocate is not torch.empty


def mixed_channel_gates(gen, B, H, T, K, reset=0.0):
    """Per-channel gates that are mild in most places and at or near 0 in a few: some chunks
    decay by far more than fp32's exponent range (e^-88), others by little."""
    alpha = random_gate(B, H, T, K, low=0.6, generator=gen, dtype=torch.float64)
    strong = torch.rand(B, H, T, K, generator=gen, dtype=torch.float64) < 0.05
    alpha = torch.where(strong, 1e-3 * torch.rand(B, H, T, K, generator=gen, dtype=torch.float64), alpha)
    alpha[..., T // 3: T // 3 + 3, : K // 2] = reset             # (almost) a full reset of half the channels
    return alpha


def block_log_gates(gen, kind, n, K):
    """Log-gates [3, 2, n, K] accumulated from a block start, in fp64. "steep": log-gates of up to
    -400 per token, below the library's floor of -60, as a caller of decayed_scores may pass them."""
    if kind == "steep":
        return (-400 * torch.rand(3, 2, n, K, generator=gen, dtype=torch.float64)).cumsum(2)
    alpha = {"mild": lambda: random_gate(3, 2, n, K, low=0.5, generator=gen, dtype=torch.float64),
             "mixed": lambda: mixed_channel_gates(gen, 3, 2, n, K),
             "zero": lambda: torch.zeros(3, 2, n, K, dtype=torch.float64)}[kind]()
    return log_gate(alpha, torch.float64).cumsum(2)


def tile_reference(xs, k, g):
    """decayed_scores written with the full [n, n, K] tile of e^{g_t - g_i} (masked to i <= t),
    in fp64: the scores of each row set, x e^g, k e^{g_n - g} and e^{g_n}."""
    xs, k, g = tuple(x.double() for x in xs), k.double(), g.double()
    if g.dim() < k.dim():
        g = g[..., None]
    n = g.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    diff = g[..., :, None, :] - g[..., None, :, :]               # [.., t, i, K or 1]
    tile = torch.where(causal[..., None], torch.exp(diff.clamp(max=0.0)), 0.0)
    scores = tuple((x[..., :, None, :] * k[..., None, :, :] * tile).sum(-1) for x in xs)
    return scores, tuple(x * torch.exp(g) for x in xs), k * torch.exp(g[..., -1:, :] - g), torch.exp(g[..., -1:, :])


@pytest.mark.parametrize("n", [1, 2, 7, 16, 33, 64])
@pytest.mark.parametrize("gates", ["mild", "mixed", "zero", "steep"])
@pytest.mark.parametrize("mode", ["scalar", "channel"])
def test_decayed_scores_equal_the_decay_tile(gen, n, gates, mode):
    """decayed_scores (halving for per-channel gates, the masked decay matrix for scalar ones)
    against the sum over channels of x_tc k_ic e^{g_tc - g_ic} formed with the [n, n, K] tile, for
    two row sets (queries and keys, as chapter 2 calls it), with any gate strength: finite, and
    entry by entry exact up to rounding (relative to the sum of the terms' magnitudes; values
    that fp32 cannot hold may be 0)."""
    K = 8
    q, k = (torch.randn(3, 2, n, K, generator=gen, dtype=torch.float64) for _ in range(2))
    g = block_log_gates(gen, gates, n, K)
    if mode == "scalar":
        g = g[..., 0]
    for dtype, tol, tiny in ((torch.float64, 1e-12, 1e-300), (torch.float32, 1e-5, 1e-30)):
        g_d = g.to(dtype)                                        # the reference sees the same rounded g
        (P, KK), x_decs, k_end, m_dec = decayed_scores((q.to(dtype), k.to(dtype)), k.to(dtype), g_d)
        ref = tile_reference((q, k), k, g_d)
        magnitude = tile_reference((q.abs(), k.abs()), k.abs(), g_d)
        got = (P, KK, *x_decs, k_end, m_dec)
        want, bound = ((*r[0], *r[1], r[2], r[3]) for r in (ref, magnitude))
        for name, out, exp, size in zip(["P", "KK", "q e^g", "k e^g", "k_end", "m_dec"], got, want, bound):
            assert out.dtype == dtype and out.shape == exp.shape and torch.isfinite(out).all(), name
            excess = (out.double() - exp).abs() - (tol * size + tiny)
            assert excess.max() <= 0, f"{name} ({dtype}): off by {excess.max():.3g} beyond the bound"


def test_gradients_through_resets(gen):
    """Chunks that decay far beyond fp32's exponent range differentiate like the loop."""
    q, k, v, _, h0 = make_inputs(gen, 1, 2, 40, 6, 5, None, dtype=torch.float64)
    alpha = mixed_channel_gates(gen, 1, 2, 40, 6, reset=1e-6)   # 3 x log(1e-6) < -SPLIT_SPAN
    grads = []
    for backend in ("recurrent", "chunk"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, alpha, h0)]
        o, s = linear_attention(*leaves[:3], alpha=leaves[3], initial_state=leaves[4], backend=backend,
                                chunk_size=16, output_final_state=True)
        (o * torch.cos(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)).sum().add(s.square().sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, g_chunk, g_rec in zip("q k v alpha h0".split(), grads[1], grads[0]):
        assert torch.isfinite(g_chunk).all(), name
        assert_close(g_chunk, g_rec, tol=1e-8, name=f"grad {name}")


def test_chunk_decay_is_the_ratio_of_cumulative_gates(gen):
    """core.chunking.chunk_decay against products of the gates themselves, in fp64: D[t, i] = alpha_{i+1} ...
    alpha_t for i <= t (0 above the diagonal), A_t = alpha_1 ... alpha_t; a gate of 0 is a full reset."""
    from atlaslib.core.chunking import chunk_decay
    n = 7
    alpha = torch.rand(3, n, generator=gen, dtype=torch.float64) * 0.9 + 0.1
    alpha[1, 3] = 0.0
    D, A = chunk_decay(log_gate(alpha, torch.float64))
    want_D = torch.zeros(3, n, n, dtype=torch.float64)
    for t in range(n):
        for i in range(t + 1):
            want_D[:, t, i] = alpha[:, i + 1:t + 1].prod(-1)
    assert_close(D, want_D, tol=1e-12)
    assert_close(A, alpha.cumprod(-1), tol=1e-12)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_normalized_fp64_is_divided_in_fp64(gen, backend):
    """fp64 inputs: y_t = (sum_i A_t/A_i v_i k_i^T q_t) / (sum_i A_t/A_i k_i^T q_t) written out densely, to fp64
    round-off (a quotient taken in fp32 is off by ~1e-8). The layer's one-token step divides the same way."""
    q, k, v = (torch.rand(1, 2, 11, 4, generator=gen, dtype=torch.float64) + 0.1 for _ in range(3))
    log_a = torch.log(random_gate(1, 2, 11, low=0.6, dtype=torch.float64, generator=gen)).cumsum(-1)
    w = (q @ k.mT) * torch.exp(log_a[..., :, None] - log_a[..., None, :]).tril()
    o, _ = linear_attention(q, k, v, log_alpha=torch.diff(log_a, dim=-1, prepend=torch.zeros_like(log_a[..., :1])),
                            normalize=True, backend=backend)
    assert o.dtype == torch.float64
    assert_close(o, (w @ v) / w.sum(-1, keepdim=True), tol=1e-13, name=f"normalized {backend}")



def test_per_channel_gates_keep_the_scalar_gates_accuracy_over_long_sequences(gen):
    """The same gate given per channel ([B, H, T, K]) and as a scalar ([B, H, T]) is the same model: over
    4096 tokens at alpha = 0.9999 the fp32 chunk form is as far from fp64 either way. The per-channel
    decays were products of fp32 factors, one rounding per level, alike for alike gates: their error
    added up over the chunks (9x the scalar gates' here)."""
    B, H, T, K = 1, 1, 4096, 32
    q, k, v = random_qkv(B, H, T, K, K, generator=gen)
    k = torch.nn.functional.normalize(k, dim=-1)
    errors = []
    for shape in ((B, H, T), (B, H, T, K)):
        alpha = torch.full(shape, 0.9999)                              # fp32 inputs, the same values in fp64
        exact, _ = linear_attention(q.double(), k.double(), v.double(), alpha=alpha.double(), backend="chunk")
        o, _ = linear_attention(q, k, v, alpha=alpha, backend="chunk")
        errors.append(rel_rmse(o.double(), exact))
    scalar, per_channel = errors
    assert per_channel < 2 * scalar, (per_channel, scalar)
