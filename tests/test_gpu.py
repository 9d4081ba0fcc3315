"""Every Triton kernel family compiled for a real GPU, against its chunk form (skipped without CUDA).

The same comparisons as the interpreter tests, compiled for the card, in fp32 and bf16 (fp16 once per
family where the kernel takes it), at one or two shapes each, and at long T where error accumulates
over many chunks (the state pass of chapters 1 and 2). Shapes are few on purpose: `make gpu-test`
(this file, then ``bench --vs fla``) should take a few minutes on one H100, compilation included, so
where possible the shapes are those the benchmark compiles anyway (K = V = 128 in bf16, 64 in fp32).

``KERNEL_TESTS`` names, for every module of atlaslib that defines ``@triton.jit`` functions, the tests
here that run its kernels. ``test_every_kernel_module_is_covered`` (no GPU needed, so ``make test`` runs
it) fails when a module is missing from it, so a new kernel cannot go untested on the card; on the
card, ``test_every_kernel_was_launched`` (last) checks that every ``*_kernel`` of those modules was
actually launched by the tests above it, not bypassed by a fallback to the chunk form.

``ATLAS_GPU_TESTS_ON_CPU=1`` (with ``TRITON_INTERPRET=1``) runs the same tests on the CPU in Triton's
interpreter with T cut to ``DRY_T``: a check of this file itself, which ``make test`` runs in a subprocess
(``test_the_file_runs_dry_on_the_cpu``, about 75 s on one core) so that the file is known to run before a
GPU's time is spent on it.
"""
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from atlaslib.core import assert_close, poisoned_outputs, random_gate, random_qkv
from atlaslib.core.chunk_kernels import chunk_state_kernel

DRY_RUN = os.environ.get("ATLAS_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"
DRY_T = 24
# On a card the kernels must be compiled: Triton's interpreter (which tests/conftest.py switches on unless
# TRITON_INTERPRET is set) also takes CUDA tensors, copying them to the host, and would pass every test
# here slowly without building anything. Triton's own reading of the variable decides: a kernel object.
COMPILED = type(chunk_state_kernel).__name__ == "JITFunction"
gpu = pytest.mark.skipif(not (DRY_RUN or (torch.cuda.is_available() and COMPILED)),
                         reason="no CUDA device, or Triton's interpreter is on: run TRITON_INTERPRET=0 "
                                "(make gpu-test) on a card to compile the kernels")

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = {
    "atlaslib/core/kernels.py": ["test_linear_attention_kernel_on_gpu", "test_delta_rule_kernel_on_gpu"],
    "atlaslib/core/chunk_kernels.py": ["test_linear_attention_kernel_on_gpu", "test_linear_attention_long_bf16",
                                       "test_delta_rule_kernel_on_gpu"],
    "atlaslib/core/chunk_backward.py": ["test_linear_attention_backward_on_gpu", "test_delta_rule_backward_on_gpu"],
    "atlaslib/linear/backward.py": ["test_linear_attention_backward_on_gpu"],
    "atlaslib/delta/kernel.py": ["test_delta_rule_kernel_on_gpu", "test_delta_rule_long_bf16",
                                 "test_delta_rule_backward_on_gpu"],
    "atlaslib/deep/kernel.py": ["test_deep_transformer_kernel_on_gpu", "test_dot_solve_in_halves_on_gpu",
                                "test_bench_case_kernel_on_gpu",
                                "test_16_bit_products_of_chapters_6_and_7_cost_about_the_outputs_rounding_on_gpu"],
    "atlaslib/miras/kernel.py": ["test_bench_case_kernel_on_gpu"],
    "atlaslib/omega/kernel.py": ["test_bench_case_kernel_on_gpu"],
    "atlaslib/atlas/kernel.py": ["test_bench_case_kernel_on_gpu", "test_newton_schulz_kernel_on_gpu"],
    "atlaslib/caching/kernel.py": ["test_bench_case_kernel_on_gpu",
                                   "test_16_bit_products_of_chapters_6_and_7_cost_about_the_outputs_rounding_on_gpu"],
    "atlaslib/core/memory_kernels.py": ["test_deep_transformer_kernel_on_gpu", "test_bench_case_kernel_on_gpu"],
}
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-2}
RAN: set = set()                    # the tests of this file that ran (the launch check needs them all)
LAUNCHED: set = set()               # (module, kernel name) of every launch while they ran


