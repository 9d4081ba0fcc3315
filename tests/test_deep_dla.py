"""Chapter 6 (library part): DLA, deep linear attention, as the MIRAS preset "dla".

The references are written here from the definition, on fresh random inputs: a per-token loop that
differentiates the dot-product loss -<M(phi(k_t)), v_t> of a hand-written memory by autograd and takes
the step W <- alpha W - eta grad (at the previous weights, or frozen at each chunk's start), then reads
y_t = M_t(phi(q_t)). A linear memory is compared with chapter 1's gated linear attention on eta v, and
phi_star=("taylor", P) with the linear DeepTransformer on phi*_P features.
"""
import pytest
import torch
import torch.nn.functional as F

from atlaslib.core import assert_close, random_gate, random_qkv
from atlaslib.deep import deep_transformer, dla, exp_features
from atlaslib.linear import linear_attention
from atlaslib.miras import PRESETS, MirasState, init_state, miras

F64 = torch.float64


# Memories written out by hand (not the engine's Memory classes); weights W [B, H, out, in], x [B, H, in].
def _lin(W, x):
    return (W @ x[..., None])[..., 0]


HAND = {
    "mlp": lambda W, x: _lin(W["W2"], F.gelu(_lin(W["W1"], x))),
    "residual": lambda W, x: x + _lin(W["W1"], F.gelu(_lin(W["W2"], x))),
    "gated": lambda W, x: x + _lin(W["W1"], F.gelu(_lin(W["W2"], x)) * _lin(W["W3"], x)),
    "linear": lambda W, x: _lin(W["M"], x),
}


def reference(memory, fq, fk, v, alpha, eta, W0, chunk=None):
    """y_t = M_t(phi(q_t)), M_t = alpha_t M_{t-1} - eta_t grad -<M(phi(k_t)), v_t>, the gradient taken at
    M_{t-1} (chunk=None) or at the state of the last chunk boundary (chunk=b). Differentiable."""
    T = fq.shape[2]
    W = dict(W0)
    frozen = W
    out = []
    for t in range(T):
        if chunk is None or t % chunk == 0:
            frozen = W
        at = {n: w if w.requires_grad else w.detach().requires_grad_() for n, w in frozen.items()}
        loss = -(HAND[memory](at, fk[:, :, t]) * v[:, :, t]).sum()
        grads = torch.autograd.grad(loss, list(at.values()), create_graph=True)
        a = alpha[:, :, t, None, None] if alpha is not None else 1.0
        e = eta[:, :, t, None, None]
        W = {n: a * W[n] - e * g for (n, w), g in zip(W.items(), grads)}
        out.append(HAND[memory](W, fq[:, :, t]))
    return torch.stack(out, dim=2), W


def setup(gen, memory, B=2, H=2, T=13, K=4, V=4, eta_high=0.3):
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    alpha = random_gate(B, H, T, low=0.8, dtype=F64, generator=gen)
    eta = random_gate(B, H, T, low=0.05, high=eta_high, dtype=F64, generator=gen)
    return q, k, v, alpha, eta


def random_state(gen, memory, B, H, D, V):
    """A random start state, different per (batch, head), as a MirasState (memory dict) and the hand dict."""
    shapes = init_state(PRESETS["dla"].replace(memory=memory), B, H, D, V, dtype=F64).memory
    if memory == "linear":
        shapes = {"M": shapes}
    W0 = {n: torch.randn(w.shape, generator=gen, dtype=F64) / w.shape[-1] ** 0.5 for n, w in shapes.items()}
    state = W0["M"] if memory == "linear" else dict(W0)
    return state, W0


# ----------------------------------------------------------------------------- the preset

