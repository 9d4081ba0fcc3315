"""The library as a user meets it: half-precision inputs, misplaced gate layouts, torch.compile of the
public functions and of the mixers."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from atlaslib.atlas import atlas
from atlaslib.caching import memory_caching
from atlaslib.core import assert_close, random_qkv
from atlaslib.deep import deep_transformer
from atlaslib.linear import linear_attention
from atlaslib.miras import make_config, miras
from atlaslib.nn import make_mixer

B, H, T, K = 1, 2, 9, 4


def qkv(gen, dtype=torch.float32):
    return random_qkv(B, H, T, K, K, dtype=dtype, generator=gen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", [{}, {"normalize": True}, {"window": 3}], ids=["plain", "normalize", "window"])
@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_deep_transformer_taylor_takes_half_precision(gen, dtype, kw, backend):
    """phi*_P features are computed in fp32: v must follow them, or the forms refuse q, k, v of two dtypes
    (a bf16 call failed with "q, k, v must share a dtype" although the caller's q, k, v did)."""
    q, k, v = qkv(gen, dtype)
    alpha = torch.rand(B, H, T, generator=gen) * 0.2 + 0.8
    o, _ = deep_transformer(q, k, v, phi_star=("taylor", 2), alpha=alpha, eta=0.5, backend=backend,
                            chunk_size=4, **kw)
    ref, _ = deep_transformer(q.double(), k.double(), v.double(), phi_star=("taylor", 2), alpha=alpha.double(),
                              eta=0.5, backend="recurrent", **kw)
    assert o.dtype == dtype
    assert_close(o, ref.to(dtype), tol=2e-2, name=f"{dtype} vs fp64 on the same inputs")


def test_memory_caching_names_a_gate_in_the_wrong_layout(gen):
    """A gate given as [B, T, H] is not cut into segments; it used to reach every segment whole, whose
    base call then asked for a shape with the *segment's* length. It is refused with the sequence's shape."""
    q, k, v = qkv(gen)
    with pytest.raises(ValueError, match=r"base_kwargs\['alpha'\] must have shape \[B, H, T, \.\.\.\] = "
                                         rf"\[{B}, {H}, {T}, \.\.\.\]"):
        memory_caching(q, k, v, base=linear_attention, segments=3, base_kwargs={"alpha": torch.full((B, T, H), 0.9)})


def compiled_equals_eager(fn, *args):
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    try:
        got = torch.compile(fn, fullgraph=True, backend=counter)(*args)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1
    assert_close(got, fn(*args), tol=1e-6, name="compiled vs eager")


@pytest.mark.slow                                 # compiles, as test_compile.py does (2 s)
def test_miras_with_a_config_compiles_into_one_graph(gen):
    """The MIRAS mixers call ``miras(config=...)``, which validates the config on every call: reading the
    dataclass's fields there broke fullgraph compilation of every chapter 3 mixer. (No initial_state: the
    linear memory's zero start made a random generator it did not use, which broke it too.)"""
    q, k, v = qkv(gen)
    cfg = make_config("titans", memory="linear")
    theta = torch.rand(B, H, T, generator=gen)
    compiled_equals_eager(lambda q, k, v, t: miras(q, k, v, config=cfg, eta=0.1, theta=t, backend="chunk",
                                                   chunk_size=4)[0], q, k, v, theta)


def deep_atlas_mixer(gen, name, **kw):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    return make_mixer(name, 8, 2, backend="chunk", chunk_size=4, **kw), torch.randn(2, 5, 8, generator=gen)


@pytest.mark.parametrize("name, kw", [("atlas", {"memory": "mlp", "ns_steps": 2}), ("atlas++", {"window": 2})])
def test_deep_atlas_mixers_start_from_their_learned_w0(gen, name, kw):
    """A deep ATLAS memory starts from W_0 parameters of the layer, as chapter 3's mixers do: the forward is
    ``atlas`` from them, they receive a gradient, and two layers draw different ones (they were fixed seeded
    weights, shared by every layer and never trained)."""
    mixer, x = deep_atlas_mixer(gen, name, **kw)
    other, _ = deep_atlas_mixer(gen, name, **kw)
    assert set(mixer.initial) == set(other.initial) and all(
        not torch.equal(mixer.initial[n], other.initial[n]) for n in mixer.initial)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=gen) for _ in range(3))
    q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    got = mixer.mix(q, k, v, x)
    got.square().sum().backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in mixer.initial.values())
    with torch.no_grad():
        gamma, _, eta = mixer.gate_tensors(x, torch.float32, alpha=False)
        W0 = {n: w.detach()[None].expand(2, -1, -1, -1) for n, w in mixer.initial.items()}
        ref, _ = atlas(q, k, v, window=mixer.window, gamma=gamma, log_alpha=mixer.log_alpha(x), eta=eta,
                       theta=mixer.theta(x), ns_steps=mixer.ns_steps, ns_coeffs=mixer.ns_coeffs, memory=mixer.memory,
                       initial_state=W0, backend="chunk", chunk_size=4)
        seeded_start, _ = atlas(q, k, v, window=mixer.window, gamma=gamma, log_alpha=mixer.log_alpha(x), eta=eta,
                                theta=mixer.theta(x), ns_steps=mixer.ns_steps, ns_coeffs=mixer.ns_coeffs,
                                memory=mixer.memory, backend="chunk", chunk_size=4)
    assert_close(got.detach(), ref, tol=1e-6, name="mixer vs atlas(initial_state=its W_0)")
    assert (got.detach() - seeded_start).abs().max() > 1e-3


