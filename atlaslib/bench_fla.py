"""Chapters 1 and 2 side by side with fla-core: ``python -m atlaslib.bench --vs fla``.

fla-core (flash-linear-attention's kernels, https://github.com/fla-org/flash-linear-attention) is an
optional, benchmark-only dependency pinned in ``requirements-fla.txt``; the library never imports it.
Install it next to the pinned torch and triton without letting pip touch them::

    pip install --no-deps -r requirements-fla.txt

Six models, each against fla's own op:

    model                ours                                    fla (CUDA)                 fla (CPU reference)
    linear               linear_attention                        chunk_linear_attn          naive_chunk_linear_attn
    linear_scalar_gate   linear_attention, log_alpha [B,H,T]     chunk_simple_gla           naive_chunk_simple_gla
    linear_channel_gate  linear_attention, log_alpha [B,H,T,K]   chunk_gla                  naive_recurrent_gla
    deltanet             delta_rule                              chunk_delta_rule (*)       delta_rule_chunkwise
    gated_deltanet       delta_rule, log_alpha [B,H,T]           chunk_gated_delta_rule     naive_chunk_gated_delta_rule
    kda                  delta_rule, log_alpha [B,H,T,K]         chunk_kda                  naive_chunk_kda

(The names are those of the main table's rows; ``--models`` picks some of them.)

(*) ``chunk_delta_rule`` refuses fp32 inputs, so in fp32 the DeltaNet row runs fla's
``chunk_gated_delta_rule`` with a zero log-gate (the same recurrence); the row's note says so.

Both sides get the same numbers in their own layout, converted once outside the timed calls:

* ours takes ``[B, H, T, K]``, fla ``[B, T, H, K]`` (its only layout in 0.6.0: ``head_first`` was
  removed; ``delta_rule_chunkwise``, the DeltaNet reference, is the exception and takes ``[B, H, T, K]``);
* fla scales queries by ``K^-0.5`` unless told otherwise; ours never scales, so fla gets
  ``scale=1.0`` (the two references without a ``scale`` argument get ``q * K^0.5`` instead);
* gates are fla's ``g``, the log of the decay (per channel for GLA and KDA), in fp32 on both sides
  (ours as ``log_alpha``); ``beta`` is the delta rule's step, in the activation dtype;
* every optional transform of fla is off: ``normalize=False`` for linear attention, no in-kernel
  l2-norm of q and k (the keys are already unit vectors), no in-kernel gate or beta activation;
  no initial state, no final state.

On CUDA, for each shape of ``GPU_SHAPES`` (B=4, H=16, T=4096, K=V=128 in bf16, and B=2, H=8, T=4096,
K=V=64 in fp32) and each model, the table has our forward time (``backend="triton"``) and fla's,
fla / ours (> 1: ours faster), the relative error of our output against fla's (Frobenius norm of the
difference over fla's), the peak memory of each forward (beyond its inputs, as in the main table),
and the same for forward + backward (gradients of q, k, v, beta and the gate, from a fixed random
output gradient): the times, the largest relative error of our gradients against fla's (over the
inputs), and the peak memory of the pair. Our backward is the backward kernels of chapter 1
(``linear.backward``) and chapter 2 (``delta.kernel.DeltaRuleFunction``). Times are medians
of ``--repeats`` rounds measured with CUDA events, the two sides called in turn within each round,
after ``--warmup`` untimed rounds (fla autotunes each op on its first call: 25-35 s each).

On a CPU the same command compares our chunk forms (``backend="chunk"``) with fla's pure-PyTorch
references at a small size (``CPU_SHAPE``), and also reports our per-token loop's error against the
reference: a check of both models against an independent implementation.

Every forward row is measured first, then (CUDA) the forward + backward columns of each row; a line is
printed as each is measured, with the time so far. ``--json PATH`` writes the table with the card, the
versions, the date and the shapes, rewritten after each row ("complete": false until the end). ``--profile`` adds,
for each row, the forward's largest kernels on both sides (``kernel_times``: torch.profiler, self time
per call), printed after the table and kept in each JSON row as "profile": the first place to look when a
ratio is low.

In fp32 the two sides do not multiply alike: our kernels' ``tl.dot`` products of fp32 tiles are exact
(``input_precision="ieee"``, CUDA cores, as the tests' tolerances need) unless ``ATLASLIB_TF32=1`` is set,
while most of fla's run Triton's default, TF32 on tensor cores. The JSON's "fp32_dot" and the line under
the table say which our side used; ``ATLASLIB_TF32=1 python -m atlaslib.bench --vs fla`` times ours at
fla's precision.

fla-core 0.6.0 refuses its gated backward (``chunk_bwd_dqkwg``) on Hopper cards under Triton older than
3.7.1, which gives wrong results there: run the forward + backward columns with the pinned Triton.
"""
from __future__ import annotations