def length(T: int) -> int:
    return min(T, DRY_T) if DRY_RUN else T


@pytest.fixture(autouse=True, scope="module")
def record_launches():
    """Wrap ``run`` of compiled and interpreted Triton functions so each launch records its kernel."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def recording(original):
        def run(self, *args, **kwargs):
            LAUNCHED.add((self.fn.__module__, self.fn.__name__))
            return original(self, *args, **kwargs)
        return run
    for cls, original in originals.items():
        cls.run = recording(original)
    yield
    for cls, original in originals.items():
        cls.run = original


@pytest.fixture(autouse=True)
def record_test(request):
    yield
    RAN.add(request.node.originalname)


def kernel_modules() -> set:
    """atlaslib's modules (paths from the repository root) that define a ``@triton.jit`` function."""
    return {str(p.relative_to(ROOT)) for p in (ROOT / "atlaslib").rglob("*.py")
            if re.search(r"^\s*@triton\.jit", p.read_text(), flags=re.M)}


def test_every_kernel_module_is_covered():
    """Runs without a GPU: every module with ``@triton.jit`` functions is in KERNEL_TESTS, with tests that
    exist here (the eight families: chapters 1, 2, 4 (Titans), 4 (Omega/SWLA), 5, 6, 7 and the shared tiles)."""
    import sys
    assert set(KERNEL_TESTS) == kernel_modules(), "add the new kernel module to KERNEL_TESTS with tests that run it"
    here = sys.modules[__name__]
    for module, tests in KERNEL_TESTS.items():
        assert tests and all(callable(getattr(here, t, None)) and t.startswith("test_") for t in tests), module


