"""The Triton kernel for chunkwise Titans with a linear memory (atlaslib.miras.kernel).

Run under TRITON_INTERPRET=1 (tests/conftest.py sets it). The reference is a plain
per-token loop written out here in fp64, independent of the kernel: every gradient of a
chunk is taken at the chunk-start state, then momentum, retention and readout token by
token. Checked: kernel == reference for chunk sizes 1, 3, 16, 64 on odd shapes with each
gate absent or present (theta exactly 0 and 1, alpha exactly 0 and 1), with and without
M_0 and S_0, outputs NaN-poisoned; chunk size 1 without momentum or retention == the
delta rule (TTT-Linear = DeltaNet, beta = eta), and where that reduction must fail it
does; b > 1 really differs from per-token Titans; bf16/fp16 inputs; the library's chunk
form (when atlaslib.miras provides it); bad inputs. A GPU class (skipped without CUDA)
runs T = 4096 in fp32 and bf16.
"""
import pytest
import torch

from atlaslib.core import TOLERANCE, assert_close, poisoned_outputs, random_qkv, rel_rmse
from atlaslib.core.testing import assert_within_rounding
from atlaslib.miras.kernel import MAX_CHUNK, MAX_KEY, kernel_supports, titans_linear_triton


# ------------------------------------------------------------------ the reference (fp64, per token)
def titans_reference(q, k, v, alpha=None, eta=None, theta=None, M0=None, S0=None, chunk_size=1):
    """Per-token loop, gradients frozen at the state of each chunk start (b = 1: per-token Titans).

        e_t = M_{t0} k_t - v_t,  S_t = theta_t S_{t-1} - eta_t e_t k_t^T,  M_t = alpha_t M_{t-1} + S_t,
        y_t = M_t q_t.   None gates: alpha = 1, eta = 1, theta = 0.  Returns fp64 (o, M_T, S_T).
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    dev = q.device
    q, k, v = q.double(), k.double(), v.double()
    M = torch.zeros(B, H, V, K, dtype=torch.float64, device=dev) if M0 is None else M0.double().clone()
    S = torch.zeros(B, H, V, K, dtype=torch.float64, device=dev) if S0 is None else S0.double().clone()
    ys = []
    for t in range(T):
        if t % chunk_size == 0:
            M_start = M.clone()
        a_t = 1.0 if alpha is None else alpha[:, :, t, None, None].double()
        eta_t = 1.0 if eta is None else eta[:, :, t, None, None].double()
        theta_t = 0.0 if theta is None else theta[:, :, t, None, None].double()
        err = torch.einsum("bhvk,bhk->bhv", M_start, k[:, :, t]) - v[:, :, t]
        S = theta_t * S - eta_t * err[..., :, None] * k[:, :, t, None, :]
        M = a_t * M + S
        ys.append(torch.einsum("bhvk,bhk->bhv", M, q[:, :, t]))
    return torch.stack(ys, dim=2), M, S


def make_inputs(gen, B, H, T, K, V, spec, device="cpu"):
    """q, k, v and the optional arguments named by ``spec`` (letters; absent letter -> None):

    a: alpha uniform in [0.5, 1];  A: alpha with exact 1s and exact 0s (full resets) among random values
    e: eta uniform in [0, 1]
    t: theta uniform in [0, 1];    T: theta with exact 0s and exact 1s among random values
    z: theta exactly 0 everywhere; o: theta exactly 1 everywhere
    m: initial state M_0;          s: initial momentum S_0
    """
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    u = lambda: torch.rand(B, H, T, generator=gen)  # noqa: E731
    alpha = eta = theta = M0 = S0 = None
    if "a" in spec:
        alpha = 0.5 + 0.5 * u()
    if "A" in spec:
        alpha = 0.5 + 0.5 * u()
        alpha[..., 0::3] = 1.0
        alpha[..., 4::9] = 0.0
    if "e" in spec:
        eta = u()
    if "t" in spec:
        theta = u()
    if "T" in spec:
        theta = u()
        theta[..., 0::4] = 0.0
        theta[..., 1::3] = 1.0
    if "z" in spec:
        theta = torch.zeros(B, H, T)
    if "o" in spec:
        theta = torch.ones(B, H, T)
    if "m" in spec:
        M0 = torch.randn(B, H, V, K, generator=gen) / K ** 0.5
    if "s" in spec:
        S0 = 0.1 * torch.randn(B, H, V, K, generator=gen) / K ** 0.5
    mv = lambda x: None if x is None else x.to(device)  # noqa: E731
    return [mv(x) for x in (q, k, v, alpha, eta, theta, M0, S0)]


def check_against_reference(inputs, chunk_size, tol=1e-5):
    with poisoned_outputs():
        o, M_T, S_T = titans_linear_triton(*inputs, chunk_size=chunk_size)
    ref_o, ref_M, ref_S = titans_reference(*inputs, chunk_size=chunk_size)
    assert o.dtype == inputs[0].dtype and M_T.dtype == torch.float32 and S_T.dtype == torch.float32
    assert_close(o.double(), ref_o, tol=tol)
    assert_close(M_T.double(), ref_M, tol=tol, name="M_T")
    assert_close(S_T.double(), ref_S, tol=tol, name="S_T")


# ------------------------------------------------------------------ kernel == reference
CASES = [
    # B, H, T,  K,   V,  chunk, gates / states
    (1, 2, 21, 12, 10, 1, "aetms"),       # per-token Titans, everything on
    (2, 1, 21, 12, 10, 3, "AeTms"),       # exact 0/1 gates: resets and undamped momentum
    (1, 1, 75, 60, 100, 16, "aetms"),     # K, V not powers of two, V split across two programs
    (2, 2, 75, 12, 10, 64, ""),           # all gates None, no state: TTT-Linear from zero
    (1, 1, 1, 12, 10, 16, "aetms"),       # T = 1
    (1, 2, 21, 12, 10, 64, "ats"),        # one ragged chunk, no eta, no M_0
    (1, 1, 75, 12, 10, 16, "eTm"),        # no alpha, exact theta
    (2, 1, 21, 60, 100, 3, "Aem"),        # no momentum, exact alpha
    (1, 1, 21, 12, 10, 1, "aos"),         # theta exactly 1: momentum never decays
    (1, 1, 21, 12, 10, 3, "ez"),          # theta exactly 0 given as a tensor
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}T{c[2]}K{c[3]}V{c[4]}b{c[5]}-{c[6] or 'none'}")
def test_kernel_matches_reference(gen, case):
    B, H, T, K, V, b, spec = case
    check_against_reference(make_inputs(gen, B, H, T, K, V, spec), b)


def test_neutral_gates_equal_none(gen):
    """alpha = 1, eta = 1, theta = 0 as tensors take other code paths than None; results must agree."""
    q, k, v, _, _, _, M0, S0 = make_inputs(gen, 1, 2, 21, 12, 10, "ms")
    ones, zeros = torch.ones(1, 2, 21), torch.zeros(1, 2, 21)
    o1, M1, S1 = titans_linear_triton(q, k, v, None, None, None, M0, S0, chunk_size=5)
    o2, M2, S2 = titans_linear_triton(q, k, v, ones, ones, zeros, M0, S0, chunk_size=5)
    for a, b, name in ((o1, o2, "o"), (M1, M2, "M_T"), (S1, S2, "S_T")):
        assert_close(a, b, tol=1e-6, name=name)


def test_full_reset_forgets_the_past(gen):
    """alpha = theta = eta = 0 at the last token of a chunk: M and S restart from zero, so the outputs
    after it do not depend on anything before (with eta > 0 that token's step would still carry the
    previous chunk's state through its frozen error)."""
    q, k, v, alpha, eta, theta, M0, S0 = make_inputs(gen, 1, 1, 21, 12, 10, "aetms")
    r = 8                                          # token 8 starts the third chunk at b = 4
    alpha[..., r - 1] = 0.0
    theta[..., r - 1] = 0.0
    eta[..., r - 1] = 0.0
    o1, M1, _ = titans_linear_triton(q, k, v, alpha, eta, theta, M0, S0, chunk_size=4)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    k2[..., : r - 1, :] = torch.randn(r - 1, 12, generator=gen)
    v2[..., : r - 1, :] = torch.randn(r - 1, 10, generator=gen)
    o2, M2, _ = titans_linear_triton(q2, k2, v2, alpha, eta, theta, 5 * M0, 5 * S0, chunk_size=4)
    assert torch.isfinite(o1).all() and torch.isfinite(M1).all()
    assert_close(o1[..., r:, :], o2[..., r:, :], tol=1e-6)
    assert_close(M1, M2, tol=1e-6, name="M_T")
    assert rel_rmse(o1[..., : r - 1, :], o2[..., : r - 1, :]) > 1e-2      # before the reset they differ


def test_log_alpha_is_used_as_given(gen):
    """A retention given as a log reaches the kernel as that log: decays closer to 1 than fp32 resolves
    still count (alpha = exp(log_alpha) in fp32 would be exactly 1), and log_alpha = -inf is a reset."""
    B, H, T, K, V = 1, 2, 1024, 12, 10
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    M0 = torch.randn(B, H, V, K, generator=gen)
    log_alpha = -torch.empty(B, H, T).uniform_(1e-8, 2.9e-8, generator=gen)
    assert (log_alpha.double().exp().float() == 1).all()  # under half of fp32 step 2^-24 below 1
    zero = torch.zeros(B, H, T)                   # eta = 0: no writes, the memory only decays
    _, M_T, _ = titans_linear_triton(q, k, v, eta=zero, initial_state=M0, chunk_size=64, log_alpha=log_alpha)
    expected = M0.double() * log_alpha.double().sum(-1).exp()[..., None, None]
    assert rel_rmse(M0, expected) > 1e-5                     # the decay, about 2e-5 ...
    assert_close(M_T, expected, tol=2e-6, name="M_T after T decays")    # ... against fp32 rounding per chunk
    # the full contract from a log, against the reference fed the same gates as alpha in fp64
    q, k, v, alpha, eta, theta, M0, S0 = make_inputs(gen, B, H, 37, K, V, "aetms")
    alpha[..., 20] = 0.0
    log_a = alpha.log()                                            # -inf at token 20: a reset
    o, M_T, S_T = titans_linear_triton(q, k, v, None, eta, theta, M0, S0, chunk_size=16, log_alpha=log_a)
    ref = titans_reference(q, k, v, alpha, eta, theta, M0, S0, chunk_size=16)
    for got, want, name in zip((o, M_T, S_T), ref, ("o", "M_T", "S_T")):
        assert_close(got, want, tol=1e-5, name=name)
    with pytest.raises(ValueError, match="not both"):
        titans_linear_triton(q, k, v, alpha, log_alpha=log_a)


# ------------------------------------------------------------------ reductions and what must differ
def test_chunk1_without_momentum_is_the_delta_rule(gen):
    """b = 1, theta = None, alpha = None: M_t = M_{t-1} + eta_t (v_t - M_{t-1} k_t) k_t^T = DeltaNet, beta = eta."""
    from atlaslib.delta import delta_rule
    q, k, v, _, _, _, M0, _ = make_inputs(gen, 2, 2, 21, 12, 10, "m")
    beta = 2.0 * torch.rand(2, 2, 21, generator=gen)
    with poisoned_outputs():
        o, M_T, S_T = titans_linear_triton(q, k, v, eta=beta, initial_state=M0, chunk_size=1)
    ref, ref_M = delta_rule(q, k, v, beta, initial_state=M0, output_final_state=True, backend="recurrent")
    assert_close(o, ref, tol=1e-5)
    assert_close(M_T, ref_M, tol=1e-5, name="M_T")
    # without momentum S_T is the last step: -eta_T e_T k_T^T with e_T at M_{T-1}
    _, M_prev = delta_rule(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], beta[:, :, :-1], initial_state=M0,
                           output_final_state=True, backend="recurrent")
    err = torch.einsum("bhvk,bhk->bhv", M_prev, k[:, :, -1]) - v[:, :, -1]
    assert_close(S_T, -beta[:, :, -1, None, None] * err[..., None] * k[:, :, -1, None, :], tol=1e-5, name="S_T")


