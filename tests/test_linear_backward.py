"""Linear attention's backward kernels (``linear.backward`` through ``LinearAttentionFunction``).

Under TRITON_INTERPRET=1 (compiled on a GPU through ``tests/test_gpu.py``), on fresh random inputs:
the gradients of q, k, v, the log-gates (or alpha) and the initial state from
``backend="triton"`` against autograd through the per-token loop in fp64 and through the chunk
form, with an initial state and a gradient of the final state, T not a multiple of the chunk,
K != V and widths past one key and one value block, gates exactly 0 and 1, bf16 inputs against
the fp32 loop at bf16 tolerance, and ``torch.autograd.gradcheck`` of the Function (in fp32: the
kernels accumulate in fp32 and refuse fp64, so finite differences use a step and tolerances an
fp32 function allows). Per-channel gates cost the most under the interpreter (sub-chunk loops),
so their cases are the fewest and smallest.
"""
import pytest
import torch

from atlaslib.caching import memory_caching
from atlaslib.core import assert_close, poisoned_outputs, random_qkv
from atlaslib.core.chunk_kernels import CHUNK
from atlaslib.delta import delta_rule
from atlaslib.linear import linear_attention
from atlaslib.linear.kernel import LinearAttentionFunction
from atlaslib.omega import omega_rule

MODES = [None, "scalar", "channel"]
NAMES = ("q", "k", "v", "gate", "initial state")


def draw(gen, T, mode, B=1, H=2, K=12, V=10, extreme=False):
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    shape = (B, H, T) if mode == "scalar" else (B, H, T, K)
    alpha = None if mode is None else 0.6 + 0.4 * torch.rand(*shape, generator=gen)
    if extreme and mode is not None:          # some gates exactly 0 (a reset) and exactly 1
        pick = torch.rand(*shape, generator=gen)
        alpha = torch.where(pick < 0.1, torch.zeros(()), torch.where(pick > 0.85, torch.ones(()), alpha))
    h0 = torch.randn(B, H, V, K, generator=gen) / K
    do = torch.randn(B, H, T, V, generator=gen)
    dht = torch.randn(B, H, V, K, generator=gen)
    return [q, k, v, alpha, h0], do, dht


def grads(backend, inputs, do, dht, dtype=None, as_log=True):
    """Gradients of <do, o> + <dht, final state> w.r.t. q, k, v, the gate (log_alpha or alpha), h0."""
    xs = [None if x is None else (x.to(dtype) if dtype is not None else x).detach().requires_grad_()
          for x in inputs]
    q, k, v, gate, h0 = xs
    kw = {"log_alpha": gate.log().clamp_min(-60.0).detach().requires_grad_()} if as_log and gate is not None \
        else {"alpha": gate}
    if as_log and gate is not None:
        xs[3] = kw["log_alpha"]
    o, s = linear_attention(q, k, v, initial_state=h0, output_final_state=True, backend=backend, **kw)
    loss = (o.double() * do.double()).sum() + (s.double() * dht.double()).sum()
    loss.backward()
    return [None if x is None else x.grad for x in xs]


def compare(got, ref, tol, what=""):
    for name, a, r in zip(NAMES, got, ref):
        if r is None:
            assert a is None, name
            continue
        assert torch.isfinite(a).all(), f"{what}{name}"
        assert_close(a.double(), r.double(), tol=tol, name=f"{what}{name} gradient")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", [1, CHUNK + 13])
def test_gradients_match_the_fp64_loop(gen, mode, T):
    inputs, do, dht = draw(gen, T, mode)
    with poisoned_outputs():
        got = grads("triton", inputs, do, dht)
    f64 = [None if x is None else x.double() for x in inputs]
    compare(got, grads("recurrent", f64, do, dht), tol=1e-5)
    compare(got, grads("chunk", inputs, do, dht), tol=1e-5, what="chunk form: ")


@pytest.mark.parametrize("mode", ["scalar", "channel"])
def test_wider_heads_than_one_block(gen, mode):
    # K = 80 and V = 72: two key blocks (dq, dk, the log-gate shares summed over them) and two value blocks
    inputs, do, dht = draw(gen, 40, mode, H=1, K=80, V=72)
    with poisoned_outputs():
        got = grads("triton", inputs, do, dht)
    compare(got, grads("recurrent", [None if x is None else x.double() for x in inputs], do, dht), tol=1e-5)


