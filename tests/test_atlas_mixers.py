"""Chapter 5 mixers (atlas, atlas++) and the hybrid backbones (swa, mag, mal) of atlaslib.nn."""
import math

import pytest
import torch

from atlaslib.atlas import atlas
from atlaslib.core.testing import assert_close
from atlaslib.nn import TinyLM, make_mixer
from mixer_helpers import projections, seeded, step_through

D, H = 12, 2


def x_of(gen, B=2, T=9, dtype=torch.float32):
    return torch.randn(B, T, D, generator=gen).to(dtype)


@pytest.mark.parametrize("name, kw", [
    ("atlas", {}), ("atlas", {"window": 3, "memory": "residual"}), ("atlas++", {}),
    ("swa", {"window": 4}), ("mag", {"memory": "atlas", "window": 4}), ("mal", {"memory": "deltanet", "window": 4}),
    ("mag", {"memory": "atlas++", "window": 2, "memory_window": 2}),
])
def test_shapes(gen, name, kw):
    seeded(gen)
    y = make_mixer(name, D, H, backend="chunk", **kw)(x_of(gen))
    assert y.shape == (2, 9, D) and torch.isfinite(y).all()


def test_swa_is_the_masked_softmax(gen):
    """Independent reference: per head, scores masked to t - c < i <= t, softmax, weighted values."""
    seeded(gen)
    c, x = 3, x_of(gen, dtype=torch.float64)
    swa = make_mixer("swa", D, H, window=c, conv_size=0).double()
    B, T, _ = x.shape
    q, k, v = (p(x).view(B, T, H, -1).transpose(1, 2) for p in (swa.q_proj, swa.k_proj, swa.v_proj))
    t = torch.arange(T)
    mask = (t[None] <= t[:, None]) & (t[None] > t[:, None] - c)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
    assert_close(swa(x), swa.o_proj(o))                           # fp64: the default fp64 tolerance


def test_swa_with_a_long_window_is_softmax_attention(gen):
    seeded(gen)
    x = x_of(gen)
    swa = make_mixer("swa", D, H, window=x.shape[1])
    full = make_mixer("softmax", D, H)
    full.load_state_dict(swa.state_dict())
    assert_close(swa(x), full(x))


@pytest.mark.parametrize("memory", ["atlas", "gla"])
def test_mal_with_a_long_window_is_attention_after_the_normalised_memory(gen, memory):
    """y = SWA(RMSNorm(Memory(x))): the RMS norm written out here, with a weight that is not all ones."""
    seeded(gen)
    x = x_of(gen)
    mal = make_mixer("mal", D, H, memory=memory, window=x.shape[1], backend="chunk")
    full = make_mixer("softmax", D, H)
    full.load_state_dict(mal.attention.state_dict())
    weight = torch.rand(D, generator=gen, dtype=x.dtype) + 0.5
    with torch.no_grad():
        mal.norm.weight.copy_(weight)
        h = mal.memory(x)
        eps = torch.finfo(h.dtype).eps
        assert_close(mal(x), full(h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight))


def test_mal_attention_learns_from_the_start_as_a_plain_window_does(gen):
    """The reason for MAL's norm: at initialisation (memory at zero, small steps) the memory's output is
    small, and without the norm the attention's query projection gets gradients orders of magnitude
    smaller than a sliding window's on the same input; with it, of the same order."""
    seeded(gen)
    x = torch.randn(4, 16, D, generator=gen)
    mal = make_mixer("mal", D, H, memory="atlas", window=4)
    swa = make_mixer("swa", D, H, window=4)
    target = torch.randn(4, 16, D, generator=gen)

    def q_grad(mixer, inputs):
        mixer.zero_grad()
        ((mixer(inputs) - target) ** 2).mean().backward()
        return mixer.attention.q_proj.weight.grad.norm() if mixer is mal else mixer.q_proj.weight.grad.norm()

    with torch.no_grad():
        raw = mal.memory(x)
    assert raw.pow(2).mean().sqrt() < 0.2, "the memory's output starts small"
    ratio = q_grad(mal, x) / q_grad(swa, x)
    assert 0.1 < ratio < 10, ratio


@pytest.mark.parametrize("g, branch", [(1.0, "attention"), (0.0, "memory")])
def test_mag_gate_selects_a_branch(gen, g, branch):
    seeded(gen)
    x = x_of(gen)
    mag = make_mixer("mag", D, H, memory="atlas", window=3, backend="chunk")
    with torch.no_grad():
        mag.gate_proj.weight.zero_()
        mag.gate_proj.bias.fill_(1e4 if g == 1.0 else -1e4)            # sigmoid: exactly 1 / 0 in fp32
        assert_close(mag(x), getattr(mag, branch)(x))