@pytest.mark.slow                                 # compiles (3 s)
def test_a_deep_atlas_mixer_compiles_into_one_graph(gen):
    """The mixer once drew W_0 with a generator made inside its forward, which fullgraph compilation refuses."""
    mixer, x = deep_atlas_mixer(gen, "atlas", memory="mlp", ns_steps=1)
    with torch.no_grad():
        compiled_equals_eager(mixer, x)


@pytest.mark.parametrize("segments, T", [(16, 9), ("log", 2)])
def test_memory_caching_mixer_gives_every_parameter_a_gradient_on_one_segment(gen, segments, T):
    """With T no longer than a segment nothing is cached and the relevance projection scores nothing: its
    gradient was None, which stops DistributedDataParallel (``torchrun -m atlaslib.train --mixer
    memory_caching --seq-len 16`` failed at its second step). It is zero now, and the output is unchanged."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    mixer = make_mixer("memory_caching", 8, 2, segments=segments, backend="chunk")
    x = torch.randn(2, T, 8, generator=gen)
    y = mixer(x)
    y.sum().backward()
    missing = [n for n, p in mixer.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert mixer.u_proj.weight.grad.abs().max() == 0
    base = make_mixer("gated_deltanet", 8, 2, backend="chunk")     # one segment: MC is its base mixer
    base.load_state_dict({n: p for n, p in mixer.state_dict().items() if not n.startswith("u_proj")})
    with torch.no_grad():
        assert_close(y.detach(), base(x), tol=1e-6, name="one segment vs the base mixer")


def _clear_process_caches():
    from atlaslib.caching import segments
    from atlaslib.core import featuremaps
    from atlaslib.deep import features, mlp
    from atlaslib.miras import state
    featuremaps._multiset_table.cache_clear()
    features._coefficients_on.cache_clear()
    mlp._seeded_w2.cache_clear()
    state._seeded_params.cache_clear()
    segments._BLOCKS.clear()
    segments._GROUPS.clear()
    segments._BOUNDS.clear()


def _cached_constants(device):
    """One call into each process-wide cache of tensors: monomial tables, the seeded W2 of an MLP memory, a
    deep memory's seeded initial weights, a caching layout's read tables."""
    from atlaslib.caching import make_layout
    from atlaslib.core import monomial_features
    from atlaslib.deep import second_layer_init
    from atlaslib.miras import init_state
    return [monomial_features(torch.ones(2, 3, device=device), 2),
            second_layer_init(1, 2, 4, 8, torch.float32, device),
            init_state(make_config("titans", memory="mlp"), 1, 2, 4, 4, device=device).memory["W1"],
            make_layout(8, 4).blocks(device)[0], make_layout(8, 4).bounds(device)[0]]


@pytest.mark.parametrize("mode", ["meta", "fake"])
def test_a_call_under_meta_or_fake_tensors_leaves_real_tensors_in_the_caches(mode):
    """Shape checks run under torch.device("meta") or FakeTensorMode; the tensors a cache builds meanwhile are
    kept for the process, and a meta or fake one failed every later real call of the same sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    _clear_process_caches()
    try:
        if mode == "meta":
            with torch.device("meta"):
                assert all(t.device.type == "meta" for t in _cached_constants("meta"))
        else:
            with FakeTensorMode(allow_non_fake_inputs=True):   # the caches' real constants meet fake inputs
                _cached_constants("cpu")
        real = _cached_constants("cpu")
        _clear_process_caches()
        fresh = _cached_constants("cpu")
    finally:
        _clear_process_caches()
    for got, want in zip(real, fresh):
        assert type(got) is torch.Tensor and torch.equal(got, want)