@pytest.mark.parametrize("mode", ["scalar", "channel"])
def test_gates_of_exactly_zero_and_one(gen, mode):
    # alpha itself gets the gradient: through log(max(alpha, e^-60)), so 0 where alpha = 0 (the
    # chunk form's convention); q, k, v and the initial state against the loop
    inputs, do, dht = draw(gen, CHUNK + 7, mode, H=1, extreme=True)
    assert (inputs[3] == 0).any() and (inputs[3] == 1).any()
    with poisoned_outputs():
        got = grads("triton", inputs, do, dht, as_log=False)
    f64 = [None if x is None else x.double() for x in inputs]
    loop = grads("recurrent", f64, do, dht, as_log=False)
    compare(got[:3] + [None, got[4]], loop[:3] + [None, loop[4]], tol=1e-5)
    chunk = grads("chunk", f64, do, dht, as_log=False)
    assert_close(got[3].double(), chunk[3], tol=5e-5, name="alpha gradient")     # fp32 sums of dB over T
    assert (got[3][inputs[3] == 0] == 0).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("V", [16, 100])
def test_bf16_inputs_within_bf16_rounding(gen, mode, V):
    # V = 100: the dv kernel's one value block of 128 channels (``chunk_value_tiles``), 28 of them masked
    inputs, do, dht = draw(gen, 40, mode, H=1, K=16, V=V)
    half = [x.bfloat16() if i < 3 else x for i, x in enumerate(inputs)]
    got = grads("triton", half, do, dht)
    assert all(g.dtype == torch.bfloat16 for g in got[:3])
    compare(got, grads("recurrent", [None if x is None else x.double() for x in inputs], do, dht), tol=2e-2)


def test_final_state_only_and_summed_outputs(gen):
    # a loss on the final state alone (no gradient reaches o) and one on o.sum() (an expanded do)
    (q, k, v, alpha, h0), _, dht = draw(gen, CHUNK + 3, "scalar")
    for backend in ("triton", "chunk"):
        xs = [x.detach().requires_grad_() for x in (q, k, v, alpha)]
        _, s = linear_attention(*xs[:3], alpha=xs[3], initial_state=h0, output_final_state=True, backend=backend)
        (s * dht).sum().backward()
        o, _ = linear_attention(*xs[:3], alpha=xs[3], backend=backend)
        o.sum().backward()
        if backend == "triton":
            got = [x.grad for x in xs]
    for name, a, r in zip(NAMES, got, [x.grad for x in xs]):
        assert_close(a, r, tol=1e-5, name=name)


@pytest.mark.parametrize("which", range(len(NAMES)), ids=NAMES)
def test_one_input_alone_gets_its_gradient(gen, which):
    # only one input requires grad (a frozen embedding's k and v, say): the Function must return that
    # input's gradient, selected by its own needs_input_grad, and it must be the fp64 loop's
    inputs, do, dht = draw(gen, CHUNK + 3, "scalar")
    inputs[3] = inputs[3].log()
    ref = []
    for backend, dtype in (("triton", torch.float32), ("recurrent", torch.float64)):
        xs = [x.detach().to(dtype).requires_grad_(i == which) for i, x in enumerate(inputs)]
        o, s = linear_attention(*xs[:3], log_alpha=xs[3], initial_state=xs[4], output_final_state=True,
                                backend=backend)
        ((o.double() * do.double()).sum() + (s.double() * dht.double()).sum()).backward()
        assert all(x.grad is None for i, x in enumerate(xs) if i != which)
        ref.append(xs[which].grad)
    got, want = ref
    assert got is not None, f"no gradient reached {NAMES[which]}"
    assert_close(got.double(), want, tol=1e-5, name=f"{NAMES[which]} gradient")


def test_kept_states_give_the_same_gradients(gen):
    (q, k, v, alpha, h0), do, dht = draw(gen, CHUNK + 3, "scalar")
    logs = alpha.log()
    out = []
    for keep in (False, True):
        xs = [x.detach().requires_grad_() for x in (q, k, v, logs, h0)]
        o, s, h = LinearAttentionFunction.apply(*xs, keep)
        assert (h is not None) == keep
        ((o * do).sum() + (s * dht).sum()).backward()
        out.append([x.grad for x in xs])
    for name, a, b in zip(NAMES, *out):
        assert torch.equal(a, b), name


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck(gen):
    # fp32 throughout (the kernels refuse fp64): central differences with a step of 1e-2 on
    # inputs of size ~1 are accurate to ~1e-4 here, rounding adds ~1e-7 / 1e-2
    inputs, _, _ = draw(gen, 20, "scalar", H=1, K=4, V=3)
    q, k, v, alpha, h0 = inputs
    xs = [x.detach().requires_grad_() for x in (q, k, v, alpha.log(), h0)]
    fn = lambda *a: LinearAttentionFunction.apply(*a, False)[:2]  # noqa: E731
    assert torch.autograd.gradcheck(fn, xs, eps=1e-2, atol=2e-3, rtol=2e-3, fast_mode=True)


