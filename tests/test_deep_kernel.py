"""Chapter 6's Triton kernel (``atlaslib.deep.kernel``) under the interpreter, against the chunk form.

The kernel-trick DeepTransformer with backend="triton" must compute what backend="chunk" computes
(the chunk form is checked against dense references in test_deep.py): on odd shapes, with and
without the normaliser, windows, gates, multi-block sequences, fp32 / bf16 inputs and views; stay
finite on scores far beyond exp's range when normalised; and differentiate through the chunk form.
DOT with c = 1 (``dot_kernel_triton``, the coefficient solve) is checked against its definition, the
per-token coefficient loop in fp64, and against its chunk form.
"""
import math

import pytest
import torch

from atlaslib.core import assert_close, random_gate
from atlaslib.core.testing import assert_within_rounding, poisoned_outputs
from atlaslib.deep import deep_transformer, dot, dot_chunk, dot_coefficient_recurrent
from atlaslib.deep.kernel import DOT_MAX_KEY, MAX_KEY, dot_kernel_limits, kernel_limits

F64 = torch.float64


def inputs(gen, B=2, H=2, T=37, K=20, V=12, scale=0.4, gates=True, dtype=torch.float32):
    q, k = (scale * torch.randn(B, H, T, K, generator=gen) for _ in range(2))
    v = torch.randn(B, H, T, V, generator=gen)
    alpha = random_gate(B, H, T, low=0.7, generator=gen) if gates else None
    eta = (0.2 + torch.rand(B, H, T, generator=gen)) if gates else None
    return q.to(dtype), k.to(dtype), v.to(dtype), alpha, eta


def reference(q, k, v, alpha, eta, **kw):
    """The chunk form in fp64 on the same (rounded) inputs."""
    def d(x):
        return None if x is None else x.double()
    o, _ = deep_transformer(q.double(), k.double(), v.double(), alpha=d(alpha), eta=d(eta), backend="chunk",
                            chunk_size=7, **kw)
    return o


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("gates", [False, True])
def test_triton_matches_chunk_on_odd_shapes(gen, normalize, window, gates):
    q, k, v, alpha, eta = inputs(gen, gates=gates)                 # T = 37, K = 20, V = 12, B*H = 4
    want = reference(q, k, v, alpha, eta, normalize=normalize, window=window)
    got, state = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=normalize, window=window,
                                  backend="triton")
    assert state is None and got.dtype == torch.float32 and got.shape == v.shape
    assert_close(got, want.float(), tol=1e-5)
    chunk, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=normalize, window=window, backend="chunk")
    assert_close(got, chunk, tol=1e-5)


@pytest.mark.parametrize("normalize, window", [(True, None), (False, None), (True, 70), (False, 5), (True, 64)])
def test_many_query_and_key_blocks(gen, normalize, window):
    """T = 150: five query blocks of 32 (fp32 inputs; 64 for bf16/fp16), windows reaching back across block
    edges, decays over long spans."""
    q, k, v, _, eta = inputs(gen, B=1, H=2, T=150, K=16, V=8)
    alpha = random_gate(1, 2, 150, low=0.95, generator=gen)
    want = reference(q, k, v, alpha, eta, normalize=normalize, window=window)
    got, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=normalize, window=window, backend="triton")
    assert_close(got, want.float(), tol=1e-5)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("window", [2, 34, 70, 90])
def test_windows_at_key_block_edges_and_past_T(gen, normalize, window):
    """T = 70 (fp32: query and key blocks of 32). Windows of 2 and 34 put the oldest key of the query block
    at 32 (and 64) in the last row of the key block before it; a window of T or more is every past key."""
    q, k, v, _, eta = inputs(gen, B=1, H=2, T=70, K=8, V=6)
    alpha = random_gate(1, 2, 70, low=0.95, generator=gen)           # the first key still counts at t = 69
    want = reference(q, k, v, alpha, eta, normalize=normalize, window=window)
    got, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=normalize, window=window, backend="triton")
    assert_close(got, want.float(), tol=1e-5)
    if window >= 70:
        full = reference(q, k, v, alpha, eta, normalize=normalize)
        assert_close(want, full, name="a window of T or more is no window")


def test_wide_keys_and_values(gen):
    """K = 136 (tile 256: query/key blocks of 32) and V = 70 (two value blocks of 64)."""
    q, k, v, alpha, eta = inputs(gen, B=1, H=1, T=45, K=136, V=70, scale=0.15)
    for normalize in (False, True):
        want = reference(q, k, v, alpha, eta, normalize=normalize, window=40)
        got, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=normalize, window=40, backend="triton")
        assert_close(got, want.float(), tol=1e-5)


