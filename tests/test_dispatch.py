"""backend="auto" behaves the same in every chapter: the kernel on CUDA where it takes the inputs,
otherwise the chunk form with a warning saying why. CI has no GPU, so the CUDA side of the choice
is exercised with a stand-in tensor that reports being on CUDA."""
import linecache
import warnings

import pytest
import torch

import atlaslib.core.dispatch as dispatch
from atlaslib.core import random_gate, random_qkv
from atlaslib.deep import deep_transformer, dla, dot
from atlaslib.linear import linear_attention
from atlaslib.miras import miras
from atlaslib.omega import omega_rule


class OnCuda:
    """All that resolve_backend asks of a tensor: whether it is on CUDA."""
    is_cuda = True


def test_auto_on_cuda_runs_the_kernel_where_it_takes_the_inputs():
    assert dispatch.resolve_backend("auto", OnCuda(), unsupported=lambda: None) == "triton"


def test_auto_on_cuda_falls_back_with_a_warning_saying_why():
    with pytest.warns(RuntimeWarning, match="does not take fp64 inputs; using the chunk form"):
        assert dispatch.resolve_backend("auto", OnCuda(), unsupported=lambda: "fp64 inputs") == "chunk"


def test_auto_on_cpu_is_the_chunk_form_without_asking():
    asked = []
    assert dispatch.resolve_backend("auto", torch.zeros(1), unsupported=lambda: asked.append(1)) == "chunk"
    assert not asked


