"""The launch set-up every chapter's kernel shares (atlaslib.core.kernels), under TRITON_INTERPRET=1.

Checked for each kernel (linear attention in its three gate modes, the delta rule in its three,
Omega, SWLA, Titans, chapter 6's DeepTransformer): inputs that are views, not contiguous
tensors, give the same outputs bit for bit as their contiguous copies and match the chunk
form; the views reach the kernel
as they are (same storage and strides, no copy), and absent inputs reach it as None. Layouts:
[B, T, H, K] transposed to [B, H, T, K] (what the mixers hand in), q/k/v sliced out of one
fused projection, and channel-major heads ([B, H, K, T] transposed, channel stride != 1).
Also: the gate-mode names work on the host as ints, and the host-side checks of
``forward_launch`` (fp64, heads too long for 32-bit offsets).
"""
import pytest
import torch
import triton

from atlaslib import aot
from atlaslib.core import assert_close, poisoned_outputs
from atlaslib.core.kernels import (GATE_CHANNEL, GATE_NONE, GATE_SCALAR, MAX_HEAD_SPAN, dot_tile, feature_tile,
                                   forward_launch, gate_mode, value_tile)
from atlaslib.deep import kernel_table
from atlaslib.deep.kernel import deep_kernel_triton
from atlaslib.delta.chunk import delta_rule_chunk
from atlaslib.delta.kernel import delta_rule_triton
from atlaslib.linear.chunk import linear_attention_chunk
from atlaslib.linear.kernel import linear_attention_triton
from atlaslib.miras import titans_linear_chunk
from atlaslib.miras.kernel import titans_linear_triton
from atlaslib.omega.chunk import omega_chunk, swla_chunk
from atlaslib.omega.kernel import omega_triton, swla_triton

B, H, T, K, V = 2, 3, 37, 12, 10
LAYOUTS = ["bthk", "fused", "channel_major"]


def views(gen, layout):
    """q, k [B, H, T, K] and v [B, H, T, V] as non-contiguous views of the given layout."""
    if layout == "bthk":           # x.view(B, T, H, -1).transpose(1, 2), as the mixers do
        make = lambda n: torch.randn(B, T, H, n, generator=gen).transpose(1, 2)  # noqa: E731
        q, k, v = make(K), make(K), make(V)
    elif layout == "fused":        # one projection [B, T, H, 2K + V], split along the features
        qkv = torch.randn(B, T, H, 2 * K + V, generator=gen).transpose(1, 2)
        q, k, v = qkv[..., :K], qkv[..., K:2 * K], qkv[..., 2 * K:]
    else:                          # heads stored [B, H, K, T]: the channel stride is T, not 1
        make = lambda n: torch.randn(B, H, n, T, generator=gen).transpose(2, 3)  # noqa: E731
        q, k, v = make(K), make(K), make(V)
    k = k / k.norm(dim=-1, keepdim=True)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    return q, k, v


def gates(gen, shape, low=0.6):
    return low + (1 - low) * torch.rand(*shape, generator=gen)