def test_what_must_differ(gen):
    """Retention here decays after the gradient (Gated DeltaNet takes it at alpha M_{t-1}), and b > 1
    freezes gradients: both must really change the result (book ch. 2 §3, book ch. 3 §8)."""
    from atlaslib.delta import delta_rule
    q, k, v, alpha, eta, theta, M0, S0 = make_inputs(gen, 1, 2, 21, 12, 10, "aetms")
    alpha = 0.5 + 0.6 * (alpha - 0.5)                # in [0.5, 0.8]: a clear decay
    o, _, _ = titans_linear_triton(q, k, v, alpha, eta, None, M0, None, chunk_size=1)
    gated, _ = delta_rule(q, k, v, eta, alpha=alpha, initial_state=M0, backend="recurrent")
    assert rel_rmse(o, gated) > 1e-2
    o16, _, _ = titans_linear_triton(q, k, v, alpha, eta, theta, M0, S0, chunk_size=16)
    per_token, _, _ = titans_reference(q, k, v, alpha, eta, theta, M0, S0, chunk_size=1)
    assert rel_rmse(o16[:, :, 1:], per_token[:, :, 1:]) > 1e-2
    assert_close(o16[:, :, :1].double(), per_token[:, :, :1], tol=1e-5)   # the first token is per-token


