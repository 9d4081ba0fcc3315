"""Every Triton kernel built ahead of time for real GPUs, on a machine that has none.

Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python on NumPy, which is how
the tests check the kernels' numbers on CPU. It also accepts programs that a real build
rejects or that would crawl on a card: more shared memory than the card has, ``tl.dot``
shapes below 16, register spills. So this module builds each kernel for named targets —
sm_80 (A100), sm_90 (H100) and sm_86 (RTX 3090, standing for the consumer cards that let a
program use 99 KB of shared memory) — without a device:

1. it calls the chapter's Triton wrapper on small CPU tensors with the kernel launch
   intercepted, so the tile sizes, flags and argument dtypes are exactly the ones the wrapper
   chooses for the target's shared memory (``core.kernels.assume_shared_memory``; nothing here
   repeats the wrappers' tile logic);
2. it specialises the captured arguments as Triton's JIT does at a launch (dtypes,
   16-byte alignment, integers divisible by 16) and compiles with
   ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``;
3. it reads what the build used: shared memory (from the compiled metadata), registers and
   spilled bytes (from the ``ptxas -v`` log of that same build), whether every offset
   added to a kernel's pointer arguments is 64-bit (from the Triton IR), and which of its
   ``tl.dot`` products run on tensor cores and which on CUDA cores (from the TTGIR, where
   each product has been given a tensor-core layout or left as a plain FMA loop).

Every grid is checked as well, at T = 40 and T = 400. Most kernels' programs loop over
chunks, so a head's kernel launches the same grid at both. Chapters 1 and 2 run the
chunk-parallel forward (``core.chunk_kernels``): their intra-chunk and output kernels have a
program per chunk, so those grids grow with the number of chunks, while their state pass
keeps the grid independent of T. Chapter 6's kernel-trick forward (also DOT's read) has a program
per block of queries, as FlashAttention's, so its grid grows with T. Chapter 5's Newton–Schulz kernel is one program per
momentum matrix, launched once per chunk on that chunk's B*H*b matrices, so its grid is
bounded by B*H*b and its number of launches grows with T. A call that launches several
kernels has each of them built.

``python -m atlaslib.aot`` prints the table (``--family atlas``: one family's) and exits with status 1
if a build failed, does not fit (but for the configurations known to run the chunk form on a
consumer card, ``CHUNK_FORM_ON``) or adds 32-bit offsets to a pointer argument. ``--fast`` stops
each build once its shared memory is allocated, before LLVM and ptxas: about a second a build
instead of up to minutes, with everything checked but registers and spills. ``make test`` runs
the tests that assert every configuration builds, fits and addresses 64-bit offsets on fast
builds; ``make aot`` runs them on full builds and checks registers too. Results are cached in
``_build/aot/`` of the repository's checkout (an installed copy: ``$XDG_CACHE_HOME/atlaslib/aot``,
by default ``~/.cache/atlaslib/aot``; ``ATLAS_AOT_CACHE`` overrides both) keyed by the kernel's
source hash, the arguments' specialisation, the target and the 64-bit offset check
(``checks_version``), so an unchanged kernel is not rebuilt.
Needs the real kernels: run it with ``TRITON_INTERPRET`` unset (it re-executes itself that way
when asked from an interpreted process). Uses Triton's JIT internals
(``create_function_from_signature``, ``_pack_args``), pinned by ``triton==3.7.1``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# Shared memory one program may use (the opt-in maximum per block) on each target.
TARGETS = {
    "sm_80": {"cc": 80, "card": "A100", "shared_limit": 163 * 1024},
    "sm_90": {"cc": 90, "card": "H100", "shared_limit": 227 * 1024},
    # consumer cards: RTX 3090 (sm_86); the RTX 4090 (sm_89) and 5090 (sm_120) allow the same 99 KB
    "sm_86": {"cc": 86, "card": "RTX 3090", "shared_limit": 99 * 1024},
}
# What does not fit a consumer card even with its narrow tiles (``core.kernels.narrow_tiles``; sm_86 builds,
# fp32 inputs only): there these configurations raise OutOfResources at launch and ``core.dispatch`` runs the
# chunk form instead, with a warning. The delta rule's state passes at K = 256 hold [64, 256] fp32 tiles of k
# and w, 128 KB whatever the value block; Titans at chunks of 64 with K = 256, and the Omega rule at chunks of
# 64 with D = 256 or with a window of 8 and D >= 100, would need shorter chunks, and their chunk length is
# part of the model (SWLA's is not: it shortens its chunks there, ``omega.kernel.windowed_triton``).
CHUNK_FORM_ON = {"sm_86": {
    ("chunk_state_kernel", "delta: gate=none K=V=256 fp32"),
    ("chunk_state_kernel", "delta: gate=scalar K=V=256 fp32"),
    ("chunk_state_kernel", "delta_bwd: gate=none K=V=256 fp32"),
    ("chunk_state_kernel", "delta_bwd: gate=scalar K=V=256 fp32"),
    ("chunk_dstate_kernel", "delta_bwd: gate=none K=V=256 fp32"),
    ("chunk_dstate_kernel", "delta_bwd: gate=scalar K=V=256 fp32"),
    ("chunk_dstate_kernel", "delta_bwd: gate=channel K=V=256 fp32"),
    ("chunk_dstate_kernel", "linear_bwd: reverse state pass, delta rule, gate=channel K=V=256 fp32"),
    ("titans_linear_fwd_kernel", "titans: b=64 K=V=256 fp32"),
    ("omega_fwd_kernel", "omega: c=1 b=64 D=V=256 fp32"),
    ("omega_fwd_kernel", "omega: c=8 b=64 D=V=100 fp32"),
    ("omega_fwd_kernel", "omega: c=8 b=64 D=V=128 fp32"),
}}


def default_cache_dir() -> Path:
    """The checkout's ``_build/aot``; for an installed copy (no pyproject.toml beside the package, whose
    parent is site-packages) the user's cache, not a folder next to the installed packages."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        return checkout / "_build" / "aot"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atlaslib" / "aot"


