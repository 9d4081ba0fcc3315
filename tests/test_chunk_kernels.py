"""Chapters 1-2's chunk-parallel Triton forward (``core.chunk_kernels``) at the edges of its chunking.

Under TRITON_INTERPRET=1: linear attention and the delta rule in their three gate modes
against their per-token loops (fp64) on fresh random inputs, at T = 1, one chunk, one chunk + 1
(the state pass then carries a state across a one-token chunk) and three chunks and a bit;
per-channel gates that are exactly 0 (clamped to log -60) and exactly 1 in some channels, which
push the sub-chunk scores to the ends of their exponents; and bf16 inputs against the fp32
loop at bf16 tolerance. Also the precision of the products: with bf16 inputs no kernel multiplies
fp32 tiles exactly (only the delta rule's inverse takes fp32 tiles, in TF32, which the interpreter
truncates as a card does), and that TF32 inverse costs no accuracy against exact products.
"""
import pytest
import torch
import triton
import triton.language as tl

from atlaslib.core import assert_close, poisoned_outputs, random_qkv
from atlaslib.core.chunk_kernels import CHUNK, unit_lower_inverse
from atlaslib.delta import delta_rule
from atlaslib.linear import linear_attention

MODES = [None, "scalar", "channel"]


def inputs(gen, T, mode, B=1, H=2, K=12, V=10, extreme=False):
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    shape = (B, H, T) if mode == "scalar" else (B, H, T, K)
    alpha = None if mode is None else 0.5 + 0.5 * torch.rand(*shape, generator=gen)
    if extreme and mode is not None:          # some gates exactly 0 (a reset) and exactly 1
        pick = torch.rand(*shape, generator=gen)
        alpha = torch.where(pick < 0.15, torch.zeros(()), torch.where(pick > 0.85, torch.ones(()), alpha))
    beta = torch.rand(B, H, T, generator=gen)
    h0 = torch.randn(B, H, V, K, generator=gen) / K
    return q, k, v, alpha, beta, h0


def both(model, backend, q, k, v, alpha, beta, h0):
    if model == "linear":
        return linear_attention(q, k, v, alpha=alpha, initial_state=h0, output_final_state=True, backend=backend)
    return delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, output_final_state=True, backend=backend)


def reference(model, q, k, v, alpha, beta, h0):
    f = lambda x: None if x is None else x.double()  # noqa: E731
    return both(model, "recurrent", f(q), f(k), f(v), f(alpha), f(beta), f(h0))