# ------------------------------------------------------------------ low precision
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(gen, dtype):
    q, k, v, alpha, eta, theta, M0, S0 = make_inputs(gen, 1, 2, 40, 60, 20, "aetms")
    ref_o, ref_M, ref_S = titans_reference(q, k, v, alpha, eta, theta, M0, S0, chunk_size=16)
    with poisoned_outputs():
        o, M_T, S_T = titans_linear_triton(q.to(dtype), k.to(dtype), v.to(dtype), alpha, eta, theta, M0, S0,
                                           chunk_size=16)
    assert o.dtype == dtype and M_T.dtype == torch.float32
    assert_close(o.double(), ref_o, tol=TOLERANCE[dtype])
    assert_close(M_T.double(), ref_M, tol=TOLERANCE[dtype], name="M_T")
    assert_close(S_T.double(), ref_S, tol=TOLERANCE[dtype], name="S_T")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_16_bit_products_cost_about_the_outputs_rounding(gen, dtype, chunk_size):
    """bf16/fp16 inputs: every product takes 16-bit operands (the states rounded), the states and sums stay
    fp32. Against fp64 on the same inputs, o and the states are off by a small multiple of what rounding
    o to that dtype costs (in the interpreter, which rounds as a card does: o 1.8x-1.9x, M_T 1.2x-1.4x over
    six seeds; a state kept in 16 bits between chunks gives M_T 2.4x at 16-token chunks). No decay, so
    the memory keeps every error it is given."""
    q, k, v, _, eta, _, _, _ = make_inputs(gen, 1, 2, 256, 32, 32, "e")
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    q, k, v, eta = q.to(dtype), k.to(dtype), v.to(dtype), 0.5 * eta
    ref_o, ref_M, ref_S = titans_reference(q, k, v, None, eta, None, chunk_size=chunk_size)
    o, M_T, S_T = titans_linear_triton(q, k, v, None, eta, None, chunk_size=chunk_size)
    own = rel_rmse(ref_o.to(dtype).double(), ref_o)        # what rounding o to the dtype costs
    assert_within_rounding(o.double(), ref_o, dtype, 2.5)
    assert_close(M_T.double(), ref_M, tol=1.8 * own, name="M_T")
    assert_close(S_T.double(), ref_S, tol=2.5 * own, name="S_T")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_fp16_decay_products_cost_about_the_outputs_rounding(gen, chunk_size):
    """With decay and momentum, the decay product D_alpha D_theta weighs every output, and for fp16 inputs it is
    one TF32 product, whose error is as large as fp16's rounding: o is off fp64 by 2.37x (chunks of 16) and
    2.79x (64) what rounding it to fp16 costs (interpreter, T = 512, K = V = 64; bf16: 1.75x). Three TF32
    products ("tf32x3") gave 1.75x-1.77x, but their builds spilled 2.2-3.0 KB a thread at 64-token chunks
    (1.3-1.7 KB with TF32), so TF32 stays; the bound keeps the kernel at that."""
    B, H, T, K = 1, 2, 512, 64
    q, k, v = random_qkv(B, H, T, K, K, generator=gen)
    q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    alpha = 0.9 + 0.1 * torch.rand(B, H, T, generator=gen)
    eta, theta = 0.5 * torch.rand(B, H, T, generator=gen), 0.8 * torch.rand(B, H, T, generator=gen)
    q, k, v = q.half(), k.half(), v.half()
    ref_o, _, _ = titans_reference(q, k, v, alpha, eta, theta, chunk_size=chunk_size)
    o, _, _ = titans_linear_triton(q, k, v, alpha, eta, theta, chunk_size=chunk_size)
    assert_within_rounding(o.double(), ref_o, torch.float16, 3.3)