def host_copies(fn) -> int:
    """Copies from the host to another device while fn() runs a second time (the first fills the caches)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            to = kwargs.get("device")
            if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" and to is not None \
                    and torch.device(to).type != "cpu":
                Copies.count += 1
            return func(*args, **kwargs)
    fn()
    with Copies():
        fn()
    return Copies.count


def test_feature_maps_and_caching_copy_nothing_from_the_host_per_call():
    """On a GPU a copy from the host waits for the device (as a host read does): the feature maps' monomial
    tables and coefficients, and the caching layouts' pooling bounds, are kept per device, not copied on every
    call and every decoded token. The meta device stands in for the GPU."""
    from atlaslib.caching import log_linear_pp
    from atlaslib.core import monomial_features
    from atlaslib.deep import exp_features
    x = torch.randn(2, 2, 16, 8, device="meta")
    assert host_copies(lambda: monomial_features(x, 2)) == 0
    assert host_copies(lambda: exp_features(x, 2)) == 0
    q, k, v = (torch.randn(1, 2, 32, 8, device="meta") for _ in range(3))
    assert host_copies(lambda: memory_caching(q, k, v, base=linear_attention, segments=8, backend="chunk")) == 0
    assert host_copies(lambda: log_linear_pp(q, k, v, base=linear_attention, backend="chunk")) == 0
    torch.manual_seed(0)
    mixer = make_mixer("dot", 16, 2, phi_star=("taylor", 2), chunk_size=4, backend="chunk").to("meta")
    xs = torch.randn(1, 5, 16, device="meta")
    with torch.no_grad():
        _, cache = mixer.step(xs[:, 0], None)
        assert host_copies(lambda: mixer(xs)) == host_copies(lambda: mixer.step(xs[:, 1], cache)) == 0


@pytest.mark.parametrize("preset, memory", [("titans", "mlp"), ("moneta", "mlp"), ("memora", "linear"),
                                            ("yaad", "linear")])
def test_the_default_start_state_is_not_copied_from_the_host_per_call(preset, memory):
    """miras with initial_state=None starts from seeded weights (deep memories) or zeros (the linear memory):
    kept per device or made there, not drawn on the CPU and copied on every call."""
    from atlaslib.miras import miras
    q, k, v = (torch.randn(1, 2, 8, 4, device="meta") for _ in range(3))
    assert host_copies(lambda: miras(q, k, v, preset=preset, memory=memory, backend="chunk", chunk_size=4)) == 0


def test_the_readout_kernels_backward_is_given_the_layouts_reader_groups(gen, monkeypatch):
    """Log-linear segments through the readout kernel: its backward (the chunk form) takes the layout's reader
    groups; finding them in the table instead reads it from the device, several syncs per backward."""
    from atlaslib.caching import chunk, log_linear_pp

    def refused(*args):
        raise AssertionError("reader groups found in the table")
    monkeypatch.setattr(chunk, "reader_groups", refused)
    q, k, v = random_qkv(1, 2, 40, 16, 16, generator=gen)
    q.requires_grad_()
    for backend in ("chunk", "triton"):
        o, _ = log_linear_pp(q, k, v, base=linear_attention, backend=backend)
        o.sum().backward()


@pytest.fixture
def default_float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def test_memoras_seeded_start_does_not_depend_on_the_default_dtype(request):
    """The default start of a deep Memora memory is a function of its sizes and seed: a caller's default
    dtype drew a different random sequence, and the first call fixed it for the process."""
    from atlaslib.miras import init_state
    config = make_config("memora", memory="mlp")

    def fresh_start():
        from atlaslib.miras import state
        state._seeded_params.cache_clear()
        return init_state(config, 1, 2, 4, 4).memory["W1"].double()
    under_float32 = fresh_start()
    request.getfixturevalue("default_float64")
    assert torch.equal(fresh_start(), under_float32)


@pytest.mark.parametrize("name, kw", [("titans", {}), ("memora", {}), ("ttt_linear", {}), ("atlas++", {}),
                                      ("omeganet", {"degree": 2}), ("dla", {})])
def test_a_mixer_built_under_float64_has_only_float64_parameters(default_float64, name, kw):
    """As nn.Linear's weights: a learned start W_0 or Taylor coefficients kept in float32 gave an fp64
    model fp32 gradients for them (and a_i = 1/i! only to 3e-8)."""
    torch.manual_seed(0)
    mixer = make_mixer(name, 8, 2, backend="chunk", chunk_size=1, **kw)
    assert {n: p.dtype for n, p in mixer.named_parameters() if p.dtype != torch.float64} == {}