def test_dla_is_the_miras_preset(gen):
    cfg = PRESETS["dla"]
    assert (cfg.memory, cfg.bias, cfg.retention, cfg.optimizer, cfg.window) == ("mlp", "dot", "decay", "gd", 1)
    q, k, v, alpha, eta = setup(gen, "mlp")
    o, s = dla(q, k, v, alpha=alpha, eta=eta, output_final_state=True, chunk_size=4)
    o2, s2 = miras(q, k, v, preset="dla", alpha=alpha, eta=eta, output_final_state=True, chunk_size=4)
    assert torch.equal(o, o2) and all(torch.equal(s.memory[n], s2.memory[n]) for n in s.memory)
    assert isinstance(s, MirasState) and s.momentum is None and set(s.memory) == {"W1", "W2"}
    assert dla(q, k, v, alpha=alpha, eta=eta)[1] is None


def test_log_alpha_is_alpha(gen):
    """The gate as its log gives the same model (the engine turns it into alpha at entry, in fp64 here)."""
    q, k, v, alpha, eta = setup(gen, "mlp")
    for backend in ("recurrent", "chunk"):
        o, _ = dla(q, k, v, alpha=alpha, eta=eta, backend=backend, chunk_size=4)
        o2, _ = dla(q, k, v, log_alpha=alpha.log(), eta=eta, backend=backend, chunk_size=4)
        assert_close(o2, o, tol=1e-13, name=f"log_alpha ({backend})")
    o3, _ = dla(q, k, v, eta=eta, backend="chunk", chunk_size=4)
    assert (o3 - o).abs().max() > 1e-3, "alpha < 1 must change the output"


# ----------------------------------------------------------------------------- linear memory: chapter 1

@pytest.mark.parametrize("backend", ["recurrent", "frozen_seq", "chunk"])
@pytest.mark.parametrize("phi", [None, "elu+1"])
def test_linear_memory_is_gated_linear_attention(gen, backend, phi):
    """memory="linear": M_t = alpha_t M_{t-1} + eta_t v_t phi(k_t)^T, linear_attention on eta v, every b."""
    B, H, T, K, V = 2, 3, 21, 5, 3
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    alpha = random_gate(B, H, T, low=0.5, dtype=F64, generator=gen)
    eta = random_gate(B, H, T, low=0.1, high=2.0, dtype=F64, generator=gen)
    h0 = torch.randn(B, H, V, K, generator=gen, dtype=F64)
    fq, fk = (q, k) if phi is None else (F.elu(q) + 1, F.elu(k) + 1)
    ref, ref_s = linear_attention(fq, fk, eta[..., None] * v, alpha=alpha, initial_state=h0,
                                  output_final_state=True, backend="recurrent")
    for b in (1, 4, 7, 32):
        o, s = dla(q, k, v, alpha=alpha, eta=eta, phi=phi, memory="linear", initial_state=h0,
                   output_final_state=True, backend=backend, chunk_size=b)
        assert_close(o, ref, tol=1e-12, name=f"o ({backend}, b={b})")
        assert_close(s.memory, ref_s, tol=1e-12, name=f"M_T ({backend}, b={b})")
    # no alpha, no eta: plain causal linear attention
    o, _ = dla(q, k, v, phi=phi, memory="linear", backend=backend, chunk_size=4)
    assert_close(o, linear_attention(fq, fk, v, backend="recurrent")[0], tol=1e-12, name="ungated")


# ----------------------------------------------------------------------------- deep memories

@pytest.mark.parametrize("memory", ["mlp", "residual", "gated"])
def test_deep_memory_per_token_definition(gen, memory):
    """recurrent == the hand-written autograd loop; chunk(1) == recurrent; from the default and a given state."""
    B, H, T, K = 2, 2, 11, 4
    q, k, v, alpha, eta = setup(gen, memory, B, H, T, K, K)
    state, W0 = random_state(gen, memory, B, H, K, K)
    ref, ref_W = reference(memory, q, k, v, alpha, eta, W0)
    for backend, b in (("recurrent", 16), ("chunk", 1), ("frozen_seq", 1)):
        o, s = dla(q, k, v, alpha=alpha, eta=eta, memory=memory, initial_state=state, output_final_state=True,
                   backend=backend, chunk_size=b)
        assert_close(o, ref, tol=1e-11, name=f"{memory} o ({backend}, b={b})")
        for n in ref_W:
            assert_close(s.memory[n], ref_W[n], tol=1e-11, name=f"{memory} {n}_T ({backend})")
    # the default start: the engine's seeded weights (a zero deep memory would never move)
    default = init_state(PRESETS["dla"].replace(memory=memory), B, H, K, K, dtype=F64).memory
    assert all(w.abs().sum() > 0 for w in default.values())
    o, _ = dla(q, k, v, alpha=alpha, eta=eta, memory=memory, backend="recurrent")
    assert_close(o, reference(memory, q, k, v, alpha, eta, default)[0], tol=1e-11, name="default start")


