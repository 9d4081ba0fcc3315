"""Chapter 6 token mixers (deep_transformer, swdt, dot, dla).

Each mixer's sequence mixing is checked against a reference written here from the math (masked
softmax with cumulative log-decays, autograd on the window loss, autograd on the dot-product loss of
an MLP memory), or against another model it must equal (softmax attention, SWA); not against
atlaslib.deep, but for one check that DOT's mixer hands its gates to ``dot`` as they are.
"""
import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F

from atlaslib.core.testing import assert_close, rel_rmse, window_l2_grad
from atlaslib.deep import dot, exp_features
from atlaslib.nn import MIXERS, TinyLM, available_mixers, make_mixer
from atlaslib.nn.deep_mixers import CoefficientCache, KernelCache
from mixer_helpers import seeded, step_through

D, H = 12, 2
NAMES = ("deep_transformer", "swdt", "dot", "dla")
CONFIGS = [
    ("deep_transformer", {}),
    ("deep_transformer", {"retention": "none"}),
    ("deep_transformer", {"normalize": False}),
    ("swdt", {"window": 3}),
    ("dot", {}),
    ("dot", {"window": 3, "gamma": "offset"}),
    ("dot", {"phi_star": ("taylor", 2)}),
    ("dot", {"phi_star": ("taylor", 2), "window": 3, "gamma": "source"}),
    ("dla", {}),
    ("dla", {"memory": "linear"}),
    ("dla", {"memory": "residual", "expansion": 2}),
    ("dla", {"phi_star": ("taylor", 2)}),
]
# the per-token rule: the forward's model at chunk_size=1 (c = 1 and the exact forms: at every chunk size)
STEP_CONFIGS = [
    ("deep_transformer", {}),
    ("deep_transformer", {"normalize": False, "chunk_size": 4}),
    ("swdt", {"window": 3, "chunk_size": 4}),
    ("dot", {"chunk_size": 4}),
    ("dot", {"window": 3, "chunk_size": 1}),
    ("dot", {"window": 3, "chunk_size": 1, "gamma": "source"}),
    ("dot", {"window": 3, "chunk_size": 1, "gamma": "offset", "retention": "none"}),
    ("dot", {"phi_star": ("taylor", 2), "chunk_size": 4}),
    ("dot", {"phi_star": ("taylor", 2), "window": 3, "chunk_size": 1, "gamma": "source"}),
    ("dla", {"chunk_size": 1}),
    ("dla", {"chunk_size": 1, "memory": "linear"}),
    ("dla", {"chunk_size": 1, "phi_star": ("taylor", 2)}),
]


def x_of(gen, B=2, T=9, dtype=torch.float32):
    return torch.randn(B, T, D, generator=gen).to(dtype)


def mix_inputs(mixer, x):
    """(q, k, v, mix output) as the mixer's forward builds them: the projections, convolution and
    normalisation are the shared front end; the references below start from its q, k, v."""
    seen = {}
    real = mixer.mix

    def spy(q, k, v, x_):
        seen.update(q=q, k=k, v=v)
        seen["o"] = real(q, k, v, x_)
        return seen["o"]
    mixer.mix = spy
    try:
        mixer(x)
    finally:
        del mixer.mix
    return seen["q"], seen["k"], seen["v"], seen["o"]


def test_registered_and_made_by_name():
    assert set(NAMES) <= set(available_mixers())
    for name in NAMES:
        mixer = make_mixer(name, D, H)
        assert mixer.mixer_name == name and MIXERS[name].__module__ == "atlaslib.nn.deep_mixers"
        assert name in repr(mixer)


