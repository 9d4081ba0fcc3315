"""The reverse state pass (``core.chunk_backward.dstate_pass``) against autograd through the forward recursion.

Under TRITON_INTERPRET=1, on fresh random inputs: the chunk recursion of the forward written in
PyTorch (fp64), h[c+1] = h[c] Diag(e^{g_n}) + v_new^T (k e^{g_n - g}) with v_new = u - w h[c]^T
for the delta rule (v_new = v otherwise), and a loss that reads every state the way the outputs
do, sum(do * (q e^g) h[c]^T) + sum(dv_local * v_new) + sum(dht * h_final). Autograd then gives
the gradient of every state, of h0 and of v_new, which the kernel must reproduce: a reference
that runs the recursion forward, not the kernel's backward formula. Linear attention (key blocks
in separate programs, K > 64) and the delta rule (random w, dv_local) in the three gate modes,
T not a multiple of the chunk, K != V, and bf16 inputs at bf16 tolerance.
"""
import pytest
import torch

from atlaslib.atlas import atlas
from atlaslib.core import assert_close, poisoned_outputs, random_qkv
from atlaslib.core.chunk_backward import dstate_pass
from atlaslib.core.chunk_kernels import CHUNK
from atlaslib.core.kernels import chunk_gates
from atlaslib.miras import miras
from atlaslib.omega import omega_rule

MODES = [None, "scalar", "channel"]


def draw(gen, mode, delta, B=1, H=2, T=CHUNK * 2 + 9, K=12, V=10):
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, do = r(B, H, T, K) / K ** 0.5, r(B, H, T, K) / K ** 0.5, r(B, H, T, V)
    shape = (B, H, T) if mode == "scalar" else (B, H, T, K)
    alpha = None if mode is None else 0.6 + 0.4 * torch.rand(*shape, generator=gen)
    if alpha is not None:                                   # some resets and some gates of exactly 1
        pick = torch.rand(*shape, generator=gen)
        alpha = torch.where(pick < 0.05, torch.zeros(()), torch.where(pick > 0.9, torch.ones(()), alpha))
    dht = r(B, H, V, K)
    w = r(B, H, T, K) / K if delta else None
    dv_local = r(B, H, T, V) if delta else None
    return q, k, do, alpha, dht, w, dv_local