# ------------------------------------------------------------------ kernel == the library's chunk form
def _library():
    try:
        from atlaslib import miras as lib
    except ImportError as exc:                                    # pragma: no cover - depends on the tree
        pytest.skip(f"atlaslib.miras cannot be imported yet ({exc})")
    if not hasattr(lib, "miras") or not hasattr(lib, "MirasState"):
        pytest.skip("atlaslib.miras does not expose miras()/MirasState yet: no chunk form to compare with")
    return lib


@pytest.mark.parametrize("chunk_size", [1, 5, 16])
def test_kernel_matches_library_chunk_titans(gen, chunk_size):
    lib = _library()
    q, k, v, alpha, eta, theta, M0, S0 = make_inputs(gen, 2, 1, 21, 12, 10, "aetms")
    ref, state = lib.miras(q, k, v, preset="titans", memory="linear", alpha=alpha, eta=eta, theta=theta,
                           initial_state=lib.MirasState(M0, S0), output_final_state=True, backend="chunk",
                           chunk_size=chunk_size)
    with poisoned_outputs():
        o, M_T, S_T = titans_linear_triton(q, k, v, alpha, eta, theta, M0, S0, chunk_size=chunk_size)
    assert_close(o, ref, tol=1e-5)
    assert_close(M_T, state.memory, tol=1e-5, name="M_T")
    assert_close(S_T, state.momentum, tol=1e-5, name="S_T")


