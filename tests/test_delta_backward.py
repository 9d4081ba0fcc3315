"""Chapter 2's backward kernels (DeltaNet, Gated DeltaNet, KDA) under Triton's interpreter.

``delta_rule(..., backend="triton")`` differentiates through ``delta.kernel.DeltaRuleFunction``:
recomputed WY factors and chunk states, the reverse state pass and the per-chunk gradient kernels.
Its gradients of q, k, v, beta, the gates and the initial state are checked against autograd
through two independent references on fresh random inputs: the per-token loop in fp64 and the
chunk form in fp64. The inputs cover what the kernels treat specially: T not a multiple of the
chunk of 64 (a partial last chunk and two chunks of state passing), K != V, gates exactly 0 and 1,
beta across [0, 2] including both ends, an initial state and a gradient of the final state.
"""
import pytest
import torch

from atlaslib.core import assert_close, poisoned_outputs, random_gate, random_qkv
from atlaslib.delta import BETA_MAX, delta_rule

MODES = [None, "scalar", "channel"]
NAMES = ("q", "k", "v", "beta", "alpha", "h0")


def extreme_inputs(gen, B, H, T, K, V, mode, dtype=torch.float32):
    """Random inputs with a few gates exactly 0 and many exactly 1, and beta spanning [0, 2] with both ends."""
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    beta = BETA_MAX * torch.rand(B, H, T, generator=gen)
    beta[..., 3], beta[..., T // 2] = 0.0, BETA_MAX
    alpha = None
    if mode is not None:
        alpha = random_gate(B, H, T, K if mode == "channel" else None, low=0.5, generator=gen)
        ones = torch.rand(alpha.shape, generator=gen) < 0.3
        alpha = torch.where(ones, torch.ones_like(alpha), alpha)
        alpha[:, :, T - 5] = 0.0                      # a full reset (every channel) late in the sequence
        if mode == "channel":
            alpha[:, :, T // 6, : K // 2] = 0.0       # and half the channels early on
    h0 = torch.randn(B, H, V, K, generator=gen)
    return [x if x is None else x.to(dtype) for x in (q, k, v, beta, alpha, h0)]


def gradients(backend, inputs, weights, dtype=None, **kw):
    """(o, final state, gradients of every given input) of sum(o * W_o) + sum(state * W_s)."""
    leaves = [None if x is None else (x if dtype is None else x.to(dtype)).clone().requires_grad_(True)
              for x in inputs]
    q, k, v, beta, alpha, h0 = leaves
    o, s = delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, output_final_state=True, backend=backend, **kw)
    w_o, w_s = weights
    loss = (o * w_o.to(o.dtype)).sum() if w_o is not None else 0.0
    (loss + (s * w_s.to(s.dtype)).sum()).backward()
    return o.detach(), s.detach(), [None if x is None else x.grad for x in leaves]


def compare(got, ref, tol, skip_alpha=None):
    for name, g, r in zip(NAMES, got, ref):
        if r is None:
            continue
        if name == "alpha" and skip_alpha is not None:
            # a gate of exactly 0 is clamped to e^-60 before its log: its own gradient is 0 there,
            # where the loop, which multiplies by alpha, has a nonzero one
            g, r = g[~skip_alpha], r[~skip_alpha]
        assert_close(g.double(), r, tol=tol, name=f"grad {name}")


@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_the_loop_and_the_chunk_form(gen, mode):
    """fp32 kernels against fp64 autograd through the per-token loop and through the chunk form:
    T = 70 (two chunks, the second partial), K = 16 != V = 24, extreme gates and betas, h0, d(final state)."""
    B, H, T, K, V = 1, 2, 70, 16, 24
    inputs = extreme_inputs(gen, B, H, T, K, V, mode)
    weights = (torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen))
    with poisoned_outputs():
        o, s, got = gradients("triton", inputs, weights)
    zeros = None if mode is None else inputs[4] == 0
    o_ref, s_ref, loop = gradients("recurrent", inputs, weights, torch.float64)
    assert_close(o.double(), o_ref, tol=1e-5)
    assert_close(s.double(), s_ref, tol=1e-5, name="final state")
    compare(got, loop, 1e-4, zeros)
    _, _, chunk = gradients("chunk", inputs, weights, torch.float64, chunk_size=16)
    compare(got, chunk, 1e-4, zeros)