@pytest.mark.parametrize("model", ["linear", "delta"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", [1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_chunk_edges_match_the_loop(gen, model, mode, T):
    q, k, v, alpha, beta, h0 = inputs(gen, T, mode)
    with poisoned_outputs():
        o, s = both(model, "triton", q, k, v, alpha, beta, h0)
    ref_o, ref_s = reference(model, q, k, v, alpha, beta, h0)
    assert_close(o, ref_o, tol=1e-5)
    assert_close(s.memory if hasattr(s, "memory") else s, ref_s.memory if hasattr(ref_s, "memory") else ref_s,
                 tol=1e-5, name="final state")


@pytest.mark.parametrize("model", ["linear", "delta"])
@pytest.mark.parametrize("mode", ["scalar", "channel"])
def test_gates_of_exactly_zero_and_one(gen, model, mode):
    q, k, v, alpha, beta, h0 = inputs(gen, 2 * CHUNK + 7, mode, extreme=True)
    assert (alpha == 0).any() and (alpha == 1).any()
    with poisoned_outputs():
        o, s = both(model, "triton", q, k, v, alpha, beta, h0)
    ref_o, ref_s = reference(model, q, k, v, alpha, beta, h0)
    assert torch.isfinite(o).all()
    assert_close(o, ref_o, tol=1e-5)
    assert_close(s.memory if hasattr(s, "memory") else s, ref_s.memory if hasattr(ref_s, "memory") else ref_s,
                 tol=1e-5, name="final state")


@pytest.mark.parametrize("model", ["linear", "delta"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("V", [16, 100])
def test_bf16_inputs_within_bf16_rounding(gen, model, mode, V):
    # bf16 tiles meet on bf16 tensor cores (fp32 sums); decayed values are rounded to bf16 before
    # their products, so the outputs carry a few bf16 roundings (2^-9 relative each). V = 100: the
    # output kernel's one value block of 128 channels (``chunk_value_tiles``), 28 of them masked
    q, k, v, alpha, beta, h0 = inputs(gen, CHUNK + 9, mode, K=16, V=V)
    ref_o, _ = reference(model, q, k, v, alpha, beta, h0)
    half = [None if x is None else x.bfloat16() for x in (q, k, v, alpha)]
    o, _ = both(model, "triton", *half, beta, h0)
    assert o.dtype == torch.bfloat16
    assert_close(o.float(), ref_o.float(), tol=2e-2, name="bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_chunk_states_are_the_prefix_states_in_the_state_dtype(gen, dtype):
    """h[c], the state at the start of chunk c, equals the loop's final state over the first 64c tokens;
    stored in fp32 for fp32 inputs and in the inputs' dtype for 16-bit ones (``state_dtype``)."""
    from atlaslib.core.chunk_kernels import state_dtype, state_pass
    from atlaslib.core.kernels import chunk_gates, forward_launch
    q, k, v, alpha, _, h0 = inputs(gen, 3 * CHUNK + 5, "scalar", K=16, V=16)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    run = forward_launch(q, k, v, BV=64)
    gate, g, Tp = chunk_gates(alpha, None, run.T, CHUNK, dtype)
    h, _, _ = state_pass(run, gate, g, Tp, h0)
    assert h.dtype == state_dtype(dtype) == (torch.float32 if dtype == torch.float32 else dtype)
    h = h.view(1, 2, -1, 16, 16)
    assert_close(h[:, :, 0].float(), h0, tol=1e-5 if dtype == torch.float32 else 1e-2, name="h[0]")
    for c in range(1, h.shape[2]):
        n = c * CHUNK
        _, ref = linear_attention(q[:, :, :n].double(), k[:, :, :n].double(), v[:, :, :n].double(),
                                  alpha=alpha[:, :, :n].double(), initial_state=h0.double(),
                                  output_final_state=True, backend="recurrent")
        assert_close(h[:, :, c].float(), ref.float(), tol=1e-5 if dtype == torch.float32 else 1e-2, name=f"h[{c}]")


@pytest.mark.parametrize("grad", [False, True])
def test_short_sequences_hold_no_padded_chunk(gen, grad, monkeypatch):
    """Every per-token buffer of the delta rule's kernels (w, u, v_new; backward dv_local, dv2, dk, dw)
    has T rows, not whole 64-row chunks (Memory Caching runs blocks of 1-32 tokens as batch rows). Read
    from the shapes the kernels allocate (``core.alloc``): a buffer whose rows are channels (K = V = 32)
    holds T = 3 token rows or, for a state [.., V, K], V rows. The per-chunk score buffers [B*H, Tp, BT]
    are whole chunks by design (their rows end in 64 columns) and are not per-token buffers."""
    import atlaslib.core.alloc as alloc
    B, H, T, K, V = 16, 2, 3, 32, 32
    q, k, v, alpha, beta, _ = inputs(gen, T, "scalar", B=B, H=H, K=K, V=V)
    for x in (q, k, v, beta):
        x.requires_grad_(grad)
    shapes = []

    def recording(*shape, **kw):
        shapes.append(tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape)
        return torch.empty(*shape, **kw)

    monkeypatch.setattr(alloc, "allocate", recording)
    with torch.set_grad_enabled(grad):
        o, s = delta_rule(q, k, v, beta, alpha=alpha, output_final_state=True, backend="triton")
        if grad:
            (o.sum() + s.sum()).backward()
    per_token = [x for x in shapes if len(x) >= 2 and x[-1] in (K, V)]
    assert per_token and all(x[-2] in (T, V) for x in per_token), shapes
    assert all(x[-2] != CHUNK for x in per_token), shapes


@triton.jit
def invert(a_ptr, r_ptr, BT: tl.constexpr):
    o = tl.arange(0, BT)
    b_A = tl.load(a_ptr + o[:, None] * BT + o[None, :])
    tl.store(r_ptr + o[:, None] * BT + o[None, :], unit_lower_inverse(b_A, BT, 16, "ieee"))


@pytest.mark.parametrize("BT", [16, 32, 64])
def test_unit_lower_inverse_is_the_inverse(gen, BT):
    """``unit_lower_inverse`` (the batched diagonal blocks, then the block rows) on a strictly lower
    [BT, BT] tile: (I + A)^{-1} against a triangular solve in fp64, for one, two and four blocks of 16."""
    A = torch.tril(torch.randn(BT, BT, generator=gen) / BT ** 0.5, diagonal=-1)
    R = torch.full((BT, BT), float("nan"))
    invert[(1,)](A, R, BT=BT)
    want = torch.linalg.solve_triangular(torch.eye(BT, dtype=torch.float64) + A.double(),
                                         torch.eye(BT, dtype=torch.float64), upper=False)
    assert_close(R, want.float(), tol=1e-6, name="(I + A)^-1")


@triton.jit
def product(a_ptr, b_ptr, c_ptr, N: tl.constexpr, PRECISION: tl.constexpr):
    o = tl.arange(0, N)
    b_a = tl.load(a_ptr + o[:, None] * N + o[None, :])
    b_b = tl.load(b_ptr + o[:, None] * N + o[None, :])
    tl.store(c_ptr + o[:, None] * N + o[None, :], tl.dot(b_a, b_b, input_precision=PRECISION))


def test_interpreter_multiplies_tf32_as_a_card(gen):
    """A "tf32" tl.dot of fp32 tiles reads each operand with the low 13 of its 23 mantissa bits dropped, as
    a card's TF32 tensor cores do (Triton passes the fp32 bits unconverted), and "ieee" multiplies exactly:
    so the interpreter tests see the error of the kernels' TF32 products (the delta rule's inverse for
    16-bit inputs)."""
    a, b = (torch.randn(32, 32, generator=gen) for _ in range(2))
    truncated = lambda x: (x.view(torch.int32) & -(1 << 13)).view(torch.float32).double()  # noqa: E731
    out = {}
    for p in ("ieee", "tf32"):
        out[p] = torch.full((32, 32), float("nan"))
        product[(1,)](a, b, out[p], N=32, PRECISION=p)
    assert_close(out["ieee"], (a.double() @ b.double()).float(), tol=1e-6, name="ieee")
    assert_close(out["tf32"], (truncated(a) @ truncated(b)).float(), tol=1e-6, name="tf32")
    assert (out["tf32"] - out["ieee"]).norm() > 1e-4 * out["ieee"].norm()      # TF32: about 2^-11 relative


def test_interpreter_multiplies_tf32x3_about_exactly(gen):
    """"tf32x3" (on a card: each fp32 operand split into its TF32 part and the rest, three TF32 products,
    about 2^-21 relative) is not read as "tf32": it comes out as the exact product, not one TF32 product."""
    a, b = (torch.randn(32, 32, generator=gen) for _ in range(2))
    out = {p: torch.full((32, 32), float("nan")) for p in ("tf32", "tf32x3")}
    for p, o in out.items():
        product[(1,)](a, b, o, N=32, PRECISION=p)
    exact = a.double() @ b.double()
    assert (out["tf32x3"].double() - exact).norm() < 1e-6 * exact.norm() < 1e-2 * (out["tf32"].double() - exact).norm()


@triton.jit
def to_bf16_kernel(x_ptr, y_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y_ptr + o, tl.load(x_ptr + o).to(tl.bfloat16))


def test_interpreter_rounds_fp32_to_bf16_as_a_card(gen):
    """A cast of fp32 to bf16 rounds to the nearest, ties to even, as a card and torch do: checked bit for bit
    against torch's ``x.to(torch.bfloat16)`` on values exactly halfway between two bf16 numbers (whose last kept
    bit is even and odd, of both signs), where rounding ties away from zero would differ, on random values of
    many scales, and on +-inf, +-0 and the largest fp32 (which rounds to inf); NaN stays NaN."""
    ties = [1 + 2**-8, 1 + 3 * 2**-8, 3 + 2**-7, 3 + 3 * 2**-7, 2**-100 * (1 + 2**-8), 1000 + 2]
    ties += [-t for t in ties]
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, torch.finfo(torch.float32).max]
    x = torch.cat([torch.tensor(ties + special), torch.randn(64, generator=gen) * 10.0 ** torch.randint(-20, 20, (64,),
                                                                                                   generator=gen)])
    x = x[:64].float()
    halfway = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert halfway[:len(ties)].all()                        # the ties are ties
    y = torch.zeros(64, dtype=torch.bfloat16)
    to_bf16_kernel[(1,)](x, y, N=64)
    nan = x.isnan()                                         # a NaN's payload bits are no one's contract
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int16), x[~nan].to(torch.bfloat16).view(torch.int16)), (x, y)


@triton.jit
def padded_sum_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, OTHER: tl.constexpr):
    """y = the sum of x's N entries, read as one padded block; OTHER gives the padding a value (0)."""
    o = tl.arange(0, BLOCK)
    if OTHER:
        b = tl.load(x_ptr + o, mask=o < N, other=0)
    else:
        b = tl.load(x_ptr + o, mask=o < N)
    tl.store(y_ptr, tl.sum(b.to(tl.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32])
def test_interpreter_leaves_masked_off_lanes_undefined_as_a_card(dtype):
    """A masked load without ``other`` gets NaN (integers: their largest value) in its masked-off lanes, which
    a card leaves undefined and the bare interpreter fills with 0: a sum over them shows it."""
    x, y = (torch.rand(20) * 10).to(dtype), torch.zeros(1)
    padded_sum_kernel[(1,)](x, y, 20, BLOCK=32, OTHER=True)
    torch.testing.assert_close(y[0], x.float().sum())
    padded_sum_kernel[(1,)](x, y, 20, BLOCK=32, OTHER=False)   # 12 lanes a card leaves undefined
    assert not torch.isfinite(y[0]) if dtype.is_floating_point else y[0] > 1e9


@triton.jit
def outer_product_kernel(a_ptr, b_ptr, y_ptr, INNER: tl.constexpr):
    """y = a b^T as one tl.dot of a [16, INNER] by an [INNER, 16] tile (INNER = 1: a column by a row)."""
    r, c = tl.arange(0, 16), tl.arange(0, INNER)
    a = tl.load(a_ptr + r[:, None] * INNER + c[None, :])
    b = tl.load(b_ptr + c[:, None] * 16 + r[None, :])
    tl.store(y_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b, input_precision="ieee"))


def test_interpreter_refuses_a_dot_a_card_cannot_compile():
    """A card's compiler needs tl.dot's inner dimension >= 16; the bare interpreter takes 1, so a kernel
    (a graded exercise's) could pass here and fail to build on a GPU. Here it fails as on the card."""
    for inner in (16, 1):
        a, b, y = torch.randn(16, inner), torch.randn(inner, 16), torch.zeros(16, 16)
        if inner == 16:
            outer_product_kernel[(1,)](a, b, y, INNER=inner)
            torch.testing.assert_close(y, a @ b)
        else:
            with pytest.raises(Exception, match="K >= 16"):
                outer_product_kernel[(1,)](a, b, y, INNER=inner)


@triton.jit
def descriptor_copy_kernel(x_ptr, y_ptr, N: tl.constexpr):
    """y = 2 x through tensor descriptors (the interpreter's load passes its options as keywords)."""
    src = tl.make_tensor_descriptor(x_ptr, shape=[N, N], strides=[N, 1], block_shape=[16, 16])
    dst = tl.make_tensor_descriptor(y_ptr, shape=[N, N], strides=[N, 1], block_shape=[16, 16])
    dst.store([0, 0], src.load([0, 0]) * 2)


def test_interpreter_as_a_card_runs_tensor_descriptors():
    """Triton steers kernels from block pointers to tensor descriptors; the card-like masked load must take
    the keyword options a descriptor's load passes."""
    x, y = torch.randn(16, 16), torch.zeros(16, 16)
    descriptor_copy_kernel[(1,)](x, y, N=16)
    torch.testing.assert_close(y, 2 * x)


@pytest.mark.parametrize("mode", MODES)
def test_tf32_inverse_of_16_bit_inputs_costs_no_accuracy(gen, mode, monkeypatch):
    """For bf16 inputs the delta rule builds R = (I + Diag(beta) L)^{-1} with TF32 products (and takes dA's
    product with it in TF32): outputs and every gradient are as close to the fp64 result as with exact
    products, since R is rounded to bf16 right after."""
    import atlaslib.delta.kernel as delta_kernel
    from atlaslib.core.kernels import intermediate_precision, precision
    assert intermediate_precision(torch.bfloat16) == intermediate_precision(torch.float16) == "tf32"
    assert intermediate_precision(torch.float32) == precision(torch.float32)
    q, k, v, alpha, beta, h0 = inputs(gen, 2 * CHUNK, mode, K=64, V=32)
    beta = 0.5 + 0.5 * beta                                 # strong corrections: R far from I
    ref = [None if x is None else x.double().requires_grad_() for x in (q, k, v, alpha, beta)]
    ref_o = delta_rule(*ref[:3], ref[4], alpha=ref[3], backend="chunk")[0]
    do = torch.randn(ref_o.shape, generator=gen, dtype=torch.float64)
    names = [n for n, x in zip(["o", "q", "k", "v", "alpha", "beta"], [ref_o, *ref]) if x is not None]
    wanted = [x for x in ref if x is not None]
    ref_g = torch.autograd.grad(ref_o, wanted, do)
    ref_o = ref_o.detach()
    errors, outputs = {}, {}
    for p in ("ieee", "tf32"):
        monkeypatch.setattr(delta_kernel, "intermediate_precision", lambda dtype, p=p: p)
        x = [None if t is None else t.detach().to(torch.bfloat16 if i < 3 else torch.float32).requires_grad_()
             for i, t in enumerate(ref)]
        o = delta_rule(*x[:3], x[4], alpha=x[3], backend="triton")[0]
        grads = torch.autograd.grad(o, [t for t in x if t is not None], do.to(o.dtype))
        outputs[p] = o.detach()
        errors[p] = [float((a.double() - b).norm() / b.norm()) for a, b in zip((o.detach(), *grads), (ref_o, *ref_g))]
    assert not torch.equal(outputs["tf32"], outputs["ieee"]), "the TF32 products did not reach the kernel"
    for name, e_tf32, e_ieee in zip(names, errors["tf32"], errors["ieee"]):
        assert e_tf32 <= 1.1 * e_ieee, f"{name}: {e_tf32:.2e} (TF32 inverse) vs {e_ieee:.2e} (exact)"


def test_16_bit_inputs_multiply_no_fp32_tiles_exactly(gen, monkeypatch):
    """With bf16 inputs, every tl.dot that chapters 1-2's kernels run, forward and backward in every gate
    mode, takes bf16 tiles, except the delta rule's triangular inverse and dA's product with it, which
    take fp32 tiles in TF32: no product runs as exact fp32 (on CUDA cores rather than tensor cores)."""
    from triton.runtime import interpreter
    from atlaslib.core import random_gate
    from atlaslib.linear import linear_attention
    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    dot, call, kernel, seen = builder.create_dot, executor.__call__, [None], set()

    def recording_call(self, *args, **kwargs):
        kernel[0] = self.fn.__name__
        return call(self, *args, **kwargs)

    def recording_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        seen.add((kernel[0], str(a.dtype), str(b.dtype), getattr(input_precision, "name", str(input_precision))))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(executor, "__call__", recording_call)
    monkeypatch.setattr(builder, "create_dot", recording_dot)
    for model in ("linear", "delta"):
        for mode in MODES:
            q, k, v = (x.bfloat16().requires_grad_() for x in random_qkv(1, 2, CHUNK + 9, 32, 16, generator=gen))
            shape = (1, 2, CHUNK + 9) + ((32,) if mode == "channel" else ())
            logs = None if mode is None else random_gate(*shape, generator=gen).log().requires_grad_()
            beta = torch.rand(1, 2, CHUNK + 9, generator=gen).requires_grad_()
            if model == "linear":
                o = linear_attention(q, k, v, log_alpha=logs, backend="triton")[0]
            else:
                o = delta_rule(q, k, v, beta, log_alpha=logs, backend="triton")[0]
            o.float().square().sum().backward()
    fp32 = {(name, p) for name, a, b, p in seen if a == b == "fp32"}
    assert {(name, a, b) for name, a, b, _ in seen if "fp32" in (a, b) and a != b} == set()
    assert fp32 == {("delta_wy_kernel", "TF32"), ("delta_bwd_wy_kernel", "TF32")}, fp32
    assert {name for name, a, _, _ in seen if a == "bf16"} >= {"chunk_state_kernel", "chunk_output_kernel",
                                                               "delta_wy_kernel", "delta_bwd_wy_kernel"}


@pytest.mark.parametrize("model", ["linear", "delta"])
def test_bf16_inputs_keep_an_fp32_final_state(gen, model):
    # the final state is fp32 whatever the inputs (stored from the running fp32 state, not from the bf16 chunk
    # states): with no gate and beta = 0 for the delta rule (M_T = M_0 + sum_t v_t k_t^T: bf16 products exact in
    # fp32), it keeps fp32's digits, where one bf16 rounding costs 1e-3
    q, k, v = (x.bfloat16() for x in random_qkv(1, 2, CHUNK + 9, 16, 16, generator=gen))
    h0 = torch.randn(1, 2, 16, 16, generator=gen) / 16
    if model == "linear":
        _, s = linear_attention(q, k, v, initial_state=h0, output_final_state=True, backend="triton")
        want = h0.double() + v.double().mT @ k.double()
    else:
        _, s = delta_rule(q, k, v, 0.0, initial_state=h0, output_final_state=True, backend="triton")
        want = h0.double()
    assert s.dtype == torch.float32
    assert_close(s.double(), want, tol=1e-6, name="final state")