import datetime
import importlib
import json
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass

import torch

FLA_VERSION = "0.6.0"
# The pins of the repository's requirements-fla.txt, spelled out for an installed copy, which has no such file
# (--no-deps: pip keeps the torch and triton already installed).
INSTALL = f"pip install --no-deps fla-core=={FLA_VERSION} einops==0.8.2"
MODELS = ("linear", "linear_scalar_gate", "linear_channel_gate", "deltanet", "gated_deltanet", "kda")
GATES = {"linear": None, "linear_scalar_gate": "scalar", "linear_channel_gate": "channel", "deltanet": None,
         "gated_deltanet": "scalar", "kda": "channel"}
DELTA = {"deltanet", "gated_deltanet", "kda"}
FP32_DOT = {"ieee": "exact fp32 (ieee, CUDA cores; ATLASLIB_TF32=1 for TF32)", "tf32": "TF32 (ATLASLIB_TF32=1)"}
FLA_CHUNK = {"linear": "linear_attn.chunk_linear_attn", "linear_scalar_gate": "simple_gla.chunk_simple_gla",
             "linear_channel_gate": "gla.chunk_gla", "deltanet": "delta_rule.chunk_delta_rule",
             "gated_deltanet": "gated_delta_rule.chunk_gated_delta_rule", "kda": "kda.chunk_kda"}
FLA_NAIVE = {"linear": "linear_attn.naive.naive_chunk_linear_attn",
             "linear_scalar_gate": "simple_gla.naive.naive_chunk_simple_gla",
             "linear_channel_gate": "gla.naive.naive_recurrent_gla",
             "deltanet": "delta_rule.naive.delta_rule_chunkwise",
             "gated_deltanet": "gated_delta_rule.naive.naive_chunk_gated_delta_rule",
             "kda": "kda.naive.naive_chunk_kda"}


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    T: int
    K: int
    V: int
    dtype: str = "float32"


GPU_SHAPES = (Shape(4, 16, 4096, 128, 128, "bfloat16"), Shape(2, 8, 4096, 64, 64, "float32"))
# T a multiple of 64: the references of linear attention and DeltaNet need whole chunks (64 and 32)
CPU_SHAPE = Shape(1, 2, 128, 32, 32, "float32")


class FlaMissing(RuntimeError):
    pass


def require_fla():
    """Import fla, or raise FlaMissing with the one line that says how to install it."""
    try:
        with warnings.catch_warnings():                      # "Triton is not supported ... roll back to CPU"
            warnings.simplefilter("ignore")
            import fla
    except ImportError as e:
        raise FlaMissing(f"--vs fla needs fla-core=={FLA_VERSION} (benchmark only, not a dependency of atlaslib): "
                         f"{INSTALL}   [{e}]") from None
    return fla


def fla_function(path: str):
    """``fla.ops.<path>``, e.g. "gla.chunk_gla"."""
    module, name = f"fla.ops.{path}".rsplit(".", 1)
    with warnings.catch_warnings():                          # fla's "Triton is not supported ..." on a CPU
        warnings.simplefilter("ignore")
        return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------- inputs and calls

