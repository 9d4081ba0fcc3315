"""Chapter 6: the deep ("mlp") memory of deep_transformer and dot, W2 act(W1 phi*(x)) with W1_0 = 0.

The reference is written here from the definition, on fresh random inputs in fp64: a per-token loop on
explicit features with hand-held weights W1 [h, D], W2 [V, h], the loss differentiated by autograd
(-<y, v> for the DeepTransformer, the gamma-weighted 1/2 ||y - v||^2 of the window for DOT), the step
W <- alpha W - eta grad at the previous weights, then y_t = W2 act(W1 phi(q_t)). The coefficient loop
(W1 = sum_j U_j phi*(k_j)^T) with the Taylor kernel sum_{n<=P} s^n / n! must equal it on exp_features
exactly; with exp it must approach the Taylor form as P grows.
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from atlaslib.core import assert_close, random_gate, random_qkv
from atlaslib.core.testing import window_gate
from atlaslib.deep import (deep_mlp_recurrent, deep_transformer, dot, dot_mlp_recurrent, exp_features, exp_kernel,
                           second_layer_init)
from atlaslib.miras import miras
from atlaslib.omega import omega_rule

F64 = torch.float64
ACT = {"gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu}


def reference(fq, fk, v, W1, W2, alpha, eta, act, bias="dot", c=1, gamma=None):
    """The deep memory on explicit features, per token, gradients by autograd at W_{t-1}. Returns (o, W1, W2)."""
    T = fq.shape[2]
    out = []
    for t in range(T):
        with torch.enable_grad():
            A, Bw = W1.detach().requires_grad_(), W2.detach().requires_grad_()
            loss = 0.0
            for i in range(max(0, t - c + 1), t + 1):
                y = (Bw @ act(A @ fk[:, :, i, :, None]))[..., 0]                    # W2 act(W1 phi(k_i))
                l_i = -(y * v[:, :, i]).sum(-1) if bias == "dot" else 0.5 * (y - v[:, :, i]).square().sum(-1)
                loss = loss + window_gate(gamma, t, i) * l_i
            g1, g2 = torch.autograd.grad(loss.sum(), (A, Bw))
        a = 1.0 if alpha is None else alpha[:, :, t, None, None]
        e = eta[:, :, t, None, None]
        W1, W2 = a * W1 - e * g1, a * W2 - e * g2
        out.append((W2 @ act(W1 @ fq[:, :, t, :, None]))[..., 0])
    return torch.stack(out, 2), W1, W2


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def inputs(gen, B=2, H=2, T=9, K=2, V=3, h=5, c=1, layout=None):
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    q, k = unit(q), unit(k)
    alpha = random_gate(B, H, T, low=0.7, dtype=F64, generator=gen)
    eta = (0.1 + 0.5 * torch.rand(B, H, T, generator=gen, dtype=F64)) / c
    W2 = torch.randn(B, H, V, h, generator=gen, dtype=F64) / math.sqrt(h)
    shape = {"source": (B, H, T), "offset": (B, H, T, c)}.get(layout)
    gamma = None if shape is None else torch.rand(*shape, generator=gen, dtype=F64)
    return q, k, v, alpha, eta, W2, gamma


# -- the coefficient loop is the deep memory: with the Taylor kernel it equals the feature loop exactly --

@pytest.mark.parametrize("act", ["gelu", "tanh", "silu"])
@pytest.mark.parametrize("P", [1, 3])
def test_deep_transformer_kernel_loop_equals_features(gen, act, P):
    q, k, v, alpha, eta, W2, _ = inputs(gen)
    fq, fk = exp_features(q, P), exp_features(k, P)
    W1 = torch.zeros(*W2.shape[:2], W2.shape[-1], fq.shape[-1], dtype=F64)
    want, _, want_W2 = reference(fq, fk, v, W1, W2, alpha, eta, ACT[act])
    got, (W2_T, U) = deep_mlp_recurrent(q, k, v, W2, alpha, eta, exp_kernel(P), act)
    assert_close(got, want, tol=1e-12, name="coefficient loop, Taylor kernel")
    assert_close(W2_T, want_W2, tol=1e-12, name="W2_T")
    assert U.shape == (*W2.shape[:2], q.shape[2], W2.shape[-1])
    assert (want - reference(fq, fk, v, W1, W2, None, eta, ACT[act])[0]).abs().max() > 1e-4   # alpha matters


@pytest.mark.parametrize("layout", [None, "source", "offset"])
@pytest.mark.parametrize("c", [1, 3])
def test_dot_kernel_loop_equals_features(gen, layout, c):
    P = 2
    q, k, v, alpha, eta, W2, gamma = inputs(gen, c=c, layout=layout)
    fq, fk = exp_features(q, P), exp_features(k, P)
    W1 = torch.zeros(*W2.shape[:2], W2.shape[-1], fq.shape[-1], dtype=F64)
    want, _, want_W2 = reference(fq, fk, v, W1, W2, alpha, eta, F.gelu, "l2", c, gamma)
    got, (W2_T, _) = dot_mlp_recurrent(q, k, v, W2, alpha, eta, exp_kernel(P), "gelu", c, gamma)
    assert_close(got, want, tol=1e-12, name="DOT coefficient loop, Taylor kernel")
    assert_close(W2_T, want_W2, tol=1e-12, name="W2_T")


# -- the public Taylor forms (chapter 3's engine on exp_features) --

@pytest.mark.parametrize("given_W1", [False, True])
def test_deep_transformer_taylor_matches_reference(gen, given_W1):
    P, h = 2, 7                                  # D = 6 features: h = 7 is padded to 12 inside
    q, k, v, alpha, eta, W2, _ = inputs(gen, h=h)
    fq, fk = exp_features(q, P), exp_features(k, P)
    W1 = torch.zeros(*W2.shape[:2], h, fq.shape[-1], dtype=F64)
    state = {"W2": W2}
    if given_W1:                                 # the Taylor form takes any first layer
        W1 = 0.3 * torch.randn(W1.shape, generator=gen, dtype=F64)
        state["W1"] = W1
    want, want_W1, want_W2 = reference(fq, fk, v, W1, W2, alpha, eta, F.gelu)
    got, final = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P), memory="mlp",
                                  initial_state=state, output_final_state=True, backend="recurrent")
    assert_close(got, want, tol=1e-12, name="taylor recurrent")
    assert final.momentum is None                # MirasState({"W1", "W2"}, None)
    assert_close(final.memory["W1"], want_W1, tol=1e-12, name="W1_T")
    assert_close(final.memory["W2"], want_W2, tol=1e-12, name="W2_T")


@pytest.mark.parametrize("c", [1, 3])
def test_dot_taylor_matches_reference(gen, c):
    P, h = 2, 4
    q, k, v, alpha, eta, W2, gamma = inputs(gen, h=h, c=c, layout="offset" if c > 1 else None)
    fq, fk = exp_features(q, P), exp_features(k, P)
    W1 = torch.zeros(*W2.shape[:2], h, fq.shape[-1], dtype=F64)
    want, _, _ = reference(fq, fk, v, W1, W2, alpha, eta, F.tanh, "l2", c, gamma)
    got, _ = dot(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, phi_star=("taylor", P), memory="mlp",
                 initial_state={"W2": W2}, activation="tanh", backend="recurrent")
    assert_close(got, want, tol=1e-12, name="dot taylor recurrent")


@pytest.mark.parametrize("c", [1, 3])
def test_dot_taylor_is_chapter_4_deep_omega_rule(gen, c):
    """With h = 4 D (the engine's expansion 4) and GELU, dot is omega_rule(memory="mlp") on the features;
    with c = 1 and alpha = 1 it is the deep delta rule (miras' deltanet with an MLP memory)."""
    P = 2
    q, k, v, _, eta, _, gamma = inputs(gen, c=c, layout="source" if c > 1 else None)
    fq, fk = exp_features(q, P), exp_features(k, P)
    D = fq.shape[-1]
    W2 = torch.randn(*q.shape[:2], v.shape[-1], 4 * D, generator=gen, dtype=F64) / math.sqrt(4 * D)
    start = {"W1": torch.zeros(*q.shape[:2], 4 * D, D, dtype=F64), "W2": W2}
    want, _ = omega_rule(fq, fk, v, window=c, gamma=gamma, eta=eta, memory="mlp", initial_state=start,
                         backend="recurrent")
    got, _ = dot(q, k, v, window=c, gamma=gamma, eta=eta, phi_star=("taylor", P), memory="mlp",
                 initial_state={"W2": W2}, backend="recurrent")
    assert_close(got, want, tol=1e-12, name="dot vs omega_rule(memory='mlp')")
    if c == 1:
        delta, _ = miras(fq, fk, v, preset="deltanet", memory="mlp", eta=eta, initial_state=start,
                         backend="recurrent")
        assert_close(got, delta, tol=1e-12, name="dot c=1 vs the deep delta rule")


def test_taylor_chunk_freezes_gradients(gen):
    """Chunk(b) equals the frozen-gradient oracle for every b, the definition only at b = 1."""
    P, b = 2, 3
    q, k, v, alpha, eta, W2, gamma = inputs(gen, T=10, c=2, layout="source")
    st = {"W2": W2}
    for fn, kw in ((deep_transformer, {}), (dot, {"window": 2, "gamma": gamma})):
        def run(backend, chunk_size):
            return fn(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", P), memory="mlp", initial_state=st,
                      backend=backend, chunk_size=chunk_size, **kw)[0]
        rec = run("recurrent", b)
        assert_close(run("chunk", 1), rec, tol=1e-12, name=f"{fn.__name__} chunk(1) vs recurrent")
        assert_close(run("chunk", b), run("frozen_seq", b), tol=1e-12, name=f"{fn.__name__} chunk vs frozen_seq")
        assert (run("chunk", b) - rec).abs().max() > 1e-6          # b > 1 is an approximation


# -- the exact phi* (kernel) form: the Taylor forms converge to it as P grows --

@pytest.mark.parametrize("model", ["deep_transformer", "dot"])
def test_kernel_is_the_limit_of_taylor(gen, model):
    q, k, v, alpha, eta, W2, gamma = inputs(gen, T=10, K=3, c=3, layout="offset")
    if model == "dot":
        eta = eta / math.e                          # |phi*(k)|^2 = e for unit keys: keep the window step stable

    def run(phi_star):
        kw = {"window": 3, "gamma": gamma} if model == "dot" else {}
        fn = dot if model == "dot" else deep_transformer
        return fn(q, k, v, alpha=alpha, eta=eta, phi_star=phi_star, memory="mlp", initial_state={"W2": W2},
                  backend="recurrent", **kw)[0]
    exact = run("kernel")
    errors = [(run(("taylor", P)) - exact).abs().max().item() for P in (1, 2, 4, 6, 8)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5 * exact.abs().max().item(), errors
    assert errors[0] > 1e-4, errors                 # the truncation is visible at P = 1


def test_defaults_share_W2(gen):
    """initial_state=None: W2 = second_layer_init (h = 4 K, seed 0) and W1 = 0 for every phi*."""
    q, k, v, alpha, eta, _, _ = inputs(gen, K=2, V=2)
    B, H, T, K = q.shape
    W2 = second_layer_init(B, H, v.shape[-1], 4 * K, F64, "cpu")
    got, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, memory="mlp")
    want, _ = deep_mlp_recurrent(q, k, v, W2, alpha, eta, exp_kernel())
    assert_close(got, want, tol=1e-12, name="kernel default")
    taylor, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", 8), memory="mlp",
                                 backend="recurrent")
    assert (taylor - got).abs().max() < 1e-5 * got.abs().max()


def test_default_W2_is_normal_with_variance_one_over_h():
    """second_layer_init's draw is N(0, 1/h) (the variance that keeps W2 g's entries of the scale of g's):
    checked on its moments at h = 256 (V * h = 16384 draws: the std's relative spread is about 0.6 %)."""
    W2 = second_layer_init(2, 2, 64, 256, F64, "cpu")
    assert torch.equal(W2[0], W2[1])                                  # shared by the batch
    assert abs(W2.std().item() * math.sqrt(256) - 1) < 0.05
    assert abs(W2.mean().item()) * math.sqrt(256) < 0.05


@pytest.mark.parametrize("memory", ["mlp", "linear"])
@pytest.mark.parametrize("phi_star", ["kernel", ("taylor", 2)])
def test_log_alpha_is_alpha_as_its_log(gen, memory, phi_star):
    """log_alpha = log(alpha) gives what alpha gives, on every memory and phi* (a log_alpha dropped on
    its way to a backend would run without retention)."""
    q, k, v, alpha, eta, _, _ = inputs(gen)
    run = dict(eta=eta, memory=memory, phi_star=phi_star, backend="recurrent")
    want, _ = deep_transformer(q, k, v, alpha=alpha, **run)
    got, _ = deep_transformer(q, k, v, log_alpha=alpha.log(), **run)
    assert_close(got, want, tol=1e-12, name=f"{memory} {phi_star}")
    assert (want - deep_transformer(q, k, v, **run)[0]).abs().max() > 1e-4         # alpha matters


@pytest.mark.parametrize("model", ["deep_transformer", "dot"])
def test_expansion_sets_the_default_width(gen, model):
    """expansion=e: the default W2 is second_layer_init's draw of width h = e K (the final state shows h)."""
    q, k, v, alpha, eta, _, _ = inputs(gen, K=2, V=2)
    B, H, T, K = q.shape
    f = {"deep_transformer": deep_transformer, "dot": dot}[model]
    for phi_star in ("kernel", ("taylor", 2)):
        run = {"alpha": alpha, "eta": eta / math.e, "memory": "mlp", "phi_star": phi_star, "backend": "recurrent"}
        got, _ = f(q, k, v, expansion=2, **run)
        want, _ = f(q, k, v, initial_state={"W2": second_layer_init(B, H, 2, 2 * K, F64, "cpu")}, **run)
        assert_close(got, want, tol=1e-13, name=f"{model} {phi_star} expansion=2")
        assert (got - f(q, k, v, **run)[0]).abs().max() > 1e-4      # the default (4) is another memory
    _, state = f(q, k, v, expansion=3, output_final_state=True, memory="mlp", phi_star=("taylor", 2))
    assert state.memory["W2"].shape[-1] == 3 * K and state.memory["W1"].shape[-2] == 3 * K


@pytest.mark.parametrize("phi_star", ["kernel", ("taylor", 2)])
def test_window_at_least_T_is_the_global_window(gen, phi_star):
    T = 6
    q, k, v, alpha, eta, W2, _ = inputs(gen, T=T, c=T)
    fq, fk = exp_features(q, 2), exp_features(k, 2)
    runs = [dot(q, k, v, window=c, alpha=alpha, eta=eta / math.e, phi_star=phi_star, memory="mlp",
                initial_state={"W2": W2}, backend="recurrent")[0] for c in (T, T + 5)]
    assert_close(runs[1], runs[0], tol=1e-13, name="c > T vs c = T")
    if phi_star != "kernel":
        W1 = torch.zeros(*W2.shape[:2], W2.shape[-1], fq.shape[-1], dtype=F64)
        want, _, _ = reference(fq, fk, v, W1, W2, alpha, eta / math.e, F.gelu, "l2", T)
        assert_close(runs[1], want, tol=1e-12, name="global window vs reference")


# -- the linear memory is unchanged --

def test_linear_memory_unchanged(gen):
    q, k, v = random_qkv(1, 2, 8, 3, 2, dtype=F64, generator=gen)
    q, k = unit(q), unit(k)
    scores = torch.exp(q @ k.mT).tril()              # unnormalised causal attention
    want = scores @ v
    for memory in ("linear", None):
        kw = {} if memory is None else {"memory": memory}
        got, _ = deep_transformer(q, k, v, backend="recurrent", **kw)
        assert_close(got, want, tol=1e-12, name="linear deep_transformer")
    beta = torch.full(q.shape[:3], 0.2, dtype=F64)
    lin, _ = dot(q, k, v, eta=beta, memory="linear", backend="recurrent")
    deep, _ = dot(q, k, v, eta=beta, memory="mlp", backend="recurrent")
    assert (lin - deep).abs().max() > 1e-3           # the memories are different models


# -- gradients --

def test_gradcheck_kernel_forms(gen):
    q, k, v, alpha, eta, W2, gamma = inputs(gen, B=1, H=1, T=4, K=2, V=2, h=3, c=2, layout="source")
    xs = [x.clone().requires_grad_() for x in (q, k, v, W2)]

    def dt(q, k, v, W2):
        return deep_transformer(q, k, v, alpha=alpha, eta=eta, memory="mlp", initial_state={"W2": W2})[0]

    def do(q, k, v, W2):
        return dot(q, k, v, window=2, gamma=gamma, alpha=alpha, eta=eta, memory="mlp", initial_state={"W2": W2},
                   activation="tanh")[0]
    assert torch.autograd.gradcheck(dt, xs)
    assert torch.autograd.gradcheck(do, xs)


def test_gradcheck_taylor_form(gen):
    q, k, v, alpha, eta, W2, _ = inputs(gen, B=1, H=1, T=4, K=2, V=2, h=3)
    xs = [x.clone().requires_grad_() for x in (q, k, v, W2)]

    def dt(q, k, v, W2):
        return deep_transformer(q, k, v, alpha=alpha, eta=eta, phi_star=("taylor", 2), memory="mlp",
                                initial_state={"W2": W2}, backend="chunk", chunk_size=2)[0]
    assert torch.autograd.gradcheck(dt, xs)


# -- bad input --

def test_bad_input(gen):
    q, k, v, _, _, W2, _ = inputs(gen, T=4)
    st = {"W2": W2}
    with pytest.raises(ValueError, match="memory must be one of"):
        deep_transformer(q, k, v, memory="residual")
    with pytest.raises(ValueError, match="memory must be one of"):
        dot(q, k, v, memory="deep")
    for backend in ("chunk", "triton", "frozen_seq"):
        with pytest.raises(ValueError, match="backend='recurrent'"):
            deep_transformer(q, k, v, memory="mlp", initial_state=st, backend=backend)
        with pytest.raises(ValueError, match="backend='recurrent'"):
            dot(q, k, v, window=2, memory="mlp", initial_state=st, backend=backend)
    with pytest.raises(ValueError, match="normalize"):
        deep_transformer(q, k, v, memory="mlp", normalize=True)
    with pytest.raises(ValueError, match="window") as refused:
        deep_transformer(q, k, v, memory="mlp", window=2)
    assert "use dot" in str(refused.value) and "atlaslib.omega.swla" in str(refused.value)
    dot(q, k, v, window=2, memory="mlp", backend="recurrent")      # what the message offers runs
    with pytest.raises(ValueError, match="output_final_state"):
        deep_transformer(q, k, v, memory="mlp", output_final_state=True)
    with pytest.raises(ValueError, match="W1 = 0"):         # the kernel form's first layer starts at zero
        deep_transformer(q, k, v, memory="mlp", initial_state={"W1": torch.zeros(2, 2, 5, 3, dtype=F64), "W2": W2})
    with pytest.raises(ValueError, match="shape"):
        deep_transformer(q, k, v, memory="mlp", initial_state={"W2": W2[:, :1]})
    with pytest.raises(ValueError, match="W1"):             # W1 of the wrong feature width
        deep_transformer(q, k, v, memory="mlp", phi_star=("taylor", 2),
                         initial_state={"W1": torch.zeros(2, 2, 5, 3, dtype=F64), "W2": W2})
    with pytest.raises(ValueError, match="initial_state"):
        deep_transformer(q, k, v, memory="mlp", initial_state=W2)
    with pytest.raises(ValueError, match="activation"):
        deep_transformer(q, k, v, memory="mlp", activation="softmax")
    with pytest.raises(ValueError, match="activation"):
        deep_transformer(q, k, v, activation="tanh")
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="expansion must be an int"):
            dot(q, k, v, memory="mlp", expansion=bad)
    with pytest.raises(ValueError, match="linear memory has none"):
        deep_transformer(q, k, v, expansion=2)
    with pytest.raises(ValueError, match="sets h"):              # W2's width is h = 5, not 2 K
        dot(q, k, v, memory="mlp", expansion=2, initial_state=st)
    with pytest.raises(ValueError, match="initial_state") as refused:
        dot(q, k, v, initial_state=st)
    assert "memory='mlp'" in str(refused.value)
    dot(q, k, v, memory="mlp", initial_state=st)                    # what the message offers runs
    with pytest.raises(ValueError, match="output_final_state") as refused:
        dot(q, k, v, output_final_state=True)
    assert "memory='mlp'" not in str(refused.value)                 # which has no final state here either
    with pytest.raises(ValueError, match="output_final_state"):
        dot(q, k, v, memory="mlp", output_final_state=True)