def _call(chapter, dtype, K=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (x.to(dtype) for x in random_qkv(1, 2, 12, K, 4, generator=g))
    alpha = random_gate(1, 2, 12, generator=g, dtype=dtype)
    if chapter == "linear":
        from atlaslib.linear import linear_attention
        return linear_attention(q, k, v, alpha=alpha)
    if chapter == "delta":
        from atlaslib.delta import delta_rule
        return delta_rule(q, k, v, torch.full_like(alpha, 0.5), alpha=alpha)
    if chapter == "omega":
        from atlaslib.omega import omega_rule
        return omega_rule(q, k, v, window=4, alpha=alpha)
    if chapter == "deep":
        from atlaslib.deep import deep_transformer
        return deep_transformer(q, k, v, alpha=alpha, normalize=True, window=5)
    if chapter == "deep_taylor":
        from atlaslib.deep import deep_transformer
        return deep_transformer(q, k, v, alpha=alpha, phi_star=("taylor", 2))
    if chapter in ("dot", "dot_taylor"):                 # window c = 1: the coefficient solve, or the features
        from atlaslib.deep import dot
        k = torch.nn.functional.normalize(k, dim=-1)
        return dot(q, k, v, alpha=alpha, eta=0.1, phi_star="kernel" if chapter == "dot" else ("taylor", 2))
    if chapter == "swla":
        from atlaslib.omega import swla
        return swla(q, k, v, window=3, alpha=alpha)
    if chapter == "atlas":
        from atlaslib.atlas import atlas
        return atlas(q, k, v, alpha=alpha, eta=0.1)
    if chapter == "caching":
        from atlaslib.caching import memory_caching
        from atlaslib.linear import linear_attention
        return memory_caching(q, k, v, base=linear_attention, segments=4, base_kwargs={"alpha": alpha})
    from atlaslib.miras import miras
    return miras(q, k, v, preset="ttt_linear")


@pytest.mark.parametrize("chapter, module", [("linear", "atlaslib.linear"), ("delta", "atlaslib.delta"),
                                             ("omega", "atlaslib.omega"), ("swla", "atlaslib.omega"),
                                             ("miras", "atlaslib.miras"), ("atlas", "atlaslib.atlas"),
                                             ("deep", "atlaslib.deep"), ("deep_taylor", "atlaslib.deep"),
                                             ("dot", "atlaslib.deep"), ("dot_taylor", "atlaslib.deep"),
                                             ("caching", "atlaslib.caching")])
def test_every_chapter_applies_its_kernel_limits_the_same_way(monkeypatch, chapter, module):
    """Every predicate ``unsupported`` that a model hands to the dispatcher runs on a (stand-in) GPU tensor:
    DOT's named a function its kernel module lacks, which only a GPU call would have reached."""
    import importlib
    importlib.import_module(module)
    choices = []

    real = dispatch.resolve_backend

    def as_if_on_cuda(backend, x, unsupported=None):
        choices.append(real(backend, OnCuda(), unsupported))
        return "chunk"                            # then compute on the CPU as usual
    monkeypatch.setattr(dispatch, "resolve_backend", as_if_on_cuda)   # every chapter reaches it via dispatch
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # inputs the kernel takes: no warning
        _call(chapter, torch.float32)
    assert choices and set(choices) == {"triton"}     # (Memory Caching asks once per call of its base too)
    choices.clear()
    with pytest.warns(RuntimeWarning, match="does not take fp64 inputs"):
        _call(chapter, torch.float64)
    assert choices and set(choices) == {"chunk"}


# ---- the dispatcher itself: a table {backend: function} -------------------------------------

def _table(log):
    """Three stand-in forms of y = 2 x that record which one ran."""
    def form(name):
        def run(x, scale):
            log.append(name)
            return (x * scale,)
        run.__name__ = name
        return run
    return {"recurrent": form("recurrent"), "chunk": form("chunk"), "triton": form("triton")}


def test_dispatch_runs_the_named_form():
    log = []
    x = torch.randn(3)
    for name in ("recurrent", "chunk"):
        (y,) = dispatch.dispatch(name, x, _table(log), x, 2.0)
        assert log[-1] == name and torch.equal(y, 2 * x)


def test_a_kernel_runs_on_the_inputs_gpu(monkeypatch):
    """Triton launches on the current device: dispatch makes the inputs' GPU current around the kernel
    (and only around the kernel)."""
    pytest.importorskip("triton")
    current = []

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            current.append(self.device)

        def __exit__(self, *exc):
            current.append(None)

    class OnGpu1(OnCuda):
        device = torch.device("cuda", 1)

    def kernel(x, y):
        log.append(("triton", current[-1] if current else None))
        return (y,)

    def chunk(x, y):
        log.append(("chunk", current[-1] if current else None))
        return (y,)

    monkeypatch.setattr(torch.cuda, "device", Device)
    log = []
    dispatch.dispatch("triton", OnGpu1(), {"chunk": chunk, "triton": kernel}, OnGpu1(), torch.zeros(2))
    dispatch.dispatch("chunk", OnGpu1(), {"chunk": chunk, "triton": kernel}, OnGpu1(), torch.zeros(2))
    assert log == [("triton", torch.device("cuda", 1)), ("chunk", None)] and current[-1] is None


def test_auto_on_cpu_runs_the_chunk_form():
    log = []
    dispatch.dispatch("auto", torch.zeros(2), _table(log), torch.zeros(2), 1.0)
    assert log == ["chunk"]


def test_triton_runs_forward_only_and_differentiates_the_chunk_form():
    """with_chunk_backward: the kernel's forward under no_grad, the gradient from the chunk form."""
    log = []
    x = torch.randn(4, requires_grad=True)
    (y,) = dispatch.call_backend("triton", _table(log), x, 3.0)
    assert log == ["triton"]
    y.square().sum().backward()
    assert log == ["triton", "chunk"]
    torch.testing.assert_close(x.grad, 18.0 * x.detach())          # d/dx (3x)^2 = 18 x


def test_a_differentiable_kernel_has_its_own_backward():
    """An entry marked differentiable (``lazy(..., differentiable=True)``) runs as it is, under autograd: the
    gradient is its own, and the chunk form runs neither forward nor backward."""
    pytest.importorskip("triton")                                  # forward_or_fallback names Triton's error
    log = []
    table = _table(log)
    table["triton"].differentiable = True
    x = torch.randn(4, requires_grad=True)
    (y,) = dispatch.call_backend("triton", table, x, 3.0)
    y.square().sum().backward()
    assert log == ["triton"]
    torch.testing.assert_close(x.grad, 18.0 * x.detach())          # d/dx (3x)^2 = 18 x


def test_kernel_limits_end_at_the_largest_head_size_built():
    """``matrix_kernel_limits`` takes every head size the kernels are built for (``aot.HEAD_SIZES``), up to the
    largest, its default ``max_key``, and names the first one past it."""
    from atlaslib.aot import HEAD_SIZES
    largest = max(HEAD_SIZES)
    for K in (*HEAD_SIZES, largest - 1):
        assert dispatch.matrix_kernel_limits(torch.empty(1, 1, 1, K, device="meta")) is None, K
    assert (dispatch.matrix_kernel_limits(torch.empty(1, 1, 1, largest + 1, device="meta"))
            == f"head size K={largest + 1} (at most {largest})")
    limits = lambda K, **kw: dispatch.matrix_kernel_limits(torch.empty(1, 1, 1, K, device="meta", **kw), 8)  # noqa: E731
    assert limits(8) is None and limits(9) == "head size K=9 (at most 8)"
    assert "fp64" in limits(8, dtype=torch.float64)


def test_a_backend_the_model_lacks_is_a_value_error_naming_the_ones_it_has():
    table = {"recurrent": None, "chunk": None}
    with pytest.raises(ValueError, match=r"deep thing has no backend 'triton': no kernel; its backends are "
                                         r"'recurrent', 'chunk', 'auto'"):
        dispatch.choose_backend("triton", torch.zeros(1), table, model="deep thing", missing="no kernel")
    with pytest.raises(ValueError, match=r"backend must be one of \('recurrent', 'chunk', 'auto'\), got 'fast'"):
        dispatch.choose_backend("fast", torch.zeros(1), table)
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.choose_backend(["chunk"], torch.zeros(1), table)


def test_auto_without_a_kernel_is_the_chunk_form_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.choose_backend("auto", OnCuda(), {"recurrent": None, "chunk": None}) == "chunk"


def test_explicit_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.choose_backend("triton", torch.zeros(1), _table([]))


ENGINE = "'recurrent', 'frozen_seq', 'chunk', 'auto'"


@pytest.mark.parametrize("call, model, has", [
    (lambda q, k, v: omega_rule(q, k, v, window=2, memory="mlp", backend="triton"),
     r"omega_rule\(memory='mlp'\)", ENGINE),
    (lambda q, k, v: miras(q, k, v, preset="titans", backend="triton"), "miras", ENGINE),
    (lambda q, k, v: linear_attention(q, k, v, backend="frozen_seq"), "linear_attention",
     "'recurrent', 'chunk', 'triton', 'auto'"),
    # functions that run on chapter 3's engine name themselves, not miras
    (lambda q, k, v: dla(q, k, v, backend="triton"), "dla", ENGINE),
    (lambda q, k, v: dla(q, k, v, memory="linear", backend="triton"), "dla", ENGINE),
    (lambda q, k, v: deep_transformer(q, k, v, memory="mlp", phi_star=("taylor", 2), backend="triton"),
     r"deep_transformer\(memory='mlp'\)", ENGINE),
    (lambda q, k, v: dot(q, k, v, memory="mlp", phi_star=("taylor", 2), backend="triton"),
     r"dot\(memory='mlp'\)", ENGINE),
])
def test_chapters_name_the_backends_a_model_has(call, model, has):
    q, k, v = random_qkv(1, 1, 5, 4, 4, seed=0)
    with pytest.raises(ValueError, match=f"^{model} has no backend .*its backends are {has}$"):
        call(q, k, v)


# ---- the fallback warnings name the user's line, not the library's ----------------------------

def _warned_line(run):
    """(file, source line) of the one RuntimeWarning that ``run()`` raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    caught = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(caught) == 1, [str(w.message) for w in caught]
    return caught[0].filename, linecache.getline(caught[0].filename, caught[0].lineno)


@pytest.mark.parametrize("chapter", ["linear", "miras", "mixer"])
def test_the_auto_fallback_warning_points_at_the_users_call(monkeypatch, chapter):
    """Every chapter reaches the warning through a different number of library frames (and a mixer
    through nn.Module.__call__); the warning must name the line that called the library."""
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))   # "auto" asks the kernel
    q, k, v = (x.double() for x in random_qkv(1, 2, 12, 8, 8, seed=0))          # which refuses fp64

    def run():
        if chapter == "linear":
            linear_attention(q, k, v)                                            # the user's call
        elif chapter == "miras":
            miras(q, k, v, preset="ttt_linear")                                  # the user's call
        else:
            mixer(x)                                                             # the user's call
    if chapter == "mixer":
        from atlaslib.nn import make_mixer
        mixer = make_mixer("gla", 16, 2).double()
        x = torch.randn(1, 12, 16, dtype=torch.float64)
    filename, line = _warned_line(run)
    assert filename == __file__ and line.rstrip().endswith("# the user's call"), (filename, line)


def test_the_kernels_fallback_warning_points_at_the_users_call():
    """A kernel that does not fit the card falls back to the chunk form, also inside autograd's apply."""
    errors = pytest.importorskip("triton.runtime.errors")

    def too_big(x):
        raise errors.OutOfResources(1 << 20, 1 << 16, "shared memory")
    table = {"triton": too_big, "chunk": lambda x: (2 * x,)}
    x = torch.randn(3, requires_grad=True)
    filename, line = _warned_line(lambda: dispatch.call_backend("triton", table, x))     # the user's call
    assert filename == __file__ and line.rstrip().endswith("# the user's call"), (filename, line)


@pytest.mark.parametrize("model", ["linear", "delta"])
def test_backward_kernels_the_card_refuses_fall_back_to_the_chunk_forms_gradients(gen, monkeypatch, model):
    """Chapters 1-2's Functions: a forward that fits the card and a backward that does not (it holds more
    tiles at once) give the gradients of autograd through the chunk form, with a warning, not a crash."""
    errors = pytest.importorskip("triton.runtime.errors")
    import atlaslib.delta.kernel as delta_kernel
    import atlaslib.linear.backward as linear_backward
    from atlaslib.delta import delta_rule

    def too_big(*args, **kwargs):
        raise errors.OutOfResources(150_000, 101_376, "shared memory")
    monkeypatch.setattr(*((delta_kernel, "delta_rule_backward") if model == "delta"
                          else (linear_backward, "linear_attention_backward")), too_big)
    B, H, T, K, V = 1, 2, 70, 8, 6                               # two chunks, the second one short
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    alpha = random_gate(B, H, T, low=0.8, generator=gen)
    beta = random_gate(B, H, T, generator=gen)
    h0 = torch.randn(B, H, V, K, generator=gen)
    do, dht = torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, V, K, generator=gen)

    def grads(backend):
        xs = [x.clone().requires_grad_() for x in (q, k, v, alpha, beta, h0)]
        q_, k_, v_, a_, b_, h_ = xs
        if model == "delta":
            o, ht = delta_rule(q_, k_, v_, b_, alpha=a_, initial_state=h_, output_final_state=True, backend=backend)
        else:
            o, ht = linear_attention(q_, k_, v_, alpha=a_, initial_state=h_, output_final_state=True,
                                     backend=backend)
        wrt = xs if model == "delta" else [q_, k_, v_, a_, h_]
        return torch.autograd.grad((o * do).sum() + (ht * dht).sum(), wrt)

    with pytest.warns(RuntimeWarning, match="the backward kernels do not fit this GPU .*shared memory.*chunk form"):
        got = grads("triton")
    names = ["q", "k", "v", "alpha", "beta", "h0"] if model == "delta" else ["q", "k", "v", "alpha", "h0"]
    for name, g, ref in zip(names, got, grads("recurrent"), strict=True):
        err = float((g - ref).norm() / ref.norm())
        assert err < 1e-5, f"{model} d{name}: relative error {err:.2e}"