def reference(q, k, do, gate_g, dht, w, dv_local):
    """Autograd through the forward recursion in fp64: (dh [B*H, NT, V, K], dh0, dv_new [B, H, T, V])."""
    B, H, T, K = q.shape
    V = do.shape[-1]
    NT = -(-T // CHUNK)
    d = lambda x: None if x is None else x.double()  # noqa: E731
    q, k, do, dht, w, dv_local = map(d, (q, k, do, dht, w, dv_local))
    g = None if gate_g is None else gate_g.double()
    h0 = torch.randn(B, H, V, K, dtype=torch.float64, requires_grad=True)
    u = torch.randn(B, H, T, V, dtype=torch.float64)
    h, loss, ends, vnews = h0, 0.0, [], []
    for c in range(NT):
        s = slice(c * CHUNK, min(T, (c + 1) * CHUNK))
        n = s.stop - s.start
        if g is None:
            gc = torch.zeros(B, H, n, 1, dtype=torch.float64)
            gn = torch.zeros(B, H, 1, dtype=torch.float64)
        elif g.dim() == 3:
            gc = g[:, :, s, None]
            gn = g[:, :, c * CHUNK + CHUNK - 1, None]
        else:
            gc = g[:, :, s]
            gn = g[:, :, c * CHUNK + CHUNK - 1]
        qc, kc = q[:, :, s], k[:, :, s]
        loss = loss + (do[:, :, s] * ((qc * gc.exp()) @ h.transpose(-1, -2))).sum()
        if w is not None:
            vn = u[:, :, s] - w[:, :, s] @ h.transpose(-1, -2)
            vn.retain_grad()
            vnews.append(vn)
            loss = loss + (dv_local[:, :, s] * vn).sum()
        else:
            vn = u[:, :, s]
        h = h * gn.exp()[..., None, :] + vn.transpose(-1, -2) @ (kc * (gn[..., None, :] - gc).exp())
        h.retain_grad()
        ends.append(h)
    loss = loss + (dht * h).sum()
    loss.backward()
    dh = torch.stack([e.grad for e in ends], 2).reshape(B * H, NT, V, K)
    dv2 = torch.cat([x.grad for x in vnews], 2) if w is not None else None
    return dh, h0.grad, dv2


@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_dstate_pass_matches_autograd_of_the_forward_recursion(gen, mode, delta):
    K = 12 if delta else 80                                  # linear attention: two key-block programs
    q, k, do, alpha, dht, w, dv_local = draw(gen, mode, delta, K=K)
    T = q.shape[2]
    gate, g, Tp = chunk_gates(alpha, None, T, CHUNK, q.dtype)
    pad = lambda x: None if x is None else torch.nn.functional.pad(x, (0, 0, 0, Tp - T) if g is not None else (0, 0, 0, -T % CHUNK))  # noqa: E731,E501
    with poisoned_outputs():
        dh, dh0, dv2 = dstate_pass(q, do, gate, g, dht, k=k if delta else None, w=pad(w), dv_local=pad(dv_local))
    ref_dh, ref_dh0, ref_dv2 = reference(q, k, do, g, dht, w, dv_local)
    assert_close(dh, ref_dh, tol=1e-5, name="dh")
    assert_close(dh0, ref_dh0, tol=1e-5, name="dh0")
    if delta:
        assert (dv2[:, :, T:] == 0).all()
        assert_close(dv2[:, :, :T], ref_dv2, tol=1e-5, name="dv_new")
    else:
        assert dv2 is None


def test_no_final_gradient_and_views(gen):
    # dht None is a zero final gradient; q and do handed in as [B, T, H, C] views transposed
    q, k, do, alpha, _, _, _ = draw(gen, "scalar", False, B=2, T=CHUNK + 3)
    gate, g, _ = chunk_gates(alpha, None, q.shape[2], CHUNK, q.dtype)
    qv, dov = q.transpose(1, 2).contiguous().transpose(1, 2), do.transpose(1, 2).contiguous().transpose(1, 2)
    with poisoned_outputs():
        dh, dh0, _ = dstate_pass(qv, dov, gate, g)
    ref_dh, ref_dh0, _ = reference(q, k, do, g, torch.zeros(2, 2, do.shape[-1], q.shape[-1]), None, None)
    assert_close(dh, ref_dh, tol=1e-5, name="dh")
    assert_close(dh0, ref_dh0, tol=1e-5, name="dh0")


@pytest.mark.parametrize("delta", [False, True])
def test_bf16_inputs_within_bf16_rounding(gen, delta):
    q, k, do, alpha, dht, w, dv_local = draw(gen, "channel", delta, K=16, V=16)
    T = q.shape[2]
    gate, g, Tp = chunk_gates(alpha, None, T, CHUNK, torch.bfloat16)
    pad = lambda x: None if x is None else torch.nn.functional.pad(x, (0, 0, 0, Tp - T))  # noqa: E731
    b = lambda x: None if x is None else x.bfloat16()  # noqa: E731
    dh, dh0, dv2 = dstate_pass(b(q), b(do), gate, g, dht, k=b(k) if delta else None, w=b(pad(w)),
                               dv_local=b(pad(dv_local)), dv2_dtype=torch.float32)
    ref_dh, ref_dh0, ref_dv2 = reference(q, k, do, g, dht, w, dv_local)
    assert_close(dh, ref_dh, tol=2e-2, name="dh")
    assert_close(dh0, ref_dh0, tol=2e-2, name="dh0")
    if delta:
        assert_close(dv2[:, :, :T], ref_dv2, tol=2e-2, name="dv_new")


def test_every_backward_entry_copies_a_view_whose_head_is_too_long(gen, monkeypatch):
    """The kernels index inside a head with 32-bit offsets: a [B, T, H, C] view whose one head spans
    2^31 elements or more must reach them as a contiguous copy, in the backward as in the forward. The
    limit is lowered here so that a small view crosses it; every [B, H, T, C] tensor a kernel is then
    launched with (forward and backward, the output gradient included) must span less."""
    import atlaslib.core.kernels as kernels
    from triton.runtime.interpreter import InterpretedFunction
    from atlaslib.delta import delta_rule
    from atlaslib.linear import linear_attention
    monkeypatch.setattr(kernels, "MAX_HEAD_SPAN", 1024)      # above a contiguous head padded to 64 tokens
    launched = []
    run = InterpretedFunction.run

    def recording_run(self, *args, **kwargs):          # every launch's tensors, then the launch itself
        launched.append((self.fn.__name__, [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]))
        return run(self, *args, **kwargs)
    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    B, T, H, K = 1, 20, 8, 8                                   # one head of a [B, T, H, K] view spans 1224
    for model in ("linear", "delta"):
        x = torch.randn(B, T, 3 * H * K, generator=gen, requires_grad=True)
        q, k, v = (t.reshape(B, T, H, K).transpose(1, 2) for t in x.split(H * K, dim=-1))
        k = torch.nn.functional.normalize(k, dim=-1)
        beta = torch.full((B, H, T), 0.5)
        weight = torch.randn(B, T, H, K, generator=gen)     # do = weight's [B, H, T, K] view: it spans 1224 too
        launched.clear()
        o = (linear_attention(q, k, v, backend="triton")[0] if model == "linear"
             else delta_rule(q, k, v, beta, backend="triton")[0])
        n_forward = len(launched)
        (o.transpose(1, 2) * weight).sum().backward()
        assert 0 < n_forward < len(launched), (model, n_forward, len(launched))    # a backward kernel ran
        too_long = [(name, tuple(t.shape), kernels._head_span(t)) for name, ts in launched for t in ts
                    if kernels._head_span(t) >= 1024]
        assert not too_long, (model, too_long)
        assert torch.isfinite(x.grad).all()
        x.grad = None


@pytest.mark.parametrize("delta", [False, True])
def test_a_transposed_final_gradient(gen, delta):
    # autograd hands dht over as a view whenever the loss reads the final state through one (s.mT): the same
    # values with strides (.., 1, V) must give the same gradients
    q, k, do, alpha, dht, w, dv_local = draw(gen, "scalar", delta)
    T = q.shape[2]
    gate, g, Tp = chunk_gates(alpha, None, T, CHUNK, q.dtype)
    pad = lambda x: None if x is None else torch.nn.functional.pad(x, (0, 0, 0, Tp - T))  # noqa: E731
    view = dht.mT.contiguous().mT
    assert not view.is_contiguous()
    dh, dh0, _ = dstate_pass(q, do, gate, g, view, k=k if delta else None, w=pad(w), dv_local=pad(dv_local))
    ref_dh, ref_dh0, _ = reference(q, k, do, g, dht, w, dv_local)
    assert_close(dh, ref_dh, tol=1e-5, name="dh")
    assert_close(dh0, ref_dh0, tol=1e-5, name="dh0")


def test_bf16_reverse_pass_keeps_an_fp32_running_gradient(gen):
    # no gate: dh0 = dht + sum_t do_t^T q_t, each product of bf16 numbers exact in fp32, so the fp32 running
    # gradient (and an fp32 dh0) is fp64's to fp32 rounding; rounding it to bf16 per chunk costs 1e-3
    T = 3 * CHUNK + 5
    q, do = (torch.randn(1, 2, T, 16, generator=gen).bfloat16() for _ in range(2))
    dht = torch.randn(1, 2, 16, 16, generator=gen)
    _, dh0, _ = dstate_pass(q, do, 0, None, dht)
    assert dh0.dtype == torch.float32
    assert_close(dh0.double(), dht.double() + do.double().mT @ q.double(), tol=1e-6, name="dh0")


def test_refuses_what_it_cannot_hold(gen):
    q, k, do, _, dht, w, dv_local = draw(gen, None, True, T=CHUNK, K=300)
    with pytest.raises(ValueError, match="K <= 256"):
        dstate_pass(q, do, 0, None, dht, k=k, w=w, dv_local=dv_local)
    q, k, do, _, dht, w, dv_local = draw(gen, None, True, T=CHUNK)
    with pytest.raises(ValueError, match="needs k, w and dv_local together"):
        dstate_pass(q, do, 0, None, dht, w=w)


@pytest.mark.parametrize("model", ["omega", "atlas", "titans", "deep_transformer", "memory_caching"])
def test_torch_func_grad_through_a_chunk_backward_kernel(gen, model):
    """torch.func.grad through a kernel whose gradients come from the chunk form (``ChunkBackward``): the
    transform differentiates the chunk form itself (it refused the Function before), and gives autograd's
    gradient of the chunk form."""
    from atlaslib.caching import memory_caching
    from atlaslib.deep import deep_transformer
    from atlaslib.linear import linear_attention
    q, k, v = random_qkv(1, 2, 12, 4, 4, generator=gen)
    k = torch.nn.functional.normalize(k, dim=-1)
    calls = {
        "omega": lambda q, b: omega_rule(q, k, v, window=2, eta=0.3, backend=b, chunk_size=4),
        "atlas": lambda q, b: atlas(q, k, v, eta=0.3, backend=b, chunk_size=4),
        "titans": lambda q, b: miras(q, k, v, preset="titans", memory="linear", eta=0.3, theta=0.5, backend=b,
                                     chunk_size=4),
        "deep_transformer": lambda q, b: deep_transformer(q, k, v, alpha=0.9, normalize=True, backend=b),
        "memory_caching": lambda q, b: memory_caching(q, k, v, base=linear_attention, segments=4, backend=b)}
    loss = lambda q, b: (calls[model](q, b)[0] ** 2).sum()  # noqa: E731
    got = torch.func.grad(lambda x: loss(x, "triton"))(q)
    leaf = q.clone().requires_grad_(True)
    loss(leaf, "chunk").backward()
    assert_close(got, leaf.grad, tol=1e-6, name=f"{model}: torch.func.grad on the kernel path")