@pytest.mark.parametrize("name", ["mamba2", "linear"])
def test_auto_on_cuda_trains_the_mixers_through_the_kernels(monkeypatch, name):
    # a mixer with backend="auto" on a (pretended) CUDA tensor runs the Function both ways, and its
    # gradients are those of the chunk form
    from atlaslib.nn import make_mixer
    x = torch.randn(1, 12, 16)
    mixer = make_mixer(name, 16, 2)
    ref = torch.autograd.grad(mixer(x.requires_grad_()).square().sum(), [x, *mixer.parameters()])
    calls = []
    apply = LinearAttentionFunction.apply
    monkeypatch.setattr(LinearAttentionFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    got = torch.autograd.grad(mixer(x).square().sum(), [x, *mixer.parameters()])
    assert calls
    for a, r in zip(got, ref):
        assert_close(a, r, tol=1e-5)


def test_torch_func_grad_reaches_the_kernels(gen):
    """``torch.func.grad`` through the Function gives autograd's gradients, and the fp64 loop's."""
    (q, k, v, alpha, h0), do, _ = draw(gen, 40, "scalar")

    def loss(q, k, v):
        return (linear_attention(q, k, v, alpha=alpha, initial_state=h0, backend="triton")[0] * do).sum()
    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    loss(*leaves).backward()
    for g, x in zip(got, leaves):
        torch.testing.assert_close(g, x.grad)
    ref = [x.double().requires_grad_(True) for x in (q, k, v)]
    (linear_attention(*ref, alpha=alpha.double(), initial_state=h0.double(), backend="recurrent")[0]
     * do.double()).sum().backward()
    for g, x in zip(got, ref):
        assert_close(g.double(), x.grad, tol=1e-4)


def test_bf16_state_pass_keeps_an_fp32_running_state(gen):
    # bf16 inputs, no gate: every product of two bf16 numbers is exact in fp32, so the final state
    # (h0 + sum_t v_t k_t^T, carried in registers across 4 chunks) matches fp64 to fp32 rounding; a
    # state rounded to bf16 between chunks would be off by ~2^-9
    B, H, T, K, V = 1, 2, 3 * CHUNK + 5, 16, 16
    q, k, v = (x.bfloat16() for x in random_qkv(B, H, T, K, V, generator=gen))
    h0 = torch.randn(B, H, V, K, generator=gen)
    with poisoned_outputs():
        _, s = linear_attention(q, k, v, initial_state=h0, output_final_state=True, backend="triton")
    _, ref = linear_attention(q.double(), k.double(), v.double(), initial_state=h0.double(),
                              output_final_state=True, backend="recurrent")
    assert s.dtype == torch.float32
    assert_close(s.double(), ref, tol=1e-5, name="final state")


def test_scalar_gate_gradients_with_batches_and_two_key_blocks(gen):
    # B = 2 and K = 80 (two key blocks of 64): the scalar log-gate shares of both key blocks of every
    # batch*head, against autograd through the fp64 loop
    B, H, T, K, V = 2, 1, 40, 80, 16
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    log_alpha = (0.6 + 0.4 * torch.rand(B, H, T, generator=gen)).log()
    h0 = torch.randn(B, H, V, K, generator=gen) / K
    do, dht = torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen)
    grads = []
    for backend, dtype in (("triton", torch.float32), ("recurrent", torch.float64)):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, log_alpha, h0)]
        o, s = linear_attention(*xs[:3], log_alpha=xs[3], initial_state=xs[4], output_final_state=True,
                                backend=backend)
        ((o.double() * do.double()).sum() + (s.double() * dht.double()).sum()).backward()
        grads.append([x.grad for x in xs])
    for name, got, want in zip(("q", "k", "v", "log_alpha", "h0"), *grads):
        assert_close(got.double(), want, tol=1e-5, name=f"{name} gradient")


SECOND_ORDER = {
    "linear_attention": lambda q, k, v, b: linear_attention(q, k, v, alpha=0.9, backend=b)[0],
    "delta_rule": lambda q, k, v, b: delta_rule(q, k, v, 0.5, backend=b)[0],
    "omega_rule": lambda q, k, v, b: omega_rule(q, k, v, window=2, eta=0.3, chunk_size=3, backend=b)[0],
}


