"""The chapter 7 mixer, ``make_mixer("memory_caching", ...)``.

Its mix is checked against Memory Caching written here from the math (per-segment delta rule with
explicit projectors, cached final states, softmax over <u_t, mean keys>), against the library's
definition (``memory_caching(backend="recurrent")``) with the gates computed here from the raw weights,
and against the identities that tie it to other mixers: one segment is the base mixer; residual
Memory Caching over linear attention with independent segments is linear attention.
"""
import pytest
import torch
import torch.nn.functional as F

from atlaslib.caching import memory_caching
from atlaslib.core.testing import assert_close
from atlaslib.delta import delta_rule
from atlaslib.linear import linear_attention
from atlaslib.nn import TinyLM, make_mixer
from atlaslib.nn.caching_mixers import CACHED, MemoryCaching
from atlaslib.train import MQARTask, train_mqar
from mixer_helpers import seeded

D, H = 12, 2
BASES = sorted(CACHED)
F64 = torch.float64


def front_end(mixer, x):
    """q, k, v [B, H, T, d] as TokenMixer.forward makes them: projections, short convolution, heads, l2 norm."""
    q, k, v = mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)
    if mixer.q_conv is not None:
        q, k, v = mixer.q_conv(q), mixer.k_conv(k), mixer.v_conv(v)
    B, T, _ = x.shape
    q, k, v = (y.view(B, T, H, -1).transpose(1, 2) for y in (q, k, v))
    return (F.normalize(q, dim=-1), F.normalize(k, dim=-1), v) if mixer.qk_norm else (q, k, v)


def heads(y, B, T):
    return y.view(B, T, H, -1).transpose(1, 2)


def gates_from_weights(mixer, x):
    """beta_t = sigmoid(W_b x_t + b), log alpha_t = logsigmoid(W_a x_t + b) / 16, u_t = W_u x_t, from the
    weights themselves (not the mixer's gate code)."""
    B, T, _ = x.shape
    gates = {}
    if hasattr(mixer, "beta"):
        gates["beta"] = torch.sigmoid(x @ mixer.beta.proj.weight.T + mixer.beta.proj.bias).transpose(1, 2)
    if hasattr(mixer, "gate_proj"):
        la = F.logsigmoid(x @ mixer.gate_proj.weight.T + mixer.gate_proj.bias) / 16.0
        la = heads(la, B, T)
        gates["log_alpha"] = la if la.shape[-1] > 1 else la[..., 0]
    return gates, None if mixer.u_proj is None else heads(x @ mixer.u_proj.weight.T, B, T)   # residual: no u


