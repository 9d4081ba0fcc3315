"""Timing and peak-memory tables: ``python -m atlaslib.bench``.

For every registered model (a *bench case*) and every backend it prints

    model  backend  device  dtype  B  H  T  K  V  time_ms  peak_MiB  speedup  speedup_vs  [TFLOP/s  GB/s]

* ``time_ms``: median wall time of ``--repeats`` calls after ``--warmup`` calls (CUDA
  calls are synchronised before the clock stops). The backends of one model and T are
  called in turn (recurrent, chunk, ..., then again), so a machine whose speed drifts
  slows them alike and ``speedup`` compares times taken over the same stretch.
* ``peak_MiB``: the most memory the call held *beyond what existed before it* (inputs
  excluded, output included). On CUDA this is ``torch.cuda.max_memory_allocated`` minus
  the allocation before the call. On CPU PyTorch keeps no such counter, so the call is
  run once more under ``torch.profiler`` with ``profile_memory=True``: the profiler
  records every allocation and free of the CPU allocator with its size and time; the
  running sum of those sizes in time order is the memory held at each moment, and its
  maximum is the peak. (This counts tensor storage only, not Python objects, which is
  what grows with T.)
* ``speedup``: the time of the ``speedup_vs`` backend / this backend's time, for the same model and
  shape: the recurrent loop's (or, for a case that registers another ``reference`` backend, that
  one's: ``deep_vs_sdpa``
  divides PyTorch's ``scaled_dot_product_attention`` by chapter 6's kernel-trick forms, chapter 7's
  ``mc_gdn_*`` the chunk form by the kernel, the loop being compared under the table); the
  reference's own row reads 1.0x. Ratios below 0.1 keep two significant digits.
* A first line, starting with "#", names the machine (card, or CPU model and threads), the
  versions, whether Triton's interpreter ran the triton rows, the chunk size and the repeats.
* On CUDA also ``TFLOP/s`` (the case's FLOP count for its chunkwise algorithm, divided
  by the time) and ``GB/s`` (bytes of inputs read plus outputs written, divided by the
  time); the footer prints the card's measured matmul and copy peaks to compare with.

Under the table, cases that register a ``note`` print one line per T (ATLAS: the share of
the chunk form's time spent in Newton–Schulz).

``--scaling`` instead prints chunk-form time and memory for T = 1024 .. 8192, so one can
see memory grow linearly in T (the state is constant; what grows is the output and the
per-chunk work).

``--vs fla`` instead compares chapters 1 and 2 with fla-core (``atlaslib.bench_fla`` has the details):
linear attention, scalar and per-channel gates, DeltaNet, Gated DeltaNet and KDA. On CUDA, at B=4,
H=16, T=4096, K=V=128 in bf16 and B=2, H=8, T=4096, K=V=64 in fp32, one row per model with our forward
time (``backend="triton"``) and fla's Triton kernels' time, their ratio, the relative error against
fla, the peak memory of each, and forward + backward times (ours: the backward kernels of chapters 1-2);
CUDA-event medians, the two sides interleaved. On a CPU: our chunk forms (and the relative error of our
per-token loops) against fla's pure-PyTorch references at a small size. ``--json PATH`` writes the table
with the card, versions, date and shapes. fla-core is optional and benchmark-only:
``pip install --no-deps -r requirements-fla.txt`` (pinned; torch and triton stay as pinned). fla-core
0.6.0 refuses its gated backward on Hopper cards under Triton 3.4 to 3.7.0 (3.7.1 is pinned here).

Every chapter adds its rows with ``core.benchcases.register_bench_case(name, builder,
flops=...)`` in a module ``atlaslib/<chapter>/bench_cases.py``, which ``load_chapter_cases``
imports (the chapters never import this module): the builder takes a ``BenchShape`` and a
``torch.Generator`` and returns ``call(backend)``, a function that runs the model once on
fixed inputs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

from .core.benchcases import BENCH_CASES, BenchCase, BenchShape, register_bench_case  # noqa: F401
from .core.dispatch import interpreter_on
from .tables import format_table


def load_chapter_cases() -> None:
    """Import ``atlaslib.<chapter>.bench_cases`` for every chapter package that has one, in chapter order."""
    import atlaslib
    for pkg in sorted(pkgutil.iter_modules(atlaslib.__path__), key=lambda p: atlaslib.CHAPTERS.get(p.name, 99)):
        if pkg.ispkg and importlib.util.find_spec(f"atlaslib.{pkg.name}.bench_cases") is not None:
            importlib.import_module(f"atlaslib.{pkg.name}.bench_cases")


# ---------------------------------------------------------------------------- measuring

def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fns: dict, device, *, warmup: int = 1, repeats: int = 3) -> dict:
    """Median wall time in milliseconds of each ``fns[name]()``, after ``warmup`` untimed calls.

    The calls are interleaved (one of each, ``repeats`` times round), so that on a machine
    whose speed drifts (a shared VM) every function is timed over the same stretch and
    their ratios stay fair.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(device)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def time_call(fn, device, *, warmup: int = 1, repeats: int = 3) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` untimed calls."""
    return time_calls({"fn": fn}, device, warmup=warmup, repeats=repeats)["fn"]


def _cpu_allocations(prof):
    """(time_ns, bytes) of every CPU allocator event (frees have negative size) seen by the profiler.

    Reads the profiler's private event tree (torch 2.13: an allocation's ``extra_fields`` has
    ``device``, a ``torch.device``, and ``alloc_size``)."""
    from torch._C._profiler import _EventType
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            out.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return out


def _cpu_allocations_fallback(prof):
    """Same from the public event list: ops' own allocations plus the stand-alone [memory] events."""
    return [(e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
            for e in prof.events()]


def peak_memory_mib(fn, device) -> float:
    """Peak memory (MiB) that one call of ``fn`` holds beyond what existed before it."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
        return peak / 2**20
    # Kineto logs every profiler start and stop on stderr at its "USDT" level (5), read when the profiler
    # first starts: 6 keeps those lines out of the table (a reader's own setting wins).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    try:
        events = _cpu_allocations(prof)
    except ImportError:                    # a torch without the private event types: the public event list
        events = _cpu_allocations_fallback(prof)
    held, peak = 0, 0
    for _, nbytes in sorted(events):
        held += nbytes
        peak = max(peak, held)
    return peak / 2**20


def falls_back(fn) -> bool:
    """Whether ``fn()`` ran the chunk form in place of a Triton kernel the card refused
    (``core.dispatch.forward_or_fallback``'s warning): its time is then the chunk form's."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return any("does not fit this GPU" in str(w.message) for w in caught)


def case_backends(case: BenchCase, backends, device) -> list[str]:
    """The backends of ``case`` to time: those of ``backends`` it has, in that order; by default
    (``backends`` None) every one it registers, baselines such as "sdpa" included, the Triton
    ones ("triton", "triton_...") on CUDA only."""
    if backends:
        return [b for b in backends if b in case.backends]
    on_gpu = str(device).startswith("cuda")
    return [b for b in case.backends if on_gpu or not b.startswith("triton")]


def run_benchmarks(models=None, Ts=(1024, 4096), *, backends=None, device="cpu", dtype=torch.float32,
                   B=1, H=4, K=64, V=64, chunk_size=64, warmup=1, repeats=3, seed=0,
                   progress=True) -> list[dict]:
    """Measure every (model, T, backend); one row per measurement (see the module docstring)."""
    load_chapter_cases()
    models = list(BENCH_CASES) if not models else list(models)
    unknown = [m for m in models if m not in BENCH_CASES]
    if unknown:
        raise ValueError(f"unknown bench case(s) {unknown}; registered: {sorted(BENCH_CASES)}")
    on_gpu = str(device).startswith("cuda")
    jobs = [(m, T) for m in models for T in Ts]
    rows = []
    for name, T in tqdm(jobs, desc="bench", disable=not progress):
        case = BENCH_CASES[name]
        shape = BenchShape(B, H, T, K, V, str(device), dtype, chunk_size)
        call = case.builder(shape, torch.Generator().manual_seed(seed))
        fns = {b: (lambda b=b: call(b)) for b in case_backends(case, backends, device)}
        with torch.no_grad():
            # a Triton backend that fell back to the chunk form is timed, but labelled as what ran
            ran = {b: f"{b} (ran chunk: kernel did not fit)" if b.startswith("triton") and falls_back(fn) else b
                   for b, fn in fns.items()}
            times = time_calls(fns, device, warmup=warmup, repeats=repeats)      # backends interleaved
            peaks = {b: peak_memory_mib(fn, device) for b, fn in fns.items()}
        ref = times.get(case.reference)
        for backend, ms in times.items():
            row = {"model": name, "backend": ran[backend], "device": str(device),
                   "dtype": str(dtype).replace("torch.", ""), "B": B, "H": H, "T": T, "K": K, "V": V,
                   "time_ms": ms, "peak_MiB": peaks[backend], "speedup": (ref / ms) if ref else None,
                   "speedup_vs": case.reference if ref else None}
            if on_gpu:
                # FLOPs of the chunkwise algorithm: meaningless for the token loop, so left blank there
                row["TFLOP/s"] = (case.flops(shape) / (ms * 1e-3) / 1e12
                                  if case.flops and backend != "recurrent" else None)
                row["GB/s"] = case.bytes(shape) / (ms * 1e-3) / 1e9 if case.bytes else None
            rows.append(row)
    return rows


def scaling(models=None, Ts=(1024, 2048, 4096, 8192), *, backend="chunk", **kw) -> list[dict]:
    """Time and peak memory of one backend as T doubles; adds peak memory per 1k tokens."""
    rows = run_benchmarks(models, Ts, backends=[backend], **kw)
    for r in rows:
        r["MiB_per_1k_tokens"] = r["peak_MiB"] / (r["T"] / 1024)
        r.pop("speedup")
        r.pop("speedup_vs")
    return rows


def case_notes(models=None, Ts=(1024, 4096), *, device="cpu", dtype=torch.float32, B=1, H=4, K=64, V=64,
               chunk_size=64, **_) -> list[str]:
    """The lines that cases with a ``note`` print under the table, one per (model, T)."""
    load_chapter_cases()
    lines = []
    for name in (list(BENCH_CASES) if not models else list(models)):
        case = BENCH_CASES[name]
        for T in Ts if case.note else ():
            lines.append(f"{name} T={T}: {case.note(BenchShape(B, H, T, K, V, str(device), dtype, chunk_size))}")
    return lines


def measured_peaks(device) -> dict:
    """The card's achievable fp32/tf32 matmul TFLOP/s and copy GB/s, measured here."""
    n = 4096
    a = torch.randn(n, n, device=device)
    ms = time_call(lambda: a @ a, device, warmup=2, repeats=5)
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    copy_ms = time_call(lambda: x.clone(), device, warmup=2, repeats=5)
    return {"matmul_TFLOP/s": 2 * n**3 / (ms * 1e-3) / 1e12, "copy_GB/s": 2 * x.numel() / (copy_ms * 1e-3) / 1e9}


def setting_line(kw: dict) -> str:
    """What the times depend on besides the sizes in the rows: the machine, threads, interpreter, repeats."""
    from .bench_fla import environment
    env = environment()
    where = env["card"] if str(kw["device"]).startswith("cuda") else f"CPU {env['cpu']}, {env['threads']} threads"
    return (f"# {where}; torch {env['torch']}, triton {env['triton']}"
            f"{' (TRITON_INTERPRET=1: triton rows are interpreter times)' if env['interpreter'] else ''}; "
            f"chunk_size {kw['chunk_size']}; median of {kw['repeats']} after {kw['warmup']} warm-up")


def _table(rows):
    fmt = []
    for r in rows:
        r = dict(r)
        for key in ("time_ms", "peak_MiB", "MiB_per_1k_tokens", "GB/s"):
            if isinstance(r.get(key), float):
                r[key] = round(r[key], 2)
        if isinstance(r.get("speedup"), float):
            r["speedup"] = f"{r['speedup']:.1f}x" if r["speedup"] >= 0.1 else f"{r['speedup']:.2g}x"
        elif "speedup" in r:
            r["speedup"] = "-"
        if isinstance(r.get("TFLOP/s"), float):
            r["TFLOP/s"] = round(r["TFLOP/s"], 3)
        fmt.append({key: "-" if val is None else val for key, val in r.items()})
    return format_table(fmt, digits=2)


def finite_rows(rows: list[dict]) -> list[dict]:
    """The rows with NaN and inf as None (JSON has neither)."""
    import math
    return [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in rows]


def write_rows_json(path, rows: list[dict], **settings) -> dict:
    """Write {card, versions, date, settings, rows} to ``path`` (NaN and inf become null); returns the dict."""
    import json

    from .bench_fla import environment
    env = environment()
    if not str(settings.get("device", "cpu")).startswith("cuda"):
        env["card"] = None                               # nothing ran on a card, whatever the machine has
    doc = {**env, "settings": {k: str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v
                               for k, v in settings.items()},
           "rows": finite_rows(rows)}
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    return doc


def main(argv=None):
    load_chapter_cases()
    p = argparse.ArgumentParser(prog="python -m atlaslib.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths (default 1024 4096)")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--models", nargs="+", default=None, help=f"bench cases (default all: {', '.join(BENCH_CASES)})")
    p.add_argument("--backends", nargs="+", default=None,
                   help="default: each case's own (recurrent chunk, + triton on CUDA; deep_vs_sdpa: sdpa and "
                        "the kernel-trick forms)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="chunk length of the chunk backend (default 64: for the models whose chunk form freezes "
                        "gradients, Titans, TTT-MLP, Omega, ATLAS, whose own default is 16, that times b = 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default 3; --vs fla: 10 on CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: leave as is)")
    p.add_argument("--quick", action="store_true", help="small and fast: T=256, one timed call (unless --repeats)")
    p.add_argument("--scaling", action="store_true",
                   help="time and memory for T=1024..8192 of one backend (--backends X; default chunk)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--vs", choices=["fla"], default=None,
                   help="chapters 1-2 against fla-core (CUDA: its Triton kernels at two fixed shapes; CPU: its "
                        "PyTorch references at a small one; --T with --B --H --K --V --dtype: that shape instead)")
    p.add_argument("--profile", action="store_true",
                   help="--vs fla: also each forward's largest kernels (CUDA) or operators (CPU), both sides")
    p.add_argument("--json", default=None,
                   help="also write the rows, the card, versions, date and settings to this file")
    args = p.parse_args(argv)
    for name in ("T", "B", "H", "K", "V", "chunk_size", "repeats", "threads"):
        value = getattr(args, name)
        bad = [v for v in (value if isinstance(value, list) else [value]) if v is not None and v < 1]
        if bad:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {bad[0]}")
    if args.warmup is not None and args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: the benchmarks run on cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available on this machine (use --device cpu)")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)      # synchronize and the peak-memory counters act on the current GPU
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json {args.json}: no folder {os.path.dirname(os.path.abspath(args.json))}")
    if args.json and os.path.isdir(args.json):
        p.error(f"--json {args.json} is a folder; give a file name")
    if "triton" in (args.backends or ()) and device.type == "cpu" and not interpreter_on():
        p.error("--backends triton on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 (or use a GPU)")
    if args.scaling and len(args.backends or ()) > 1:
        p.error(f"--scaling times one backend, got --backends {' '.join(args.backends)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile and args.vs != "fla":
        p.error("--profile lists the largest kernels of --vs fla's forwards; it needs --vs fla")
    if args.vs == "fla":
        from . import bench_fla
        ignored = [flag for flag, on in (("--quick", args.quick), ("--scaling", args.scaling),
                                         ("--chunk-size", args.chunk_size is not None),
                                         ("--backends", args.backends is not None)) if on]
        if ignored:
            p.error(f"--vs fla times its own fixed forms: {', '.join(ignored)} do not apply")
        if not args.T and (args.dtype != "float32" or any(getattr(args, n) != d for n, d in
                                                          (("B", 1), ("H", 4), ("K", 64), ("V", 64)))):
            p.error("--vs fla: --dtype, --B, --H, --K and --V choose a shape only together with --T")
        if device.type == "cpu" and args.T and (args.dtype != "float32" or any(T % 64 for T in args.T)):
            p.error("--vs fla on the CPU: fla's PyTorch references take float32 and T a multiple of 64")
        shapes = None
        if args.T:
            shapes = [bench_fla.Shape(args.B, args.H, T, args.K, args.V, args.dtype) for T in args.T]
        unknown = [m for m in args.models or () if m not in bench_fla.MODELS]
        if unknown:
            p.error(f"--vs fla compares {', '.join(bench_fla.MODELS)}; not {', '.join(unknown)}")
        try:
            bench_fla.run(args.device, shapes=shapes, models=args.models or bench_fla.MODELS,
                          warmup=1 if args.warmup is None else args.warmup, repeats=args.repeats,
                          json_path=args.json, profile=args.profile)
        except bench_fla.FlaMissing as e:
            p.exit(2, f"{p.prog}: {e}\n")
        return
    unknown = [m for m in args.models or () if m not in BENCH_CASES]
    if unknown:
        p.error(f"unknown --models {', '.join(unknown)}; known: {', '.join(BENCH_CASES)}")
    known = list(dict.fromkeys(b for m in args.models or BENCH_CASES for b in BENCH_CASES[m].backends))
    unknown = [b for b in args.backends or () if b not in known]
    if unknown:
        p.error(f"no case run has --backends {', '.join(unknown)}; they have {', '.join(known)}")
    dtype = getattr(torch, args.dtype)
    # the bar redraws itself with carriage returns: on a terminal only, not in a log file
    repeats = (1 if args.quick else 3) if args.repeats is None else args.repeats
    kw = dict(device=args.device, dtype=dtype, B=args.B, H=args.H, K=args.K, V=args.V,
              chunk_size=args.chunk_size or 64, warmup=1 if args.warmup is None else args.warmup, repeats=repeats,
              progress=not args.no_progress and sys.stderr.isatty())
    print(setting_line(kw))
    if args.scaling:
        Ts = args.T or ([256, 512, 1024] if args.quick else [1024, 2048, 4096, 8192])
        backend = (args.backends or ["chunk"])[0]
        rows = scaling(args.models, Ts, backend=backend, **kw)
        print(_table(rows))
        if args.json:
            write_rows_json(args.json, rows, Ts=Ts, backend=backend, **{k: v for k, v in kw.items() if k != "progress"})
            print(f"wrote {args.json}")
    else:
        Ts = args.T or ([256] if args.quick else [1024, 4096])
        rows = run_benchmarks(args.models, Ts, backends=args.backends, **kw)
        print(_table(rows))
        print("speedup = the time of the speedup_vs backend / this row's time (> 1: this row faster)")
        notes = case_notes(args.models, Ts, **kw)
        if notes:
            print("\n" + "\n".join(notes))
        if args.json:
            write_rows_json(args.json, rows, Ts=Ts, notes=notes, **{k: v for k, v in kw.items() if k != "progress"})
            print(f"wrote {args.json}")
    if str(args.device).startswith("cuda"):
        peaks = measured_peaks(args.device)
        print(f"measured peaks on this card: fp32 matmul {peaks['matmul_TFLOP/s']:.1f} TFLOP/s "
              f"(TF32 if enabled), copy {peaks['copy_GB/s']:.0f} GB/s")


if __name__ == "__main__":
    # run the copy of this module that chapter bench_cases register into (``atlaslib.bench``),
    # not the ``__main__`` copy that ``python -m`` executes
    from atlaslib.bench import main as canonical_main
    canonical_main()