@pytest.mark.parametrize("name", list(SECOND_ORDER))
def test_a_gradient_penalty_through_the_kernels_is_differentiated(gen, name):
    """create_graph=True through backend="triton": the gradients are differentiable (through the chunk form)
    and a penalty on them reaches q as it does through the chunk form (it used to be dropped silently: the
    kernels' gradients carried no graph). Chapter 1-2 kernels have their own backward; omega_rule's is
    chapter 1's generic ``ChunkBackward``."""
    q, k, v = random_qkv(1, 2, 9, 8, 8, generator=gen)

    def penalised(backend):
        x = q.clone().requires_grad_(True)
        o = SECOND_ORDER[name](x, k, v, backend)
        (gq,) = torch.autograd.grad(o.square().sum(), x, create_graph=True)
        assert gq.requires_grad, "the gradient carries no graph"
        (g,) = torch.autograd.grad(o.sum() + gq.square().sum(), x)
        return g
    assert_close(penalised("triton"), penalised("chunk"), tol=1e-5, name=f"{name}: d/dq of o + |do/dq|^2")


def unit(x):
    return torch.nn.functional.normalize(x, dim=-1)


ONE_TENSOR = {          # x is several inputs, or an input and the tensor another is made from
    "linear_attention, q = k": lambda x, v, b: linear_attention(x, x, v, alpha=0.9, backend=b)[0],
    "delta_rule, k = unit(q)": lambda x, v, b: delta_rule(x, unit(x), v, 0.5, backend=b)[0],
    "delta_rule, Longhorn's beta from k": lambda x, v, b: delta_rule(x.flip(2), x, v, 0.5, longhorn=True,   # |k| != 1
                                                                     backend=b)[0],
    "omega_rule, q = k": lambda x, v, b: omega_rule(x, unit(x), v, window=2, eta=0.3, chunk_size=3, backend=b)[0],
    "memory_caching, u = q = k": lambda x, v, b: memory_caching(x, unit(x), v, base=linear_attention, segments=3,
                                                                mode="independent", aggregate="grm", u=x,
                                                                backend=b)[0],
}


@pytest.mark.parametrize("name", list(ONE_TENSOR))
def test_create_graph_does_not_change_the_gradient_of_inputs_made_from_one_tensor(gen, name):
    """create_graph=True makes the kernels' gradients differentiable; it must not change them. The backward
    took them with respect to the saved inputs themselves, so an input made from another (q is k, Longhorn's
    beta from k, the readout's online output from q) got both paths there and the outer graph added the
    other again (q = k: exactly twice). Reference: the chunk form, first order."""
    x, _, v = random_qkv(1, 2, 9, 8, 8, generator=gen)
    x.requires_grad_(True)
    (ref,) = torch.autograd.grad(ONE_TENSOR[name](x, v, "chunk").square().sum(), x)
    for create_graph in (False, True):
        (g,) = torch.autograd.grad(ONE_TENSOR[name](x, v, "triton").square().sum(), x, create_graph=create_graph)
        assert_close(g, ref, tol=1e-5, name=f"{name}, create_graph={create_graph}")


@pytest.mark.parametrize("name", ["linear_attention", "delta_rule"])
def test_grad_of_grad_under_torch_func_through_the_kernels_is_refused(gen, name):
    """torch.func.grad of torch.func.grad: the kernels' backward unwraps every level, so the outer grad
    would see a constant and return 0; it raises instead (one level, first order, still works)."""
    q, k, v = random_qkv(1, 1, 5, 4, 4, generator=gen)

    def f(backend):
        return lambda x: SECOND_ORDER[name](x, k, v, backend).pow(3).sum()
    assert_close(torch.func.grad(f("triton"))(q), torch.func.grad(f("chunk"))(q), tol=1e-5, name="first order")
    with pytest.raises(RuntimeError, match="first order under torch.func"):
        torch.func.grad(lambda x: torch.func.grad(f("triton"))(x).square().sum())(q)