def grm_gated_delta_by_hand(q, k, v, beta, alpha, u, C):
    """Memory Caching, GRM, independent segments of C tokens over the gated delta rule, from the math:
    M_t = alpha_t M_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T restarted at 0 every C tokens;
    y_t = sum_i g_i M^(i) q_t + g_s M^(s)_t q_t, g = softmax(<u_t, mean keys of each segment (own: up to t)>)."""
    B, Hh, T, K = q.shape
    eye = torch.eye(K, dtype=q.dtype)
    out = torch.zeros(B, Hh, T, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(Hh):
            cached, means, M = [], [], torch.zeros(v.shape[-1], K, dtype=q.dtype)
            for t in range(T):
                if t % C == 0 and t:
                    cached.append(M)
                    means.append(k[b, h, t - C:t].mean(0))
                    M = torch.zeros_like(M)
                kt = k[b, h, t]
                M = alpha[b, h, t] * M @ (eye - beta[b, h, t] * torch.outer(kt, kt)) + \
                    beta[b, h, t] * torch.outer(v[b, h, t], kt)
                own = k[b, h, t - t % C:t + 1].mean(0)
                g = torch.softmax(torch.stack([u[b, h, t] @ m for m in means + [own]]), 0)
                out[b, h, t] = sum(g_i * (S @ q[b, h, t]) for g_i, S in zip(g, cached + [M]))
    return out


# ---------------------------------------------------------------- the layer

@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("segments", [4, "log"])
def test_forward_shape_and_the_classes_behind_the_name(gen, base, segments):
    seeded(gen)
    mixer = make_mixer("memory_caching", D, H, base=base, segments=segments)
    assert isinstance(mixer, MemoryCaching) and isinstance(mixer, type(make_mixer(base, D, H)))
    assert mixer.mixer_name == "memory_caching" and mixer.state_size is None
    y = mixer(torch.randn(2, 11, D, generator=gen))
    assert y.shape == (2, 11, D) and torch.isfinite(y).all()


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("aggregate", ["grm", "ssc", "residual"])
def test_gradient_reaches_every_parameter(gen, base, aggregate):
    """Every parameter takes part (DistributedDataParallel, as atlaslib.train uses it, refuses unused ones):
    residual MC reads no relevance scores, so it has no u projection."""
    seeded(gen)
    mixer = make_mixer("memory_caching", D, H, base=base, segments=3, aggregate=aggregate,
                       top_k=1 if aggregate == "ssc" else None)
    mixer(torch.randn(2, 10, D, generator=gen)).square().sum().backward()
    for name, p in mixer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_mix_is_memory_caching_by_hand(gen):
    """The default layer (Gated DeltaNet, GRM, independent) against the math written out above."""
    seeded(gen)
    mixer = make_mixer("memory_caching", D, H, segments=3).double()
    x = torch.randn(2, 10, D, generator=gen, dtype=F64)
    with torch.no_grad():
        q, k, v = front_end(mixer, x)
        gates, u = gates_from_weights(mixer, x)
        ref = grm_gated_delta_by_hand(q, k, v, gates["beta"], gates["log_alpha"].exp(), u, 3)
        assert_close(mixer.mix(q, k, v, x), ref, name="mixer.mix vs GRM by hand")


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("options", [dict(segments=3), dict(segments=2, mode="checkpoint", aggregate="residual"),
                                     dict(segments=2, aggregate="ssc", top_k=1, pool="sum"),
                                     dict(segments="log", chunk_size=4)])
def test_mix_is_the_library_definition_on_the_same_projections(gen, base, options):
    """mixer.mix (chunk form) == memory_caching(backend="recurrent") with gates and u_t from the raw weights."""
    seeded(gen)
    mixer = make_mixer("memory_caching", D, H, base=base, backend="chunk", **options).double()
    x = torch.randn(2, 9, D, generator=gen, dtype=F64)
    library = delta_rule if base in ("deltanet", "gated_deltanet", "kda") else linear_attention
    kw = dict(mode="independent", aggregate="grm")            # the layer's defaults (not the library's)
    kw.update((n, val) for n, val in options.items() if n != "chunk_size")
    with torch.no_grad():
        q, k, v = front_end(mixer, x)
        gates, u = gates_from_weights(mixer, x)
        u = None if kw["aggregate"] == "residual" else u                # residual reads no scores
        ref, _ = memory_caching(q, k, v, base=library, base_kwargs=gates, u=u, backend="recurrent", **kw)
        assert_close(mixer.mix(q, k, v, x), ref, name=f"{base} {options}")


@pytest.mark.parametrize("base", BASES)
def test_one_segment_is_the_base_mixer(gen, base):
    """N = 1 ([MC]: one segment is the plain RNN): with segments >= T the layer is its base mixer."""
    seeded(gen)
    mixer = make_mixer("memory_caching", D, H, base=base, segments=16, backend="chunk").double()
    plain = make_mixer(base, D, H, backend="chunk").double()
    plain.load_state_dict({n: p for n, p in mixer.state_dict().items() if not n.startswith("u_proj")})
    x = torch.randn(2, 12, D, generator=gen, dtype=F64)
    with torch.no_grad():
        assert_close(mixer(x), plain(x), name=f"one segment vs {base}")


def test_residual_independent_over_linear_attention_is_linear_attention(gen):
    """Chapter 7 §3: residual MC with independent zero-start segments over linear attention is linear attention."""
    seeded(gen)
    mixer = make_mixer("memory_caching", D, H, base="linear", segments=3, aggregate="residual").double()
    plain = make_mixer("linear", D, H).double()
    plain.load_state_dict({n: p for n, p in mixer.state_dict().items() if not n.startswith("u_proj")})
    x = torch.randn(2, 11, D, generator=gen, dtype=F64)
    with torch.no_grad():
        assert_close(mixer(x), plain(x), name="residual MC over linear attention")
        other = make_mixer("memory_caching", D, H, base="linear", segments=3).double()
        other.load_state_dict(mixer.state_dict() | {"u_proj.weight": other.u_proj.weight})
        assert (other(x) - plain(x)).abs().max() > 1e-6, "GRM must differ, or the test proves nothing"


@pytest.mark.parametrize("bad, match", [
    (dict(base="titans"), "base must be one of"),
    (dict(segments=0), "segments must be"),
    (dict(segments=[4, 4]), "segments must be"),
    (dict(segments="linear"), "segments must be"),
    (dict(segments=True), "segments must be"),
    (dict(mode="online"), "mode must be one of"),
    (dict(segments="log", mode="checkpoint"), "needs mode='independent'"),
    (dict(aggregate="mean"), "aggregate must be one of"),
    (dict(top_k=2), "top_k is SSC's parameter"),
    (dict(aggregate="ssc", top_k=0), "top_k must be >= 1"),
    (dict(pool="max"), "pool must be one of"),
    (dict(base="linear", normalize=True), "normalize=False"),
])
def test_bad_options_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        make_mixer("memory_caching", D, H, **bad)


def test_a_cached_class_refuses_another_base():
    with pytest.raises(ValueError, match="caches 'gla', not 'deltanet'"):
        CACHED["gla"](D, H, base="deltanet")
    assert type(CACHED["gla"](D, H, base="gla")) is type(CACHED["gla"](D, H)) is CACHED["gla"]
    assert CACHED["gla"](D, H).base == "gla" and make_mixer("memory_caching", D, H).base == "gated_deltanet"


# ---------------------------------------------------------------- generation and training

@pytest.mark.parametrize("kw", [dict(segments=3), dict(segments=2, mode="checkpoint", base="gla")])
def test_generation_caches_one_state_per_completed_segment(gen, kw):
    """The step's cache grows by one state per finished segment (step == forward: tests/test_step.py)."""
    seeded(gen)
    lm = TinyLM(17, 16, 2, "memory_caching", 2, backend="chunk", **kw).double()
    state = None
    with torch.no_grad():
        for _ in range(9):
            _, state = lm.step(torch.randint(0, 17, (2,), generator=gen), state)
    for cache in state.layers:
        assert cache.memory.states.shape[:3] == (2, 2, 9 // kw["segments"])


def test_mqar_training_lowers_the_loss(gen):
    """A few AdamW steps on MQAR: the loss goes down (a smoke test that the layer trains)."""
    torch.manual_seed(0)
    task = MQARTask(vocab_size=64, seq_len=32, num_kv_pairs=4, num_train=512, num_test=32)
    model = TinyLM(task.vocab_size, 32, 1, "memory_caching", 2, segments=8)
    res = train_mqar(model, task.data(0), steps=40, batch_size=16, lr=3e-3, warmup=5, progress=False)
    first, last = sum(res.losses[:5]) / 5, sum(res.losses[-5:]) / 5
    assert last < first - 0.1, (first, last)