def test_log_alpha_numbers_and_zero_eta(gen):
    q, k, v, alpha, eta = inputs(gen, T=29, K=5, V=3)
    eta[:, :, 1::3] = 0.0                                          # tokens that write nothing
    for kw in ({"log_alpha": alpha.log(), "eta": eta}, {"alpha": 0.9, "eta": 0.5}, {"alpha": alpha, "eta": eta}):
        for normalize in (False, True):
            got, _ = deep_transformer(q, k, v, normalize=normalize, window=4, backend="triton", **kw)
            want, _ = deep_transformer(q, k, v, normalize=normalize, window=4, backend="chunk", **kw)
            assert_close(got, want, tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(gen, dtype):
    """16-bit inputs take 64-row query and key blocks (fp32 takes 32): T = 100 spans two of each. Their
    weights go to the product with v in the inputs' dtype, except unnormalised fp16 (kept fp32)."""
    q, k, v, alpha, eta = inputs(gen, B=1, T=100, dtype=dtype)
    for normalize in (False, True):
        for window in (None, 5, 70):
            want = reference(q, k, v, alpha, eta, normalize=normalize, window=window)
            got, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=normalize, window=window,
                                      backend="triton")
            assert got.dtype == dtype
            assert_close(got, want.to(dtype), tol=2e-2)


@pytest.mark.parametrize("dtype,times", [(torch.bfloat16, 2.0), (torch.float16, 3.5)])
def test_16_bit_products_cost_about_the_outputs_rounding(gen, dtype, times):
    """Against fp64 on the same 16-bit inputs, o is within a small multiple of what rounding it to that dtype
    costs (interpreter, which rounds as a card does, five seeds: bf16 and normalised fp16 1.3x-1.6x;
    unnormalised fp16, whose fp32 weights meet v in a TF32 product, 2.0x-2.7x, 1.0x with exact products)."""
    q, k, v, alpha, eta = inputs(gen, B=1, T=100, dtype=dtype)
    for normalize in (False, True):
        for window in (None, 5):
            want = reference(q, k, v, alpha, eta, normalize=normalize, window=window)
            got, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=normalize, window=window,
                                      backend="triton")
            assert_within_rounding(got.double(), want, dtype, times, name=f"normalize={normalize} window={window}")


def test_views_are_read_in_place(gen):
    """[B, T, H, K] tensors transposed to [B, H, T, K], as the mixers pass them."""
    g = gen
    q, k = (0.4 * torch.randn(2, 37, 3, 20, generator=g).transpose(1, 2) for _ in range(2))
    v = torch.randn(2, 37, 3, 12, generator=g).transpose(1, 2)
    got, _ = deep_transformer(q, k, v, normalize=True, window=5, backend="triton")
    want, _ = deep_transformer(q.contiguous(), k.contiguous(), v.contiguous(), normalize=True, window=5,
                               backend="chunk")
    assert_close(got, want, tol=1e-5)


def test_large_scores_are_stable_with_the_normaliser(gen):
    """k.q up to ~1000 (exp overflows fp64): the running max keeps the normalised kernel exact."""
    q, k, v, _, _ = inputs(gen, B=1, H=2, T=90, K=8, V=4, scale=1.0, gates=False)
    q, k = 12 * q, 12 * k
    s = (q.double() @ k.double().mT).masked_fill(~torch.ones(90, 90, dtype=torch.bool).tril(), -math.inf)
    assert s.max() > 200
    got, _ = deep_transformer(q, k, v, normalize=True, backend="triton")
    assert torch.isfinite(got).all()
    assert_close(got, (s.softmax(-1) @ v.double()).float(), tol=1e-4)
    for window in (1, 5):                                          # and with a window and gates
        alpha = random_gate(1, 2, 90, low=0.5, generator=gen)
        got, _ = deep_transformer(q, k, v, alpha=alpha, normalize=True, window=window, backend="triton")
        assert torch.isfinite(got).all()
        assert_close(got, reference(q, k, v, alpha, None, normalize=True, window=window).float(), tol=1e-4)
    with pytest.raises(ValueError, match="overflow"):              # unnormalised: refused, as the chunk form
        deep_transformer(q, k, v, backend="triton")