@pytest.mark.parametrize("name", ["mag", "mal"])
def test_hybrid_head_dims_reach_both_branches(gen, name):
    """head_k_dim / head_v_dim (what a d_model that n_heads does not divide needs) size both branches,
    unless attention_kw sizes the attention's own."""
    hybrid = make_mixer(name, 10, 3, memory="deltanet", window=3, head_k_dim=4, head_v_dim=5)
    for branch in (hybrid.memory, hybrid.attention):
        assert (branch.head_k_dim, branch.head_v_dim) == (4, 5)
    assert hybrid(torch.randn(2, 7, 10, generator=gen)).shape == (2, 7, 10)
    own = make_mixer(name, 12, 3, memory="deltanet", window=3, head_k_dim=4, head_v_dim=4,
                     attention_kw={"head_k_dim": 2, "head_v_dim": 6})
    assert (own.attention.head_k_dim, own.attention.head_v_dim) == (2, 6)


@pytest.mark.parametrize("name", ["mag", "mal"])
def test_hybrid_windows_reach_their_branches(gen, name):
    """``window`` is the attention's and ``memory_window`` the memory's own Omega window: the memory branch
    computes what an atlas mixer built with that window computes on the same weights."""
    seeded(gen)
    hybrid = make_mixer(name, D, H, memory="atlas", window=5, memory_window=3, backend="chunk", chunk_size=1)
    assert hybrid.attention.window == 5
    alone = make_mixer("atlas", D, H, window=3, backend="chunk", chunk_size=1)
    alone.load_state_dict(hybrid.memory.state_dict())
    x = x_of(gen)
    with torch.no_grad():
        assert_close(hybrid.memory(x), alone(x), name="memory branch vs atlas(window=3)")