@pytest.mark.parametrize("memory", ["mlp", "residual", "gated"])
def test_deep_memory_chunk_is_frozen_seq_for_every_b(gen, memory):
    """chunk(b) == frozen_seq(b) == the hand loop with gradients frozen at chunk starts, b | T or not;
    and b > 1 really differs from the per-token definition (the gradient depends on the state)."""
    B, H, T, K = 1, 3, 17, 4
    q, k, v, alpha, eta = setup(gen, memory, B, H, T, K, K, eta_high=0.5)
    state, W0 = random_state(gen, memory, B, H, K, K)
    per_token = reference(memory, q, k, v, alpha, eta, W0)[0]
    for b in (2, 5, 8, 17, 40):
        ref, ref_W = reference(memory, q, k, v, alpha, eta, W0, chunk=b)
        for backend in ("frozen_seq", "chunk"):
            o, s = dla(q, k, v, alpha=alpha, eta=eta, memory=memory, initial_state=state, output_final_state=True,
                       backend=backend, chunk_size=b)
            assert_close(o, ref, tol=1e-11, name=f"{memory} o ({backend}, b={b})")
            for n in ref_W:
                assert_close(s.memory[n], ref_W[n], tol=1e-11, name=f"{memory} {n}_T ({backend}, b={b})")
        assert (ref - per_token).abs().max() > 1e-4, f"b={b} should freeze the gradient of a deep memory"


def test_deep_memory_gradients(gen):
    """Gradients in q, k, v, alpha, eta and the start weights: chunk(b) vs autograd through the hand loop."""
    B, H, T, K, V = 1, 2, 9, 3, 4
    q, k, v, alpha, eta = setup(gen, "mlp", B, H, T, K, V)
    state, W0 = random_state(gen, "mlp", B, H, K, V)
    w = torch.randn(B, H, T, V, generator=gen, dtype=F64)
    leaves = [q, k, v, alpha, eta, state["W1"], state["W2"]]
    for b in (1, 4):
        for x in leaves:
            x.grad = None
            x.requires_grad_()
        o, _ = dla(q, k, v, alpha=alpha, eta=eta, initial_state=state, backend="chunk", chunk_size=b)
        got = torch.autograd.grad((o * w).sum(), leaves)
        ref, _ = reference("mlp", q, k, v, alpha, eta, {"W1": state["W1"], "W2": state["W2"]}, chunk=b)
        want = torch.autograd.grad((ref * w).sum(), leaves)
        for name, g1, g2 in zip(["q", "k", "v", "alpha", "eta", "W1", "W2"], got, want):
            assert g1.abs().max() > 0, f"gradient of {name} is zero"
            assert_close(g1, g2, tol=1e-10, name=f"d/d{name} (b={b})")


# ----------------------------------------------------------------------------- phi* = ("taylor", P)

@pytest.mark.parametrize("P", [1, 2, 3])
def test_taylor_linear_is_the_deep_transformer(gen, P):
    """phi_star=("taylor", P) with a linear memory == deep_transformer(phi_star=("taylor", P)), unnormalised."""
    B, H, T, K, V = 2, 2, 19, 3, 4
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    alpha = random_gate(B, H, T, low=0.5, dtype=F64, generator=gen)
    eta = random_gate(B, H, T, low=0.1, high=1.5, dtype=F64, generator=gen)
    D = exp_features(q[..., :1, :], P).shape[-1]
    h0 = torch.randn(B, H, V, D, generator=gen, dtype=F64)
    ref, ref_s = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P), initial_state=h0,
                                  output_final_state=True, backend="recurrent")
    for backend, b in (("recurrent", 16), ("chunk", 1), ("chunk", 6), ("frozen_seq", 5)):
        o, s = dla(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P), memory="linear", initial_state=h0,
                   output_final_state=True, backend=backend, chunk_size=b)
        assert_close(o, ref, tol=1e-12, name=f"o ({backend}, b={b})")
        assert_close(s.memory, ref_s.memory, tol=1e-12, name=f"M_T ({backend}, b={b})")