@pytest.mark.parametrize("name, kw", CONFIGS)
def test_shape_causality_and_gradients(gen, name, kw):
    seeded(gen)
    mixer = make_mixer(name, D, H, backend="chunk", chunk_size=4, **kw)
    x = x_of(gen, T=11)
    y = mixer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    x2 = x.clone()
    x2[:, 6:] = torch.randn(2, 5, D, generator=gen)                 # the future must not reach the past
    with torch.no_grad():
        assert_close(mixer(x2)[:, :6], y.detach()[:, :6], name=f"{name}: causality")
    y.square().sum().backward()
    missing = [n for n, p in mixer.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing
    assert any(p.grad.abs().sum() > 0 for p in mixer.parameters())


# ---------------------------------------------------------------- the DeepTransformer and SWDT

def attention_with_decay(q, k, v, log_alpha, window=None, normalize=True):
    """y_t = sum_{i visible} exp(q_t.k_i / sqrt(K) + L_t - L_i) v_i (divided by the same sum without v_i),
    L_t = sum_{s<=t} log alpha_s: the dense masked form."""
    T = q.shape[2]
    s = q @ k.mT / math.sqrt(q.shape[-1])
    if log_alpha is not None:
        L = log_alpha.cumsum(-1)
        s = s + L[..., :, None] - L[..., None, :]
    t = torch.arange(T)
    mask = t[None] <= t[:, None]
    if window is not None:
        mask &= t[None] > t[:, None] - window
    s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v if normalize else s.exp() @ v


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("normalize", [True, False])
def test_deep_transformer_is_attention_with_a_learned_decay(gen, window, normalize):
    seeded(gen)
    mixer = make_mixer("deep_transformer", D, H, window=window, normalize=normalize, backend="chunk",
                       chunk_size=4).double()
    x = x_of(gen, T=10, dtype=torch.float64)
    with torch.no_grad():
        q, k, v, o = mix_inputs(mixer, x)
        log_alpha = mixer.log_gate(x)
        assert (log_alpha < 0).all()
        assert_close(o, attention_with_decay(q, k, v, log_alpha, window, normalize), name="dense reference")


@pytest.mark.parametrize("name, other, kw", [("deep_transformer", "softmax", {}),
                                             ("swdt", "swa", {"window": 3})])
def test_without_retention_it_is_softmax_attention(gen, name, other, kw):
    """[A]'s claim, with the normaliser: alpha = eta = 1 and the exact phi* give (sliding-window) softmax attention."""
    seeded(gen)
    deep = make_mixer(name, D, H, retention="none", backend="chunk", chunk_size=4, **kw)
    ref = make_mixer(other, D, H, **kw)
    ref.load_state_dict(deep.state_dict())                          # the same projections, nothing else
    x = x_of(gen).double()
    with torch.no_grad():
        assert_close(deep.double()(x), ref.double()(x))                 # fp64: both exact to rounding


def test_swdt_cache_is_bounded_and_full_cache_grows(gen):
    seeded(gen)
    swdt, full = make_mixer("swdt", D, H, window=3), make_mixer("deep_transformer", D, H)
    assert swdt.state_size == 3 * H * (2 * D // H + 1) and full.state_size is None
    assert make_mixer("swdt", D, H).window == 64
    x = x_of(gen, B=1, T=6)
    with torch.no_grad():
        _, small = step_through(swdt, x)
        _, big = step_through(full, x)
    assert isinstance(small.memory, KernelCache) and small.memory.keys.shape[2] == 3
    assert sum(t[0].numel() for t in small.memory) == swdt.state_size
    assert big.memory.keys.shape[2] == big.memory.log_weights.shape[2] == 6


# ---------------------------------------------------------------- DOT

def omega_by_autograd(fq, fk, v, c, gamma, alpha, eta, kappa=None):
    """One GD step per token on sum_i gamma_i^{(t)} 1/2 |M phi(k_i) - v_i|^2 over the last c pairs, by autograd.
    With ``kappa`` the memory is kept in coefficient form M = sum_j u_j phi(k_j)^T (phi* exact), and the
    gradient is taken with respect to the coefficients' image: M phi(x) = sum_j u_j kappa(k_j, x)."""
    B, Hh, T, _ = fk.shape
    M, ys = torch.zeros(B, Hh, v.shape[-1], fk.shape[-1], dtype=v.dtype), []
    for t in range(T):
        grad = window_l2_grad(M, fk, v, t, c, gamma)
        a = 1.0 if alpha is None else alpha[:, :, t, None, None]
        M = a * M - eta[:, :, t, None, None] * grad
        ys.append(torch.einsum("bhvd,bhd->bhv", M, fq[:, :, t]))
    return torch.stack(ys, dim=2)


@pytest.mark.parametrize("kw", [{}, {"window": 3, "gamma": "offset"}, {"window": 3, "gamma": "source"},
                                {"window": 2, "retention": "none"}])
def test_dot_on_taylor_features_is_the_omega_rule(gen, kw):
    """phi* = phi*_P: GD on the window's l2 loss of the features, the mixer's gates put where they belong."""
    seeded(gen)
    mixer = make_mixer("dot", D, H, phi_star=("taylor", 2), backend="chunk", chunk_size=1, **kw).double()
    x = x_of(gen, T=8, dtype=torch.float64)
    with torch.no_grad():
        q, k, v, o = mix_inputs(mixer, x)
        gamma, alpha, eta = mixer.gate_tensors(x, torch.float64)
    assert_close(o, omega_by_autograd(exp_features(q, 2), exp_features(k, 2), v, mixer.window, gamma, alpha, eta),
                 name="dot (taylor 2) vs autograd")


@pytest.mark.parametrize("kw", [{}, {"window": 3, "gamma": "source"}])
def test_dot_mixer_passes_its_retention_as_log_gates(gen, kw):
    """The mixer passes log alpha (as the other mixers do); dot given the gates alpha themselves agrees."""
    seeded(gen)
    mixer = make_mixer("dot", D, H, backend="recurrent", **kw)
    x = x_of(gen)
    with torch.no_grad():
        q, k, v, o = mix_inputs(mixer, x)
        gamma, alpha, eta = mixer.gate_tensors(x, torch.float32)
        ref, _ = dot(q, k, v, window=mixer.window, gamma=gamma, alpha=alpha, eta=eta, backend="recurrent")
    assert alpha is not None
    assert_close(o, ref, name="dot mixer vs dot")


def test_dot_kernel_is_the_limit_of_the_taylor_features(gen):
    """The exact phi* and phi*_P with the same weights and step: the gap falls with P (unit q, k: the
    truncation error of exp is at most e / (P + 1)!)."""
    seeded(gen)
    exact = make_mixer("dot", D, H, window=2, backend="chunk", chunk_size=1, eta_max=0.15).double()
    x = x_of(gen, T=8, dtype=torch.float64)
    with torch.no_grad():
        ref = exact(x)
        gaps = []
        for P in (1, 2, 4, 6):
            approx = make_mixer("dot", D, H, window=2, phi_star=("taylor", P), backend="chunk", chunk_size=1,
                                eta_max=0.15).double()
            approx.load_state_dict(exact.state_dict())
            gaps.append(rel_rmse(approx(x), ref))
    assert all(a > b for a, b in zip(gaps, gaps[1:])), gaps
    assert gaps[-1] < 1e-4, gaps


def test_dot_default_step_bound():
    """eta_max = 1 / (c |phi*(k)|^2) for unit keys: 1 / (c e) exact, 1 / (c sum_{n<=P} 1/n!) truncated."""
    assert math.isclose(make_mixer("dot", D, H, window=3).eta_max, 1 / (3 * math.e))
    assert math.isclose(make_mixer("dot", D, H, phi_star=("taylor", 2)).eta_max, 1 / 2.5)
    assert make_mixer("dot", D, H).qk_norm
    with pytest.raises(TypeError, match="phi\\*"):
        make_mixer("dot", D, H, degree=2)
    with pytest.raises(ValueError, match="phi_star"):
        make_mixer("dot", D, H, phi_star="taylor")


def test_dot_caches(gen):
    """The kernel form keeps a coefficient per past token (state_size None); phi*_P a fixed [V, D] memory."""
    seeded(gen)
    x = x_of(gen, B=1, T=6)
    kernel = make_mixer("dot", D, H, window=3, gamma="source")
    taylor = make_mixer("dot", D, H, window=3, phi_star=("taylor", 2))
    with torch.no_grad():
        _, grow = step_through(kernel, x)
        _, fixed = step_through(taylor, x)
    assert kernel.state_size is None and isinstance(grow.memory, CoefficientCache)
    assert grow.memory.keys.shape[2] == grow.memory.coefficients.shape[2] == 6
    assert grow.memory.values.shape[2] == grow.memory.sources.shape[2] == 2          # the last c - 1
    assert fixed.memory.M.numel() == taylor.state_size == H * math.comb(D // H + 2, 2) * (D // H)


# ---------------------------------------------------------------- DLA

def dla_by_autograd(q, k, v, W1, W2, alpha, eta):
    """W_t = alpha_t W_{t-1} - eta_t grad_W (-<W2 gelu(W1 k_t), v_t>), y_t = W2_t gelu(W1_t q_t), per head."""
    ys = []
    for t in range(q.shape[2]):
        W1v, W2v = W1.clone().requires_grad_(True), W2.clone().requires_grad_(True)
        pred = torch.einsum("bhvi,bhi->bhv", W2v, F.gelu(torch.einsum("bhik,bhk->bhi", W1v, k[:, :, t])))
        g1, g2 = torch.autograd.grad(-(pred * v[:, :, t]).sum(), (W1v, W2v))
        a, e = alpha[:, :, t, None, None], eta[:, :, t, None, None]
        W1, W2 = a * W1 - e * g1, a * W2 - e * g2
        ys.append(torch.einsum("bhvi,bhi->bhv", W2, F.gelu(torch.einsum("bhik,bhk->bhi", W1, q[:, :, t]))))
    return torch.stack(ys, 2)


@pytest.mark.parametrize("P", [None, 2])
def test_dla_is_gd_on_the_dot_product_loss_of_an_mlp(gen, P):
    """phi_star=("taylor", P): the same on phi*_P(q), phi*_P(k), the DeepTransformer with a deep memory."""
    seeded(gen)
    mixer = make_mixer("dla", D, H, backend="chunk", chunk_size=1, phi_star=P and ("taylor", P)).double()
    x = x_of(gen, T=7, dtype=torch.float64)
    with torch.no_grad():
        q, k, v, o = mix_inputs(mixer, x)
        g = mixer.gates(x, torch.float64)
    if P is not None:
        q, k = exp_features(q, P), exp_features(k, P)
        assert mixer.initial["W1"].shape[-1] == math.comb(D // H + P, P)
    W1, W2 = (mixer.initial[n].double()[None].expand(2, -1, -1, -1) for n in ("W1", "W2"))
    assert_close(o, dla_by_autograd(q, k, v, W1, W2, g["alpha"], g["eta"]), name="dla vs autograd")


@pytest.mark.parametrize("kw", [{"window": 3}, {"window": 3, "phi_star": ("taylor", 2)}])
def test_dot_mixer_runs_dots_default_model(gen, kw):
    """With c > 1 the chunk size is part of DOT's model: without chunk_size the mixer runs dot()'s default
    model (FROZEN_CHUNK_SIZE = 16, as chapter 4's Omega rule), which another chunk size changes."""
    from atlaslib.deep import FROZEN_CHUNK_SIZE
    mixer = make_mixer("dot", D, H, backend="chunk", **kw).double()
    x = torch.randn(2, 40, D, generator=gen, dtype=torch.float64)
    outputs = {}
    for b in (None, FROZEN_CHUNK_SIZE, 64):
        other = copy.deepcopy(mixer)
        if b is not None:
            other.chunk_size = b
        outputs[b] = other(x)
    assert_close(outputs[None], outputs[FROZEN_CHUNK_SIZE], tol=1e-12)
    assert rel_rmse(outputs[None], outputs[64]) > 1e-6


def test_dla_axes_are_fixed():
    assert make_mixer("dla", D, H).config.memory == "mlp"
    for bad in ({"bias": "l2"}, {"optimizer": "momentum"}, {"window": 2}):
        with pytest.raises(TypeError, match="fixed by DLA"):
            make_mixer("dla", D, H, **bad)
    with pytest.raises(ValueError, match="with a deep memory is the per-token function"):
        make_mixer("dla", D, H, phi_star="kernel")
    with pytest.raises(ValueError, match="window"):
        make_mixer("swdt", D, H, window=0)


# ---------------------------------------------------------------- steps and the LM

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name, kw", STEP_CONFIGS)
def test_step_is_the_forward(gen, dtype, name, kw):
    seeded(gen)
    mixer = make_mixer(name, D, H, backend="chunk", **kw).to(dtype)
    x = x_of(gen, T=7, dtype=dtype)
    with torch.no_grad():
        assert_close(step_through(mixer, x)[0], mixer(x), name=f"{name}: step vs forward")


@pytest.mark.parametrize("name, kw", [("deep_transformer", {}), ("swdt", {"window": 4}), ("dot", {}),
                                      ("dot", {"phi_star": ("taylor", 2), "window": 2, "chunk_size": 1}),
                                      ("dla", {"chunk_size": 1})])
def test_tinylm_trains_and_generates(gen, name, kw):
    seeded(gen)
    lm = TinyLM(19, 16, 2, name, 2, backend="chunk", **kw)
    ids = torch.randint(0, 19, (4, 16), generator=gen)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(lm(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    lm.double()
    out = lm.generate(ids[:, :3], 5)
    with torch.no_grad():
        teacher = lm(out).argmax(-1)
    assert out.shape == (4, 8) and torch.equal(teacher[:, 2:-1], out[:, 3:])


@pytest.mark.parametrize("window", [1, 2])
def test_dot_with_taylor_features_builds_under_meta(window):
    """DOT's default eta_max = 1 / (c |phi*_P(k)|^2) (unit k) is a number, not a tensor: the mixer builds
    under torch.device("meta") like every other, with the eta_max it has on the CPU."""
    P = 2
    k = F.normalize(torch.randn(7, dtype=torch.float64), dim=0)
    expected = 1.0 / (window * exp_features(k, P).square().sum().item())     # |phi*_P(k)|^2 = sum_n 1/n!
    with torch.device("meta"):
        m = make_mixer("dot", 16, 2, phi_star=("taylor", P), window=window)
    assert m.eta_max == make_mixer("dot", 16, 2, phi_star=("taylor", P), window=window).eta_max
    assert m.eta_max == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name, kw", [("deep_transformer", {}), ("swdt", {"window": 3})])
def test_unnormalised_step_refuses_overflowing_scores_as_the_forward(gen, name, kw):
    """Without the normaliser a score above the library's cap overflows exp: the one-token step refuses it
    with the forward's ValueError instead of returning NaN."""
    seeded(gen)
    m = make_mixer(name, 16, 2, normalize=False, conv_size=0, **kw)
    x = torch.randn(1, 4, 16, generator=gen) * 60
    with pytest.raises(ValueError, match="exceeds 80") as forward:
        m(x)
    with pytest.raises(ValueError, match=re.escape(str(forward.value).split(" = ")[0])):
        step_through(m, x)
    y, _ = step_through(m, x / 60)                                            # small scores: a finite read
    assert torch.isfinite(y).all()