CACHE_DIR = Path(os.environ.get("ATLAS_AOT_CACHE") or default_cache_dir())
INT32_MAX = 2**31 - 1


@dataclasses.dataclass
class Launch:
    """One kernel launch as a wrapper makes it: the JIT function, its grid and arguments."""
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


@dataclasses.dataclass
class Build:
    """What one configuration used on one target."""
    kernel: str
    config: str
    target: str
    shared: int            # bytes of shared memory per program
    registers: int         # per thread
    spill_stores: int      # bytes per thread
    spill_loads: int
    int64_bases: bool      # every offset added to a pointer argument is 64-bit
    error: str = ""        # the build's error message, if it failed
    tensor_core_dots: int = -1     # tl.dot products lowered to tensor cores (mma / wgmma)
    cuda_core_dots: int = -1       # and to FMA loops on the CUDA cores (fp32 "ieee" products)
    grid: tuple = ()       # the (largest) launch grid at T = 40 (B*H = 2)
    grid_fixed_in_T: bool = True   # the same grid at T = 400: programs loop over chunks
    launches: tuple = (1, 1)       # kernel launches per call at T = 40 and T = 400
    grid_long: tuple = ()          # the (largest) launch grid at T = 400
    warps: int = 4                 # the launch's num_warps
    maxnreg: int = 0               # its register cap a thread (0: ptxas chooses)

    @property
    def fits(self) -> bool:
        return not self.error and self.shared <= TARGETS[self.target]["shared_limit"]

    @property
    def runs_chunk_form(self) -> bool:
        """Built, too big for the target, and known to be (``CHUNK_FORM_ON``): the chunk form runs there."""
        return not self.error and not self.fits and (self.kernel, self.config) in CHUNK_FORM_ON.get(self.target, ())


