"""Options and small helpers refuse nonsense with an error that names the option.

Mixer sizes and options (checked once, in ``TokenMixer``), the MIRAS mixers' ``eta_init``, the cache
that ``step`` takes, the layout and feature-width helpers, and ``pool`` with the residual aggregate.
Before these checks each of them either ran on (0 meant "default") or failed deep inside torch.
"""
import math

import pytest
import torch

from atlaslib.caching import (consecutive_layout, dyadic_blocks, log_layout, make_layout, memory_caching, memory_reads,
                              segment_lengths)
from atlaslib.core import softmax_attention
from atlaslib.core.featuremaps import monomial_dim
from atlaslib.deep import exp_feature_dim
from atlaslib.linear import linear_attention
from atlaslib.nn import TinyLM, make_mixer
from atlaslib.nn.lm import DecodeState
from atlaslib.nn.base import MixerCache
from atlaslib.tasks import capacity_sweep

D, H = 16, 2


# ---------------------------------------------------------------- mixer sizes and options

@pytest.mark.parametrize("option, value, error", [
    ("head_k_dim", 0, ValueError), ("head_k_dim", -2, ValueError), ("head_k_dim", 2.5, TypeError),
    ("head_k_dim", True, TypeError), ("head_v_dim", 0, ValueError), ("head_v_dim", -1, ValueError),
    ("conv_size", -1, ValueError), ("conv_size", 1.5, TypeError), ("conv_size", True, TypeError),
    ("chunk_size", 0, ValueError), ("chunk_size", -4, ValueError), ("chunk_size", 2.0, TypeError),
    ("backend", "fast", ValueError), ("backend", 3, ValueError),
])
def test_mixer_sizes_and_options_are_checked(option, value, error):
    """As the library functions: TypeError for what is not an int (True and 2.0 too), ValueError below the range."""
    with pytest.raises(error, match=f"{option} must be"):
        make_mixer("linear", D, H, **{option: value})


def _generate(**kw):
    torch.manual_seed(0)
    lm = TinyLM(11, D, 1, "linear", H)
    return lm.generate(torch.zeros(1, 2, dtype=torch.long), kw.pop("max_new_tokens", 2), greedy=False, **kw)


QKV = [torch.randn(1, H, 5, 4) for _ in range(3)]
COUNTS = {      # every count the library takes, outside the models' own arguments: (call, its name in the error)
    "attention window": (lambda n: softmax_attention(*QKV, window=n), "window"),
    "swa window": (lambda n: make_mixer("swa", D, H, window=n), "window"),
    "generate max_new_tokens": (lambda n: _generate(max_new_tokens=n), "max_new_tokens"),
    "generate top_k": (lambda n: _generate(top_k=n), "top_k"),
    "capacity_sweep m": (lambda n: capacity_sweep(8, 8, [n], trials=1), "every m"),
}


@pytest.mark.parametrize("value, error", [(2.0, TypeError), (True, TypeError), (-1, ValueError)])
@pytest.mark.parametrize("what", sorted(COUNTS))
def test_counts_are_ints(what, value, error):
    """TypeError for what is not an int (as the models' chunk_size and window), ValueError below the range."""
    call, name = COUNTS[what]
    call(2)
    with pytest.raises(error, match=f"^{name} must be"):
        call(value)


def test_qk_norm_must_be_a_bool():
    with pytest.raises(TypeError, match="qk_norm must be True or False"):
        make_mixer("linear", D, H, qk_norm="no")


@pytest.mark.parametrize("name", ["gla", "deltanet", "ttt_linear", "omeganet", "atlas", "dot", "memory_caching", "mag"])
@pytest.mark.parametrize("option, value", [("head_k_dim", 0), ("head_v_dim", -4), ("chunk_size", 0)])
def test_every_mixer_checks_sizes(name, option, value):
    """The check sits in ``TokenMixer.__init__``, which every mixer (and a hybrid's memory) goes through."""
    with pytest.raises(ValueError, match=f"{option} must be"):
        make_mixer(name, D, H, **{option: value})


