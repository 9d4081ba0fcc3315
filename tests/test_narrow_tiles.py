"""The narrower tiles the kernels take on a card with less shared memory than an A100.

Consumer cards (RTX 3090 / 4090 / 5090) let a program use 99 KB of shared memory, an A100 163 KB.
Under ``core.kernels.assume_shared_memory(99 KB)`` the wrappers choose the tiles they would choose
on such a card, whatever the device; here, under TRITON_INTERPRET=1, those tiles run on fresh random
inputs against the per-token loops (fp64) and the chunk forms, forward and backward. Each test also
reads the launches to see that the narrow tiles were really taken (and the full ones without the
context), so a rule that never fires cannot pass. ``tests/test_aot.py`` builds the same tiles for sm_86.
"""
import pytest
import torch

from atlaslib import aot
from atlaslib.core import assert_close, kernels, poisoned_outputs, random_gate, random_qkv
from atlaslib.delta import delta_rule
from atlaslib.delta.kernel import delta_rule_backward
from atlaslib.linear import linear_attention
from atlaslib.omega import swla

CONSUMER = 99 * 1024          # an RTX 3090's opt-in shared memory a program


def launches_of(call):
    """{kernel name: the keyword arguments of its first launch}, running nothing."""
    return {name: ls[0].kwargs for name, ls in aot.by_kernel(aot.captured_launches(call)).items()}


def test_the_card_decides_and_the_context_overrides(monkeypatch):
    x = torch.zeros(1)
    assert kernels.shared_memory(x.device) == kernels.FULL_SHARED_MEMORY and not kernels.narrow_tiles(x)
    with kernels.assume_shared_memory(CONSUMER):
        assert kernels.shared_memory(x.device) == CONSUMER and kernels.narrow_tiles(x)
    with kernels.assume_shared_memory(kernels.FULL_SHARED_MEMORY):
        assert not kernels.narrow_tiles(x)
    assert not kernels.narrow_tiles(x)                       # the context is undone
    # on a card: what Triton checks at launch (the opt-in maximum per block), asked once per card
    asked = []
    monkeypatch.setattr("triton.compiler.max_shared_mem", lambda index: asked.append(index) or 101376 + index)
    kernels._card_shared_memory.cache_clear()
    try:
        assert kernels.shared_memory(torch.device("cuda", 1)) == 101377
        assert kernels.shared_memory(torch.device("cuda", 1)) == 101377
        assert kernels.shared_memory(torch.device("cuda", 0)) == 101376
        assert asked == [1, 0]
    finally:
        kernels._card_shared_memory.cache_clear()


def chapter_inputs(gen, T, K, V, mode):
    q, k, v = random_qkv(1, 1, T, K, V, generator=gen)
    alpha = None if mode is None else random_gate(1, 1, T, K if mode == "channel" else None, low=0.5, generator=gen)
    beta = torch.rand(1, 1, T, generator=gen)
    h0 = torch.randn(1, 1, V, K, generator=gen) / K
    return [q, k, v, beta, alpha, h0]


def run(model, backend, inputs, w_o, w_s):
    """(o, final state, gradients) of sum(o * w_o) + sum(state * w_s)."""
    leaves = [None if x is None else x.clone().requires_grad_(True) for x in inputs]
    q, k, v, beta, alpha, h0 = leaves
    if model == "linear":
        o, s = linear_attention(q, k, v, alpha=alpha, initial_state=h0, output_final_state=True, backend=backend)
    else:
        o, s = delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, output_final_state=True, backend=backend)
    ((o * w_o.to(o.dtype)).sum() + (s * w_s.to(s.dtype)).sum()).backward()
    grads = [None if x is None else x.grad for x in leaves]
    if model == "linear":
        grads[3] = None
    return o.detach(), s.detach(), grads