@contextlib.contextmanager
def intercepted_launches():
    """Record every ``kernel[grid](...)`` instead of running it (no device is touched).

    Works on compiled kernels and, under ``TRITON_INTERPRET=1``, on interpreted ones, so
    tests can see what a wrapper hands its kernel (only compiled ones can be built here).
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, tuple(grid), args, kwargs))

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
    for cls in originals:
        cls.run = record
    try:
        yield launches
    finally:
        for cls, run in originals.items():
            cls.run = run


def captured(call) -> Launch:
    """The one launch ``call()`` makes (a wrapper run on CPU tensors)."""
    launches = captured_launches(call)
    if len(launches) != 1:
        raise RuntimeError(f"expected one kernel launch, got {len(launches)}")
    return launches[0]


def captured_launches(call) -> list[Launch]:
    """Every launch ``call()`` makes, in order (chapters 1 and 2 launch several kernels per call;
    chapter 5's chunk form launches its Newton–Schulz kernel once per chunk)."""
    with intercepted_launches() as launches:
        call()
    if not launches:
        raise RuntimeError("expected kernel launches, got none")
    return launches


def kernel_name(launch: Launch) -> str:
    return launch.kernel.fn.__name__


def by_kernel(launches: list[Launch]) -> dict[str, list[Launch]]:
    """A call's launches grouped by kernel, in the order the kernels first run."""
    groups: dict[str, list[Launch]] = {}
    for launch in launches:
        groups.setdefault(kernel_name(launch), []).append(launch)
    return groups


def specialised(launch: Launch, target_name: str):
    """(ASTSource, options, key) as the JIT would build them for this launch on the target."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(GPUTarget("cuda", TARGETS[target_name]["cc"], 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, specialization, options)
    source = ASTSource(kernel, signature, constexprs, attrs)
    key = hashlib.sha256(repr((kernel.cache_key, sorted(signature.items()), sorted(constexprs.items(), key=str),
                               sorted(attrs.items(), key=str), sorted(options.__dict__.items(), key=str),
                               target_name)).encode()).hexdigest()[:24]
    return source, options, key


PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_REGS = re.compile(r"Used (\d+) registers")
# A pointer argument (%q_ptr) or a splat of one (%q, or a number: %43), moved by an offset of type ...
ADDPTR = re.compile(r"tt\.addptr (%[\w]+), %[\w]+ : [^,]+, (?:tensor<[^>]*x)?(i32|i64)>?")


def int64_bases(ttir: str, pointer_args: list[str]) -> bool:
    """Whether every offset added directly to a pointer argument (or a splat of it) is i64.

    Offsets relative to a program's own slice (a chunk's rows within one head) stay small;
    the offset of the slice itself, (batch*head) * T * K, exceeds 2^31 at long T and must be
    computed in 64 bits. Splats of arguments are followed through ``tt.splat``.
    """
    bases = {f"%{name}" for name in pointer_args}
    for line in ttir.splitlines():
        m = re.search(r"(%[\w]+) = tt\.splat (%[\w]+)", line)
        if m and m.group(2) in bases:
            bases.add(m.group(1))
    return all(dtype == "i64" for base, dtype in ADDPTR.findall(ttir) if base in bases)


# A product in the TTGIR: ``tt.dot`` (its result's layout says where it runs) or Hopper's ``ttng.warp_group_dot``.
DOT_OP = re.compile(r"= (tt\.dot|ttng\.warp_group_dot) .*-> tensor<[^,>]*(?:, #(\w+))?")


def dot_units(ttgir: str) -> tuple[int, int]:
    """(tensor-core products, CUDA-core products) of a build's TTGIR.

    Triton gives every ``tl.dot`` it can run on tensor cores an ``#mma`` result layout (Hopper's
    wgmma becomes ``ttng.warp_group_dot``); a product it cannot (fp32 operands in ``"ieee"``
    precision, tiles below 16) keeps a ``#blocked`` layout and becomes a loop of FMAs.
    """
    tensor = cuda = 0
    for op, layout in DOT_OP.findall(ttgir):
        if op == "ttng.warp_group_dot" or layout.startswith("mma"):
            tensor += 1
        else:
            cuda += 1
    return tensor, cuda


def checks_version() -> str:
    """A hash of what ``int64_bases`` and ``dot_units`` read from a build's IR, part of the cache's file
    names: a changed check reads every build again instead of reusing the verdicts of the old one."""
    read = ADDPTR.pattern + inspect.getsource(int64_bases) + DOT_OP.pattern + inspect.getsource(dot_units)
    return hashlib.sha256(read.encode()).hexdigest()[:8]


class _StopBeforeLLVM(Exception):
    """Raised where the build would translate to LLVM: a fast check has what it needs by then."""


@contextlib.contextmanager
def _stop_before_llvm(seen: dict):
    """Make ``triton.compile`` stop once shared memory is allocated, keeping the TTIR, TTGIR and that size.

    The TTGIR-to-LLVM-dialect passes allocate shared memory and record it on the module
    (``ttg.shared``, which the full build copies into its metadata). Everything after that,
    the translation to LLVM IR, LLVM's -O3, its PTX code generation and ptxas, takes nearly
    all of a build's time (measured: 0.9 s against 11 s for chapter 1's kernel at K=V=128 fp32)
    and is what registers and spills come from, so a fast build leaves those unmeasured.
    """
    from triton import knobs
    from triton.backends.nvidia import compiler as nvidia

    def hook(backend=None, stages=None, *rest):
        if stages is None:                       # asked for a cache key: keep these builds apart
            return "stop-before-llvm", "stop-before-llvm"
        make_ttir, make_ttgir = stages["ttir"], stages["ttgir"]

        def ttir(src, metadata):
            module = make_ttir(src, metadata)
            seen["ttir"] = str(module)
            return module

        def ttgir(src, metadata, *rest):
            module = make_ttgir(src, metadata, *rest)
            seen["ttgir"] = str(module)
            return module
        stages["ttir"], stages["ttgir"] = ttir, ttgir

    def stop(module, context):
        seen["shared"] = module.get_int_attr("ttg.shared")
        raise _StopBeforeLLVM

    old_hook, old_to_module = knobs.runtime.add_stages_inspection_hook, nvidia.llvm.to_module
    knobs.runtime.add_stages_inspection_hook, nvidia.llvm.to_module = hook, stop
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook, nvidia.llvm.to_module = old_hook, old_to_module


def build(launch: Launch, target_name: str, config: str, full: bool = True) -> Build:
    """Compile one captured launch for one target and measure it (cached on disk).

    ``full=False`` stops once shared memory is allocated (``_stop_before_llvm``): shared memory,
    64-bit offsets and the build's errors up to that point, in about a second; registers and
    spills (from ptxas) are then -1, unmeasured.
    """
    import triton
    from triton import knobs

    source, options, key = specialised(launch, target_name)
    name = launch.kernel.fn.__name__
    cache = CACHE_DIR / f"{name}-{key}-{checks_version()}{'' if full else '-fast'}.json"
    if cache.exists():
        return Build(**json.loads(cache.read_text()))
    pointer_args = [p.name for p, a in zip(launch.kernel.params, launch.args) if isinstance(a, torch.Tensor)]
    log, seen = io.StringIO(), {}
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(log):
            # a private Triton cache, so that ptxas runs and prints its resource log
            old_dir, old_dump = knobs.cache.dir, knobs.nvidia.dump_ptxas_log
            knobs.cache.dir, knobs.nvidia.dump_ptxas_log = tmp, True
            try:
                with contextlib.nullcontext() if full else _stop_before_llvm(seen):
                    compiled = triton.compile(source, target=_target(target_name), options=options.__dict__)
                seen = {"shared": compiled.metadata.shared, "ttir": compiled.asm["ttir"],
                        "ttgir": compiled.asm["ttgir"]}
            except _StopBeforeLLVM:
                pass
            finally:
                knobs.cache.dir, knobs.nvidia.dump_ptxas_log = old_dir, old_dump
    except Exception as exc:   # a build that fails is a result, reported in the table
        return Build(name, config, target_name, 0, 0, 0, 0, False, error=f"{type(exc).__name__}: {exc}"[:500])
    text = log.getvalue()
    spills = PTXAS_SPILLS.search(text)
    regs = PTXAS_REGS.search(text)
    result = Build(name, config, target_name, shared=int(seen["shared"]),
                   registers=int(regs.group(1)) if regs else -1,
                   spill_stores=int(spills.group(1)) if spills else -1,
                   spill_loads=int(spills.group(2)) if spills else -1,
                   int64_bases=int64_bases(seen["ttir"], pointer_args))
    result.tensor_core_dots, result.cuda_core_dots = dot_units(seen["ttgir"])
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(dataclasses.asdict(result)))
    return result


def _target(target_name: str):
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", TARGETS[target_name]["cc"], 32)


# ---------------------------------------------------------------------------------------
# The configurations the dispatch can launch
# ---------------------------------------------------------------------------------------
HEAD_SIZES = (16, 64, 128, 256)
ODD_SIZE = 100                      # not a power of two: padded to the next tile by the wrapper
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _qkv(K, V, dtype, T, views=False):
    """q, k [1, 2, T, K], v [1, 2, T, V]; with ``views``, [1, T, 2, K] tensors transposed (as the mixers pass them)."""
    g = torch.Generator().manual_seed(0)
    if views:
        q, k = (torch.randn(1, T, 2, K, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
        return q, k, torch.randn(1, T, 2, V, generator=g).to(dtype).transpose(1, 2)
    q, k = (torch.randn(1, 2, T, K, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(1, 2, T, V, generator=g).to(dtype)
    return q, k, v


def _gate(shape):
    return torch.full(shape, 0.9)


def sizes_and_dtypes():
    """Head sizes x dtypes: every size in fp32 and bf16, fp16 and an odd size at 64/128."""
    for K in HEAD_SIZES:
        for dt in ("fp32", "bf16"):
            yield K, dt
    yield 64, "fp16"
    yield ODD_SIZE, "fp32"


def backward_sizes_and_dtypes():
    """The backward families' subset of ``sizes_and_dtypes``: every tile width once in the element
    size that fills its shared memory most (fp32 at 16 and 256, the odd size for the 128 tile) and
    bf16 at 64, 128 and 256. Each configuration builds four to seven kernels, so the full cross
    product would add minutes to ``make test`` for tiles the forward's families already cover."""
    yield from ((16, "fp32"), (64, "bf16"), (128, "bf16"), (256, "bf16"), (256, "fp32"), (ODD_SIZE, "fp32"))