@pytest.mark.parametrize("model", ["linear", "delta"])
def test_other_errors_of_the_backward_kernels_are_not_swallowed(gen, monkeypatch, model):
    """Only a card's refusal (OutOfResources) sends the gradients to the chunk form: a bug in the backward
    kernels, or an input they refuse, is raised, not turned into a warning about shared memory."""
    import atlaslib.delta.kernel as delta_kernel
    import atlaslib.linear.backward as linear_backward
    from atlaslib.delta import delta_rule

    def broken(*args, **kwargs):
        raise ValueError("a bug in the backward kernels")
    monkeypatch.setattr(*((delta_kernel, "delta_rule_backward") if model == "delta"
                          else (linear_backward, "linear_attention_backward")), broken)
    q, k, v = (x.requires_grad_() for x in random_qkv(1, 2, 70, 8, 6, generator=gen))
    o, _ = (delta_rule(q, k, v, 0.5, backend="triton") if model == "delta"
            else linear_attention(q, k, v, backend="triton"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="a bug in the backward kernels"):
            o.sum().backward()


@pytest.mark.parametrize("module", ["atlaslib.miras.backends", "atlaslib.caching"])
def test_kernels_called_outside_dispatch_run_on_the_inputs_gpu(monkeypatch, module):
    """Chapter 3's kernel (miras' own backend table) and chapter 7's readout kernel are launched without
    ``dispatch``: each launch runs inside ``on_the_inputs_gpu`` of its inputs (they ran on whichever GPU
    was current)."""
    import importlib
    pytest.importorskip("triton")
    mod = importlib.import_module(module)
    entered = []
    monkeypatch.setattr(mod, "on_the_inputs_gpu", lambda x: entered.append(x) or dispatch.on_the_inputs_gpu(x))
    g = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(1, 2, 12, 8, 4, generator=g)
    if module == "atlaslib.caching":
        from atlaslib.caching import memory_caching
        memory_caching(q, k, v, base=linear_attention, segments=4, aggregate="grm", backend="triton")
    else:
        miras(torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1), v,
              preset="titans", memory="linear", eta=0.1, theta=0.5, backend="triton")
    assert entered and all(x is q or x.shape[:3] == q.shape[:3] for x in entered)


def test_on_the_inputs_gpu_makes_a_cuda_tensors_device_current(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", lambda device: ("current", device))

    class OnGpu1:
        device = torch.device("cuda", 1)
    assert dispatch.on_the_inputs_gpu(OnGpu1()) == ("current", torch.device("cuda", 1))
    with dispatch.on_the_inputs_gpu(torch.zeros(1)):                 # a CPU tensor: nothing to do
        pass