@pytest.mark.parametrize("model", ["linear", "delta"])
@pytest.mark.parametrize("mode", [None, "scalar", "channel"])
def test_fp32_kernels_step_through_32_keys_and_match_the_loop(gen, model, mode):
    # K = 40: one key block of 64 on a full card, two of 32 (the second 8 wide) on a narrow one
    T, K, V = 64 + 5, 40, 24
    inputs = chapter_inputs(gen, T, K, V, mode)
    w_o, w_s = torch.randn(1, 1, T, V, generator=gen), torch.randn(1, 1, V, K, generator=gen)
    call = lambda: run(model, "triton", inputs, w_o, w_s)  # noqa: E731
    assert launches_of(call)["chunk_output_kernel"]["BK"] == 64
    with kernels.assume_shared_memory(CONSUMER):
        tiles = launches_of(call)
        assert tiles["chunk_output_kernel"]["BK"] == 32
        if model == "delta":
            assert tiles["delta_wy_kernel"]["BK"] == 32
        with poisoned_outputs():
            o, s, grads = call()
    ref = run(model, "recurrent", [None if x is None else x.double() for x in inputs], w_o.double(), w_s.double())
    assert_close(o.double(), ref[0], tol=1e-5)
    assert_close(s.double(), ref[1], tol=1e-5, name="final state")
    for name, g, r in zip(("q", "k", "v", "beta", "alpha", "h0"), grads, ref[2]):
        if r is not None:
            assert_close(g.double(), r, tol=1e-4, name=f"grad {name}")


def test_16_bit_inputs_keep_their_key_blocks():
    # the 16-bit builds fit a 99 KB card as they are (sm_86): only fp32 takes the narrow tiles
    q, k, v = (x.bfloat16() for x in random_qkv(1, 1, 70, 40, 24))
    with kernels.assume_shared_memory(CONSUMER):
        tiles = launches_of(lambda: linear_attention(q, k, v, alpha=torch.rand(1, 1, 70, 40).bfloat16() / 2 + 0.5,
                                                     backend="triton"))
    assert tiles["chunk_output_kernel"]["BK"] == 64


@pytest.mark.parametrize("mode", [None, "channel"])
def test_the_delta_rules_reverse_pass_holds_32_values_and_matches_the_chunk_form(gen, mode):
    # K = 100: rows of 128 fp32 keys, where the reverse pass holds 64 value channels on a full card, 32 on a
    # narrow one (V = 40: two value blocks, the second 8 wide)
    T, K, V = 64 + 3, 100, 40
    inputs = chapter_inputs(gen, T, K, V, mode)
    w_o, w_s = torch.randn(1, 1, T, V, generator=gen), torch.randn(1, 1, V, K, generator=gen)

    q, k, v, beta, alpha, h0 = inputs
    logs = None if alpha is None else torch.log(alpha)
    backward = lambda: delta_rule_backward(w_o, w_s, q, k, v, beta, logs, h0)  # noqa: E731
    forward = lambda: delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, backend="triton")  # noqa: E731
    assert launches_of(backward)["chunk_dstate_kernel"]["BV"] == launches_of(forward)["chunk_state_kernel"]["BV"] == 64
    with kernels.assume_shared_memory(CONSUMER):
        assert launches_of(backward)["chunk_dstate_kernel"]["BV"] == 32
        assert launches_of(forward)["chunk_state_kernel"]["BV"] == 32            # the forward's pass too
        with poisoned_outputs():
            o, s, grads = run("delta", "triton", inputs, w_o, w_s)
    ref = run("delta", "chunk", [None if x is None else x.double() for x in inputs], w_o.double(), w_s.double())
    assert_close(o.double(), ref[0], tol=1e-5)
    assert_close(s.double(), ref[1], tol=1e-5, name="final state")
    for name, g, r in zip(("q", "k", "v", "beta", "alpha", "h0"), grads, ref[2]):
        if r is not None:
            assert_close(g.double(), r, tol=1e-4, name=f"grad {name}")


def test_swla_takes_chunks_of_16_on_a_narrow_card_and_stays_exact(gen):
    # SWLA's chunk form is exact for every chunk length; at b = 64, c = 8 its window tile needs 104 KB (fp32)
    T, D, c = 64 + 9, 24, 8
    q, k, v = random_qkv(1, 2, T, D, D, generator=gen)
    gamma = 0.5 + 0.5 * torch.rand(1, 2, T, c, generator=gen)
    alpha = random_gate(1, 2, T, None, low=0.8, generator=gen)
    call = lambda: swla(q, k, v, window=c, gamma=gamma, alpha=alpha, backend="triton", chunk_size=64)  # noqa: E731
    assert launches_of(call)["omega_fwd_kernel"]["BT"] == 64
    with kernels.assume_shared_memory(CONSUMER):
        assert launches_of(call)["omega_fwd_kernel"]["BT"] == 16
        with poisoned_outputs():
            y, _ = call()
    f = lambda x: x.double()  # noqa: E731
    ref, _ = swla(f(q), f(k), f(v), window=c, gamma=f(gamma), alpha=f(alpha), backend="recurrent")
    assert_close(y.double(), ref, tol=1e-5)