def test_none_and_zero_keep_their_meaning():
    m = make_mixer("linear", D, H, head_k_dim=None, head_v_dim=None, conv_size=None, chunk_size=None)
    assert (m.head_k_dim, m.head_v_dim, m.q_conv, m.chunk_size) == (D // H, D // H, None, None)
    m(torch.randn(1, 5, D))                                     # chunk_size None: the library's own default
    assert make_mixer("linear", D, H, conv_size=0).q_conv is None
    assert make_mixer("linear", D, H, conv_size=1, head_k_dim=3, chunk_size=1).head_k_dim == 3


@pytest.mark.parametrize("name", ["ttt_linear", "titans", "dla"])
@pytest.mark.parametrize("eta_init", [0, 0.0, -1.0, math.inf, math.nan, "0.1", True])
def test_eta_init_must_be_a_finite_positive_number(name, eta_init):
    with pytest.raises(ValueError, match="eta_init must be a finite number > 0"):
        make_mixer(name, D, H, eta_init=eta_init)


def test_eta_init_sets_the_start_of_eta():
    m = make_mixer("ttt_linear", D, H, eta_init=0.25)
    assert torch.allclose(m.eta_gate(torch.zeros(1, 3, D)), torch.full((1, H, 3), 0.25))


def test_theta_and_delta_start_where_the_mixers_say():
    # theta_t = sigmoid(w^T x + b) starts at 0.5 (Titans' momentum decay) and delta_t = softplus(w^T x + b) at 1
    # (Yaad's Huber threshold), as miras_mixers documents: at x = 0 each gate is its start
    x = torch.zeros(1, 3, D)
    assert torch.allclose(make_mixer("titans", D, H).theta_gate(x), torch.full((1, H, 3), 0.5))
    assert torch.allclose(make_mixer("yaad", D, H).delta_gate(x), torch.full((1, H, 3), 1.0))


# ---------------------------------------------------------------- the cache of step

@pytest.mark.parametrize("name", ["linear", "deltanet", "softmax", "ttt_linear", "omeganet"])
@pytest.mark.parametrize("cache", ["cache", 5, (None,), (None, None), (1, 2, 3), {}])
def test_step_refuses_a_cache_it_did_not_return(name, cache):
    mixer = make_mixer(name, D, H)
    with pytest.raises(TypeError, match="cache must be None .* or the MixerCache that the previous step returned"):
        mixer.step(torch.randn(2, D), cache)


def test_step_refuses_convolution_buffers_of_another_layer():
    x = torch.randn(2, D)
    _, cache = make_mixer("linear", D, H).step(x)
    with pytest.raises(ValueError, match=r"cache.conv must hold .*\[2, 3, 16\]"):
        make_mixer("linear", D, H, conv_size=2).step(x, cache)           # buffers of size - 1 = 3, not 1
    with pytest.raises(ValueError, match=r"made for a batch of 2 sequences, x_t has 3 rows"):
        make_mixer("linear", D, H).step(torch.randn(3, D), cache)         # another batch
    with pytest.raises(ValueError, match=r"cache.conv must hold"):
        make_mixer("linear", D, H).step(x, MixerCache((1, 2), cache.memory))
    with pytest.raises(ValueError, match=r"cache.conv must hold"):
        make_mixer("linear", D, H).step(x, MixerCache(None, cache.memory))
    _, plain = make_mixer("linear", D, H, conv_size=0).step(x)
    with pytest.raises(ValueError, match="cache.conv must be None"):
        make_mixer("linear", D, H, conv_size=0).step(x, cache)


@pytest.mark.parametrize("name", ["linear", "deltanet", "titans", "softmax", "atlas", "memory_caching", "mag"])
def test_step_refuses_the_cache_of_another_batch_or_layer(name):
    """Without a convolution nothing else would notice: a matrix memory of batch 2 broadcast against one
    row returned two rows; engine states failed deep in torch."""
    x = torch.randn(2, D)
    _, cache = make_mixer(name, D, H, conv_size=0).step(x)
    with pytest.raises(ValueError, match="made for a batch of 2 sequences, x_t has 1 rows"):
        make_mixer(name, D, H, conv_size=0).step(x[:1], cache)
    with pytest.raises(ValueError, match="comes from another layer"):
        make_mixer(name, D, 2 * H, conv_size=0).step(x, cache)
    make_mixer(name, D, H, conv_size=0).step(x, cache)         # another layer of the same kind and size takes it


@pytest.mark.parametrize("name", ["mag", "mal"])
def test_hybrid_step_refuses_a_cache_it_did_not_return(name):
    mixer = make_mixer(name, D, H, memory="linear", window=4)
    x = torch.randn(2, D)
    _, cache = mixer.step(x)
    mixer.step(x, cache)                                                 # its own cache is fine
    _, other = make_mixer("linear", D, H).step(x)
    for bad in ("cache", (None,), other):
        with pytest.raises(TypeError, match="cache must be None .* or the HybridCache that the previous step returned"):
            mixer.step(x, bad)



@pytest.mark.parametrize("name, option, value", [
    ("linear", "normalize", "no"), ("omeganet", "constant", 0), ("atlas", "momentum", "no"),
    ("deep_transformer", "normalize", None)])
def test_mixer_switches_must_be_bools(name, option, value):
    """A string such as "no" is truthy: read as a switch it turned the option on."""
    with pytest.raises(TypeError, match=f"{option} must be True or False"):
        make_mixer(name, D, H, **{option: value})


@pytest.mark.parametrize("name", ["omeganet", "swla", "atlas", "dot"])
@pytest.mark.parametrize("eta_max", [0, -0.5, math.inf, math.nan, "a", True])
def test_eta_max_must_be_a_finite_positive_number(name, eta_max):
    with pytest.raises(ValueError, match="eta_max must be a finite number > 0"):
        make_mixer(name, D, H, eta_max=eta_max)


@pytest.mark.parametrize("ns_steps, error", [(-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_atlas_mixer_checks_ns_steps(ns_steps, error):
    with pytest.raises(error, match="ns_steps must be"):
        make_mixer("atlas", D, H, ns_steps=ns_steps)


def test_lm_step_refuses_a_state_it_did_not_return():
    lm = TinyLM(vocab_size=11, d_model=D, n_layers=2, mixer="linear", n_heads=H)
    ids = torch.tensor([1, 2])
    _, state = lm.step(ids)
    lm.step(ids, state)                                                   # its own state is fine
    for bad in ((0, (None, None)), "state", 3):
        with pytest.raises(TypeError, match="state must be None .* or the DecodeState"):
            lm.step(ids, bad)
    with pytest.raises(ValueError, match=r"one cache per layer \(2\)"):
        lm.step(ids, DecodeState(1, state.layers[:1]))

# ---------------------------------------------------------------- layouts and feature widths

@pytest.mark.parametrize("make", [lambda T: make_layout(T, 4), lambda T: make_layout(T, "log"), log_layout,
                                  lambda T: segment_lengths(T, 4)])
@pytest.mark.parametrize("T, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)])
def test_layouts_need_a_positive_int_length(make, T, error):
    with pytest.raises(error, match=r"T \(the number of tokens\) must be"):
        make(T)


def test_layouts_of_one_token_still_work():
    assert make_layout(1, "log").visible == [[]] and log_layout(1).online == [(0, 1)]
    assert make_layout(1, 4).online == [(0, 1)] and segment_lengths(5, 4) == [4, 1]


@pytest.mark.parametrize("lengths", [[3, 3], [6], [1, 1, 1, 1], (2, 2), [5, 1]])
def test_segment_lengths_must_sum_to_the_sequence(lengths):
    """A list of lengths covers the T tokens exactly: a sum short of T or past it (a segment of tokens that do not
    exist) is refused with the sum; a list that sums to T is returned as a list."""
    with pytest.raises(ValueError, match=rf"sum to {sum(lengths)}, but the sequence has T = 5 tokens"):
        segment_lengths(5, lengths)
    assert segment_lengths(sum(lengths), lengths) == list(lengths)


@pytest.mark.parametrize("top_k, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_memory_reads_checks_top_k(top_k, error):
    with pytest.raises(error, match=r"top_k must be .*\(or None: all visible states\)"):
        memory_reads(make_layout(8, 4), top_k)


def test_memory_reads_of_valid_top_k():
    layout = make_layout(8, 2)                                   # tokens see 0, 0, 1, 1, 2, 2, 3, 3 states
    assert memory_reads(layout) == 8 + 12 and memory_reads(layout, 1) == 8 + 6



@pytest.mark.parametrize("lengths", [[], [2, 0], [2.0, 2], (True, 3), 5, "44"])
def test_consecutive_layout_needs_positive_int_lengths(lengths):
    with pytest.raises(ValueError, match="segments as a list must hold positive int lengths"):
        consecutive_layout(lengths)


@pytest.mark.parametrize("position, error", [(2.0, TypeError), (True, TypeError), (0, ValueError)])
def test_dyadic_blocks_needs_a_positive_int_position(position, error):
    with pytest.raises(error, match="position"):
        dyadic_blocks(position)


def test_memory_reads_needs_a_layout():
    with pytest.raises(TypeError, match="layout must be a Layout"):
        memory_reads("x")
    assert consecutive_layout((3, 1)).online == make_layout(4, 3).online

@pytest.mark.parametrize("dim", [monomial_dim, exp_feature_dim,
                                 lambda d, p: exp_feature_dim(d, p, compressed=False)])
@pytest.mark.parametrize("d, error", [(0, ValueError), (-1, ValueError), (-5, ValueError), (2.5, TypeError),
                                      (True, TypeError)])
def test_feature_widths_need_a_positive_int_input_width(dim, d, error):
    with pytest.raises(error, match=r"d \(the input width\) must be"):
        dim(d, 2)


def test_feature_widths_of_degree_zero():
    """Degree 0 is legitimate: the constant feature alone."""
    assert monomial_dim(3, 0) == exp_feature_dim(3, 0) == exp_feature_dim(3, 0, compressed=False) == 1
    assert monomial_dim(4, 2) == exp_feature_dim(4, 2) == 15 and exp_feature_dim(3, 2, compressed=False) == 13


# ---------------------------------------------------------------- pool with the residual aggregate

@pytest.mark.parametrize("pool", ["mean", "sum"])
def test_residual_refuses_a_pool(gen, pool):
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(3))
    with pytest.raises(ValueError, match="pool scores the cached states"):
        memory_caching(q, k, v, base=linear_attention, segments=4, aggregate="residual", pool=pool)
    with pytest.raises(ValueError, match="pool scores the cached states"):
        make_mixer("memory_caching", D, H, base="linear", aggregate="residual", pool=pool)


def test_pool_default_is_the_mean(gen):
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(3))
    run = lambda **kw: memory_caching(q, k, v, base=linear_attention, segments=3, aggregate="grm", **kw)[0]  # noqa: E731
    assert torch.equal(run(), run(pool="mean")) and not torch.equal(run(), run(pool="sum"))
    memory_caching(q, k, v, base=linear_attention, segments=4, aggregate="residual", pool=None)
    mixer = make_mixer("memory_caching", D, H, base="linear", aggregate="residual", segments=2)
    x = torch.randn(1, 5, D, generator=gen)
    y, cache = mixer(x), None
    for t in range(5):
        y_t, cache = mixer.step(x[:, t], cache)
    assert torch.allclose(y_t, y[:, -1], atol=1e-5)


def test_numpy_integers_are_ints_everywhere(gen):
    """check_int takes numbers.Integral (a numpy int from a sweep's grid): so do the MIRAS configuration, the
    segment lengths, the deep memory's expansion and MQAR's sizes, with the same results as Python ints."""
    np = pytest.importorskip("numpy")
    from atlaslib.atlas import atlas
    from atlaslib.deep import deep_transformer
    from atlaslib.miras import miras
    from atlaslib.omega import omega_rule
    from atlaslib.tasks import mqar
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    calls = [lambda w: omega_rule(q, k, v, window=w, memory="mlp", eta=0.1),
             lambda w: atlas(q, k, v, window=w, memory="residual", eta=0.1),
             lambda w: miras(q, k, v, preset="titans", window=w, eta=0.1),
             lambda w: memory_caching(q, k, v, base=linear_attention, segments=w),
             lambda w: memory_caching(q, k, v, base=linear_attention, segments=[w, 3 * w]),   # a list of lengths
             lambda w: deep_transformer(q, k, v, memory="mlp", expansion=w, backend="recurrent")]
    for call in calls:
        assert torch.equal(call(np.int64(2))[0], call(2)[0])
    from atlaslib.omega import swla               # the window kernels take them as launch arguments
    for f, kw in ((omega_rule, {"eta": 0.1}), (swla, {})):
        for w, b in ((np.int64(2), 4), (2, np.int64(4))):
            assert torch.equal(f(q.float(), k.float(), v.float(), window=w, chunk_size=b, backend="triton", **kw)[0],
                               f(q.float(), k.float(), v.float(), window=2, chunk_size=4, backend="triton", **kw)[0])
    assert all(torch.equal(a, b) for a, b in zip(mqar(np.int64(4), np.int64(64), 8, 128), mqar(4, 64, 8, 128)))
    from atlaslib.miras import make_config
    config = make_config("titans", window=np.int64(2), expansion=np.int64(2))
    assert config == make_config("titans", window=2, expansion=2) and type(config.window) is int
    config = make_config("yaad", delta=np.float64(0.5))
    assert config == make_config("yaad", delta=0.5) and type(config.delta) is float and "np." not in config.name


# ---------------------------------------------------------------- where the mixers' gates start

@pytest.mark.parametrize("name, kw", [("omeganet", {}), ("omeganet", {"gamma": "source"}), ("swla", {}),
                                      ("atlas", {"window": 3}), ("dot", {"window": 3, "gamma": "offset"})])
def test_window_gates_start_open(name, kw):
    # gamma = sigmoid(w^T x + b) with b = 2 at the start (omega_mixers): windows start open, ~0.88 everywhere
    mixer = make_mixer(name, D, H, **kw)
    gamma = mixer.gammas(torch.zeros(1, 3, D))
    assert gamma is not None
    assert torch.allclose(gamma, torch.full_like(gamma, 1 / (1 + math.exp(-2.0))))


def test_mag_starts_halfway_between_its_branches(gen):
    # MAG's gate starts centred at 1/2: at x = 0 it averages the attention and memory branches
    mixer = make_mixer("mag", D, H, memory="gla", window=4)
    a, r = torch.randn(1, 3, D, generator=gen), torch.randn(1, 3, D, generator=gen)
    assert torch.allclose(mixer.combine(torch.zeros(1, 3, D), a, r), 0.5 * a + 0.5 * r)


@pytest.mark.parametrize("name", ["ttt_linear", "ttt_mlp", "titans", "moneta", "yaad", "memora", "dla"])
def test_miras_mixers_default_to_the_chapters_chunk_length(gen, name):
    # the chunk length is part of these models (gradients frozen within a chunk): the mixers default to
    # chapter 3's, not to the base class's 64
    from atlaslib.miras import DEFAULT_CHUNK_SIZE
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    mixer = make_mixer(name, D, H).double()
    assert mixer.chunk_size == DEFAULT_CHUNK_SIZE < 64
    x = torch.randn(1, 3 * DEFAULT_CHUNK_SIZE, D, generator=gen).double()
    with torch.no_grad():
        default = mixer(x)
        mixer.chunk_size = DEFAULT_CHUNK_SIZE
        explicit = mixer(x)
        mixer.chunk_size = 64
        longer = mixer(x)
    assert torch.equal(default, explicit)
    assert (default - longer).abs().max() > 1e-6            # another chunk length, another model


# ---------------------------------------------------------------- an empty sequence

@pytest.mark.parametrize("name, kw", [("linear", {}), ("linear", {"conv_size": 0}), ("deltanet", {}),
                                      ("titans", {}), ("omeganet", {}), ("softmax", {}), ("memory_caching", {})])
def test_a_sequence_of_no_tokens_is_refused_by_name(name, kw):
    with pytest.raises(ValueError, match=r"T >= 1"):
        make_mixer(name, D, H, **kw)(torch.randn(2, 0, D))


@pytest.mark.parametrize("name, kw", [("linear", {}), ("titans", {}), ("softmax", {}), ("memory_caching", {}),
                                      ("mag", {"memory": "deltanet", "window": 2}),
                                      ("mal", {"memory": "gla", "window": 2})])
def test_a_batch_of_no_sequences_is_refused_by_name(name, kw):
    """A [0, T, D] input stopped in a reshape ("cannot reshape tensor of 0 elements") that named no batch."""
    mixer = make_mixer(name, D, H, **kw)
    with pytest.raises(ValueError, match=r"B >= 1"):
        mixer(torch.randn(0, 5, D))
    with pytest.raises(ValueError, match=r"B >= 1"):
        mixer.step(torch.randn(0, D), None)


def test_the_language_model_refuses_a_batch_of_no_sequences():
    lm = TinyLM(vocab_size=11, d_model=D, n_layers=1, n_heads=H, mixer="linear")
    for ids in (torch.zeros(0, 5, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"B >= 1\) of at least one token \(T >= 1"):
            lm(ids)
    with pytest.raises(ValueError, match=r"B >= 1 and T0 >= 1"):
        lm.generate(torch.zeros(0, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"ids_t must hold one token for each of B >= 1"):
        lm.step(torch.zeros(0, dtype=torch.long))


def test_the_default_start_state_takes_device_none():
    from atlaslib.miras import init_state, make_config
    for memory in ("linear", "mlp"):
        assert init_state(make_config("titans", memory=memory), 1, 2, 4, 4, device=None).memory is not None


@pytest.mark.parametrize("dim", [1, -1])
def test_chunk_windows_cuts_the_rows_a_slice_would(dim):
    """Chunk [s, e) gets rows [s, e + extra) along dim, a negative dim included."""
    from atlaslib.core.chunking import chunk_spans, chunk_windows
    x = torch.randn(3, 13 + 2)
    got = chunk_windows(x, 5, 2, dim=dim)
    assert [tuple(w.shape) for w in got] == [(3, e - s + 2) for s, e in chunk_spans(13, 5)]
    assert all(torch.equal(w, x[:, s:e + 2]) for w, (s, e) in zip(got, chunk_spans(13, 5)))