# The kernel families ``cases`` yields, for ``--family``.
FAMILIES = ("linear", "linear_bwd", "delta", "delta_bwd", "titans", "omega", "swla", "atlas", "deep", "caching")


def cases():
    """(kernel family, config label, call(T)) for every configuration checked."""
    from .delta.kernel import delta_rule_triton
    from .linear.kernel import linear_attention_triton
    from .miras.kernel import titans_linear_triton
    from .omega.kernel import MAX_FEATURES, kernel_supports, omega_triton, swla_triton

    for K, dt in sizes_and_dtypes():
        for gate in ("none", "scalar", "channel"):
            def linear(T, K=K, dt=dt, gate=gate):
                q, k, v = _qkv(K, K, DTYPES[dt], T)
                alpha = None if gate == "none" else _gate(q.shape[:3] if gate == "scalar" else q.shape)
                linear_attention_triton(q, k, v, alpha, torch.zeros(1, 2, K, K))

            def delta(T, K=K, dt=dt, gate=gate):
                q, k, v = _qkv(K, K, DTYPES[dt], T)
                alpha = None if gate == "none" else _gate(q.shape[:3] if gate == "scalar" else q.shape)
                delta_rule_triton(q, k, v, torch.full(q.shape[:3], 0.5), alpha, torch.zeros(1, 2, K, K))
            yield "linear", f"gate={gate} K=V={K} {dt}", linear
            yield "delta", f"gate={gate} K=V={K} {dt}", delta
        for b in (16, 64):
            def titans(T, K=K, dt=dt, b=b):
                q, k, v = _qkv(K, K, DTYPES[dt], T)
                gates = [_gate(q.shape[:3]) for _ in range(3)]
                titans_linear_triton(q, k, v, *gates, torch.zeros(1, 2, K, K), torch.zeros(1, 2, K, K), chunk_size=b)
            yield "titans", f"b={b} K=V={K} {dt}", titans
        for c, b in ((1, 64), (8, 64), (8, 16), (16, 16)):
            if K > MAX_FEATURES or not kernel_supports(K, c, b):
                continue      # the dispatch sends these to the chunk form
            for fn, family in ((omega_triton, "omega"), (swla_triton, "swla")):
                def windowed(T, K=K, dt=dt, c=c, b=b, fn=fn):
                    q, k, v = _qkv(K, K, DTYPES[dt], T)
                    fn(q, k, v, c, torch.full((1, 2, T, c), 0.9), _gate(q.shape[:3]), torch.full(q.shape[:3], 0.1),
                       torch.zeros(1, 2, K, K), chunk_size=b)
                yield family, f"c={c} b={b} D=V={K} {dt}", windowed
    yield from linear_backward_cases()
    yield from delta_backward_cases()
    yield from atlas_cases()
    yield from deep_cases()
    yield from caching_cases()
    yield from bare_cases()