def test_kernel_matches_library_chunk_ttt_linear(gen):
    lib = _library()
    q, k, v, _, eta, _, M0, _ = make_inputs(gen, 1, 2, 21, 12, 10, "em")
    ref, state = lib.miras(q, k, v, preset="ttt_linear", eta=eta, initial_state=M0, output_final_state=True,
                           backend="chunk", chunk_size=8)
    o, M_T, _ = titans_linear_triton(q, k, v, eta=eta, initial_state=M0, chunk_size=8)
    assert_close(o, ref, tol=1e-5)
    assert_close(M_T, state.memory, tol=1e-5, name="M_T")


def test_library_triton_backend_uses_the_kernel(gen):
    lib = _library()
    q, k, v, alpha, eta, theta, M0, S0 = make_inputs(gen, 1, 1, 21, 12, 10, "aetms")
    kw = dict(preset="titans", memory="linear", alpha=alpha, eta=eta, theta=theta,
              initial_state=lib.MirasState(M0, S0), output_final_state=True, chunk_size=7)
    ref, ref_state = lib.miras(q, k, v, backend="chunk", **kw)
    with poisoned_outputs():
        o, state = lib.miras(q, k, v, backend="triton", **kw)
    assert_close(o, ref, tol=1e-5)
    assert_close(state.memory, ref_state.memory, tol=1e-5, name="M_T")


@pytest.mark.parametrize("preset, kw", [("titans", dict(memory="linear")), ("ttt_linear", {})])
def test_library_triton_backend_weighs_each_token_by_gamma(gen, preset, kw):
    """With window 1, gamma scales each token's gradient: backend "triton" must give the chunk form's outputs,
    state and gradients (of gamma too) for gamma per source token, per offset and as one number."""
    lib = _library()
    q, k, v, alpha, eta, theta, M0, S0 = make_inputs(gen, 1, 2, 21, 12, 10, "aetms")
    if preset == "titans":
        kw = dict(kw, alpha=alpha, theta=theta, initial_state=lib.MirasState(M0, S0))
    g = 0.2 + 0.8 * torch.rand(1, 2, 21, generator=gen)
    for gamma in (g, g[..., None], 0.3):
        outs = {}
        for backend in ("chunk", "triton"):
            leaf = gamma.clone().requires_grad_() if isinstance(gamma, torch.Tensor) else gamma
            e = eta.clone().requires_grad_()
            o, state = lib.miras(q, k, v, preset=preset, eta=e, gamma=leaf, output_final_state=True,
                                 backend=backend, chunk_size=7, **kw)
            (o * v.sum(-1, keepdim=True)).sum().backward()
            outs[backend] = (o, state.memory, e.grad, getattr(leaf, "grad", None))
        (o, M, de, dg), (o_ref, M_ref, de_ref, dg_ref) = outs["triton"], outs["chunk"]
        assert_close(o, o_ref, tol=1e-5)
        assert_close(M, M_ref, tol=1e-5, name="M_T")
        assert_close(de, de_ref, tol=1e-5, name="d eta")
        if dg_ref is not None:
            assert_close(dg, dg_ref, tol=1e-5, name="d gamma")


