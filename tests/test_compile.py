"""Every chapter's chunk form compiles into one graph (no host syncs).

``torch.compile(..., fullgraph=True)`` turns any graph break into an error, so a ``.item()``,
a branch on a tensor's value or an untraceable call on the hot path fails these tests. Each
compiled function must also count exactly one graph and give what eager mode gives, on fresh
random inputs (T leaves a partial chunk). aot_eager traces forward and backward like inductor
does, without generating code, so the tests run on a CPU in seconds.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from atlaslib.caching import memory_caching
from atlaslib.core import assert_close, random_gate, random_qkv
from atlaslib.core import validation
from atlaslib.delta import delta_rule
from atlaslib.delta.chunk import delta_rule_chunk
from atlaslib.linear import linear_attention
from atlaslib.linear.chunk import linear_attention_chunk
from atlaslib.miras import miras_chunk, prepare
from atlaslib.omega.chunk import omega_chunk, swla_chunk

B, H, T, K, V, CHUNK = 1, 2, 70, 8, 6, 32          # 70 = 2 chunks of 32 and a partial one


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test traces from scratch (no cached graph, no recompile limit carried over)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_equals_eager(fn, *args, tol=1e-6):
    """fn(*args) compiled with fullgraph=True (one graph, no breaks) equals fn(*args) in eager mode."""
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(fn, fullgraph=True, backend=counter)(*args)
    want = fn(*args)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs"
    got, want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all()
        assert_close(a, b, tol=tol, name=f"output {i}")


def inputs(gen, gate=None):
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    alpha = None if gate is None else random_gate(B, H, T, K if gate == "channel" else None, low=0.5, generator=gen)
    return q, k, v, alpha, torch.randn(B, H, V, K, generator=gen)


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_linear_attention_chunk(gen, gate):
    q, k, v, alpha, h0 = inputs(gen, gate)
    compiled_equals_eager(lambda *a: linear_attention_chunk(*a, chunk_size=CHUNK), q, k, v, alpha, h0)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_delta_rule_chunk(gen, gate):
    q, k, v, alpha, h0 = inputs(gen, gate)
    beta = torch.rand(B, H, T, generator=gen)
    compiled_equals_eager(lambda *a: delta_rule_chunk(*a, chunk_size=CHUNK), q, k, v, beta, alpha, h0)


def test_linear_attention_chunk_with_resets(gen):
    """Gates of 0 in some channels (a chunk decays by far more than fp32's range): still one graph."""
    q, k, v, alpha, h0 = inputs(gen, "channel")
    alpha[..., 20:23, : K // 2] = 0.0
    compiled_equals_eager(lambda *a: linear_attention_chunk(*a, chunk_size=CHUNK), q, k, v, alpha, h0)


@pytest.mark.parametrize("form", [omega_chunk, swla_chunk], ids=["omega", "swla"])
def test_omega_chunk(gen, form):
    q, k, v, alpha, _ = inputs(gen, "scalar")
    eta = torch.rand(B, H, T, generator=gen)
    compiled_equals_eager(lambda q, k, v, *gates: form(q, k, v, 3, *gates, chunk_size=CHUNK), q, k, v, None, alpha, eta)


@pytest.mark.parametrize("memory", ["linear", "mlp"])
def test_miras_chunk(gen, memory):
    """Titans (momentum, decay) through the MIRAS chunk engine, inputs prepared by ``miras.prepare``."""
    q, k, v, alpha, _ = inputs(gen, "scalar")
    theta = random_gate(B, H, T, low=0.0, generator=gen)
    problem = prepare(q, k, v, preset="titans", memory=memory, alpha=alpha, eta=0.1, theta=theta,
                      backend="chunk", chunk_size=CHUNK)
    parts, *args = problem.args
    compiled_equals_eager(lambda *a: miras_chunk(parts, *a, chunk_size=CHUNK), *args)


def test_memory_caching_chunk(gen):
    """Memory Caching over Gated DeltaNet (chapter 7, the memory_caching mixer's call): GRM, independent."""
    q, k, v, alpha, _ = inputs(gen, "scalar")
    beta = torch.rand(B, H, T, generator=gen)
    u = torch.randn(B, H, T, K, generator=gen)
    compiled_equals_eager(lambda q, k, v, b, a, u: memory_caching(
        q, k, v, base=delta_rule, base_kwargs=dict(beta=b, log_alpha=a.log()), u=u, segments=16,
        mode="independent", aggregate="grm", backend="chunk", chunk_size=8)[0], q, k, v, beta, alpha, u)


def test_public_functions_compile_with_their_checks(gen):
    """linear_attention and delta_rule, input checks included, under fullgraph compilation."""
    q, k, v, alpha, h0 = inputs(gen, "channel")
    beta = torch.rand(B, H, T, generator=gen)
    compiled_equals_eager(lambda q, k, v, a, h: linear_attention(q, k, v, alpha=a, initial_state=h, backend="chunk",
                                                                 chunk_size=CHUNK, output_final_state=True),
                          q, k, v, alpha, h0)
    torch._dynamo.reset()
    compiled_equals_eager(lambda q, k, v, b, a, h: delta_rule(q, k, v, b, alpha=a, initial_state=h, backend="chunk",
                                                              chunk_size=CHUNK, output_final_state=True),
                          q, k, v, beta, alpha, h0)


def test_value_checks_on_an_accelerator_assert_on_the_device(monkeypatch):
    """The branch CUDA tensors take: a device-side assert with the argument's name. Here it runs on
    CPU tensors (where torch._assert_async raises at once) by declaring them accelerator tensors."""
    monkeypatch.setattr(validation, "_value_check", lambda x: "device")
    good = torch.full((1, 2, 5), 0.5)
    assert validation.check_gate("alpha", good, 1, 2, 5) is good
    assert validation.check_state("initial_state", torch.zeros(2, 3), (2, 3), good) is not None
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(RuntimeError, match=r"alpha must lie in \[0.0, 1.0\]"):
            validation.check_gate("alpha", torch.full((1, 2, 5), bad), 1, 2, 5)
    validation.check_gate("eta", torch.full((1, 2, 5), 7.0), 1, 2, 5, high=None)    # no upper bound
    with pytest.raises(RuntimeError, match=r"eta must lie in \[0.0, inf\)"):          # but finite
        validation.check_gate("eta", torch.full((1, 2, 5), float("inf")), 1, 2, 5, high=None)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(RuntimeError, match="initial_state contains NaN or inf"):
            validation.check_state("initial_state", torch.tensor([[0.0, bad]]), (1, 2), good)


@pytest.mark.parametrize("model", ["linear_attention", "delta_rule"])
def test_a_new_sequence_length_recompiles_instead_of_failing(gen, model):
    """After one length, torch.compile traces T as a symbolic length: the input checks must not turn it
    into a string unless they raise (str() of a symbolic length cannot be traced; every call with a gate
    or a start state failed there). The second length compiles and equals eager mode."""
    def fn(q, k, v, a, h):
        if model == "linear_attention":
            return linear_attention(q, k, v, alpha=a, initial_state=h, backend="chunk", chunk_size=8,
                                    output_final_state=True)
        return delta_rule(q, k, v, a, alpha=a, initial_state=h, backend="chunk", chunk_size=8,
                          output_final_state=True)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for length in (20, 27):
        q, k, v = random_qkv(B, H, length, K, K, generator=gen)
        args = (q, k, v, random_gate(B, H, length, low=0.5, generator=gen), torch.randn(B, H, K, K, generator=gen))
        for i, (a, b) in enumerate(zip(compiled(*args), fn(*args))):
            assert_close(a, b, tol=1e-6, name=f"T={length}, output {i}")


def test_taylor_features_compile(gen):
    """The monomials' index table is a constant of (d, p): torch.compile takes it as one instead of tracing
    itertools (which it cannot), so DeepTransformers with Taylor features compile into one graph."""
    from atlaslib.deep import deep_transformer
    q, k, v, alpha, _ = inputs(gen, "scalar")
    compiled_equals_eager(lambda q, k, v, a: deep_transformer(q, k, v, alpha=a, phi_star=("taylor", 2), window=3,
                                                              backend="chunk", chunk_size=8)[0], q, k, v, alpha,
                          tol=1e-5)


@pytest.mark.parametrize("segments", [16, "log"])
def test_memory_caching_compiles_for_every_length(gen, segments):
    """The layout is Python structure built for one T: under dynamic shapes the length is fixed to its value
    (each length compiles its own graph), and the log-linear readout takes its reader groups from the layout's
    lists (a table's values are unknown while tracing). Every length equals eager mode; a length seen
    before runs its graph again."""
    def fn(q, k, v, b, a, u):
        return memory_caching(q, k, v, base=delta_rule, base_kwargs=dict(beta=b, log_alpha=a.log()), u=u,
                              segments=segments, mode="independent", aggregate="grm", backend="chunk",
                              chunk_size=8)[0]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter, dynamic=True)
    graphs = []
    for length in (37, 21, 37) if segments == 16 else (13, 9, 13):
        q, k, v = random_qkv(B, H, length, K, K, generator=gen)
        args = (q, k, v, torch.rand(B, H, length, generator=gen), random_gate(B, H, length, low=0.5, generator=gen),
                torch.randn(B, H, length, K, generator=gen))
        assert_close(compiled(*args), fn(*args), tol=1e-6, name=f"T={length}")
        graphs.append(counter.frame_count)
    assert graphs[2] == graphs[1] > graphs[0], graphs


@pytest.mark.parametrize("model", ["titans", "dla"])
def test_deep_memories_default_start_compiles(gen, model):
    """initial_state=None on an MLP memory draws the default weights from a seeded generator: a table of the
    sizes and the seed, which torch.compile takes as a constant (a generator made in the trace stops it)."""
    from atlaslib.deep import dla
    from atlaslib.miras import miras
    q, k, v, alpha, _ = inputs(gen, "scalar")
    if model == "titans":
        fn = lambda q, k, v, a: miras(q, k, v, preset="titans", memory="mlp", alpha=a, eta=0.1, theta=0.5,  # noqa: E731
                                      backend="chunk", chunk_size=CHUNK)[0]
    else:
        fn = lambda q, k, v, a: dla(q, k, v, memory="mlp", alpha=a, backend="chunk", chunk_size=CHUNK)[0]  # noqa: E731
    compiled_equals_eager(fn, q, k, v, alpha, tol=1e-5)


def test_default_start_state_is_a_fresh_copy():
    """The default deep weights are kept for the process: what a call returns must be its own tensors."""
    from atlaslib.deep.mlp import second_layer_init
    from atlaslib.miras import init_state, make_config
    cfg = make_config("titans", memory="mlp")
    first = init_state(cfg, 1, 2, 4, 3).memory
    want = {n: w.clone() for n, w in first.items()}
    for w in first.values():
        w.add_(1.0)
    assert all(torch.equal(init_state(cfg, 1, 2, 4, 3).memory[n], w) for n, w in want.items())
    w2 = second_layer_init(1, 2, 3, 8, torch.float64, "cpu")
    w2_again = w2.clone()
    w2.zero_()
    assert torch.equal(second_layer_init(1, 2, 3, 8, torch.float64, "cpu"), w2_again)


@pytest.mark.parametrize("model", ["deltanet", "titans_mlp", "memora_mlp", "dla_mlp", "deep_transformer_taylor",
                                   "deep_transformer_taylor_matrix", "dot_taylor"])
def test_dynamic_shapes_compile(gen, model):
    """Under dynamic=True torch.compile traces the config's numbers and the widths as symbolic: the config's
    checks compare instead of calling math.isfinite, messages are built from values, and the seeded default
    weights and the monomials' tables take the sizes' values (``validation.static_int``), and the tables are
    built in the graph from numbers (a constant tensor's sizes have no source a guard can name: the matrix
    memory on Taylor features failed inside torch). Three lengths, one seen twice: equal to eager mode."""
    from atlaslib.deep import deep_transformer, dla, dot
    from atlaslib.miras import miras
    calls = {
        "deltanet": lambda q, k, v, a: miras(q, k, v, preset="deltanet", eta=0.1, backend="chunk", chunk_size=8),
        "titans_mlp": lambda q, k, v, a: miras(q, k, v, preset="titans", memory="mlp", alpha=a, eta=0.1, theta=0.5,
                                               backend="chunk", chunk_size=8),
        "memora_mlp": lambda q, k, v, a: miras(q, k, v, preset="memora", memory="mlp", alpha=a, eta=0.1,
                                               backend="chunk", chunk_size=8),
        "dla_mlp": lambda q, k, v, a: dla(q, k, v, memory="mlp", alpha=a, backend="chunk", chunk_size=8),
        "deep_transformer_taylor": lambda q, k, v, a: deep_transformer(q, k, v, alpha=a, phi_star=("taylor", 2),
                                                                       window=3, normalize=True, backend="chunk",
                                                                       chunk_size=8),
        "deep_transformer_taylor_matrix": lambda q, k, v, a: deep_transformer(q, k, v, alpha=a, phi_star=("taylor", 2),
                                                                              normalize=True, backend="chunk",
                                                                              chunk_size=8),
        "dot_taylor": lambda q, k, v, a: dot(q, k, v, alpha=a, phi_star=("taylor", 2), backend="chunk", chunk_size=8)}
    fn = lambda *args: calls[model](*args)[0]  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for length in (13, 21, 13):
        q, k, v = random_qkv(B, H, length, K, K, generator=gen)
        args = (q, k, v, random_gate(B, H, length, low=0.5, generator=gen))
        assert_close(compiled(*args), fn(*args), tol=1e-5, name=f"T={length}")


def test_sliding_window_attention_compiles_on_views_at_every_length(gen):
    """The mixers hand softmax attention head-split views; padding one by nothing (T a multiple of the
    window) kept its strides in eager mode and broke the compiled graph's view of the query blocks."""
    from atlaslib.core import softmax_attention

    def swa(x, w):
        q, k, v = ((x @ w[i]).unflatten(-1, (2, 4)).transpose(1, 2) for i in range(3))
        return softmax_attention(q, k, v, window=3)
    compiled = torch.compile(swa, fullgraph=True, backend="aot_eager", dynamic=True)
    w = torch.randn(3, 8, 8, generator=gen, requires_grad=True)
    for length in (9, 10, 12, 7):
        x = torch.randn(1, length, 8, generator=gen)
        want, got = swa(x, w), compiled(x, w)
        assert_close(got, want, tol=1e-6, name=f"T={length}")
        (g_want,), (g_got,) = (torch.autograd.grad(y.sum(), w) for y in (want, got))
        assert_close(g_got, g_want, tol=1e-6, name=f"gradient, T={length}")