def cases(gen):
    """(name, kernel wrapper, chunk form, extra arguments after q, k, v, number of states)."""
    h0 = torch.randn(B, H, V, K, generator=gen) / K
    beta = torch.rand(B, H, T, generator=gen)
    yield "linear none", linear_attention_triton, linear_attention_chunk, (None, h0)
    yield "linear scalar", linear_attention_triton, linear_attention_chunk, (gates(gen, (B, H, T)), h0)
    yield "linear channel", linear_attention_triton, linear_attention_chunk, (gates(gen, (B, H, T, K)), h0)
    yield "delta none", delta_rule_triton, delta_rule_chunk, (beta, None, h0)
    yield "delta scalar", delta_rule_triton, delta_rule_chunk, (beta, gates(gen, (B, H, T)), h0)
    yield "delta channel", delta_rule_triton, delta_rule_chunk, (beta, gates(gen, (B, H, T, K)), h0)
    window, chunk_size = 4, 8
    hv = torch.randn(B, H, V, K, generator=gen) / K          # omega's state is [V, D] with D = K here
    omega_args = (window, gates(gen, (B, H, T)), gates(gen, (B, H, T)), 0.5 * torch.rand(B, H, T, generator=gen),
                  hv, chunk_size)
    yield "omega", omega_triton, omega_chunk, omega_args
    yield "swla", swla_triton, swla_chunk, omega_args
    titans_args = (gates(gen, (B, H, T), 0.8), 0.3 * torch.rand(B, H, T, generator=gen), gates(gen, (B, H, T), 0.0),
                   h0, 0.1 * h0, chunk_size)
    yield "titans", titans_linear_triton, titans_linear_chunk, titans_args
    deep_chunk = kernel_table(chunk_size)["chunk"]           # same arguments as deep_kernel_triton
    deep_gates = (gates(gen, (B, H, T)), 0.2 + torch.rand(B, H, T, generator=gen))
    yield "deep normalize", deep_kernel_triton, deep_chunk, (*deep_gates, None, window, True)
    yield "deep", deep_kernel_triton, deep_chunk, (*deep_gates, None, None, False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_give_the_contiguous_result_and_match_the_chunk_form(gen, layout):
    q, k, v = views(gen, layout)
    for name, kernel, chunk, extra in cases(gen):
        with poisoned_outputs():
            out = kernel(q, k, v, *extra)
            dense = kernel(q.contiguous(), k.contiguous(), v.contiguous(), *extra)
        ref = chunk(q.contiguous(), k.contiguous(), v.contiguous(), *extra)
        for i, (a, d, r) in enumerate(zip(out, dense, ref)):
            if r is None:                                     # no final state (chapter 6's kernel form)
                assert a is None and d is None, name
                continue
            what = f"{name}, {layout}: {'o' if i == 0 else f'state {i}'}"
            assert torch.equal(a, d), f"{what} differs from the kernel on contiguous copies"
            assert_close(a, r, tol=1e-5, name=what)
        assert out[0].is_contiguous()


@pytest.mark.parametrize("model", ["linear", "delta"])
@pytest.mark.parametrize("mode", [None, "scalar", "channel"])
def test_views_of_beta_gates_and_initial_state_in_the_forward(gen, model, mode):
    # the mixers hand beta and the gates over as [B, T, H(, K)] projections transposed, and an initial state may
    # be a transposed [B, H, K, V] tensor: the forward kernels read dense arrays, so the wrappers must copy them
    from atlaslib.delta import delta_rule
    from atlaslib.linear import linear_attention
    B, H, T, K, V = 1, 2, 70, 12, 10
    q, k, v = (torch.randn(B, H, T, n, generator=gen) for n in (K, K, V))
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.rand(B, T, H, generator=gen).transpose(1, 2)
    alpha = None if mode is None else (0.5 + 0.5 * torch.rand(B, T, H, *((K,) if mode == "channel" else ()),
                                                               generator=gen)).transpose(1, 2)
    h0 = (torch.randn(B, H, K, V, generator=gen) / K).mT
    assert not (beta.is_contiguous() or h0.is_contiguous() or (alpha is not None and alpha.is_contiguous()))

    def run(backend, *xs):
        q, k, v, beta, alpha, h0 = xs
        if model == "linear":
            return linear_attention(q, k, v, alpha=alpha, initial_state=h0, output_final_state=True, backend=backend)
        return delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, output_final_state=True, backend=backend)
    xs = (q, k, v, beta, alpha, h0)
    o, s = run("triton", *xs)
    ro, rs = run("recurrent", *(None if x is None else x.double() for x in xs))
    assert_close(o, ro, tol=1e-5, name="o")
    assert_close(s, rs, tol=1e-5, name="final state")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_reach_the_kernel_without_copies(gen, layout):
    q, k, v = views(gen, layout)
    for name, kernel, _, extra in cases(gen):
        launches = aot.captured_launches(lambda: kernel(q, k, v, *extra))
        if len(launches) == 1:
            (launch,) = launches
            for x, arg in zip((q, k, v), launch.args[:3]):
                assert arg is x, f"{name}: an input was copied or converted before the launch"
            strides = [a for a in launch.args if isinstance(a, tuple)]
            assert strides[:3] == [q.stride(), k.stride(), v.stride()], name
            continue
        # chapters 1-2: several kernels; every q, k, v they read is the view itself, with its strides
        read = set()
        for launch in launches:
            tensors = [a for a in launch.args if isinstance(a, torch.Tensor)]
            strides = [a for a in launch.args if isinstance(a, tuple)]
            for arg in tensors:
                if any(arg.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in (q, k, v)):
                    assert any(arg is x for x in (q, k, v)), f"{name}: an input was copied before the launch"
            for x in (q, k, v):
                if any(arg is x for arg in tensors):
                    read.add(id(x))
                    assert tuple(x.stride()) in strides, name
        assert {id(q), id(k)} <= read, name
        assert id(v) in read, name


def test_absent_inputs_reach_the_kernel_as_none(gen):
    q, k, v = views(gen, "bthk")
    beta = torch.rand(B, H, T, generator=gen)

    def tensor_or_none(launch):
        return [None if a is None else "t" for a in launch.args if a is None or isinstance(a, torch.Tensor)]

    state, output = aot.captured_launches(lambda: linear_attention_triton(q, k, v))
    assert tensor_or_none(state) == ["t", "t", None, None, None, "t", "t", None]     # w, g, h0, v_new
    assert tensor_or_none(output) == ["t", "t", "t", None, None, "t", "t"]           # g, A
    assert state.kwargs["GATE"] == output.kwargs["GATE"] == GATE_NONE
    wy, state, output = aot.captured_launches(lambda: delta_rule_triton(q, k, v, beta))
    assert tensor_or_none(wy) == ["t", "t", "t", None, None, "t", "t", None]         # g, A_kk, R
    assert tensor_or_none(state) == ["t", "t", "t", None, None, "t", "t", "t"]       # g, h0
    assert tensor_or_none(output) == ["t", "t", "t", None, None, "t", "t"]           # g, A
    launch = aot.captured(lambda: omega_triton(q, k, v, 3, chunk_size=8))
    assert tensor_or_none(launch) == ["t", "t", "t", "t", None, None, None, "t", "t"]  # eta, g, h0
    launch = aot.captured(lambda: deep_kernel_triton(q, k, v))
    assert tensor_or_none(launch) == ["t", "t", "t", None, None, "t"]                # g, eta
    launch = aot.captured(lambda: titans_linear_triton(q, k, v, chunk_size=8))
    assert tensor_or_none(launch) == ["t", "t", "t"] + [None] * 5 + ["t", "t", "t"]  # alpha .. S_0