def linear_backward_cases():
    """Chapter 1's backward (``linear.backward``) and the reverse state pass it shares with chapter 2
    (``core.chunk_backward.dstate_pass``), at ``backward_sizes_and_dtypes``, in the three gate modes,
    with a final-state gradient; the reverse pass also in its delta-rule mode (all K key channels
    in one program, BV = 32 at K = 256), as chapter 2's backward launches it."""
    from .core.chunk_backward import dstate_pass
    from .core.chunk_kernels import CHUNK
    from .core.kernels import chunk_gates
    from .linear.backward import linear_attention_backward

    for K, dt in backward_sizes_and_dtypes():
        for gate in ("none", "scalar", "channel"):
            def backward(T, K=K, dt=dt, gate=gate):
                q, k, v = _qkv(K, K, DTYPES[dt], T)
                alpha = None if gate == "none" else _gate(q.shape[:3] if gate == "scalar" else q.shape)
                mode, g, _ = chunk_gates(alpha, None, T, CHUNK, q.dtype)
                state, h = torch.zeros(1, 2, K, K), torch.zeros(2, -(-T // CHUNK), K, K)   # h: the forward's
                linear_attention_backward(q, k, v, mode, g, state, torch.zeros_like(v), state, h=h, ht=state)
            yield "linear_bwd", f"gate={gate} K=V={K} {dt}", backward
    for K in HEAD_SIZES:
        for dt in ("fp32", "bf16"):
            def delta_pass(T, K=K, dt=dt):
                q, k, v = _qkv(K, K, DTYPES[dt], T)
                mode, g, Tp = chunk_gates(_gate(q.shape), None, T, CHUNK, q.dtype)
                w, du = torch.zeros(1, 2, Tp, K, dtype=q.dtype), torch.zeros(1, 2, Tp, K, dtype=q.dtype)
                dstate_pass(q, v, mode, g, torch.zeros(1, 2, K, K), k=k, w=w, dv_local=du)
            yield "linear_bwd", f"reverse state pass, delta rule, gate=channel K=V={K} {dt}", delta_pass


def delta_backward_cases():
    """Chapter 2's backward (``delta.kernel.delta_rule_backward``) at ``backward_sizes_and_dtypes``,
    in the three gate modes, with an initial state and a final-state gradient: the forward's
    kernels it reruns (WY factors, state pass, KDA's scores), the intra-chunk dv, the reverse state pass
    in its delta-rule mode (``core.chunk_backward``) and the two per-chunk gradient kernels."""
    from .delta.kernel import delta_rule_backward

    for K, dt in backward_sizes_and_dtypes():
        for gate in ("none", "scalar", "channel"):
            def backward(T, K=K, dt=dt, gate=gate):
                q, k, v = _qkv(K, K, DTYPES[dt], T)
                logs = None if gate == "none" else _gate(q.shape[:3] if gate == "scalar" else q.shape).log()
                state = torch.zeros(1, 2, K, K)
                delta_rule_backward(v, state, q, k, v, torch.full(q.shape[:3], 0.5), logs, state)
            yield "delta_bwd", f"gate={gate} K=V={K} {dt}", backward


def deep_cases():
    """Chapter 6's kernel-trick DeepTransformer (``deep_kernel_triton``): with and without the
    normaliser, gates and eta, a window, and the head sizes that change its tiles (BK = 256 halves
    the query and key blocks to 32); unnormalised fp16, whose weights stay fp32 (a TF32 product)."""
    from .deep.kernel import deep_kernel_triton

    for K, dt, normalize, window in ((64, "bf16", True, None), (128, "fp32", True, 8), (64, "fp32", False, None),
                                     (256, "bf16", True, None), (256, "fp32", False, 5), (64, "fp16", False, None)):
        def deep(T, K=K, dt=dt, normalize=normalize, window=window):
            q, k, v = _qkv(K, K, DTYPES[dt], T)
            deep_kernel_triton(q, k, v, _gate(q.shape[:3]), torch.full(q.shape[:3], 0.5), None, window, normalize)
        yield "deep", f"normalize={normalize} window={window} K=V={K} {dt}", deep
    yield from dot_cases()


def dot_cases():
    """DOT with c = 1 and phi_star="kernel" (``dot_kernel_triton``): the coefficient solve, gates and
    eta on, at the head sizes it takes (K <= 128) in fp32 and bf16, which change its blocks (16 rows
    for fp32 at K >= 64 and bf16 at K = 128, else 32) and warps. Leaves of one block (``leaf=1``
    rounds up to it), so T = 40 already splits and launches the recall kernel too."""
    from .deep.kernel import dot_kernel_triton

    for K in (16, 64, 128):
        for dt in ("fp32", "bf16"):
            def dot(T, K=K, dt=dt):
                q, k, v = _qkv(K, K, DTYPES[dt], T)
                dot_kernel_triton(q, k, v, _gate(q.shape[:3]), torch.full(q.shape[:3], 0.5), leaf=1)
            yield "deep", f"dot c=1 leaf=block K=V={K} {dt}", dot


def caching_cases():
    """Chapter 7's readout of cached linear memories (``cached_readout_triton``): each aggregate at
    K = V in {16, 64, 128, 256} (256: BV = 32), fp32 and bf16. The table ``blocks`` has SLOT_TILE columns (the widest
    score tile, BJ = 32), -1 padded: token t sees the segments of 8 tokens before its own. Residual
    passes no u, pooled keys or online scores (None pointers) and q as a [B, T, H, K] view.
    """
    from .caching.kernel import SLOT_TILE, cached_readout_triton

    def readout(T, K, dt, aggregate, top_k, J=SLOT_TILE):
        q, u, online = _qkv(K, K, DTYPES[dt], T, views=aggregate == "residual")
        N = max(-(-T // 8), J)
        slots = torch.arange(J)
        blocks = torch.where(slots[None, :] < torch.arange(T)[:, None] // 8, slots[None, :], -1)
        states, pooled = torch.zeros(1, 2, N, K, K), torch.zeros(1, 2, N, K, dtype=DTYPES[dt])
        if aggregate == "residual":
            cached_readout_triton(q, None, states, None, online, None, blocks, aggregate="residual")
        else:
            cached_readout_triton(q, u, states, pooled, online, torch.zeros(1, 2, T), blocks, top_k, aggregate)

    for K in HEAD_SIZES:
        for dt in ("fp32", "bf16"):
            for aggregate, top_k in (("residual", None), ("grm", None), ("ssc", 2)):
                for J in (SLOT_TILE, 2 * SLOT_TILE + 1):                 # one slot tile; tiles in a loop
                    label = f"{aggregate}{'' if top_k is None else f' top_k={top_k}'} K=V={K} J={J} {dt}"
                    yield "caching", label, (lambda T, K=K, dt=dt, a=aggregate, k=top_k, J=J:
                                             readout(T, K, dt, a, k, J))


# Momenta S [V, K] that chapter 5's Newton–Schulz kernel takes (``atlas.kernel.kernel_supports``):
# square, wide, tall (iterated on its transpose: swapped strides), and an odd size padded to
# the next tiles (20 x 12 is iterated as 12 x 20 in a 16 x 32 tile).
ATLAS_MOMENTA = ((16, 16), (64, 64), (64, 128), (128, 64), (32, 128), (20, 12))


def atlas_cases():
    """ATLAS's chunk form with Newton–Schulz on the kernel (``atlas_triton``), as the dispatch calls it.

    It launches the kernel once per chunk on that chunk's B*H*b momenta, which the chunk form
    holds in fp32 whatever q, k, v's dtype: the bf16 rows build the fp32 kernel again (cached).
    The coefficient sets (muon: a, b, c; cubic: a, b with c = 0) are run-time arguments, so
    they too share a build. The kernel's bf16 loads and stores, which only a direct call of
    ``newton_schulz_triton`` reaches, are built from one chunk's worth of bf16 momenta.
    """
    from .atlas import ATLAS_CHUNK_SIZE
    from .atlas.kernel import atlas_triton, kernel_supports, newton_schulz_triton

    for V, K in ATLAS_MOMENTA:
        for dt in ("fp32", "bf16"):
            for coeffs in ("muon", "cubic"):
                assert kernel_supports(K, V, coeffs), (V, K, coeffs)

                def atlas(T, V=V, K=K, dt=dt, coeffs=coeffs):
                    q, k, v = _qkv(K, V, DTYPES[dt], T)
                    alpha, eta, theta = _gate(q.shape[:3]), torch.full(q.shape[:3], 0.1), torch.full(q.shape[:3], 0.5)
                    atlas_triton(q, k, v, 1, None, alpha, eta, theta, 5, coeffs, torch.zeros(1, 2, V, K),
                                 torch.zeros(1, 2, V, K))
                yield "atlas", f"S={V}x{K} {coeffs} q,k,v {dt}", atlas
    for V, K in ((64, 64), (64, 128), (20, 12)):
        def direct(T, V=V, K=K):
            S = torch.randn(1, 2, min(T, ATLAS_CHUNK_SIZE), V, K, generator=torch.Generator().manual_seed(0))
            newton_schulz_triton(S.to(torch.bfloat16), 5, "muon")
        yield "atlas", f"S={V}x{K} muon S bf16 (newton_schulz_triton)", direct


def bare_cases(K=64, dt="bf16"):
    """Every kernel with its optional inputs absent (None pointers, compiled away) and q, k, v
    given as [B, T, H, K] views (read through their strides), as a model's mixers call them."""
    from .atlas.kernel import atlas_triton
    from .deep.kernel import deep_kernel_triton, dot_kernel_triton
    from .delta.kernel import delta_rule_backward, delta_rule_triton
    from .linear.kernel import linear_attention_triton
    from .miras.kernel import titans_linear_triton
    from .omega.kernel import omega_triton, swla_triton

    def qkv(T):
        return _qkv(K, K, DTYPES[dt], T, views=True)

    label = f"bare views K=V={K} {dt}"
    yield "linear", label, lambda T: linear_attention_triton(*qkv(T))
    yield "delta", label, lambda T: delta_rule_triton(*qkv(T), torch.full((1, 2, T), 0.5))
    yield "delta_bwd", label, lambda T: delta_rule_backward(qkv(T)[2], None, *qkv(T),
                                                                      torch.full((1, 2, T), 0.5), None, None)
    yield "titans", f"b=64 {label}", lambda T: titans_linear_triton(*qkv(T), chunk_size=64)
    yield "omega", f"c=8 b=16 {label}", lambda T: omega_triton(*qkv(T), 8, chunk_size=16)
    yield "swla", f"c=8 b=16 {label}", lambda T: swla_triton(*qkv(T), 8, chunk_size=16)
    yield "atlas", f"c=8 {label}", lambda T: atlas_triton(*qkv(T), 8)
    yield "deep", f"normalize=True {label}", lambda T: deep_kernel_triton(*qkv(T), normalize=True)
    yield "deep", f"dot c=1 {label}", lambda T: dot_kernel_triton(*qkv(T))


def largest_grid(launches: list[Launch]) -> tuple:
    """The grid with the most programs among a call's launches."""
    return max((launch.grid for launch in launches), key=math.prod)


def representative(short: Launch, longer: Launch) -> Launch:
    """The launch whose build stands for the kernel at every length: ``longer`` when a loop of the
    kernel runs up to an integer argument that is 1 in ``short`` and not in ``longer``. Triton
    compiles an argument equal to 1 as the constant 1, so at one chunk (T <= 64) a loop over chunks
    is unrolled away with its software pipeline, and its shared memory reads several times too small
    (the reverse state pass of the delta rule, as its tiles were when this was found: 40 KB at one chunk,
    233 KB at seven). Otherwise
    ``short``: the same code, and a faster build."""
    source = inspect.getsource(short.kernel.fn)
    for name, a, b in zip(inspect.signature(short.kernel.fn).parameters, short.args, longer.args):
        one = isinstance(a, int) and not isinstance(a, bool) and a == 1 and b != 1
        if one and re.search(rf"range\([^)]*\b{name}\b", source):
            return longer
    return short


def variants(short: list[Launch], longer: list[Launch]):
    """A kernel's launches in one call (and in the longer call) split by their keyword arguments
    (constexprs, warps): (tag, short launches, longer launches) per variant; the tag names the
    arguments that differ between variants (empty when there is one)."""
    def key(launch):
        return tuple(sorted((k, repr(v)) for k, v in launch.kwargs.items()))
    keys = list(dict.fromkeys(key(launch) for launch in short))
    if len(keys) == 1:
        return [("", short, longer)]
    differ = [k for k in dict(keys[0]) if len({dict(kv).get(k) for kv in keys}) > 1]
    return [(" [" + ", ".join(f"{k}={dict(kv)[k]}" for k in differ) + "]",
             [launch for launch in short if key(launch) == kv], [launch for launch in longer if key(launch) == kv])
            for kv in keys]


def check_all(targets=tuple(TARGETS), progress=True, families=None, full=True) -> list[Build]:
    """Build every configuration (of ``families``, default all) for every target (``full``: see ``build``).

    Each kernel a call launches is built from the short call (T = 40), unless ``representative``
    picks the longer one (T = 400). One launched more than once with the same constexprs (ATLAS: once
    per chunk) is built from its first launch, which has the largest grid; the later ones differ only in
    their grid. A kernel launched with different constexprs (KDA's backward runs chapter 1's per-channel
    kernel on dS, then with ``PAIRS`` on dL) is built once per variant, the config naming what differs.
    """
    from tqdm.auto import tqdm

    from .core.kernels import assume_shared_memory

    todo = []
    for target in targets:
        # the tiles the wrappers choose for this target's shared memory (``core.kernels.narrow_tiles``)
        with assume_shared_memory(TARGETS[target]["shared_limit"]):
            for family, label, call in cases():
                if families is None or family in families:
                    short = by_kernel(captured_launches(lambda: call(40)))
                    longer = by_kernel(captured_launches(lambda: call(400)))
                    for name in short:
                        todo += [(target, family, label + tag, s, lo)
                                 for tag, s, lo in variants(short[name], longer[name])]
    results = []
    # disable=None: a terminal or a notebook shows the bar, a log file does not
    with tqdm(total=len(todo), desc="AOT builds", disable=None if progress else True) as bar:
        for target, family, label, launches, longer in todo:
            result = build(representative(launches[0], longer[0]), target, f"{family}: {label}", full)
            results.append(dataclasses.replace(result, config=f"{family}: {label}", grid=largest_grid(launches),
                                               grid_fixed_in_T=largest_grid(launches) == largest_grid(longer),
                                               launches=(len(launches), len(longer)),
                                               grid_long=largest_grid(longer),
                                               warps=launches[0].kwargs.get("num_warps", 4),
                                               maxnreg=launches[0].kwargs.get("maxnreg") or 0))
            bar.update()
    return results


def oversized_build(target_name: str = "sm_80", full: bool = True) -> Build:
    """Chapter 1's output kernel forced to tiles no card can hold (BT = 256, BK = 256, BV = 64, fp32).

    The check must be able to fail: this build has to come out as not fitting.
    """
    from .linear.kernel import linear_attention_triton

    q, k, v = _qkv(256, 256, torch.float32, 40)
    launches = by_kernel(captured_launches(lambda: linear_attention_triton(q, k, v, None, torch.zeros(1, 2, 256, 256))))
    (launch,) = launches["chunk_output_kernel"]
    launch.kwargs.update(BT=256, BK=256)
    result = build(launch, target_name, "linear: oversized output BT=256 BK=256 BV=64 fp32", full)
    return dataclasses.replace(result, grid=largest_grid([launch]), warps=launch.kwargs.get("num_warps", 4),
                               maxnreg=launch.kwargs.get("maxnreg") or 0)


def format_builds(results: list[Build]) -> str:
    """The builds as a table: family, kernel, configuration, target, shared memory against the limit, warps,
    registers (with the launch's cap, if it sets one)."""
    from .tables import format_table
    rows = [{"family": r.config.split(":")[0], "kernel": r.kernel, "config": r.config.split(": ", 1)[1],
             "target": r.target,
             "shared KB": f"{r.shared / 1024:.1f}", "limit KB": TARGETS[r.target]["shared_limit"] // 1024,
             "warps": r.warps,
             "regs": ("-" if r.registers < 0 else f"{r.registers}") + (f" (<= {r.maxnreg})" if r.maxnreg else ""),
             "spill B": "-" if r.spill_stores < 0 else r.spill_stores,       # -1: unmeasured (--fast)
             "dots TC/CUDA": f"{r.tensor_core_dots}/{r.cuda_core_dots}",
             "int64": "yes" if r.int64_bases else "NO",
             "ok": "yes" if r.fits else "BUILD FAILED" if r.error else "chunk form" if r.runs_chunk_form
             else "TOO BIG"} for r in results]
    return format_table(rows, columns=list(rows[0]))


def popen_subprocess(args: list[str]) -> subprocess.Popen:
    """Start ``python -m atlaslib.aot ARGS`` with the interpreter off (the real kernels)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.Popen([sys.executable, "-m", "atlaslib.aot", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def in_subprocess(args: list[str]) -> subprocess.CompletedProcess:
    """Run ``python -m atlaslib.aot ARGS`` with the interpreter off and wait for it."""
    proc = popen_subprocess(args)
    out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m atlaslib.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per build instead of the table")
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help="build for this target only (repeat the flag for several)")
    parser.add_argument("--family", action="append", choices=FAMILIES, metavar="FAMILY",
                        help=f"this kernel family only (repeat the flag for several): {', '.join(FAMILIES)}")
    parser.add_argument("--oversized", action="store_true", help="build only a deliberately oversized tile")
    parser.add_argument("--fast", action="store_true", help="stop each build once shared memory is allocated "
                        "(no LLVM, no ptxas): shared memory, 64-bit offsets and grids in about a second per "
                        "build; registers and spills unmeasured")
    args = parser.parse_args(argv)
    if args.oversized and args.family:
        parser.error("--oversized builds one deliberately oversized tile (chapter 1's kernel); it takes no --family")
    from .core.dispatch import interpreter_on
    if interpreter_on():      # the real compiler, in a child that writes to this terminal (its progress bar too)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        args_ = argv if argv is not None else sys.argv[1:]
        return subprocess.run([sys.executable, "-m", "atlaslib.aot", *args_], env=env).returncode
    targets = tuple(args.target or TARGETS)
    if args.oversized:
        results = [oversized_build(t, full=not args.fast) for t in targets]
    else:
        results = check_all(targets, progress=not args.json, families=args.family, full=not args.fast)
    bad = [r for r in results if not ((r.fits or r.runs_chunk_form) and r.int64_bases)]
    if args.json:
        for r in results:
            print(json.dumps(dict(dataclasses.asdict(r), fits=r.fits, runs_chunk_form=r.runs_chunk_form)))
    else:
        print(format_builds(results))
        fallbacks = sum(r.runs_chunk_form for r in results)
        print(f"\n{len(results)} builds, {len(bad)} that would not launch or address 64-bit offsets"
              + (f"; {fallbacks} known too big for the card, where the chunk form runs instead" if fallbacks else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