# ------------------------------------------------------------------ bad inputs and tile limits
def test_bad_inputs():
    q, k, v = random_qkv(1, 1, 8, 12, 10, seed=0)
    with pytest.raises(TypeError, match="float64"):
        titans_linear_triton(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="chunk_size"):
        titans_linear_triton(q, k, v, chunk_size=MAX_CHUNK + 1)
    with pytest.raises(ValueError, match="chunk_size"):
        titans_linear_triton(q, k, v, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        titans_linear_triton(q, k, v, chunk_size=2.0)
    wide = random_qkv(1, 1, 4, MAX_KEY + 1, 8, seed=0)
    with pytest.raises(ValueError, match="K <= 256"):
        titans_linear_triton(*wide)
    with pytest.raises(ValueError, match=r"theta must have shape \[1, 1, 8\]"):
        titans_linear_triton(q, k, v, theta=torch.rand(1, 8))
    with pytest.raises(ValueError, match="initial_momentum must have shape"):
        titans_linear_triton(q, k, v, initial_momentum=torch.zeros(1, 1, 12, 10))
    with pytest.raises(ValueError, match="v must have shape"):
        titans_linear_triton(q, k, v[:, :, :5])
    with pytest.raises(TypeError, match="share a dtype"):
        titans_linear_triton(q, k, v.half())


def test_kernel_supports():
    assert kernel_supports(64, 64, 64) and kernel_supports(12, 1000, 1) and kernel_supports(256, 64, 16)
    assert not kernel_supports(64, 64, 65) and not kernel_supports(257, 64, 16) and not kernel_supports(64, 64, 0)


# ------------------------------------------------------------------ on a real GPU (skipped without CUDA)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU kernel tests skipped")
class TestOnGPU:
    """T = 4096 compiled for the card, fp32 and bf16, against the fp64 per-token reference."""

    @pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
    @pytest.mark.parametrize("chunk_size", [16, 64])
    def test_long_sequence(self, gen, dtype, tol, chunk_size):
        B, H, T, K, V = 1, 2, 4096, 64, 64
        q, k, v, alpha, eta, theta, M0, S0 = make_inputs(gen, B, H, T, K, V, "aetms", device="cuda")
        # a stable regime for frozen chunks of 64 unit keys: modest steps, some forgetting
        alpha, eta, theta = 0.9 + 0.1 * alpha, 0.1 * eta, 0.5 * theta
        ref_o, ref_M, ref_S = titans_reference(q, k, v, alpha, eta, theta, M0, S0, chunk_size=chunk_size)
        with poisoned_outputs():
            o, M_T, S_T = titans_linear_triton(q.to(dtype), k.to(dtype), v.to(dtype), alpha, eta, theta, M0, S0,
                                               chunk_size=chunk_size)
        torch.cuda.synchronize()
        assert torch.isfinite(o.float()).all()
        assert_close(o.double(), ref_o, tol=tol)
        assert_close(M_T.double(), ref_M, tol=tol, name="M_T")
        assert_close(S_T.double(), ref_S, tol=tol, name="S_T")

    def test_wide_keys_and_odd_shapes(self, gen):
        for (B, H, T, K, V, b) in [(2, 3, 1000, 256, 100, 64), (1, 1, 1, 16, 16, 1), (2, 2, 333, 60, 100, 7)]:
            inputs = make_inputs(gen, B, H, T, K, V, "aetms", device="cuda")
            inputs[4] = 0.2 * inputs[4]
            check_against_reference(inputs, b, tol=1e-4)