@pytest.mark.parametrize("normalize, window", [(True, None), (False, 4), (True, 3)])
def test_gradients_through_the_chunk_form(gen, normalize, window):
    q, k, v, alpha, eta = inputs(gen, B=1, H=2, T=23, K=6, V=5)
    grads = []
    for backend in ("triton", "chunk"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, alpha, eta)]
        o, _ = deep_transformer(xs[0], xs[1], xs[2], alpha=xs[3], eta=xs[4], normalize=normalize, window=window,
                                backend=backend, chunk_size=5)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(0))
        grads.append(torch.autograd.grad((o * w).sum(), xs))
    for name, a, b in zip("q k v alpha eta".split(), *grads):
        assert_close(a, b, tol=1e-5, name=f"d/d{name}")
        assert b.abs().sum() > 0
    # log_alpha as the differentiated input
    la = alpha.log().requires_grad_(True)
    o, _ = deep_transformer(q, k, v, log_alpha=la, eta=eta, normalize=normalize, window=window, backend="triton")
    (g_triton,) = torch.autograd.grad(o.sum(), la)
    la2 = alpha.log().requires_grad_(True)
    o, _ = deep_transformer(q, k, v, log_alpha=la2, eta=eta, normalize=normalize, window=window, backend="chunk")
    (g_chunk,) = torch.autograd.grad(o.sum(), la2)
    assert_close(g_triton, g_chunk, tol=1e-5)


def test_refusals_and_auto(gen):
    q, k, v, alpha, eta = inputs(gen, T=9, K=4, V=3)
    with pytest.raises(TypeError, match="float64"):
        deep_transformer(q.double(), k.double(), v.double(), backend="triton")
    with pytest.raises(ValueError, match="Triton kernels take phi_star='kernel', or"):
        deep_transformer(q, k, v, phi_star=("taylor", 2), window=4, backend="triton")
    wide = torch.zeros(1, 1, 3, MAX_KEY + 1)
    with pytest.raises(ValueError, match=f"K <= {MAX_KEY}"):
        deep_transformer(wide, wide, torch.zeros(1, 1, 3, 2), normalize=True, backend="triton")
    assert kernel_limits(q) is None
    assert "fp64" in kernel_limits(q.double()) and "K=257" in kernel_limits(wide)
    auto, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=True)        # CPU: the chunk form
    chunk, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=True, backend="chunk")
    assert torch.equal(auto, chunk)


# ----------------------------------------------------------------------------- phi*_P on chapter 1's kernel

@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_eta", [True, False])
def test_taylor_runs_on_chapter_1s_kernel(gen, normalize, dtype, with_eta):
    """phi_star=("taylor", P) without a window is chapter 1's matrix memory on phi*_P: its kernel runs it,
    start state and final state included (D = C(5 + 2, 2) = 21 features), with or without a step eta
    (without one, 16-bit values meet the fp32 features as they are)."""
    q, k, v, alpha, eta = inputs(gen, T=37, K=5, V=3, dtype=dtype)
    eta = eta if with_eta else None
    D, Vs = 21, 4 if normalize else 3
    h0 = 0.1 * torch.randn(2, 2, Vs, D, generator=gen)
    if normalize:
        h0[:, :, -1] = 0.0
    kw = dict(alpha=alpha, eta=eta, phi_star=("taylor", 2), normalize=normalize, initial_state=h0,
              output_final_state=True)
    want, want_state = deep_transformer(q.double(), k.double(), v.double(), **{**kw, "alpha": alpha.double(),
                                        "eta": None if eta is None else eta.double(), "initial_state": h0.double()},
                                        backend="chunk")
    got, state = deep_transformer(q, k, v, **kw, backend="triton")
    assert got.dtype == dtype and state.memory.dtype == torch.float32 and state.momentum is None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(got, want.to(dtype), tol=tol)
    assert_close(state.memory, want_state.memory.float(), tol=1e-5)