@pytest.mark.skipif(DRY_RUN or torch.cuda.is_available(), reason="the dry run itself, or a GPU runs the file for real")
def test_the_file_runs_dry_on_the_cpu():
    """Runs without a GPU: this whole file in Triton's interpreter (``ATLAS_GPU_TESTS_ON_CPU=1``, T cut to
    ``DRY_T``), in one process, so a test that would fail on the card for a reason of its own (a wrong
    shape, a kernel no test launches any more) fails here first, before a GPU's time is spent on it."""
    env = dict(os.environ, ATLAS_GPU_TESTS_ON_CPU="1", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(Path(__file__)), "-k", "not test_the_file_runs_dry_on_the_cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in summary and "skipped" not in summary, summary    # every test ran, the launch check too


def inputs(gen, B, H, T, K, V, mode, low=0.5):
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    alpha = None if mode is None else random_gate(B, H, T, K if mode == "channel" else None, low=low, generator=gen)
    h0 = torch.randn(B, H, V, K, generator=gen)
    return [None if x is None else x.to(DEVICE) for x in (q, k, v, alpha, h0)]


# (dtype, (B, H, T, K, V)): the benchmark's head sizes per dtype (compiled once for both), an odd shape
# in fp32 (padded tiles, partial last chunk) and fp16 once
CHAPTER_1_2_CASES = [(torch.float32, (2, 3, 75, 64, 64)), (torch.float32, (2, 3, 63, 60, 100)),
                     (torch.bfloat16, (1, 4, 1000, 128, 128)), (torch.float16, (2, 3, 63, 64, 64))]
MODES = [None, "scalar", "channel"]


def cast(x, dtype):
    return None if x is None else x.to(dtype)


@gpu
@pytest.mark.parametrize("dtype, shape", CHAPTER_1_2_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_linear_attention_kernel_on_gpu(gen, shape, mode, dtype):
    from atlaslib.linear import linear_attention
    B, H, T, K, V = shape
    q, k, v, alpha, h0 = inputs(gen, B, H, length(T), K, V, mode)
    ref, ref_s = linear_attention(q, k, v, alpha=alpha, initial_state=h0, output_final_state=True, backend="chunk")
    with poisoned_outputs():
        o, s = linear_attention(cast(q, dtype), cast(k, dtype), cast(v, dtype), alpha=cast(alpha, dtype),
                                initial_state=h0, output_final_state=True, backend="triton")
    assert o.dtype == dtype
    assert_close(o.float(), ref, tol=TOL[dtype])
    assert_close(s, ref_s, tol=TOL[dtype], name="final state")


@gpu
def test_linear_attention_long_bf16(gen):
    """T = 16K in bf16 (256 chunks of state passing), scalar log-gates: finite and close to the fp32 chunk form."""
    from atlaslib.linear import linear_attention
    q, k, v, alpha, h0 = inputs(gen, 1, 2, length(16384), 128, 128, "scalar", low=0.9)
    ref, _ = linear_attention(q, k, v, log_alpha=alpha.log(), initial_state=h0, backend="chunk")
    o, _ = linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_alpha=alpha.log(), initial_state=h0,
                            backend="triton")
    assert torch.isfinite(o.float()).all()
    assert_close(o.float(), ref, tol=3e-2)


@gpu
@pytest.mark.parametrize("dtype, shape", CHAPTER_1_2_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_linear_attention_backward_on_gpu(gen, shape, mode, dtype):
    """The backward kernels (``linear.backward``, the reverse state pass): gradients of q, k, v, the log-gates
    and the initial state, with a final-state gradient, against autograd through the fp32 chunk form."""
    from atlaslib.linear import linear_attention
    B, H, T, K, V = shape
    q, k, v, alpha, h0 = inputs(gen, B, H, length(T), K, V, mode)
    logs = None if alpha is None else alpha.log()
    do = torch.randn(B, H, length(T), V, generator=gen).to(DEVICE)
    dht = torch.randn(B, H, V, K, generator=gen).to(DEVICE)

    def grads(backend, dtype):
        xs = [None if x is None else x.to(dtype if i < 3 else torch.float32).detach().requires_grad_()
              for i, x in enumerate((q, k, v, logs, h0))]
        o, s = linear_attention(*xs[:3], log_alpha=xs[3], initial_state=xs[4], output_final_state=True,
                                backend=backend)
        ((o.float() * do).sum() + (s * dht).sum()).backward()
        return [None if x is None else x.grad for x in xs]
    ref = grads("chunk", torch.float32)
    with poisoned_outputs():
        got = grads("triton", dtype)
    for name, a, r in zip(("q", "k", "v", "log_alpha", "initial state"), got, ref):
        if r is not None:
            assert torch.isfinite(a.float()).all(), name
            assert_close(a.float(), r, tol=TOL[dtype], name=f"d{name}")


@gpu
@pytest.mark.parametrize("dtype, shape", CHAPTER_1_2_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_delta_rule_kernel_on_gpu(gen, shape, mode, dtype):
    from atlaslib.delta import delta_rule
    B, H, T, K, V = shape
    q, k, v, alpha, h0 = inputs(gen, B, H, length(T), K, V, mode)
    beta = torch.rand(B, H, length(T), generator=gen).to(DEVICE)
    ref, ref_s = delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, output_final_state=True, backend="chunk")
    with poisoned_outputs():
        o, s = delta_rule(cast(q, dtype), cast(k, dtype), cast(v, dtype), beta, alpha=cast(alpha, dtype),
                          initial_state=h0, output_final_state=True, backend="triton")
    assert o.dtype == dtype
    assert_close(o.float(), ref, tol=TOL[dtype])
    assert_close(s, ref_s, tol=TOL[dtype], name="final state")


@gpu
@pytest.mark.parametrize("dtype, shape", CHAPTER_1_2_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_delta_rule_backward_on_gpu(gen, shape, mode, dtype):
    """The delta rule's backward kernels (``delta.kernel.DeltaRuleFunction``, the reverse state pass): gradients
    of q, k, v, beta, the log-gates and the initial state, with a final-state gradient, against autograd
    through the fp32 chunk form."""
    from atlaslib.delta import delta_rule
    B, H, T, K, V = shape
    q, k, v, alpha, h0 = inputs(gen, B, H, length(T), K, V, mode)
    beta = torch.rand(B, H, length(T), generator=gen).to(DEVICE)
    logs = None if alpha is None else alpha.log()
    do = torch.randn(B, H, length(T), V, generator=gen).to(DEVICE)
    dht = torch.randn(B, H, V, K, generator=gen).to(DEVICE)

    def grads(backend, dtype):
        xs = [None if x is None else x.to(dtype if i < 3 else torch.float32).detach().requires_grad_()
              for i, x in enumerate((q, k, v, beta, logs, h0))]
        o, s = delta_rule(*xs[:4], log_alpha=xs[4], initial_state=xs[5], output_final_state=True, backend=backend)
        ((o.float() * do).sum() + (s * dht).sum()).backward()
        return [None if x is None else x.grad for x in xs]
    ref = grads("chunk", torch.float32)
    with poisoned_outputs():
        got = grads("triton", dtype)
    for name, a, r in zip(("q", "k", "v", "beta", "log_alpha", "initial state"), got, ref):
        if r is not None:
            assert torch.isfinite(a.float()).all(), name
            assert_close(a.float(), r, tol=TOL[dtype], name=f"d{name}")


@gpu
@pytest.mark.parametrize("model", ["linear", "delta"])
@pytest.mark.parametrize("mode", ["scalar", "channel"])
def test_fp32_kernels_keep_their_digits_after_resets_on_gpu(gen, model, mode):
    """A quarter of the gates 0, the rest within 1e-3 of 1: the fp32 kernels (fp64 chunk-local log-gate sums,
    ``core.kernels.gate_sum_dtype``) stay as close to fp64 as the fp32 chunk form on the same card, outputs and
    dq, dk, dv (with fp32 sums they were 50x-150x further in the interpreter)."""
    from atlaslib.core import rel_rmse
    from atlaslib.delta import delta_rule
    from atlaslib.linear import linear_attention
    B, H, T, K = 1, 2, length(96), 16
    q, k, v, _, _ = inputs(gen, B, H, T, K, K, None)
    shape = (B, H, T, K) if mode == "channel" else (B, H, T)
    alpha = 1 - 1e-3 * torch.rand(shape, generator=gen, dtype=torch.float64)
    alpha = alpha.masked_fill(torch.rand(shape, generator=gen) < 0.25, 0.0).to(DEVICE)
    beta = torch.full((B, H, T), 0.5, device=DEVICE)
    w = torch.randn(B, H, T, K, generator=gen).to(DEVICE)

    def run(dtype, backend):
        xs = [x.to(dtype).clone().requires_grad_() for x in (q, k, v)]
        if model == "linear":
            o, _ = linear_attention(*xs, alpha=alpha.to(dtype), backend=backend)
        else:
            o, _ = delta_rule(*xs, beta.to(dtype), alpha=alpha.to(dtype), backend=backend)
        (o * w.to(dtype)).sum().backward()
        return o.double(), torch.cat([x.grad.double().flatten() for x in xs])
    ref = run(torch.float64, "chunk")
    chunk, kernel = run(torch.float32, "chunk"), run(torch.float32, "triton")
    for i, name in enumerate(("outputs", "dq, dk, dv")):
        e_chunk, e_kernel = rel_rmse(chunk[i], ref[i]), rel_rmse(kernel[i], ref[i])
        assert e_kernel < 2.5 * e_chunk + 1e-7, f"{name}: kernels {e_kernel:.2e} from fp64, chunk form {e_chunk:.2e}"


@gpu
@pytest.mark.parametrize("mode", [None, "scalar"])
def test_delta_rule_long_bf16(gen, mode):
    """T = 16K in bf16: the kernel stays finite and close to the fp32 chunk form."""
    from atlaslib.delta import delta_rule
    T = length(16384)
    q, k, v, alpha, h0 = inputs(gen, 1, 2, T, 128, 128, mode, low=0.9)
    beta = torch.rand(1, 2, T, generator=gen).to(DEVICE)
    log_alpha = None if alpha is None else alpha.log()
    ref, _ = delta_rule(q, k, v, beta, log_alpha=log_alpha, initial_state=h0, backend="chunk")
    o, _ = delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta, log_alpha=log_alpha, initial_state=h0,
                      backend="triton")
    assert torch.isfinite(o.float()).all()
    assert_close(o.float(), ref, tol=3e-2)


@gpu
@pytest.mark.parametrize("dtype, T, K, V, normalize, window", [
    (torch.float32, 300, 64, 64, True, None), (torch.float32, 63, 60, 100, False, 5),
    (torch.bfloat16, 300, 128, 128, True, 70), (torch.float16, 300, 256, 64, False, None)])
def test_deep_transformer_kernel_on_gpu(gen, dtype, T, K, V, normalize, window):
    from atlaslib.deep import deep_transformer
    q, k, v = random_qkv(2, 2, length(T), K, V, generator=gen)
    q = q / K ** 0.5                                               # attention's scale, so exp stays in range
    alpha, eta = random_gate(2, 2, length(T), low=0.9, generator=gen), 0.2 + torch.rand(2, 2, length(T), generator=gen)
    q, k, v, alpha, eta = (x.to(DEVICE) for x in (q, k, v, alpha, eta))
    ref, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=normalize, window=window, backend="chunk")
    with poisoned_outputs():
        o, _ = deep_transformer(q.to(dtype), k.to(dtype), v.to(dtype), alpha=alpha, eta=eta, normalize=normalize,
                                window=window, backend="triton")
    assert o.dtype == dtype
    assert_close(o.float(), ref, tol=TOL[dtype])


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dot_solve_in_halves_on_gpu(gen, dtype):
    """DOT's solve split down to leaves of one block (``leaf=1``), so the recall kernel runs between every
    two halves (the bench row below splits T = 300 into leaves of 128 only), against the chunk form."""
    from atlaslib.deep import dot_chunk
    from atlaslib.deep.kernel import dot_kernel_triton
    T = length(300)
    q, k, v = random_qkv(1, 2, T, 64, 64, generator=gen)
    k = 0.5 * k / k.norm(dim=-1, keepdim=True)                      # |k|^2 = 1/4: a stable delta rule on phi*
    alpha, eta = random_gate(1, 2, T, low=0.9, generator=gen), 0.1 + 0.4 * torch.rand(1, 2, T, generator=gen)
    q, k, v, alpha, eta = (x.to(DEVICE) for x in (q, k, v, alpha, eta))
    ref, _ = dot_chunk(q, k, v, alpha, eta, "exp", 64)
    with poisoned_outputs():
        o, _ = dot_kernel_triton(q.to(dtype), k.to(dtype), v.to(dtype), alpha, eta, leaf=1)
    assert o.dtype == dtype
    assert_close(o.float(), ref, tol=TOL[dtype])


# The other families through their benchmark rows (the models' public calls with backend "triton" against
# "chunk" on the same inputs): Titans with a linear memory (miras), the Omega rule and SWLA (omega), ATLAS
# (atlas: Newton-Schulz on the kernel), DOT (deep: dot_kernel), Memory Caching over Gated DeltaNet (caching's
# readout, on chapter 2's kernel), constant and log-linear segments.
BENCH_ROWS = ["titans_linear", "omega", "swla", "atlas", "dot_kernel", "mc_gdn_c64", "mc_gdn_log"]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", BENCH_ROWS)
def test_bench_case_kernel_on_gpu(gen, case, dtype):
    from atlaslib import bench
    bench.load_chapter_cases()
    shape = bench.BenchShape(1, 2, length(300), 64, 64, DEVICE, dtype, chunk_size=64)
    call = bench.BENCH_CASES[case].builder(shape, gen)
    with torch.no_grad():
        ref = call("chunk")
        with poisoned_outputs():
            out = call("triton")
    ref, out = (x[0] if isinstance(x, tuple) else x for x in (ref, out))
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    assert_close(out.float(), ref.float(), tol=TOL[dtype])


# The memory kernels of chapters 3-5 with bf16 inputs: their products take bf16 operands (the fp32 states
# rounded for the product only). Against their chunk forms in fp64 on the same inputs the outputs stay
# within a small multiple of their own bf16 rounding (the interpreter measures 1.5x-2.0x here; the bound leaves
# room for a card's summation order). No decay, so the memories keep every error over T = 1024.
BF16_ROUNDING_BOUND = 3.0


@gpu
@pytest.mark.parametrize("model", ["titans", "omega", "swla", "atlas"])
def test_bf16_products_cost_about_the_outputs_rounding_on_gpu(gen, model):
    from atlaslib.atlas import atlas
    from atlaslib.core.testing import assert_within_rounding
    from atlaslib.miras import miras
    from atlaslib.omega import omega_rule, swla
    T = length(1024)
    q, k, v = random_qkv(1, 2, T, 64, 64, generator=gen)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    eta = (0.05 + 0.2 * torch.rand(1, 2, T, generator=gen)).to(DEVICE)
    q, k, v = (x.to(DEVICE).bfloat16() for x in (q, k, v))
    calls = {"titans": lambda *x, **kw: miras(*x, preset="titans", memory="linear", **kw),
             "omega": lambda *x, **kw: omega_rule(*x, window=4, **kw),
             "swla": lambda *x, **kw: swla(*x, window=4, **kw),
             "atlas": lambda *x, **kw: atlas(*x, **kw)}
    call = calls[model]
    ref = call(q.double(), k.double(), v.double(), eta=eta.double(), backend="chunk", chunk_size=16)[0]
    with poisoned_outputs():
        out = call(q, k, v, eta=eta, backend="triton", chunk_size=16)[0]
    assert out.dtype == torch.bfloat16
    assert_within_rounding(out.double(), ref, torch.bfloat16, BF16_ROUNDING_BOUND, name=model)


# The kernels of chapters 6 and 7 with 16-bit inputs, bounded the same way, each by what the interpreter
# measured (in parentheses) with room for a card's summation order. Few cases, each a new compile: the deep
# kernel (bf16 normalised with a window and unnormalised, 1.3x-1.6x; unnormalised fp16, whose fp32 weights
# meet v in TF32, 2.0x-2.7x), DOT (its read sums coefficients that cancel, most without gates, and reads them
# with "tf32x3": 1.0x, exact in the interpreter; one TF32 product gave 4.1x at T = 512 in bf16 without
# gates) and the caching readout (bf16: its three aggregates; fp16: GRM; 1.26x-1.39x).
ROUNDING_CASES = [("deep", torch.bfloat16, 3.0), ("deep", torch.float16, 4.0), ("dot", torch.float16, 2.0),
                  ("dot_no_gates", torch.bfloat16, 2.0), ("caching", torch.bfloat16, 3.0),
                  ("caching", torch.float16, 3.0)]


@gpu
@pytest.mark.parametrize("case, dtype, bound", ROUNDING_CASES)
def test_16_bit_products_of_chapters_6_and_7_cost_about_the_outputs_rounding_on_gpu(gen, case, dtype, bound):
    from atlaslib.core.testing import assert_within_rounding
    from atlaslib.deep import deep_transformer, dot
    if case == "caching":
        from test_caching_kernel import random_inputs, readout_reference
        from atlaslib.caching.kernel import cached_readout_triton
        aggregates = (("residual", None), ("grm", None), ("ssc", 2)) if dtype == torch.bfloat16 else (("grm", None),)
        for aggregate, top_k in aggregates:
            inputs = random_inputs(gen, dtype=dtype)
            with poisoned_outputs():
                y = cached_readout_triton(*(x.to(DEVICE) for x in inputs), top_k=top_k, aggregate=aggregate)
            assert_within_rounding(y.cpu().double(), readout_reference(*inputs, top_k, aggregate), dtype, bound,
                                   name=f"{aggregate} {dtype}")
        return
    T, K = length(512), 64
    q, k, v = random_qkv(1, 2, T, K, 64, generator=gen)
    gates = case != "dot_no_gates"
    alpha = random_gate(1, 2, T, low=0.9, generator=gen).to(DEVICE) if gates else None
    eta = (0.1 + 0.4 * torch.rand(1, 2, T, generator=gen)).to(DEVICE) if gates else None
    if case == "deep":
        q = q / K ** 0.5
        calls = [partial(deep_transformer, normalize=False)]
        if dtype == torch.bfloat16:
            calls.append(partial(deep_transformer, normalize=True, window=64))
    else:
        k = 0.5 * k / k.norm(dim=-1, keepdim=True)                  # a stable delta rule on phi*, as above
        q = 0.5 * q / q.norm(dim=-1, keepdim=True)
        calls = [dot]
    q, k, v = (x.to(DEVICE).to(dtype) for x in (q, k, v))
    a64, e64 = (None if x is None else x.double() for x in (alpha, eta))
    for call in calls:
        ref, _ = call(q.double(), k.double(), v.double(), alpha=a64, eta=e64, backend="chunk")
        with poisoned_outputs():
            out, _ = call(q, k, v, alpha=alpha, eta=eta, backend="triton")
        assert out.dtype == dtype
        assert_within_rounding(out.double(), ref, dtype, bound, name=f"{case} {dtype}")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_kernel_on_gpu(gen, dtype):
    """Chapter 5's kernel called directly on a batch of momenta (its bf16 loads and stores; the ATLAS row above
    hands it fp32), square and tall, against the PyTorch iteration."""
    from atlaslib.atlas import newton_schulz
    from atlaslib.atlas.kernel import newton_schulz_triton
    for rows, cols in ((64, 64), (128, 64)):
        G = torch.randn(2, 8, rows, cols, generator=gen).to(DEVICE)
        ref = newton_schulz(G.to(dtype).float(), 5)
        with poisoned_outputs():
            out = newton_schulz_triton(G.to(dtype), 5)
        assert out.dtype == dtype
        assert_close(out.float(), ref, tol=TOL[dtype])


@gpu
def test_every_kernel_was_launched():
    """Last: every ``*_kernel`` of every module in KERNEL_TESTS was launched by the tests above (a fallback
    to the chunk form would leave it unrun)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    needed = {t for tests in KERNEL_TESTS.values() for t in tests}
    if not needed <= RAN:
        pytest.skip(f"run the whole file: {sorted(needed - RAN)} did not run")
    import importlib
    missing = []
    for path in KERNEL_TESTS:
        module = importlib.import_module(path[:-3].replace("/", "."))
        kernels = {name for name, obj in vars(module).items()
                   if isinstance(obj, (JITFunction, InterpretedFunction)) and name.endswith("_kernel")
                   and obj.fn.__module__ == module.__name__}                       # defined there, not imported
        if not DRY_RUN:                                 # on the card: compiled, never interpreted
            assert not any(isinstance(vars(module)[name], InterpretedFunction) for name in kernels), module
        launched = {name for mod, name in LAUNCHED if mod == module.__name__}
        missing += [f"{module.__name__}.{name}" for name in sorted(kernels - launched)]
    assert not missing, f"never launched: {missing}"