@pytest.mark.parametrize("name", ["mag", "mal"])
def test_hybrid_options_are_refused_by_their_own_names(name):
    """A memory_window for a memory mixer without a window, and an attention_kw that is not a dict or sets
    the window (the hybrid's own ``window=``), are refused naming the option the user wrote."""
    with pytest.raises(TypeError, match=r"memory_window=3 was given, but the memory mixer 'gla' has no window"):
        make_mixer(name, D, H, memory="gla", memory_window=3)
    with pytest.raises(TypeError, match="attention_kw must be a dict"):
        make_mixer(name, D, H, memory="deltanet", attention_kw="x")
    with pytest.raises(ValueError, match=r"the hybrid's own window=, not attention_kw\['window'\]"):
        make_mixer(name, D, H, memory="deltanet", attention_kw={"window": 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'windw'"):   # other errors pass through
        make_mixer(name, D, H, memory="omeganet", memory_window=3, windw=2)


def test_mag_is_the_documented_mix(gen):
    seeded(gen)
    x = x_of(gen)
    mag = make_mixer("mag", D, H, memory="deltanet", window=3, backend="chunk")
    with torch.no_grad():
        g = torch.sigmoid(mag.gate_proj(x))
        assert_close(mag(x), g * mag.attention(x) + (1 - g) * mag.memory(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name, kw", [
    ("atlas", {"chunk_size": 1, "window": 2}), ("atlas", {"chunk_size": 1, "momentum": False, "gamma": None}),
    ("swa", {"window": 2}), ("mag", {"memory": "atlas", "window": 3, "chunk_size": 1}),
    ("mal", {"memory": "omeganet", "window": 2, "chunk_size": 1}),
    ("atlas", {"chunk_size": 1, "window": 3, "gamma": "source"}),
    ("atlas", {"chunk_size": 1, "memory": "residual", "window": 2, "gamma": "source"}),
    ("atlas++", {"chunk_size": 1, "window": 2}),
    ("mag", {"memory": "atlas++", "window": 3, "memory_window": 2, "chunk_size": 1}),
    ("atlas", {"chunk_size": 1, "memory": "mlp", "window": 2, "expansion": 2, "activation": "tanh"}),
])
def test_step_is_the_forward(gen, dtype, name, kw):
    seeded(gen)
    mixer = make_mixer(name, D, H, backend="chunk", **kw).to(dtype)
    x = x_of(gen, T=7, dtype=dtype)
    with torch.no_grad():
        # ATLAS in fp32: Newton-Schulz (Muon's coefficients, not a contraction) amplifies rounding, so
        # fp32 gets 5e-4; everything else, and fp64, the default of its dtype
        is_atlas = lambda n: n in ("atlas", "atlas++")                    # noqa: E731
        tol = None
        if dtype == torch.float32 and (is_atlas(name) or is_atlas(kw.get("memory"))):
            tol = 5e-4
        assert_close(step_through(mixer, x)[0], mixer(x), tol=tol, name=f"{name}: step vs forward")


def test_swa_cache_is_bounded(gen):
    swa = make_mixer("swa", D, H, window=3)
    cache = None
    for t in range(6):
        _, cache = swa.step(torch.randn(1, D, generator=gen), cache)
    assert cache.memory[0].shape[2] == 3 and swa.state_size == 3 * H * 2 * (D // H)


@pytest.mark.parametrize("name, kw", [("atlas++", {"window": 3}),
                                      ("atlas", {"memory": "mlp", "window": 3, "gamma": "source"})])
def test_deep_step_state_is_bounded(gen, name, kw):
    """A deep memory's step carries its weights, their momenta and the last c - 1 window rows (and, per
    source, their gates): a size fixed by c, whose weights and momenta are what ``state_size`` counts."""
    seeded(gen)
    mixer, B, c = make_mixer(name, D, H, **kw), 2, kw["window"]
    cache, rows = None, []
    for t in range(6):
        _, cache = mixer.step(torch.randn(B, D, generator=gen), cache)
        rows.append(cache.memory.engine.keys.shape[1])
    assert rows == [min(t + 1, c - 1) for t in range(6)]
    engine, gammas = cache.memory
    assert sum(w.numel() for part in (engine.Z, engine.S) for w in part.values()) == B * mixer.state_size
    assert (gammas is None) == (kw.get("gamma") != "source")
    assert gammas is None or gammas.shape == (B, H, c - 1)


@pytest.mark.parametrize("kw", [{"window": 3}, {"window": 2, "gamma": "source", "memory": "mlp"},
                                {"window": 1, "memory": "residual"}])
def test_mixer_is_atlas_on_its_own_projections(gen, kw):
    """Without the convolution the layer is o_proj of chapter 5's per-token rule, with every gate computed
    here from the raw weights: theta = sigmoid(.), eta = eta_max sigmoid(.), gamma, alpha as chapter 4's."""
    seeded(gen)
    m = make_mixer("atlas", D, H, conv_size=0, backend="chunk", chunk_size=1, **kw).double()
    x = torch.randn(2, 7, D, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        q, k, v, gam, alpha, eta = projections(m, x)
        gamma = gam if m.gamma_mode == "offset" else gam[..., 0]
        theta = torch.sigmoid(m.theta_proj(x)).transpose(1, 2)
        start = None if m.initial is None else {n: w[None].expand(2, *w.shape) for n, w in m.initial.items()}
        y, _ = atlas(q, k, v, window=m.window, gamma=gamma, alpha=alpha, eta=eta, theta=theta, memory=m.memory,
                     initial_state=start, backend="recurrent")
        B, _, T, V = y.shape
        assert_close(m(x), m.o_proj(y.transpose(1, 2).reshape(B, T, H * V)), name=f"atlas {kw}")


@pytest.mark.parametrize("expansion", [1, 2])
def test_deep_memory_options_shape_the_memory(gen, expansion):
    """expansion e: the MLP memory W2 act(W1 x) has h = e D hidden units; memory and momentum count twice
    H (h D + V h); the activation reaches the forward (another output)."""
    seeded(gen)
    mixer = make_mixer("atlas", D, H, memory="mlp", expansion=expansion, backend="chunk")
    Dk = Dv = D // H
    h = expansion * Dk
    assert mixer.state_size == 2 * H * (h * Dk + Dv * h)
    assert {n: tuple(w.shape) for n, w in mixer.initial.items()} == {"W1": (H, h, Dk), "W2": (H, Dv, h)}
    x = x_of(gen)
    other = make_mixer("atlas", D, H, memory="mlp", expansion=expansion, activation="tanh", backend="chunk")
    other.load_state_dict(mixer.state_dict())
    with torch.no_grad():
        assert (other(x) - mixer(x)).abs().max() > 1e-4


@pytest.mark.parametrize("name, kw", [("mag", {"memory": "atlas"}), ("mal", {"memory": "atlas"}), ("atlas", {}),
                                      ("atlas", {"memory": "mlp"}), ("atlas++", {})])
def test_gradients_flow(gen, name, kw):
    seeded(gen)
    mixer = make_mixer(name, D, H, window=3, backend="chunk", **kw)
    mixer(x_of(gen)).square().sum().backward()
    missing = [n for n, p in mixer.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing
    assert any(p.grad.abs().sum() > 0 for n, p in mixer.named_parameters() if "eta_proj" in n or "theta" in n)


def test_tiny_lm_with_a_hybrid(gen):
    seeded(gen)
    lm = TinyLM(17, d_model=D, n_layers=1, mixer="mag", n_heads=H, memory="atlas", window=4, backend="chunk")
    ids = torch.randint(0, 17, (2, 6), generator=gen)
    assert lm(ids).shape == (2, 6, 17)


@pytest.mark.parametrize("name, kw, error, match", [
    ("swa", {"window": 0}, ValueError, "window"),
    ("mag", {"window": 0}, ValueError, "window"),
    ("mal", {"window": 1.5}, TypeError, "window"),
    ("mag", {"memory": "nope"}, ValueError, "unknown memory mixer"),
    ("mal", {"memory": "mag"}, ValueError, "hybrid"),
    ("mag", {"memory": "mal"}, ValueError, "hybrid"),
    ("atlas", {"memory": "deep"}, ValueError, "memory"),
    ("atlas", {"window": 0}, ValueError, "window"),
    ("atlas", {"expansion": 2}, ValueError, "memory='linear' has none"),
    ("atlas", {"memory": "mlp", "expansion": 0}, ValueError, "expansion"),
    ("atlas", {"memory": "mlp", "activation": "softmax"}, ValueError, "activation"),
    ("atlas", {"ns_coeffs": "foo"}, ValueError, "ns_coeffs must be one of"),
    ("omeganet", {"poly": "foo"}, ValueError, "poly must be one of"),
    ("atlas++", {"head_k_dim": 4, "head_v_dim": 6}, ValueError, "head_k_dim == head_v_dim"),
    ("mamba2", {"gate_temperature": 0.0}, ValueError, "gate_temperature must be a finite number > 0"),
    ("kda", {"gate_temperature": -1.0}, ValueError, "gate_temperature must be a finite number > 0"),
])
def test_bad_input_is_named(name, kw, error, match):
    with pytest.raises(error, match=match):
        make_mixer(name, D, H, **kw)


def test_linear_memory_state_size_counts_the_momentum(gen):
    """ATLAS with a linear memory carries M and its momentum S per sequence: ``state_size`` (which the
    experiments' tables report) counts both."""
    seeded(gen)
    mixer, B = make_mixer("atlas", D, H), 2
    with torch.no_grad():
        _, cache = mixer.step(torch.randn(B, D, generator=gen))
    assert cache.memory.M.numel() + cache.memory.S.numel() == B * mixer.state_size


@pytest.mark.parametrize("memory", ["linear", "mlp"])
def test_state_size_without_momentum_is_the_memory(gen, memory):
    """momentum=False: S_t is the step's gradient, never read from the cache (a perturbed carried S leaves the
    next output as it is), so ``state_size`` counts the memory alone, half of what it counts with momentum."""
    seeded(gen)
    with_momentum = make_mixer("atlas", D, H, memory=memory, backend="chunk", chunk_size=1)
    mixer = make_mixer("atlas", D, H, memory=memory, momentum=False, backend="chunk", chunk_size=1).double()
    B = 2
    x = torch.randn(B, 3, D, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        _, cache = mixer.step(x[:, 0])
        _, cache = mixer.step(x[:, 1], cache)
        if memory == "linear":
            M, S = cache.memory.M, cache.memory.S
            weights = M.numel()
            shaken = cache._replace(memory=cache.memory._replace(S=S + torch.randn_like(S)))
        else:
            engine = cache.memory.engine
            weights = sum(w.numel() for w in engine.Z.values())
            moved = engine._replace(S={n: w + torch.randn_like(w) for n, w in engine.S.items()})
            shaken = cache._replace(memory=cache.memory._replace(engine=moved))
        y, _ = mixer.step(x[:, 2], cache)
        y_shaken, _ = mixer.step(x[:, 2], shaken)
    assert torch.equal(y, y_shaken)
    assert weights == B * mixer.state_size and with_momentum.state_size == 2 * mixer.state_size