def test_taylor_kernel_gradients_and_refusals(gen):
    q, k, v, alpha, eta = inputs(gen, B=1, T=19, K=3, V=2)
    grads = []
    for backend in ("triton", "chunk"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, alpha, eta)]
        o, _ = deep_transformer(xs[0], xs[1], xs[2], alpha=xs[3], eta=xs[4], phi_star=("taylor", 2), normalize=True,
                                backend=backend, chunk_size=4)
        grads.append(torch.autograd.grad(o.sum(), xs))
    for name, a, b in zip("q k v alpha eta".split(), *grads):
        assert_close(a, b, tol=1e-5, name=f"d/d{name}")
    with pytest.raises(ValueError, match="SWDT on phi"):        # a window: no kernel
        deep_transformer(q, k, v, phi_star=("taylor", 2), window=3, backend="triton")
    wide, wv = torch.zeros(1, 1, 3, 20), torch.zeros(1, 1, 3, 2)  # D = C(22, 2) = 231 fits, C(23, 3) = 1771 not
    deep_transformer(wide, wide, wv, phi_star=("taylor", 2), backend="triton")
    with pytest.raises(ValueError, match="D=1771"):
        deep_transformer(wide, wide, wv, phi_star=("taylor", 3), backend="triton")
    with pytest.raises(TypeError, match="float64"):
        deep_transformer(q.double(), k.double(), v.double(), phi_star=("taylor", 2), backend="triton")


def test_what_auto_sends_to_the_chunk_form():
    """backend="auto" on CUDA asks these (test_dispatch checks the mechanism for the kernel form)."""
    from atlaslib.deep import feature_kernel_limits
    from atlaslib.deep import kernel_limits as exp_kernel_limits
    assert exp_kernel_limits(torch.zeros(1, 1, 2, 256)) is None
    assert "K=257" in exp_kernel_limits(torch.zeros(1, 1, 2, 257))
    assert "fp64" in exp_kernel_limits(torch.zeros(1, 1, 2, 4, dtype=F64))
    assert feature_kernel_limits(torch.zeros(1, 1, 2, 231)) is None
    assert "D=1771" in feature_kernel_limits(torch.zeros(1, 1, 2, 1771))
    assert "fp64" in feature_kernel_limits(torch.zeros(1, 1, 2, 21, dtype=F64))


# ----------------------------------------------------------------------------- DOT, c = 1: the coefficient solve

def dot_inputs(gen, B=1, H=2, T=45, K=24, V=40, gates=True, dtype=torch.float32):
    """Keys with |k|^2 about 0.24, so |phi*(k)|^2 = e^{|k|^2} < 2 and the delta rule on phi* is stable
    even at eta = 1 (without gates the coefficients stay bounded too)."""
    scale = (0.24 / K) ** 0.5
    q, k = (scale * torch.randn(B, H, T, K, generator=gen) for _ in range(2))
    v = torch.randn(B, H, T, V, generator=gen)
    alpha = random_gate(B, H, T, low=0.7, generator=gen) if gates else None
    eta = (0.1 + 0.9 * torch.rand(B, H, T, generator=gen)) if gates else None
    return q.to(dtype), k.to(dtype), v.to(dtype), alpha, eta


def dot_definition(q, k, v, alpha, eta):
    """``dot_coefficient_recurrent`` (per token, the definition) in fp64 on the same (rounded) inputs."""
    def d(x):
        return None if x is None else x.double()
    o, _ = dot_coefficient_recurrent(q.double(), k.double(), v.double(), d(alpha), d(eta), "exp")
    return o


@pytest.mark.parametrize("alpha_on, eta_on", [(False, False), (True, True), (True, False), (False, True)])
def test_dot_triton_matches_the_definition_on_odd_shapes(gen, alpha_on, eta_on):
    """T = 45 (one full block of 32 and a partial one), K = 24, V = 40."""
    q, k, v, alpha, eta = dot_inputs(gen)
    alpha, eta = (alpha if alpha_on else None), (eta if eta_on else None)
    with poisoned_outputs():                                       # every coefficient is written before it is read
        got, state = dot(q, k, v, alpha=alpha, eta=eta, backend="triton")
    assert state is None and got.dtype == torch.float32 and got.shape == v.shape
    assert_close(got, dot_definition(q, k, v, alpha, eta).float(), tol=1e-5)
    chunk, _ = dot_chunk(q, k, v, alpha, eta, "exp", 16)
    assert_close(got, chunk, tol=1e-5)


@pytest.mark.parametrize("K", [5, 100])
def test_dot_triton_many_blocks_and_wide_values(gen, K):
    """T = 75: three blocks of 32 (K = 5), five of 16 (K = 100: fp32 halves the block at BK = 128);
    V = 70: two value blocks of 64, each solving the same system on its own columns."""
    q, k, v, alpha, eta = dot_inputs(gen, B=2, H=1, T=75, K=K, V=70)
    got, _ = dot(q, k, v, alpha=alpha, eta=eta, backend="triton")
    assert_close(got, dot_definition(q, k, v, alpha, eta).float(), tol=1e-5)