@pytest.mark.parametrize("mode", MODES)
def test_views_of_the_initial_state_and_of_the_final_states_gradient(gen, mode):
    # a transposed initial state (or one broadcast over the batch with expand) and a loss that reads the final
    # state through .mT: the backward recomputes from h0 and receives dht as views, and must read them as such
    inputs, do, dht = draw(gen, CHUNK + 13, mode, B=2)
    p = inputs[4][:1].detach().clone().requires_grad_()
    for h0 in (inputs[4].mT.contiguous().mT, p.expand(2, -1, -1, -1)):
        xs = [None if x is None else x.detach().clone().requires_grad_() for x in inputs[:4]]
        ref_xs = [None if x is None else x.detach().double().requires_grad_() for x in inputs[:4]]
        leaf, ref_leaf = (p, p.detach().double().requires_grad_()) if h0._base is p else \
            (inputs[4].mT.contiguous().requires_grad_(), inputs[4].mT.contiguous().double().requires_grad_())

        def run(backend, xs, leaf, h0):
            q, k, v, a = xs
            o, s = linear_attention(q, k, v, alpha=a, initial_state=h0, output_final_state=True, backend=backend)
            ((o * do.to(o.dtype)).sum() + (s.mT * dht.mT.to(s.dtype)).sum()).backward()
            return [None if x is None else x.grad for x in (*xs, leaf)]
        got = run("triton", xs, leaf, h0 if h0._base is p else leaf.mT)
        assert not (h0 if h0._base is p else leaf.mT).is_contiguous()
        ref = run("recurrent", ref_xs, ref_leaf, ref_leaf.expand(2, -1, -1, -1) if h0._base is p else ref_leaf.mT)
        compare(got, ref, tol=1e-5)
        p.grad = None


def test_log_gates_not_padded_to_whole_chunks_are_refused(gen):
    from atlaslib.core.kernels import chunk_gates
    from atlaslib.linear.backward import linear_attention_backward
    (q, k, v, alpha, _), do, _ = draw(gen, 70, "scalar")
    gate, g, Tp = chunk_gates(alpha, None, 70, CHUNK, q.dtype)
    assert Tp == 128
    with pytest.raises(ValueError, match="padded to 70 tokens, expected 128"):
        linear_attention_backward(q, k, v, gate, g[:, :, :70].contiguous(), None, do)


@pytest.mark.parametrize("name", ["linear_attention", "delta_rule"])
def test_non_reentrant_checkpointing_through_the_kernels(gen, name):
    """torch.utils.checkpoint(use_reentrant=False) lets a backward unpack its saved tensors once; the
    kernels' backward read them twice and failed there ("already unpacked once"). Same gradients as
    without checkpointing."""
    from torch.utils.checkpoint import checkpoint
    q, k, v = random_qkv(1, 2, 9, 8, 8, generator=gen)
    grads = []
    for wrap in (False, True):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        f = lambda q, k, v: SECOND_ORDER[name](q, k, v, "triton")          # noqa: E731
        o = checkpoint(f, *xs, use_reentrant=False) if wrap else f(*xs)
        o.square().sum().backward()
        grads.append([x.grad for x in xs])
    for got, want in zip(*grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["scalar", "channel"])
def test_bf16_log_gate_gradient_as_accurate_as_the_others(gen, mode):
    """d log alpha sums the cumulative log-gates' gradients within each chunk and takes the later chunks'
    share as <dh[c], h[c+1]>, as the delta rule does: a reverse sum over the whole sequence carried every
    token's rounding to every earlier token (per channel, 4-5 times the other gradients' error in bf16 at
    T = 256). Against the fp64 chunk form on the same rounded inputs, with a start state and dht."""
    B, H, T, K, V = 1, 2, 4 * CHUNK, 64, 64
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    q, k = (torch.nn.functional.normalize(x, dim=-1).bfloat16() for x in (q, k))
    v = v.bfloat16()
    la = (0.5 + 0.5 * torch.rand(B, H, T, *((K,) if mode == "channel" else ()), generator=gen)).log()
    h0 = torch.randn(B, H, V, K, generator=gen)
    do, dht = torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen)

    def grads(backend, dtype=None):
        xs = [x.to(dtype or x.dtype).clone().requires_grad_() for x in (q, k, v, la, h0)]
        o, s = linear_attention(*xs[:3], log_alpha=xs[3], initial_state=xs[4], output_final_state=True,
                                backend=backend)
        ((o.double() * do.double()).sum() + (s.double() * dht.double()).sum()).backward()
        return [x.grad.double() for x in xs]
    errors = [(g - r).norm() / r.norm() for g, r in zip(grads("triton"), grads("chunk", torch.float64))]
    # measured over 30 seeds, as a multiple of the largest of dq, dk, dv's errors: per channel 1.6-1.8 (the
    # whole-sequence sum: 3.9-5.4); scalar 0.8-3.1, its sum over channels cancelling (before: 1.4-5.8)
    bound = 2.5 if mode == "channel" else 4.5
    assert errors[3] <= bound * max(errors[:3]), [f"{e:.1e}" for e in errors]