def test_omega_without_eta_is_eta_one(gen):
    q, k, v = views(gen, "bthk")
    alpha = gates(gen, (B, H, T))
    with poisoned_outputs():
        o, s = omega_triton(q, k, v, 3, None, alpha, None, None, 8)
        o1, s1 = omega_triton(q, k, v, 3, None, alpha, torch.ones(B, H, T), None, 8)
    assert torch.equal(o, o1) and torch.equal(s, s1)


def test_gate_modes_are_constexpr_and_ints():
    import triton.language as tl
    assert all(isinstance(m, tl.constexpr) for m in (GATE_NONE, GATE_SCALAR, GATE_CHANNEL))
    modes = [gate_mode(None), gate_mode(torch.zeros(1, 1, 4)), gate_mode(torch.zeros(1, 1, 4, 2))]
    assert modes == [0, 1, 2] and all(type(m) is int for m in modes)
    assert modes[1] == GATE_SCALAR and modes[2] == GATE_CHANNEL and not modes[0] == GATE_SCALAR


def test_tiles():
    assert [dot_tile(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    assert value_tile(10, 64) == 16 and value_tile(100, 64) == 64 and value_tile(100, 32) == 32
    assert feature_tile(100, 256) == 128
    assert feature_tile(256, 256) == 256                  # the limit itself is inside it
    with pytest.raises(ValueError, match="K <= 256, got K=300"):
        feature_tile(300, 256)
    with pytest.raises(ValueError, match="K <= 256, got K=257"):
        feature_tile(257, 256)


@pytest.mark.parametrize("value, expected", [(None, "ieee"), ("0", "ieee"), ("", "ieee"), ("1", "tf32")])
def test_tf32_is_an_explicit_opt_in(monkeypatch, value, expected):
    """Only ATLASLIB_TF32=1 turns TF32 on: "0" or an empty value keep fp32 products exact."""
    from atlaslib.core.kernels import TF32_ENV, precision
    if value is None:
        monkeypatch.delenv(TF32_ENV, raising=False)
    else:
        monkeypatch.setenv(TF32_ENV, value)
    assert precision(torch.float32) == expected


def test_forward_launch_checks():
    q = torch.zeros(1, 2, 5, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        forward_launch(q, q, q, 16)
    # a [B, T, H, K] view whose one head spans 2^31 elements (T * H * K) is copied to [B, H, T, K]
    Tl, Hl, Kl = 2**20 + 1, 32, 64
    big = torch.empty(1, Tl, Hl, Kl, device="meta").transpose(1, 2)
    assert (Tl - 1) * Hl * Kl + Kl >= MAX_HEAD_SPAN
    run = forward_launch(big, big, big, 64)
    assert run.q.is_contiguous() and run.strides[0] == (Hl * Tl * Kl, Tl * Kl, Kl, 1)
    small = torch.empty(1, 2**10, Hl, Kl, device="meta").transpose(1, 2)
    assert forward_launch(small, small, small, 64).q is small
    # a head that spans 2^31 elements even when contiguous is refused
    huge = torch.empty(1, 1, 2**25, 64, device="meta")
    with pytest.raises(ValueError, match="32-bit offsets"):
        forward_launch(huge, huge, huge, 64)
    # T * K below 2^31, but not once T is padded to whole chunks of 64 (K not a power of two)
    T, K = 21474836, 100
    assert T * K < MAX_HEAD_SPAN <= triton.cdiv(T, 64) * 64 * K
    padded = torch.empty(1, 1, T, K, device="meta")
    with pytest.raises(ValueError, match="padded to a multiple of 64"):
        forward_launch(padded, padded, padded, 64)


def test_omega_kernel_refuses_window_gates_past_32_bit_offsets():
    """The gates [B*H, T, c] are read with 32-bit offsets inside a head: T * c must stay below 2^31 (T * K did)."""
    from atlaslib.omega.kernel import windowed_triton
    T, c = 2**25, 64
    x = torch.empty(1, 1, T, 4, device="meta")
    assert T * 4 < MAX_HEAD_SPAN <= T * c
    with pytest.raises(ValueError, match="T \\* window must be below 2\\^31"):
        windowed_triton(x, x, x, c)