@pytest.mark.parametrize("K, T, leaf", [(5, 75, 32), (5, 140, 40), (100, 75, 16), (100, 45, 1)])
@pytest.mark.parametrize("gates", [True, False])
def test_dot_triton_recursive_solve(gen, K, T, leaf, gates):
    """The solve split in halves down to leaves of ``leaf`` tokens (rounded up to the block: 32 at K = 5,
    16 at K = 100), the later halves' right-hand sides corrected by the recall kernel: three leaves
    of 32 (75 = 32 + 32 + 11), two of 64 and a partial one (140 = 64 + 64 + 12: leaf 40 rounds up to 64),
    five of 16, three of 16 (leaf = 1 rounds up): every split equals the definition (and one leaf, the
    default at these T)."""
    from atlaslib.deep.kernel import dot_kernel_triton
    q, k, v, alpha, eta = dot_inputs(gen, B=2, H=1, T=T, K=K, V=70, gates=gates)
    with poisoned_outputs():
        got, _ = dot_kernel_triton(q, k, v, alpha, eta, leaf=leaf)
    assert_close(got, dot_definition(q, k, v, alpha, eta).float(), tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gates", [True, False])
def test_dot_triton_16_bit_inputs_cost_about_the_outputs_rounding(gen, dtype, gates):
    """DOT's read sums coefficients that cancel (most without gates), so any rounding of its terms is
    amplified: it reads its fp32 coefficients with "tf32x3" (exact in the interpreter, 1.0x the output's own
    rounding). Measured here at T = 200: one TF32 product 2.6x-2.7x (bf16, no gates) and 20x (fp16);
    coefficients rounded to bf16 for bf16 products 3.1x-3.3x with gates, 18x-20x without."""
    from atlaslib.deep.kernel import dot_kernel_triton
    q, k, v, alpha, eta = dot_inputs(gen, B=1, H=2, T=200, K=16, V=32, gates=gates, dtype=dtype)
    got, _ = dot_kernel_triton(q, k, v, alpha, eta, leaf=32)
    assert_within_rounding(got.double(), dot_definition(q, k, v, alpha, eta), dtype, 1.5)


@pytest.mark.parametrize("K", [16, 100])
def test_dot_triton_bf16_and_views(gen, K):
    """bf16 inputs (bf16 key products, the read in tf32x3; T = 70: three blocks of 32 at K = 16, five of 16 at K = 100);
    [B, T, H, K] tensors transposed are read in place."""
    q, k, v, alpha, eta = dot_inputs(gen, T=70, K=K, V=12, dtype=torch.bfloat16)
    got, _ = dot(q, k, v, alpha=alpha, eta=eta, backend="triton")
    assert got.dtype == torch.bfloat16
    assert_close(got, dot_definition(q, k, v, alpha, eta).bfloat16(), tol=2e-2)
    qv, kv, vv = (x.float().transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qv.is_contiguous()
    got, _ = dot(qv, kv, vv, alpha=alpha, eta=eta, backend="triton")
    assert_close(got, dot_definition(q, k, v, alpha, eta).float(), tol=1e-5)


def test_dot_triton_numbers_and_window_gates(gen):
    """alpha, eta as numbers, and gamma at c = 1 (a factor of the step, either layout), as ``dot`` passes them."""
    q, k, v, _, eta = dot_inputs(gen, T=20, K=8, V=3)
    gamma = torch.rand(1, 2, 20, generator=gen)
    for kw in ({"alpha": 0.9, "eta": 0.5}, {"gamma": gamma, "eta": eta}, {"gamma": gamma[..., None]}):
        got, _ = dot(q, k, v, backend="triton", **kw)
        d = {key: x.double() if isinstance(x, torch.Tensor) else x for key, x in kw.items()}
        want, _ = dot(q.double(), k.double(), v.double(), backend="recurrent", **d)
        assert_close(got, want.float(), tol=1e-5)


def test_dot_triton_gradients_through_the_chunk_form(gen):
    q, k, v, alpha, eta = dot_inputs(gen, T=21, K=6, V=5)
    grads = []
    for backend in ("triton", "chunk"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, alpha, eta)]
        o, _ = dot(xs[0], xs[1], xs[2], alpha=xs[3], eta=xs[4], backend=backend, chunk_size=5)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(0))
        grads.append(torch.autograd.grad((o * w).sum(), xs))
    for name, a, b in zip("q k v alpha eta".split(), *grads):
        assert_close(a, b, tol=1e-5, name=f"d/d{name}")
        assert b.abs().sum() > 0