@pytest.mark.parametrize("mode", ["scalar", "channel"])
def test_two_key_blocks(gen, mode):
    """K = 80: the state kernels' programs split the keys in two blocks of 64 (the second partial), each
    writing its own share of dq, dk, dw and of the log-gates' gradient (per-channel gates: each block's dS
    terms in the sub-chunk kernel, the last rows' terms from the state kernel)."""
    B, H, T, K, V = 1, 1, 70, 80, 24
    inputs = extreme_inputs(gen, B, H, T, K, V, mode)
    weights = (torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen))
    with poisoned_outputs():
        _, _, got = gradients("triton", inputs, weights)
    _, _, ref = gradients("chunk", inputs, weights, torch.float64, chunk_size=16)
    compare(got, ref, 1e-4, inputs[4] == 0)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_inputs_against_an_fp32_reference(gen, mode):
    """bf16 q, k, v (products on bf16 tiles, fp32 sums) against the loop on the same rounded inputs in fp64."""
    B, H, T, K, V = 1, 1, 40, 32, 16
    inputs = extreme_inputs(gen, B, H, T, K, V, mode)
    inputs[:3] = [x.bfloat16() for x in inputs[:3]]
    weights = (torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen))
    o, _, got = gradients("triton", inputs, weights)
    assert o.dtype == torch.bfloat16 and all(g.dtype == x.dtype for g, x in zip(got, inputs) if x is not None)
    _, _, ref = gradients("recurrent", inputs, weights, torch.float64)
    compare(got, ref, 2e-2, None if mode is None else inputs[4] == 0)


@pytest.mark.parametrize("mode", [None, "channel"])
def test_bf16_in_several_key_and_value_blocks(gen, mode):
    """K = 80, V = 100: the WY backward walks 16-bit inputs in blocks of 32 channels (three key blocks and
    four value blocks, the last of each partial), the state kernels in blocks of 64 and the intra-chunk dv
    kernel in one value block of 128 (``chunk_value_tiles``)."""
    B, H, T, K, V = 1, 1, 70, 80, 100
    inputs = extreme_inputs(gen, B, H, T, K, V, mode)
    inputs[:3] = [x.bfloat16() for x in inputs[:3]]
    weights = (torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen))
    _, _, got = gradients("triton", inputs, weights)
    _, _, ref = gradients("recurrent", inputs, weights, torch.float64)
    compare(got, ref, 2e-2, None if mode is None else inputs[4] == 0)


def test_only_the_final_state_is_used(gen):
    """Truncated BPTT: the outputs unused (their gradient never materialised), the final state's given."""
    inputs = extreme_inputs(gen, 1, 2, 70, 16, 8, "scalar")
    weights = (None, torch.randn(1, 2, 8, 16, generator=gen))
    _, _, got = gradients("triton", inputs, weights)
    _, _, ref = gradients("recurrent", inputs, weights, torch.float64)
    compare(got, ref, 1e-4, inputs[4] == 0)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_on_tiny_shapes(gen, mode):
    """``torch.autograd.gradcheck`` on the kernels. They compute in fp32 and refuse fp64, so the
    function checked takes fp64 inputs, runs the kernels on fp32 copies and returns fp64: finite
    differences of step 1e-2 (truncation error ~1e-4) against the fp32 backward, with tolerances
    sized for fp32 rounding. ``fast_mode`` (one random direction each way) on every input packed
    into one vector and both results into another: a few forward and backward passes in all,
    where the full Jacobian would take a forward pass per input element in the interpreter."""
    B, H, T, K, V = 1, 1, 6, 4, 3
    q, k, v, beta, _, h0 = extreme_inputs(gen, B, H, T, K, V, None, dtype=torch.float64)
    beta = beta.clamp(0.1, 1.9)                        # keep the finite differences inside the valid range
    # log-gates at most log 0.95, so that a step of the finite differences stays <= 0
    log_alpha = None if mode is None else random_gate(B, H, T, K if mode == "channel" else None, low=0.5,
                                                      high=0.95, generator=gen, dtype=torch.float64).log()
    parts = [x for x in (q, k, v, beta, h0, log_alpha) if x is not None]

    def f(x):
        pieces = iter(torch.split(x.float(), [p.numel() for p in parts]))
        q, k, v, beta, h0, *la = (next(pieces).view(p.shape) for p in parts)
        o, s = delta_rule(q, k, v, beta, log_alpha=la[0] if la else None, initial_state=h0,
                          output_final_state=True, backend="triton")
        return torch.cat([o.flatten(), s.flatten()]).double()

    x = torch.cat([p.flatten() for p in parts]).requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x,), eps=1e-2, atol=2e-3, rtol=1e-2, fast_mode=True)


def test_views_and_torch_func(gen):
    """q, k, v as [B, T, H, K] tensors transposed (as the mixers pass them) give the contiguous
    inputs' gradients, and ``torch.func.grad`` runs through the autograd Function."""
    B, H, T, K, V = 1, 2, 20, 16, 8
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in random_qkv(B, H, T, K, V, generator=gen))
    assert not q.is_contiguous()
    beta = torch.rand(B, H, T, generator=gen)
    w = torch.randn(B, H, T, V, generator=gen)

    def loss(q, k, v):
        return (delta_rule(q, k, v, beta, backend="triton")[0] * w).sum()
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [x.contiguous().requires_grad_(True) for x in (q, k, v)]
    loss(*leaves).backward()
    for g, x in zip(grads, leaves):
        torch.testing.assert_close(g, x.grad)
    ref = [x.double().requires_grad_(True) for x in (q, k, v)]
    (delta_rule(*ref, beta.double(), backend="recurrent")[0] * w.double()).sum().backward()
    for g, x in zip(grads, ref):
        assert_close(g.double(), x.grad, tol=1e-4)