@pytest.mark.parametrize("loop", [deep_mlp_recurrent, dot_mlp_recurrent])
def test_mlp_loops_refuse_an_unknown_activation_as_deep_transformer_does(gen, loop):
    """An activation outside chapter 3's list is the same ValueError in the per-token loops as in
    deep_transformer (not a bare KeyError)."""
    q, k, v = random_qkv(1, 2, 4, 3, 3, generator=gen, dtype=F64)
    with pytest.raises(ValueError) as public:
        deep_transformer(q, k, v, memory="mlp", activation="foo")
    with pytest.raises(ValueError, match=re.escape(str(public.value))):
        loop(q, k, v, torch.zeros(1, 2, 3, 6, dtype=F64), activation="foo")


@pytest.mark.parametrize("which", ["read", "write"])
@pytest.mark.parametrize("model", ["deep_transformer", "dot"])
def test_the_exact_kernel_deep_memory_refuses_scores_past_the_cap(gen, model, which):
    # phi* = the exact kernel: e^{k_i^T k_t} (a write's correction) or e^{k_i^T q_t} (a read) past the cap would
    # overflow; the deep memory refuses them as the linear one does
    from atlaslib.deep.validation import MAX_EXPONENT
    q, k, v = (torch.randn(1, 1, 6, 4, generator=gen) for _ in range(3))
    q, k = 0.1 * q, k / k.norm(dim=-1, keepdim=True)
    if which == "write":
        k[:, :, 3] *= 10                                    # k_3^T k_3 = 100
    else:
        q[:, :, 4] = 90 * k[:, :, 2]                        # k_2^T q_4 = 90
    assert max(float((q @ k.mT).tril().max()), float((k @ k.mT).max())) > MAX_EXPONENT
    run = (lambda: deep_transformer(q, k, v, memory="mlp", phi_star="kernel")) if model == "deep_transformer" \
        else (lambda: dot(q, k, v, memory="mlp", phi_star="kernel", eta=1e-3))
    with pytest.raises(ValueError, match="exceeds"):
        run()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", ["deep_transformer", "dot"])
def test_the_default_deep_memory_does_not_depend_on_16_bit_storage(gen, dtype, model):
    # the deep memory computes in fp32 for 16-bit inputs, its default W2 drawn in fp32: the same values stored in
    # 16 bits give the fp32 run's outputs, rounded
    q, k, v = ((0.3 * torch.randn(1, 2, 8, 8, generator=gen)).to(dtype) for _ in range(3))
    run = (lambda *x: deep_transformer(*x, memory="mlp", phi_star="kernel")) if model == "deep_transformer" \
        else (lambda *x: dot(*x, memory="mlp", phi_star="kernel", eta=0.1))
    assert torch.equal(run(q, k, v)[0], run(q.float(), k.float(), v.float())[0].to(dtype))