def test_dot_triton_refusals_and_auto(gen):
    q, k, v, alpha, eta = dot_inputs(gen, T=9, K=4, V=3)
    with pytest.raises(TypeError, match="float64"):
        dot(q.double(), k.double(), v.double(), backend="triton")
    wide = torch.zeros(1, 1, 3, DOT_MAX_KEY + 1)
    with pytest.raises(ValueError, match=f"K <= {DOT_MAX_KEY}"):
        dot(wide, wide, torch.zeros(1, 1, 3, 2), backend="triton")
    assert dot_kernel_limits(q) is None
    assert "fp64" in dot_kernel_limits(q.double()) and f"K={DOT_MAX_KEY + 1}" in dot_kernel_limits(wide)
    with pytest.raises(ValueError, match="with a window has no Triton kernel"):
        dot(q, k, v, window=2, backend="triton")
    auto, _ = dot(q, k, v, alpha=alpha, eta=eta)                   # CPU: the chunk form
    chunk, _ = dot(q, k, v, alpha=alpha, eta=eta, backend="chunk")
    assert torch.equal(auto, chunk)


def test_dot_taylor_c1_runs_chapter_2s_kernel_on_the_features(gen):
    """phi_star=("taylor", P), c = 1: chapter 2's delta-rule kernel on phi*_P == the fp64 delta rule
    written here from the definition on the same features (decay after the step, as DOT's)."""
    from atlaslib.deep import exp_features
    B, H, T, K, V = 1, 2, 37, 4, 6
    q, k = (torch.randn(B, H, T, K, generator=gen) / 2 for _ in range(2))
    v = torch.randn(B, H, T, V, generator=gen)
    alpha = random_gate(B, H, T, low=0.8, high=1.0, generator=gen)
    eta = random_gate(B, H, T, low=0.05, high=0.2, generator=gen)
    tri, _ = dot(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", 2), backend="triton")
    fq, fk = exp_features(q.double(), 2), exp_features(k.double(), 2)
    M = torch.zeros(B, H, V, fk.shape[-1], dtype=torch.float64)
    ref = []
    for t in range(T):       # M_t = alpha_t M_{t-1} - eta_t (M_{t-1} phi(k_t) - v_t) phi(k_t)^T
        err = torch.einsum("bhvd,bhd->bhv", M, fk[:, :, t]) - v[:, :, t].double()
        step = eta[:, :, t, None, None].double() * err[..., None] * fk[:, :, t, None, :]
        M = alpha[:, :, t, None, None].double() * M - step
        ref.append(torch.einsum("bhvd,bhd->bhv", M, fq[:, :, t]))
    assert_close(tri.double(), torch.stack(ref, 2), tol=1e-5, name="dot taylor c=1 triton vs definition")


def test_unnormalised_fp16_weights_past_fp16s_range_stay_finite(gen):
    # unnormalised fp16 keeps its weights e^S in fp32 (fp16 ends at 65504 = e^11.09): scores up to 16, legal
    # (below the cap of 80), must give finite outputs within fp16 rounding of fp64 on the same inputs.
    # Queries and keys near one shared direction (cosines about 0.9) put most scores past 11.09 for every seed
    # (independent directions reach it for about half the seeds). Many such weights in every row also make the
    # error ratio a stable statistic: 1.7x-3.1x over 1000 seeds in the interpreter (TF32 drops the weights'
    # low bits), where rows ruled by one weight gave up to 8.7x.
    u = torch.randn(16, generator=gen)
    q, k = (u / u.norm() + 0.1 * torch.randn(1, 1, 40, 16, generator=gen) for _ in range(2))
    q, k = 4 * q / q.norm(dim=-1, keepdim=True), 4 * k / k.norm(dim=-1, keepdim=True)
    v = 1e-4 * torch.randn(1, 1, 40, 8, generator=gen)           # outputs stay in fp16 (|o| <= 5.8e3 there)
    q, k, v = q.half(), k.half(), v.half()
    assert math.log(65504) < float((q.float() @ k.float().mT).tril().max())
    want = reference(q, k, v, None, None, normalize=False)
    got, _ = deep_transformer(q, k, v, normalize=False, backend="triton")
    assert torch.isfinite(got).all()
    assert_within_rounding(got.double(), want, torch.float16, 3.5)