@pytest.mark.parametrize("V", [16, 40])
@pytest.mark.parametrize("mode", ["scalar", "channel"])
def test_gated_delta_gradients_with_mild_gates(gen, mode, V):
    # gates in [0.97, 1]: the chunk's whole decay e^{g_n} ~ e^-0.6, so the gradient of g_n through the
    # decayed start state, <dH, h[c]> e^{g_n}, is a visible part of every token's gate gradient (with
    # harsher gates e^{g_n} ~ 1e-6 hides it). V = 40: fp32 state kernels sum <dH, h[c]> over value blocks
    # of 32 (``core.chunk_backward.state_grad_tiles``), the second one partial
    B, H, T, K = 1, 1, 40, 16
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    beta = torch.rand(B, H, T, generator=gen)
    shape = (B, H, T) if mode == "scalar" else (B, H, T, K)
    log_alpha = (0.97 + 0.03 * torch.rand(*shape, generator=gen)).log()
    h0 = torch.randn(B, H, V, K, generator=gen)
    do, dht = torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen)
    grads = []
    for backend, dtype in (("triton", torch.float32), ("recurrent", torch.float64)):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, beta, log_alpha, h0)]
        o, s = delta_rule(*xs[:4], log_alpha=xs[4], initial_state=xs[5], output_final_state=True,
                          backend=backend)
        ((o.double() * do.double()).sum() + (s.double() * dht.double()).sum()).backward()
        grads.append([x.grad for x in xs])
    for name, got, want in zip(("q", "k", "v", "beta", "log_alpha", "h0"), *grads):
        assert_close(got.double(), want, tol=1e-5, name=f"{name} gradient")


@pytest.mark.parametrize("mode", MODES)
def test_views_of_beta_and_the_initial_state(gen, mode):
    # the DeltaNet mixers hand beta over as a [B, T, H] projection transposed, a non-contiguous [B, H, T] view;
    # the backward recomputes the WY factors and the state pass from beta and h0 and must read such views
    B, H, T, K, V = 2, 2, 70, 12, 10
    inputs = extreme_inputs(gen, B, H, T, K, V, mode)
    inputs[3] = inputs[3].transpose(1, 2).contiguous().transpose(1, 2)
    inputs[5] = inputs[5].mT.contiguous().mT
    weights = (torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen))
    leaves = [None if x is None else x.clone().requires_grad_(True) for x in inputs]
    assert not leaves[3].is_contiguous() and not leaves[5].is_contiguous()       # clone keeps the strides
    q, k, v, beta, alpha, h0 = leaves
    o, s = delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, output_final_state=True, backend="triton")
    ((o * weights[0]).sum() + (s * weights[1]).sum()).backward()
    _, _, ref = gradients("recurrent", inputs, weights, torch.float64)
    compare([None if x is None else x.grad for x in leaves], ref, 1e-4, None if mode is None else inputs[4] == 0)


@pytest.mark.parametrize("mode", ["scalar", "channel"])
def test_fp32_gradients_keep_fp32s_digits_with_resets(gen, mode):
    # the backward must sum the log-gates within a chunk as the forward does (fp64 for fp32 inputs): with a quarter
    # of the gates at exactly 0 (log clamped to -60) fp32 sums would cost 1e-5; the fp32 gradients stay within
    # 1e-6 of the fp64 loop (5e-6 for the gates' own)
    B, H, T, K, V = 1, 2, 96, 8, 8
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    shape = (B, H, T) if mode == "scalar" else (B, H, T, K)
    alpha = 0.3 + 0.7 * torch.rand(*shape, generator=gen)
    alpha = torch.where(torch.rand(*shape, generator=gen) < 0.25, torch.zeros(()), alpha)
    beta = torch.rand(B, H, T, generator=gen)
    inputs = [q, k, v, beta, alpha, None]
    weights = (torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen))
    _, _, got = gradients("triton", inputs, weights)
    _, _, ref = gradients("recurrent", inputs, weights, torch.float64)
    for name, g, r in zip(NAMES[:4], got, ref):
        assert_close(g.double(), r, tol=1e-6, name=f"grad {name}")
    keep = alpha != 0                     # a gate of exactly 0 has no gradient in the chunk forms (documented)
    assert_close(got[4][keep].double(), ref[4][keep], tol=5e-6, name="grad alpha")