def test_taylor_deep_memory(gen):
    """The deep DeepTransformer on phi*_P: the hand loop on exp_features features, per token and frozen."""
    B, H, T, K, V, P = 1, 2, 10, 3, 3, 2
    q, k, v, alpha, eta = setup(gen, "mlp", B, H, T, K, V)
    fq, fk = exp_features(q, P), exp_features(k, P)
    state, W0 = random_state(gen, "mlp", B, H, fq.shape[-1], V)
    o, _ = dla(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P), initial_state=state, backend="recurrent")
    assert_close(o, reference("mlp", fq, fk, v, alpha, eta, W0)[0], tol=1e-11, name="per token")
    o, _ = dla(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P), initial_state=state, backend="chunk",
               chunk_size=4)
    assert_close(o, reference("mlp", fq, fk, v, alpha, eta, W0, chunk=4)[0], tol=1e-11, name="chunk(4)")


def test_bf16_inputs_give_bf16_outputs(gen):
    q, k, v, alpha, eta = setup(gen, "mlp")
    o, _ = dla(q.bfloat16(), k.bfloat16(), v.bfloat16(), alpha=alpha.float(), eta=eta.float(),
               phi_star=("taylor", 2), chunk_size=4)
    ref, _ = dla(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), alpha=alpha, eta=eta,
                 phi_star=("taylor", 2), chunk_size=4)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    assert_close(o.double(), ref, tol=3e-2, name="bf16 vs fp64")


# ----------------------------------------------------------------------------- bad input

def _bad_cases():
    return [
        (dict(memory="transformer"), ValueError, "memory must be one of"),
        (dict(phi="elu+1", phi_star=("taylor", 2)), ValueError, "either phi or phi_star"),
        (dict(phi_star="kernel"), ValueError, "not available for DLA"),
        (dict(phi_star=("taylor", -1)), ValueError, "int P >= 0"),
        (dict(phi_star=("taylor", 2.0)), TypeError, "int P >= 0"),
        (dict(phi_star="taylor"), ValueError, "phi_star must be"),
        (dict(theta=0.5), TypeError, "unknown option"),
        (dict(bias="l2"), TypeError, "unknown option"),
        (dict(memory="linear", expansion=2), ValueError, "applies to memory"),
        (dict(alpha=1.5), ValueError, "alpha must lie"),
        (dict(eta=-0.1), ValueError, "eta must lie"),
        (dict(alpha=0.5, log_alpha=-0.1), ValueError, "not both"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(backend="triton"), ValueError, "no backend 'triton'"),
        (dict(output_final_state=1), TypeError, "output_final_state"),
        (dict(memory="linear", initial_state=torch.zeros(1, 2, 4, 5, dtype=F64)), ValueError, "initial_state"),
    ]


@pytest.mark.parametrize("kwargs,exc,match", _bad_cases())
def test_bad_input(gen, kwargs, exc, match):
    q, k, v = random_qkv(1, 2, 6, 4, 4, dtype=F64, generator=gen)
    with pytest.raises(exc, match=match):
        dla(q, k, v, **kwargs)


def test_bad_shapes(gen):
    q, k, v = random_qkv(1, 2, 6, 4, 3, dtype=F64, generator=gen)
    with pytest.raises(ValueError, match="needs the key"):
        dla(q, k, v, memory="residual")                    # x + ... needs K == V
    with pytest.raises(ValueError):
        dla(q, k[:, :, :5], v)