def make_inputs(model: str, s: Shape, device="cpu", seed: int = 0) -> dict:
    """Our layout: q, k (unit vectors), v [B,H,T,.] in s.dtype; beta [B,H,T] in [0.1, 1] (delta rule) in
    s.dtype; g, the log-gate (log of a decay in [0.9, 1]) [B,H,T] or [B,H,T,K] in fp32."""
    from .core import random_gate, random_qkv
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, s.dtype)
    q, k, v = random_qkv(s.B, s.H, s.T, s.K, s.V, generator=gen)
    x = {"q": q.to(device, dtype), "k": k.to(device, dtype), "v": v.to(device, dtype)}
    if model in DELTA:
        x["beta"] = random_gate(s.B, s.H, s.T, low=0.1, high=1.0, generator=gen).to(device, dtype)
    gate = GATES[model]
    if gate:
        x["g"] = random_gate(s.B, s.H, s.T, s.K if gate == "channel" else None, low=0.9, generator=gen).log().to(device)
    return x


def to_fla(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, ...] -> [B, T, H, ...], contiguous (fla's layout)."""
    return x.transpose(1, 2).contiguous()


def from_fla(o: torch.Tensor) -> torch.Tensor:
    """[B, T, H, V] -> [B, H, T, V] (a view)."""
    return o.transpose(1, 2)


def ours(model: str, x: dict, backend: str) -> torch.Tensor:
    """Our output [B, H, T, V] on inputs in our layout."""
    from .delta import delta_rule
    from .linear import linear_attention
    if model in DELTA:
        return delta_rule(x["q"], x["k"], x["v"], x["beta"], log_alpha=x.get("g"), backend=backend)[0]
    return linear_attention(x["q"], x["k"], x["v"], log_alpha=x.get("g"), backend=backend)[0]


def fla_inputs(model: str, x: dict, impl: str) -> dict:
    """``x`` in the layout of fla's ``impl`` ("chunk": the CUDA ops, "naive": the CPU references)."""
    if impl == "naive" and model in ("linear_channel_gate", "deltanet"):
        # these references fix the scale at K^-0.5: they get q * K^0.5, made here, outside the timed call
        x = {**x, "q": x["q"] * x["q"].shape[-1] ** 0.5}
    if impl == "naive" and model == "deltanet":                # delta_rule_chunkwise is head-first
        return {name: t.contiguous() for name, t in x.items()}
    if impl == "chunk" and model == "deltanet" and x["q"].dtype == torch.float32:
        # fp32 DeltaNet runs as chunk_gated_delta_rule with g = 0 (see fla_call): the zeros made once, here
        x = {**x, "g0": torch.zeros_like(x["beta"], dtype=torch.float32)}
    return {name: to_fla(t) for name, t in x.items()}


def fla_call(model: str, impl: str, dtype: torch.dtype, fns=None):
    """(call, name, note): ``call(f)`` runs fla's ``impl`` of ``model`` on ``f = fla_inputs(...)`` and returns
    the output in our layout; ``name``: fla's function; ``note``: a caveat or None. ``fns`` maps an fla path
    ("gla.chunk_gla") to the function (default: import it from fla.ops)."""
    get = (lambda path: fns[path]) if fns is not None else fla_function
    off = dict(initial_state=None, output_final_state=False)
    if impl == "chunk":
        if model == "deltanet" and dtype == torch.float32:
            gdn = get(FLA_CHUNK["gated_deltanet"])
            return (lambda f: from_fla(gdn(f["q"], f["k"], f["v"], g=f["g0"], beta=f["beta"], scale=1.0,
                                           use_qk_l2norm_in_kernel=False, **off)[0]),
                    "chunk_gated_delta_rule", "g = 0: chunk_delta_rule refuses fp32")
        fn = get(FLA_CHUNK[model])
        if model == "linear":
            call = lambda f: fn(f["q"], f["k"], f["v"], scale=1.0, normalize=False, **off)[0]        # noqa: E731
        elif model in ("linear_scalar_gate", "linear_channel_gate"):
            call = lambda f: fn(f["q"], f["k"], f["v"], g=f["g"], scale=1.0, **off)[0]              # noqa: E731
        elif model == "deltanet":
            call = lambda f: fn(f["q"], f["k"], f["v"], f["beta"], scale=1.0,                         # noqa: E731
                                use_qk_l2norm_in_kernel=False, **off)[0]
        elif model == "gated_deltanet":
            call = lambda f: fn(f["q"], f["k"], f["v"], g=f["g"], beta=f["beta"], scale=1.0,          # noqa: E731
                                use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, **off)[0]
        else:                                                                                       # kda
            call = lambda f: fn(f["q"], f["k"], f["v"], g=f["g"], beta=f["beta"], scale=1.0,          # noqa: E731
                                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                use_beta_sigmoid_in_kernel=False, **off)[0]
        return (lambda f: from_fla(call(f))), FLA_CHUNK[model].split(".")[-1], None
    fn = get(FLA_NAIVE[model])
    name = FLA_NAIVE[model].split(".")[-1], None
    if model == "linear":
        return (lambda f: from_fla(fn(f["q"], f["k"], f["v"], scale=1.0, normalize=False))), *name
    if model == "linear_scalar_gate":
        return (lambda f: from_fla(fn(f["q"], f["k"], f["v"], f["g"], scale=1.0, **off)[0])), *name
    if model == "linear_channel_gate":           # fixed scale K^-0.5: fla_inputs hands it q * K^0.5
        return (lambda f: from_fla(fn(f["q"], f["k"], f["v"], f["g"], **off)[0])), *name
    if model == "deltanet":                      # head-first, fixed scale (q * K^0.5 as above), 32-token chunks
        return (lambda f: fn(f["q"], f["k"], f["v"], f["beta"], chunk_size=32)[0]), *name
    if model == "gated_deltanet":
        return (lambda f: from_fla(fn(f["q"], f["k"], f["v"], f["g"], f["beta"], scale=1.0, **off)[0])), *name
    return (lambda f: from_fla(fn(f["q"], f["k"], f["v"], f["g"], f["beta"], scale=1.0, **off)[0])), *name


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref||_F / ||ref||_F in fp64."""
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm())


def with_grads(x: dict) -> dict:
    """Fresh leaves (same values) that require gradients."""
    return {name: t.detach().clone().requires_grad_(True) for name, t in x.items()}


def forward_backward(forward, x: dict, do: torch.Tensor):
    """A function that runs forward(x) and the gradients of <output, do> with respect to every input."""
    inputs = list(x.values())
    return lambda: torch.autograd.grad(forward(x), inputs, do)


# ---------------------------------------------------------------------------- timing

def cuda_event_times(fns: dict, *, warmup: int = 1, repeats: int = 10) -> dict:
    """Median milliseconds of each ``fns[name]()`` measured with CUDA events; the functions are called in
    turn within each round (interleaved), after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def default_timer(device):
    from .bench import time_calls
    if str(device).startswith("cuda"):
        return cuda_event_times
    return lambda fns, *, warmup, repeats: time_calls(fns, device, warmup=warmup, repeats=repeats)


def kernel_times(fn, device, *, calls: int = 3, top: int = 8) -> list[dict]:
    """Where the time of ``fn()`` goes, from ``torch.profiler`` over ``calls`` calls after one untimed call.

    On CUDA the GPU kernels, on a CPU the operators, by self time: the ``top`` largest as
    {"kernel", "ms" (per call), "launches" (per call)}, then one {"kernel": "all (N)", ...} row with the sum
    over all N of them. On a GPU, that sum against the CUDA-event time of the call is the time the GPU
    spent idle, waiting for the host.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    on_gpu = str(device).startswith("cuda")
    fn()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        for _ in range(calls):
            fn()
        if on_gpu:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        if us > 0 and (not on_gpu or e.device_type == DeviceType.CUDA):
            rows.append({"kernel": e.key, "ms": us / 1000 / calls, "launches": e.count / calls})
    rows.sort(key=lambda r: -r["ms"])
    total = {"kernel": f"all ({len(rows)})", "ms": sum(r["ms"] for r in rows),
             "launches": sum(r["launches"] for r in rows)}
    return rows[:top] + [total]


def format_profile(rows: list[dict], width: int = 72) -> str:
    """One block per row that has a "profile": our forward's kernels, then fla's (``kernel_times``)."""
    from .tables import format_table
    out = []
    for r in rows:
        if "profile" not in r:
            continue
        lines = [{"side": side, "kernel": k["kernel"][:width], "ms": k["ms"], "launches": f"{k['launches']:g}"}
                 for side in ("ours", "fla") for k in r["profile"][side]]
        out.append(f"{r['model']} {r['dtype']} B={r['B']} H={r['H']} T={r['T']} K={r['K']} V={r['V']}, forward, "
                   f"ms per call (ours {r['ours_ms']:.3f}, fla {r['fla_ms']:.3f} by the timer):\n"
                   + format_table(lines, ["side", "kernel", "ms", "launches"], digits=3))
    return "\n\n".join(out)


# ---------------------------------------------------------------------------- the table

def compare(models=MODELS, shape: Shape = CPU_SHAPE, *, device="cpu", impl=None, backend=None, warmup=1, repeats=3,
            forward=True, backward=None, timer=None, peak=None, fns=None, seed=0, profile=False) -> list[dict]:
    """One row per model at ``shape``: see the module docstring. ``impl`` (fla's side: "chunk" or "naive"),
    ``backend`` (ours: "triton" or "chunk") and ``backward`` (time forward + backward) default by device
    (CUDA: chunk / triton / True; CPU: naive / chunk / False); ``forward=False`` leaves the forward columns
    out (``run`` measures them in a pass of their own). ``timer(fns, *, warmup, repeats) -> medians``
    (keywords, as ``cuda_event_times`` takes them), ``peak(fn, device) -> MiB`` and ``fns`` (fla's functions by
    path) can be replaced, e.g. by a test. ``profile``: each row also gets "profile", the forward's
    ``kernel_times`` on both sides. "wall_s" and "fwdbwd_wall_s": the wall time the forward and the
    forward + backward columns took, compilation and fla's autotuning included."""
    from .bench import falls_back, peak_memory_mib
    on_gpu = str(device).startswith("cuda")
    impl = impl or ("chunk" if on_gpu else "naive")
    backend = backend or ("triton" if on_gpu else "chunk")
    backward = on_gpu if backward is None else backward
    timer = timer or default_timer(device)
    peak = peak or peak_memory_mib
    dtype = getattr(torch, shape.dtype)
    rows = []
    for model in models:
        x = make_inputs(model, shape, device, seed)
        f = fla_inputs(model, x, impl)
        fla_fn, fla_name, note = fla_call(model, impl, dtype, fns)
        row = {"model": model, **asdict(shape), "ours": backend, "fla": fla_name}
        started = time.perf_counter()
        if forward:
            with torch.no_grad():
                if backend.startswith("triton") and falls_back(lambda: ours(model, x, backend)):
                    row["ours"] = f"{backend} (ran chunk: kernel did not fit)"       # what the times are of
                    note = (note + "; " if note else "") + "our kernel did not fit this card: chunk form timed"
                o_ours, o_fla = ours(model, x, backend), fla_fn(f)
                row["rel_err"] = relative_error(o_ours, o_fla)
                if not on_gpu:
                    row["loop_rel_err"] = relative_error(ours(model, x, "recurrent"), o_fla)
                del o_ours, o_fla
                fwd = {"ours": lambda: ours(model, x, backend), "fla": lambda: fla_fn(f)}
                t = timer(fwd, warmup=warmup, repeats=repeats)
                row.update(ours_ms=t["ours"], fla_ms=t["fla"], speedup=t["fla"] / t["ours"],
                           ours_MiB=peak(fwd["ours"], device), fla_MiB=peak(fwd["fla"], device))
                if profile:
                    row["profile"] = {side: kernel_times(fn, device) for side, fn in fwd.items()}
            row["wall_s"] = time.perf_counter() - started
            started = time.perf_counter()
        if backward:
            do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
            xg, fg = with_grads(x), with_grads(f)
            # fla's output is a [B, H, T, V] view of its [B, T, H, V] tensor: its gradient is given as the same
            # kind of view of a contiguous tensor, so that fla's backward gets it contiguous, as ours does
            both = {"ours": forward_backward(lambda z: ours(model, z, backend), xg, do),
                    "fla": forward_backward(fla_fn, fg, from_fla(to_fla(do)) if impl == "chunk" else do)}
            ours_grads = both["ours"]()           # both sides called once before the timer: compiled alike
            try:
                fla_grads = both["fla"]()
            except RuntimeError as e:     # fla refuses some backward passes on some cards and Triton versions
                fla_grads = None
                del both["fla"]
                note = (note + "; " if note else "") + f"fla's backward refused: {str(e).splitlines()[0][:120]}"
            t = timer(both, warmup=warmup, repeats=repeats)
            row["ours_fwdbwd_ms"], row["ours_fwdbwd_MiB"] = t["ours"], peak(both["ours"], device)
            if fla_grads is not None:
                row.update(fla_fwdbwd_ms=t["fla"], fwdbwd_speedup=t["fla"] / t["ours"],
                           fla_fwdbwd_MiB=peak(both["fla"], device))
                back = (lambda t: t) if impl == "naive" and model == "deltanet" else from_fla
                row["grad_rel_err"] = max(relative_error(a, back(b)) for a, b in zip(ours_grads, fla_grads))
            row["fwdbwd_wall_s"] = time.perf_counter() - started
        if note:
            row["note"] = note
        rows.append(row)
    return rows


COLUMNS = ["model", "dtype", "B", "H", "T", "K", "V", "fla", "ours_ms", "fla_ms", "speedup", "rel_err",
           "loop_rel_err", "ours_MiB", "fla_MiB", "ours_fwdbwd_ms", "fla_fwdbwd_ms", "fwdbwd_speedup", "grad_rel_err",
           "ours_fwdbwd_MiB", "fla_fwdbwd_MiB", "note"]


def format_rows(rows: list[dict]) -> str:
    """The aligned table (columns a row lacks are left out; speedups as "1.23x", errors as "1.2e-03")."""
    from .tables import format_table
    columns = [c for c in COLUMNS if any(c in r for r in rows)]
    out = []
    for r in rows:
        r = dict(r)
        for key in ("speedup", "fwdbwd_speedup"):
            if isinstance(r.get(key), float):
                r[key] = f"{r[key]:.2f}x"
        for key in ("rel_err", "loop_rel_err", "grad_rel_err"):
            if isinstance(r.get(key), float):
                r[key] = f"{r[key]:.1e}"
        out.append({c: r.get(c, "-") for c in columns})
    return format_table(out, columns, digits=2)


def environment() -> dict:
    """Card, versions and date, for the table's header and the JSON file (triton None where it is missing:
    the plain bench runs without it)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import fla
        fla_version = fla.__version__
    except ImportError:
        fla_version = None
    from .core import interpreter_on
    cuda, cpu = torch.cuda.is_available(), cpu_model()
    return {"card": torch.cuda.get_device_name() if cuda else f"no CUDA device (CPU: {cpu})", "cpu": cpu,
            "threads": torch.get_num_threads(), "interpreter": interpreter_on(),
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "fla-core": fla_version, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo; elsewhere what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def write_json(path, rows: list[dict], shapes, env: dict | None = None, **meta) -> dict:
    """Write {environment, shapes, dtypes, rows, ...} to ``path``; NaN/inf become null. Returns the dict."""
    from .bench import finite_rows
    doc = {**(env or environment()), **meta, "shapes": [asdict(s) for s in shapes],
           "dtypes": sorted({s.dtype for s in shapes}), "rows": finite_rows(rows)}
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    return doc


def progress_line(row: dict, elapsed: float) -> str:
    """One line as soon as a row's forward (or forward + backward) columns are measured, with the time so far."""
    head = (f"[{elapsed:5.0f} s] {row['model']} {row['dtype']} B={row['B']} H={row['H']} T={row['T']} K={row['K']} "
            f"V={row['V']}: ")
    if "ours_fwdbwd_ms" in row:
        fla = (f"fla {row['fla_fwdbwd_ms']:.3f} ms ({row['fwdbwd_speedup']:.2f}x), grad_rel_err "
               f"{row['grad_rel_err']:.1e}" if "fla_fwdbwd_ms" in row else "fla refused")
        return head + (f"forward + backward ours {row['ours_fwdbwd_ms']:.3f} ms, {fla} "
                       f"(row {row['fwdbwd_wall_s']:.0f} s)")
    return head + (f"forward ours {row['ours_ms']:.3f} ms, fla {row['fla_ms']:.3f} ms ({row['speedup']:.2f}x), "
                   f"rel_err {row['rel_err']:.1e} (row {row['wall_s']:.0f} s)")


def run(device, *, shapes=None, models=MODELS, warmup=1, repeats=None, json_path=None, profile=False,
        out=print) -> list[dict]:
    """The ``--vs fla`` command: header, table, optional profiles (``--profile``), optional JSON.

    Every forward row first (the columns the targets are about), then on CUDA the forward + backward
    columns of each row. A line is printed as each is measured, and the JSON file is rewritten after
    each with "complete": false until the end, so that a run stopped early (fla's first calls autotune
    for minutes on a fresh machine) still leaves what it measured.
    """
    from .core.kernels import precision
    require_fla()
    on_gpu = str(device).startswith("cuda")
    shapes = shapes or (GPU_SHAPES if on_gpu else (CPU_SHAPE,))
    repeats = repeats or (10 if on_gpu else 3)
    env = environment()
    where = f"{env['card']} (CUDA {env['cuda']})" if on_gpu else f"CPU {env['cpu']}, {env['threads']} threads"
    out(f"atlaslib vs fla-core {env['fla-core']} on {where}: torch {env['torch']}, triton {env['triton']}; "
        f"median of {repeats} {'CUDA-event' if on_gpu else 'wall-clock'} timings, the two sides interleaved, "
        f"after {warmup} warm-up round(s)")
    if not on_gpu:
        out("(CPU: our chunk forms against fla's PyTorch references; loop_rel_err: our per-token loop against them)")
    meta = dict(device=str(device), warmup=warmup, repeats=repeats, ours_backend="triton" if on_gpu else "chunk")
    if on_gpu:
        meta["fp32_dot"] = {"ours": precision(torch.float32), "fla": "tf32 (Triton's default) in most kernels"}
    rows, started = [], time.perf_counter()
    kw = dict(device=device, warmup=warmup, repeats=repeats, profile=profile)

    def measured(row):
        if json_path:
            write_json(json_path, rows, shapes, env, complete=False, **meta)
        out(progress_line(row, time.perf_counter() - started))

    for s in shapes:
        for model in models:
            rows += compare([model], s, backward=False, **kw)
            measured(rows[-1])
    if on_gpu:
        for row in rows:
            s = Shape(*(row[f] for f in ("B", "H", "T", "K", "V", "dtype")))
            row.update(compare([row["model"]], s, forward=False, backward=True, **kw)[0])
            measured(row)
    out(format_rows(rows))
    out("speedup = fla time / ours (> 1: ours faster); rel_err = ||ours - fla|| / ||fla||; MiB: forward peak "
        "beyond the inputs" + ("; fwdbwd: forward + backward, gradients of every input" if on_gpu else ""))
    if on_gpu and any(s.dtype == "float32" for s in shapes):
        out(f"fp32 rows: our tl.dot products {FP32_DOT[precision(torch.float32)]}; most of fla's TF32 "
            "(Triton's default)")
    if profile:
        out("\nWhere each forward's time goes (torch.profiler; " + ("GPU kernels" if on_gpu else "CPU operators")
            + ", self time):\n\n" + format_profile(rows))
    if json_path:
        write_json(json_path, rows, shapes, env, complete=True, **meta)
        out(f"wrote {json_path}")
    return rows
