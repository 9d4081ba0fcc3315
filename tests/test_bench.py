"""Smoke tests of ``python -m atlaslib.bench`` (no timing assertions), its memory meter, and ``--vs fla``."""
import os
import re

import pytest
import torch

from atlaslib import bench, bench_fla

COLUMNS = ["model", "backend", "device", "dtype", "B", "H", "T", "K", "V", "time_ms", "peak_MiB", "speedup",
           "speedup_vs"]


def test_table_prints_all_columns(capsys):
    bench.main(["--quick", "--T", "20", "--B", "1", "--H", "2", "--K", "6", "--V", "5", "--no-progress"])
    setting, _, out = capsys.readouterr().out.strip().partition("\n")
    assert setting.startswith("# CPU ") and " threads; torch " in setting and "median of 1 after 1 warm-up" in setting
    table, notes = out.split("\n\n")
    *lines, footer = table.splitlines()
    assert footer.startswith("speedup = the time of the speedup_vs backend")
    assert lines[0].split() == COLUMNS
    rows = [line.split() for line in lines[2:]]
    assert any(line.startswith("atlas_c8 T=20: Newton-Schulz") for line in notes.splitlines())
    models = {"linear", "linear_scalar_gate", "linear_channel_gate"}
    assert {r[0] for r in rows} >= models
    assert {(r[0], r[1]) for r in rows} >= {(m, b) for m in models for b in ("recurrent", "chunk")}
    for r in rows:
        assert len(r) == len(COLUMNS) and r[2] == "cpu" and r[6] == "20"
        assert float(r[9]) >= 0 and float(r[10]) >= 0


def test_scaling_mode(capsys):
    bench.main(["--scaling", "--quick", "--T", "16", "32", "--models", "linear", "--H", "1", "--K", "4",
                "--V", "4", "--no-progress"])
    lines = capsys.readouterr().out.strip().splitlines()[1:]                 # after the "# ..." setting line
    assert "MiB_per_1k_tokens" in lines[0].split()
    assert len(lines) == 4 and all(line.split()[1] == "chunk" for line in lines[2:])


SMALL = ["--models", "linear", "--T", "16", "--H", "1", "--K", "4", "--V", "4", "--repeats", "1", "--warmup", "0"]


def usage_error(main, argv, capsys) -> str:
    """The last line ``main(argv)`` prints on stderr, after checking that it exits as argparse does (status 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--models", "nosuch"], "error: unknown --models nosuch; known: linear, "),
    (["--T", "0"], "error: --T must be >= 1, got 0"),
    (["--T", "16", "-5"], "error: --T must be >= 1, got -5"),
    (["--chunk-size", "0"], "error: --chunk-size must be >= 1, got 0"),
    (["--backends", "nosuch"], "error: no case run has --backends nosuch; they have recurrent, chunk, triton"),
    (["--device", "nosuch"], "error: --device 'nosuch' is not a torch device"),
    (["--json", "/nonexistent/x.json"], "error: --json /nonexistent/x.json: no folder /nonexistent"),
    (["--scaling", "--backends", "recurrent", "chunk"], "error: --scaling times one backend"),
    (["--device", "meta"], "error: --device meta: the benchmarks run on cpu or cuda[:N]"),
    (["--json", "/tmp"], "error: --json /tmp is a folder; give a file name"),
    (["--vs", "fla", "--quick"], "error: --vs fla times its own fixed forms: --quick do not apply"),
    (["--vs", "fla", "--chunk-size", "32"], "error: --vs fla times its own fixed forms: --chunk-size do not apply"),
    (["--vs", "fla", "--device", "cpu", "--T", "96"], "fla's PyTorch references take float32 and T a multiple of 64"),
    (["--vs", "fla", "--device", "cpu", "--T", "64", "--dtype", "bfloat16"], "take float32 and T a multiple of 64"),
    (["--profile"], "error: --profile lists the largest kernels of --vs fla's forwards; it needs --vs fla"),
])
def test_bad_arguments_are_one_line_usage_errors(capsys, argv, message):
    line = usage_error(bench.main, SMALL[:2] + argv if "--models" not in argv else argv + SMALL[2:], capsys)
    assert message in line, line


def test_triton_on_the_cpu_without_the_interpreter_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(bench, "interpreter_on", lambda: False)
    line = usage_error(bench.main, SMALL[:2] + ["--backends", "triton", "--device", "cpu"], capsys)
    assert "error: --backends triton on the CPU needs Triton's interpreter" in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_usage_error(capsys):
    line = usage_error(bench.main, [*SMALL, "--device", "cuda"], capsys)
    assert "error: --device cuda: CUDA is not available on this machine" in line, line


def test_the_progress_bar_is_left_out_of_a_log_file(capsys, monkeypatch):
    """tqdm redraws its bar with carriage returns, which a file keeps as one long line of bars."""
    bench.main([*SMALL, "--backends", "chunk"])
    out, err = capsys.readouterr()
    assert "linear" in out and "bench" not in err, err
    import sys
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)       # a terminal still gets it
    bench.main([*SMALL, "--backends", "chunk"])
    assert "bench: 100%" in capsys.readouterr().err


def test_peak_memory_sees_a_known_allocation():
    """A call that holds a 4 MiB buffer and a 2 MiB temporary peaks at 6 MiB and returns 4 MiB."""
    def fn():
        out = torch.ones(2**20)                 # 4 MiB, returned
        tmp = torch.ones(2**19)                 # 2 MiB, freed before returning
        out += tmp.sum()
        del tmp
        return out
    assert bench.peak_memory_mib(fn, "cpu") == pytest.approx(6.0, abs=0.1)


def test_the_profilers_allocations_are_read_without_the_fallback():
    """``_cpu_allocations`` reads the pinned torch's event tree itself: a 4 MiB buffer kept and a 2 MiB one freed
    are three events (+4 MiB, +2 MiB, -2 MiB) that peak at 6 MiB and agree with the public event list."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = torch.ones(2**20)
        tmp = torch.ones(2**19)
        del tmp
    events = bench._cpu_allocations(prof)
    assert sorted(nbytes for _, nbytes in events) == [-2**21, 2**21, 2**22]

    def peak(events):
        held, top = 0, 0
        for _, nbytes in sorted(events):
            held += nbytes
            top = max(top, held)
        return top
    fallback = bench._cpu_allocations_fallback(prof)
    assert peak(events) == peak(fallback) == 2**22 + 2**21
    assert sum(n for _, n in events) == sum(n for _, n in fallback) == out.numel() * out.element_size()


class FakeClock:
    """A stand-in for ``time.perf_counter``: each function given to ``step`` advances it by its next cost (ms)."""
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def step(self, costs_ms):
        costs = iter(costs_ms)

        def call(*_):
            self.now += next(costs) * 1e-3
        return call


def test_time_calls_is_the_median_in_milliseconds(monkeypatch):
    """With a clock that each timed call advances by 1, 5 and 2 ms (after an untimed 9 ms warm-up): 2 ms,
    the median (not the mean, 2.67), in milliseconds."""
    clock = FakeClock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    times = bench.time_calls({"a": clock.step([9, 1, 5, 2]), "b": clock.step([9, 7, 3, 4])}, "cpu",
                             warmup=1, repeats=3)
    assert times == {"a": pytest.approx(2.0, rel=1e-9), "b": pytest.approx(4.0, rel=1e-9)}
    assert bench.time_call(clock.step([9, 6]), "cpu", warmup=1, repeats=1) == pytest.approx(6.0, rel=1e-9)


@pytest.fixture
def probe_case(monkeypatch):
    """A registered case "_probe" whose recurrent backend takes 4 ms and chunk 1 ms on a fake clock, each call
    holding 4 KiB per token (a returned tensor), with flops 8e9, bytes 2e9 and a note naming T."""
    clock = FakeClock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    cost = {"recurrent": 4.0, "chunk": 1.0}

    def builder(shape, g):
        def call(backend):
            clock.now += cost[backend] * 1e-3
            return torch.ones(shape.T * 1024)
        return call
    bench.register_bench_case("_probe", builder, backends=("recurrent", "chunk"), flops=lambda s: 8e9,
                              bytes=lambda s: 2e9, note=lambda s: f"note of T={s.T}")
    yield
    bench.BENCH_CASES.pop("_probe")


def test_speedup_is_the_reference_time_over_this_one(probe_case):
    """recurrent 4 ms, chunk 1 ms: the chunk row's speedup is 4 (reference / this), the reference's 1; the
    dtype column names the dtype without "torch."; the table prints the speedup with one decimal and an x."""
    rows = bench.run_benchmarks(["_probe"], [8], warmup=1, repeats=3, progress=False)
    by = {r["backend"]: r for r in rows}
    assert by["recurrent"]["time_ms"] == pytest.approx(4.0) and by["chunk"]["time_ms"] == pytest.approx(1.0)
    for r in rows:
        assert r["speedup"] == by["recurrent"]["time_ms"] / r["time_ms"]
        assert r["dtype"] == "float32" and "TFLOP/s" not in r and "GB/s" not in r       # CPU: no throughput
    assert by["chunk"]["speedup"] == pytest.approx(4.0)
    lines = bench._table(rows).splitlines()
    column = lines[0].split().index("speedup")
    assert [line.split()[column] for line in lines[2:]] == [f"{r['speedup']:.1f}x" for r in rows]
    assert [line.split()[column] for line in lines[2:]] == ["1.0x", "4.0x"]
    (half,) = bench.run_benchmarks(["_probe"], [8], backends=["chunk"], dtype=torch.bfloat16, warmup=0, repeats=1,
                                   progress=False)
    assert half["dtype"] == "bfloat16"


def test_scaling_gives_memory_per_1024_tokens(probe_case):
    """``MiB_per_1k_tokens`` is peak_MiB per 1024 tokens: the probe holds 4 KiB per token, 4 MiB per 1024."""
    rows = bench.scaling(["_probe"], [8, 24], warmup=0, repeats=1, progress=False)
    assert [r["T"] for r in rows] == [8, 24] and all("speedup" not in r for r in rows)
    for r in rows:
        assert r["peak_MiB"] > 0
        assert r["MiB_per_1k_tokens"] == pytest.approx(r["peak_MiB"] * 1024 / r["T"])
        assert r["MiB_per_1k_tokens"] == pytest.approx(4.0, rel=0.05)


def test_case_notes_print_one_line_per_model_and_t(probe_case):
    lines = bench.case_notes(["_probe"], [16, 24])
    assert len(lines) == 2
    for T, line in zip([16, 24], lines):
        assert line.startswith(f"_probe T={T}") and line.endswith(f"note of T={T}")


def test_cuda_rows_subtract_the_baseline_and_add_throughput(probe_case, monkeypatch):
    """The CUDA branches with stand-in counters (no GPU): peak = (max allocated - allocated before) / 2**20;
    TFLOP/s = flops / seconds / 1e12 except for the recurrent loop; GB/s = bytes / seconds / 1e9."""
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(1))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 10 * 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    assert bench.peak_memory_mib(lambda: None, "cuda") == 7.0
    rows = bench.run_benchmarks(["_probe"], [8], device="cuda", warmup=0, repeats=1, progress=False)
    assert synced and [r["backend"] for r in rows] == ["recurrent", "chunk"]
    for r in rows:
        seconds = r["time_ms"] * 1e-3
        assert r["device"] == "cuda" and r["peak_MiB"] == 7.0
        assert r["GB/s"] == pytest.approx(2e9 / seconds / 1e9)
        assert r["TFLOP/s"] == (None if r["backend"] == "recurrent" else pytest.approx(8e9 / seconds / 1e12))
    assert rows[1]["TFLOP/s"] == pytest.approx(8.0) and rows[1]["GB/s"] == pytest.approx(2000.0)


def test_cuda_times_wait_for_the_device(monkeypatch):
    """A CUDA call returns once its kernels are queued; the clock must stop after they have run. A stand-in
    device: each call queues 5 ms of work, which ``torch.cuda.synchronize`` waits for (the fake clock advances
    then). The time is the 5 ms of work, not the 0 ms the call takes to return."""
    clock, queued = FakeClock(), [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", clock)

    def synchronize():
        clock.now += queued[0]
        queued[0] = 0.0
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    launch = lambda: queued.__setitem__(0, queued[0] + 5e-3)                  # noqa: E731
    assert bench.time_calls({"f": launch}, "cuda", warmup=1, repeats=3) == {"f": pytest.approx(5.0, rel=1e-9)}


def test_cuda_peak_forgets_the_earlier_calls(monkeypatch):
    """The CUDA peak is that of this call alone: stand-in counters where an earlier call left the high-water
    mark at 100 MiB, 3 MiB are held before the call and the call holds 1 MiB more. The counter is reset before
    the call (a reset sets it to what is allocated now), so the peak read is 1 MiB, not 100 - 3."""
    mib = 2**20
    held = {"now": 3 * mib, "top": 100 * mib}

    def reset():
        held["top"] = held["now"]

    def fn():
        held["now"] += mib
        held["top"] = max(held["top"], held["now"])
        return "out"
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: held["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: held["top"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    assert bench.peak_memory_mib(fn, "cuda") == 1.0


def test_measured_peaks_are_work_over_time(monkeypatch):
    """The footer's card peaks from stand-in times: a 4096^3 matmul is 2 * 4096^3 FLOPs, a copy of 256 MiB moves
    2 * 256 MiB."""
    times = iter([2.0, 4.0])
    monkeypatch.setattr(bench, "time_call", lambda fn, device, **kw: next(times))
    peaks = bench.measured_peaks("cpu")
    assert peaks["matmul_TFLOP/s"] == pytest.approx(2 * 4096**3 / 2e-3 / 1e12)
    assert peaks["copy_GB/s"] == pytest.approx(2 * 2**28 / 4e-3 / 1e9)


def test_finite_rows_turn_nan_and_both_infinities_into_none():
    import json
    import math
    rows = [{"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5, "e": "x", "f": 3}]
    (row,) = bench.finite_rows(rows)
    assert row == {"a": None, "b": None, "c": None, "d": 1.5, "e": "x", "f": 3}
    json.dumps(bench.finite_rows(rows), allow_nan=False)


@pytest.mark.parametrize("argv, Ts, warmup, repeats", [
    (["--quick"], [256], 1, 1),
    (["--quick", "--warmup", "4", "--repeats", "7"], [256], 4, 7),
    ([], [1024, 4096], 1, 3),
    (["--warmup", "2", "--repeats", "5", "--T", "32"], [32], 2, 5),
])
def test_quick_is_one_short_timed_call(monkeypatch, capsys, argv, Ts, warmup, repeats):
    """``--quick``: T=256, one warm-up and one timed call unless --warmup/--repeats say otherwise."""
    seen = {}

    def run_benchmarks(models, Ts, **kw):
        seen.update(kw, Ts=list(Ts))
        return []
    monkeypatch.setattr(bench, "run_benchmarks", run_benchmarks)
    monkeypatch.setattr(bench, "case_notes", lambda *a, **kw: [])
    bench.main([*argv, "--device", "cpu", "--no-progress"])
    assert (seen["Ts"], seen["warmup"], seen["repeats"]) == (Ts, warmup, repeats)


def test_chunk_size_and_threads_options_reach_the_run(monkeypatch):
    """``--chunk-size 16`` reaches ``run_benchmarks`` (and the notes), and ``--threads`` is torch's thread count
    while they run: the setting line would still print the values given."""
    seen = {}

    def run_benchmarks(models, Ts, **kw):
        seen.update(kw, threads=torch.get_num_threads())
        return []
    monkeypatch.setattr(bench, "run_benchmarks", run_benchmarks)
    monkeypatch.setattr(bench, "case_notes", lambda models, Ts, **kw: seen.update(notes=kw["chunk_size"]) or [])
    threads = torch.get_num_threads()
    try:
        bench.main([*SMALL, "--device", "cpu", "--chunk-size", "16", "--threads", str(threads + 1), "--no-progress"])
    finally:
        torch.set_num_threads(threads)
    assert (seen["chunk_size"], seen["notes"], seen["threads"]) == (16, 16, threads + 1)


def test_run_benchmarks_builds_every_case_at_the_chunk_size_asked(monkeypatch):
    """The ``BenchShape`` a case's builder (and its note) receives carries ``chunk_size``, not the default 64."""
    shapes = []

    def builder(shape, g):
        shapes.append(shape)
        return lambda backend: None
    bench.register_bench_case("_probe", builder, backends=("chunk",), note=lambda s: shapes.append(s) or "")
    try:
        bench.run_benchmarks(["_probe"], [8], chunk_size=16, warmup=0, repeats=1, progress=False)
        bench.case_notes(["_probe"], [8], chunk_size=16)
    finally:
        bench.BENCH_CASES.pop("_probe")
    assert len(shapes) == 2 and {s.chunk_size for s in shapes} == {16}


@pytest.mark.parametrize("argv, repeats", [([], None), (["--repeats", "3"], 3), (["--repeats", "5"], 5)])
def test_vs_fla_keeps_an_explicit_repeats(monkeypatch, argv, repeats):
    """``--vs fla`` without ``--repeats`` leaves the count to ``bench_fla.run`` (10 on CUDA, 3 on a CPU); any
    count given, 3 included, is passed on as given."""
    from atlaslib import bench_fla
    seen = {}
    monkeypatch.setattr(bench_fla, "run", lambda device, **kw: seen.update(kw))
    bench.main(["--vs", "fla", "--device", "cpu", *argv])
    assert seen["repeats"] == repeats


def test_time_calls_interleaves_the_functions():
    """Every function is timed over the same stretch: one call of each, round after round."""
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in ("recurrent", "chunk")}
    times = bench.time_calls(fns, "cpu", warmup=1, repeats=3)
    assert order == ["recurrent", "chunk"] * 4 and set(times) == {"recurrent", "chunk"}
    assert all(t >= 0 for t in times.values())


def test_register_bench_case_and_errors():
    calls = []
    def builder(shape, g):
        return lambda backend: calls.append((backend, shape.T))
    bench.register_bench_case("_probe", builder, backends=("chunk",))
    try:
        rows = bench.run_benchmarks(["_probe"], [8], warmup=0, repeats=1, progress=False)
        assert [(r["model"], r["backend"]) for r in rows] == [("_probe", "chunk")] and ("chunk", 8) in calls
        with pytest.raises(ValueError, match="already registered"):
            bench.register_bench_case("_probe", builder)
    finally:
        bench.BENCH_CASES.pop("_probe")
    with pytest.raises(ValueError, match="unknown bench case"):
        bench.run_benchmarks(["nope"], [8])


def test_atlas_rows_and_the_newton_schulz_share():
    from atlaslib.atlas.bench_cases import ns_share
    bench.load_chapter_cases()
    assert {"atlas", "atlas_c4", "atlas_c8"} <= set(bench.BENCH_CASES)
    share = ns_share(bench.BenchShape(1, 2, 24, 8, 8, chunk_size=8), window=8, repeats=1)
    assert 0 < share < 1


DEEP_ROWS = {"deep_kernel": ("recurrent", "chunk"), "deep_kernel_norm": ("recurrent", "chunk"),
             "deep_taylor2": ("recurrent", "chunk"), "swdt_c512": ("recurrent", "chunk"),
             "dot_kernel": ("recurrent", "chunk"), "dot_taylor2": ("recurrent", "chunk"),
             "deep_vs_sdpa": ("sdpa", "chunk", "chunk_normalize")}


def test_deep_rows_run_with_their_own_backends():
    """Chapter 6's rows: loop vs chunk, and SDPA as the reference of the kernel-trick forms (no triton on CPU)."""
    rows = bench.run_benchmarks(list(DEEP_ROWS), [12], B=1, H=2, K=4, V=3, chunk_size=4, warmup=0, repeats=1,
                                progress=False)
    assert {(r["model"], r["backend"]) for r in rows} == {(m, b) for m, bs in DEEP_ROWS.items() for b in bs}
    for r in rows:
        reference = "sdpa" if r["model"] == "deep_vs_sdpa" else "recurrent"
        assert r["time_ms"] > 0 and r["speedup"] > 0
        if r["backend"] == reference:
            assert r["speedup"] == 1.0


def test_deep_vs_sdpa_computes_what_it_compares():
    """On the case's own inputs: chunk_normalize is SDPA's softmax attention, and chunk the same exp
    scores without the normaliser (checked against exp(q k^T) built here, in fp64)."""
    bench.load_chapter_cases()
    shape = bench.BenchShape(2, 3, 33, 8, 5, dtype=torch.float64, chunk_size=8)
    call = bench.BENCH_CASES["deep_vs_sdpa"].builder(shape, torch.Generator().manual_seed(1))
    sdpa = call("sdpa")
    torch.testing.assert_close(call("chunk_normalize"), sdpa, rtol=1e-10, atol=1e-12)
    from atlaslib.core import random_qkv
    q, k, v = random_qkv(2, 3, 33, 8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    scores = torch.exp(q @ k.mT).tril()
    torch.testing.assert_close(call("chunk"), scores @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sdpa, (scores @ v) / scores.sum(-1, keepdim=True), rtol=1e-10, atol=1e-12)


def test_case_backends_default_to_the_case_and_keep_triton_for_cuda():
    case = bench.BenchCase("_x", None, backends=("sdpa", "chunk", "triton", "triton_normalize"), reference="sdpa")
    assert bench.case_backends(case, None, "cpu") == ["sdpa", "chunk"]
    assert bench.case_backends(case, None, "cuda") == ["sdpa", "chunk", "triton", "triton_normalize"]
    assert bench.case_backends(case, ["chunk", "recurrent", "sdpa"], "cpu") == ["chunk", "sdpa"]


def test_deep_kernel_flops_count_the_visible_span():
    """The masked chunk form's FLOPs: every query block times the keys from its oldest visible one to
    its last row, 2 (K + V) each; the span counted here from ``visible``'s mask of every block."""
    from atlaslib.deep.bench_cases import kernel_flops
    from atlaslib.deep.chunk import visible
    s = bench.BenchShape(2, 3, 37, 4, 5, chunk_size=8)
    for window in (None, 5, 100):
        pairs = 0
        for start in range(0, s.T, s.chunk_size):
            rows = torch.arange(start, min(start + s.chunk_size, s.T))
            seen = visible(rows, torch.arange(s.T), window).any(0).nonzero()
            pairs += len(rows) * (int(seen.max()) - int(seen.min()) + 1)
        assert kernel_flops(window)(s) == s.B * s.H * pairs * 2 * (s.K + s.V)
        assert kernel_flops(window, passes=2)(s) == 2 * kernel_flops(window)(s)


CACHING_ROWS = ("mc_gdn_c64", "mc_gdn_c256", "mc_gdn_log")


def test_caching_rows_time_the_chunk_form_and_note_the_loop():
    """Chapter 7's rows: the chunk form per segmentation in the table (no triton on CPU), the loop
    against it in the note, timed on the same tokens."""
    rows = bench.run_benchmarks(list(CACHING_ROWS), [12], B=1, H=2, K=4, V=3, chunk_size=4, warmup=0, repeats=1,
                                progress=False)
    assert [(r["model"], r["backend"], r["speedup"]) for r in rows] == [(m, "chunk", 1.0) for m in CACHING_ROWS]
    assert all(r["time_ms"] > 0 and r["peak_MiB"] > 0 for r in rows)
    notes = bench.case_notes(list(CACHING_ROWS), [12], B=1, H=2, K=4, V=3, chunk_size=4)
    assert len(notes) == 3
    for m, line in zip(CACHING_ROWS, notes):
        assert line.startswith(f"{m} T=12: loop (recurrent) ") and "on all tokens" in line
        assert line.endswith("(loop: one call; chunk: median of 3)")


@pytest.mark.parametrize("segments", [4, "log"])
def test_caching_rows_compute_memory_caching_on_the_first_tokens(segments):
    """The rows' builder on fp64 inputs, with segments shorter than T: the chunk form is the definition,
    and a run on the first n tokens gives the first n outputs (MC is causal), so the note's loop on
    LOOP_T tokens times the same function; the note says when it ran fewer tokens than T."""
    from atlaslib.caching.bench_cases import loop_note, mc_builder
    shape = bench.BenchShape(1, 2, 33, 6, 5, dtype=torch.float64, chunk_size=4)
    call = mc_builder(segments)(shape, torch.Generator().manual_seed(3))
    chunk = call("chunk")
    assert chunk.shape == (1, 2, 33, 5)
    torch.testing.assert_close(call("recurrent"), chunk, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(call("recurrent", 20), chunk[:, :, :20], rtol=1e-10, atol=1e-12)
    assert "on the first 20 tokens only" in loop_note(segments, 20)(shape)
    assert "on all tokens" in loop_note(segments, 33)(shape)


def test_caching_note_is_the_loop_time_over_the_median_chunk_time(monkeypatch):
    """The note's ratio is loop / chunk (how many times the loop is slower), with the chunk's median of 3:
    stand-in times of 0.01, 0.03 and 0.02 s for the chunk form and 1 s for the loop give 1 / 0.02 = 50x."""
    import atlaslib.caching.bench_cases as cases
    times = iter([0.01, 0.03, 0.02, 1.0])                                   # chunk x 3, then the loop
    monkeypatch.setattr(cases, "seconds", lambda fn, device: next(times))
    note = cases.loop_note(4, 1024)(bench.BenchShape(1, 2, 12, 4, 3, chunk_size=4))
    assert note.startswith("loop (recurrent) 1 s vs chunk 0.02 s on all tokens: ") and f": {1 / 0.02:.1f}x " in note


def test_chapter_1_2_rows_hand_their_gate_and_chunk_size_to_the_library(monkeypatch):
    """Each row of chapters 1-2 times the model its name says, at the chunk length asked: the gate reaching
    ``linear_attention`` / ``delta_rule`` is none, one per token [B, H, T] or one per key channel [B, H, T, K]
    (KDA and GLA), and ``chunk_size`` is the shape's."""
    import atlaslib.delta.bench_cases as delta_cases
    import atlaslib.linear.bench_cases as linear_cases
    bench.load_chapter_cases()
    seen = {}
    for module, name in ((linear_cases, "linear_attention"), (delta_cases, "delta_rule")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **kw: seen.update(kw) or real(*a, **kw))
    B, H, T, K = 1, 2, 12, 8
    shape = bench.BenchShape(B, H, T, K, 4, chunk_size=4)
    gates = {"linear": None, "linear_scalar_gate": (B, H, T), "linear_channel_gate": (B, H, T, K),
             "deltanet": None, "gated_deltanet": (B, H, T), "kda": (B, H, T, K)}
    for name, gate in gates.items():
        seen.clear()
        bench.BENCH_CASES[name].builder(shape, torch.Generator().manual_seed(0))("chunk")
        alpha = seen.get("alpha")
        assert (None if alpha is None else tuple(alpha.shape)) == gate, name
        assert seen.get("chunk_size") == 4, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_case_runs_in_half_precision(dtype):
    """``--dtype bfloat16`` (or float16) must reach every registered row: each case's builder and each of
    its CPU backends, once, at a tiny shape. (Chapter 7's rows once cast their log-gates to bf16, which
    ``memory_caching`` refuses.) The outputs keep the activation dtype and are finite."""
    bench.load_chapter_cases()
    shape = bench.BenchShape(1, 2, 12, 8, 8, dtype=dtype, chunk_size=4)
    for name, case in bench.BENCH_CASES.items():
        if name.startswith("_"):
            continue
        call = case.builder(shape, torch.Generator().manual_seed(0))
        for backend in bench.case_backends(case, None, "cpu"):
            out = call(backend)
            out = out[0] if isinstance(out, tuple) else out
            assert out.dtype == dtype and torch.isfinite(out.float()).all(), (name, backend)


# ---------------------------------------------------------------------------- bench --vs fla

FLA_SKIP = f"fla-core is not installed (benchmark-only: {bench_fla.INSTALL})"
FLA_MODELS = ["linear", "linear_scalar_gate", "linear_channel_gate", "deltanet", "gated_deltanet", "kda"]


def test_vs_fla_cpu_command(capsys, tmp_path):
    """``python -m atlaslib.bench --vs fla`` on a CPU, small: our chunk forms and per-token loops against fla's
    own PyTorch references, an implementation independent of ours (fp32: rounding only)."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    import json
    path = tmp_path / "fla.json"
    bench.main(["--vs", "fla", "--T", "64", "--B", "2", "--H", "3", "--K", "16", "--V", "8", "--repeats", "1",
                "--warmup", "0", "--json", str(path)])
    out = capsys.readouterr().out
    assert "fla_ms" in out and "rel_err" in out and f"wrote {path}" in out
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert [line.split("] ")[1].split()[0] for line in progress] == FLA_MODELS
    assert all(": forward ours " in p for p in progress)
    doc = json.loads(path.read_text())
    assert doc["complete"] is True
    assert doc["fla-core"] == "0.6.0" and doc["torch"] == torch.__version__ and doc["date"]
    assert doc["shapes"] == [{"B": 2, "H": 3, "T": 64, "K": 16, "V": 8, "dtype": "float32"}]
    rows = {r["model"]: r for r in doc["rows"]}
    assert list(rows) == FLA_MODELS
    for r in rows.values():
        assert r["ours"] == "chunk" and r["fla"].startswith(("naive", "delta_rule_chunkwise")), r
        assert r["rel_err"] < 2e-6 and r["loop_rel_err"] < 2e-6, r
        assert r["ours_ms"] > 0 and r["fla_ms"] > 0 and r["speedup"] == pytest.approx(r["fla_ms"] / r["ours_ms"])
        assert r["ours_MiB"] > 0 and r["fla_MiB"] > 0


def test_vs_fla_stopped_early_leaves_the_rows_it_measured(tmp_path):
    """A run stopped after its second row (a time limit on a GPU machine) leaves a JSON file with those two
    rows, marked incomplete."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    import json
    from atlaslib import bench_fla
    path, lines = tmp_path / "fla.json", []

    def out(line):
        lines.append(line)
        if sum(x.startswith("[") for x in lines) == 2:             # two rows measured
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        bench_fla.run("cpu", shapes=[bench_fla.Shape(1, 2, 64, 8, 4)], models=FLA_MODELS[:4], warmup=0, repeats=1,
                      json_path=path, out=out)
    doc = json.loads(path.read_text())
    assert doc["complete"] is False and [r["model"] for r in doc["rows"]] == FLA_MODELS[:2]
    assert all(r["wall_s"] > 0 and r["rel_err"] < 2e-6 for r in doc["rows"])


def test_kernel_times_finds_the_operators_a_call_runs():
    """``kernel_times`` on a CPU: a call that runs two matrix products and one exponential per call is seen as
    such (launches per call), sorted by time, with the sum over every operator last."""
    from atlaslib.bench_fla import kernel_times
    a = torch.randn(256, 256)
    rows = kernel_times(lambda: torch.mm(torch.mm(a, a), a).exp(), "cpu", calls=2, top=50)
    by_name = {r["kernel"]: r for r in rows[:-1]}
    assert by_name["aten::mm"]["launches"] == 2 and by_name["aten::exp"]["launches"] == 1
    assert [r["ms"] for r in rows[:-1]] == sorted((r["ms"] for r in rows[:-1]), reverse=True)
    assert rows[-1]["kernel"] == f"all ({len(rows) - 1})"
    assert rows[-1]["ms"] == pytest.approx(sum(r["ms"] for r in rows[:-1]))
    assert kernel_times(lambda: torch.mm(a, a), "cpu", top=1)[0]["kernel"] == "aten::mm"


def test_vs_fla_profile_on_a_cpu(capsys):
    """``--vs fla --profile``: after the table, each row's forward operators on both sides."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    bench.main(["--vs", "fla", "--T", "64", "--B", "1", "--H", "2", "--K", "16", "--V", "8", "--repeats", "1",
                "--warmup", "0", "--models", "linear", "kda", "--profile"])
    out = capsys.readouterr().out
    profiles = out.split("Where each forward's time goes")[1]
    for model in ("linear", "kda"):
        block = profiles.split(f"{model} float32 B=1 H=2 T=64 K=16 V=8, forward")[1].split("\n\n")[0]
        sides = [line.split()[0] for line in block.splitlines()[3:]]
        assert sides[0] == "ours" and sides[-1] == "fla" and set(sides) == {"ours", "fla"}
        assert sum(line.split()[1].startswith("all") for line in block.splitlines()) == 2


def test_vs_fla_without_fla_says_how_to_install(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "fla", None)                # import fla -> ImportError
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--vs", "fla"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and bench_fla.INSTALL in err


def test_the_install_line_names_the_pins_of_requirements_fla():
    """The one line printed without fla names requirements-fla.txt's pins (an installed copy has no such file)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    pins = {line.split("#")[0].strip() for line in (root / "requirements-fla.txt").read_text().splitlines()} - {""}
    assert bench_fla.INSTALL.startswith("pip install --no-deps ")
    assert set(bench_fla.INSTALL.split()[3:]) == pins


def _fake_fla_chunk_ops():
    """Stand-ins for fla's CUDA ops, with their signatures, built on fla's per-token references: each checks
    the conventions the benchmark must pass (layout [B, T, H, K], scale 1, every optional transform off)."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.kda.naive import naive_recurrent_kda
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
    seen = []

    def check(name, q, k, v, scale, initial_state, output_final_state, g=None, beta=None, **flags):
        seen.append(name)
        B, T, H, K = q.shape
        assert k.shape == q.shape and v.shape[:3] == (B, T, H) and scale == 1.0
        assert initial_state is None and output_final_state is False
        assert not any(flags.values()), flags                      # l2-norm, normalize, in-kernel gates: off
        if g is not None:
            assert g.dtype == torch.float32 and g.shape[:3] == (B, T, H) and (g <= 0).all()
        if beta is not None:
            assert beta.shape == (B, T, H)

    def linear(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True):
        check("linear", q, k, v, scale, initial_state, output_final_state, normalize=normalize)
        g = torch.zeros(q.shape[:3])
        return naive_recurrent_simple_gla(q, k, v, g, scale=scale, output_final_state=False)

    def simple_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False):
        check("simple_gla", q, k, v, scale, initial_state, output_final_state, g=g)
        return naive_recurrent_simple_gla(q, k, v, g, scale=scale, output_final_state=False)

    def gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
        check("gla", q, k, v, scale, initial_state, output_final_state, g=g)
        assert g.shape == q.shape
        return naive_recurrent_gla(q * q.shape[-1] ** 0.5, k, v, g)                  # the reference scales by K^-0.5

    def delta(q, k, v, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False):
        assert q.dtype != torch.float32                                             # as fla's chunk_delta_rule
        check("delta", q, k, v, scale, initial_state, output_final_state, beta=beta, l2=use_qk_l2norm_in_kernel)
        return naive_recurrent_gated_delta_rule(q, k, v, beta, torch.zeros(beta.shape), scale=scale)

    def gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False):
        check("gdn", q, k, v, scale, initial_state, output_final_state, g=g, beta=beta,
              l2=use_qk_l2norm_in_kernel, sigmoid=use_beta_sigmoid_in_kernel)
        return naive_recurrent_gated_delta_rule(q, k, v, beta, g, scale=scale)

    def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False):
        check("kda", q, k, v, scale, initial_state, output_final_state, g=g, beta=beta, l2=use_qk_l2norm_in_kernel,
              gate=use_gate_in_kernel, sigmoid=use_beta_sigmoid_in_kernel)
        assert g.shape == q.shape
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale)

    from atlaslib.bench_fla import FLA_CHUNK
    fakes = dict(zip(FLA_CHUNK.values(), (linear, simple_gla, gla, delta, gdn, kda)))
    return fakes, seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vs_fla_cuda_path_on_fakes(dtype, tmp_path):
    """The CUDA side's pure-Python parts on a CPU: arguments and layouts handed to fla's chunk ops (stand-ins that
    check them and compute fla's reference), forward + backward, the table and the JSON file, with fake timings."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    import json
    from atlaslib import bench_fla
    fakes, seen = _fake_fla_chunk_ops()
    shape = bench_fla.Shape(2, 3, 20, 8, 4, dtype)
    times = iter(range(1, 1000))
    timer = lambda fns, *, warmup, repeats: {name: float(next(times)) for name in fns}      # noqa: E731
    rows = bench_fla.compare(bench_fla.MODELS, shape, impl="chunk", backend="chunk", backward=True, timer=timer,
                             peak=lambda fn, device: 1.5, fns=fakes)
    fp32 = dtype == "float32"
    # each op called twice (the fake timer and peak call nothing): the output, then the gradients compared
    called = ["linear", "simple_gla", "gla", "gdn" if fp32 else "delta", "gdn", "kda"]
    assert seen == [name for name in called for _ in range(2)]
    assert [r["model"] for r in rows] == FLA_MODELS
    for r in rows:
        assert r["rel_err"] < (2e-6 if fp32 else 2e-2), r
        assert r["speedup"] == r["fla_ms"] / r["ours_ms"] and r["fla_ms"] == r["ours_ms"] + 1
        assert r["fwdbwd_speedup"] == r["fla_fwdbwd_ms"] / r["ours_fwdbwd_ms"] and r["ours_MiB"] == 1.5
        assert r["grad_rel_err"] < (1e-5 if fp32 else 5e-2), r          # gradients against fla's reference
        assert r["ours_fwdbwd_MiB"] == r["fla_fwdbwd_MiB"] == 1.5
        assert ("note" in r) == (fp32 and r["model"] == "deltanet")
    table = bench_fla.format_rows(rows).splitlines()
    assert table[0].split()[:8] == ["model", "dtype", "B", "H", "T", "K", "V", "fla"]
    assert "fwdbwd_speedup" in table[0] and len(table) == 2 + len(rows)
    doc = bench_fla.write_json(tmp_path / "g.json", rows, [shape], {"card": "fake"}, device="cuda")
    assert json.loads((tmp_path / "g.json").read_text()) == json.loads(json.dumps(doc))
    assert doc["card"] == "fake" and doc["dtypes"] == [dtype] and len(doc["rows"]) == 6
    # the two passes of ``run``: forward columns alone, then forward + backward alone, same numbers
    times = iter(range(1, 1000))
    kw = dict(impl="chunk", backend="chunk", timer=timer, peak=lambda fn, device: 1.5, fns=fakes)
    (fwd,) = bench_fla.compare(["kda"], shape, backward=False, **kw)
    (bwd,) = bench_fla.compare(["kda"], shape, forward=False, backward=True, **kw)
    assert "ours_fwdbwd_ms" not in fwd and "rel_err" not in bwd and "ours_ms" not in bwd
    assert fwd["rel_err"] == rows[-1]["rel_err"] and bwd["grad_rel_err"] == rows[-1]["grad_rel_err"]


def test_cuda_event_times_interleave_and_take_medians(monkeypatch):
    """The CUDA timer on a CPU with stand-in events: warm-up rounds untimed, then one call of each function per
    round, each bracketed by its own pair of events, and the median of each function's elapsed times."""
    from atlaslib import bench_fla
    clock, order = [0.0], []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    costs = {"ours": iter([9, 9, 1.0, 5.0, 2.0]), "fla": iter([9, 9, 3.0, 3.0, 30.0])}

    def fn(name):
        def call():
            order.append(name)
            clock[0] += next(costs[name])
        return call
    times = bench_fla.cuda_event_times({"ours": fn("ours"), "fla": fn("fla")}, warmup=2, repeats=3)
    assert order == ["ours", "fla"] * 5
    assert times == {"ours": 2.0, "fla": 3.0}


def test_fla_pins_are_exact_and_installed_by_the_venv():
    """requirements-fla.txt pins exact versions (fla-core at the version the benchmark names), and the Makefile's
    venv installs it with --no-deps (so torch and triton keep their pins) and reinstalls when it changes."""
    from pathlib import Path

    from atlaslib.bench_fla import FLA_VERSION
    root = Path(__file__).resolve().parents[1]
    pins = [line.split("#")[0].strip() for line in (root / "requirements-fla.txt").read_text().splitlines()]
    pins = [p for p in pins if p]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", p) for p in pins), pins
    assert f"fla-core=={FLA_VERSION}" in pins and not any(p.startswith(("torch==", "triton==")) for p in pins)
    make = (root / "Makefile").read_text()
    rule = re.search(r"^\$\(STAMP\):([^\n]*)\n((?:\t[^\n]*\n)+)", make, flags=re.M)
    assert rule and "requirements-fla.txt" in rule.group(1).split()
    assert "--no-deps -r requirements-fla.txt" in rule.group(2)


def test_vs_fla_records_a_refused_backward_and_times_ours_alone():
    """fla raises in some backward passes (gated ones on Hopper under Triton < 3.7.1): the row keeps our
    forward + backward time and says why fla's is missing, instead of the whole table failing."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    from atlaslib import bench_fla
    fakes, _ = _fake_fla_chunk_ops()

    class Refuse(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("this card and Triton give wrong gradients here\nsecond line")
    path = bench_fla.FLA_CHUNK["linear_scalar_gate"]
    original = fakes[path]
    fakes[path] = lambda *a, **kw: tuple(Refuse.apply(o) if torch.is_tensor(o) else o for o in original(*a, **kw))
    timer = lambda fns, *, warmup, repeats: {name: 2.0 for name in fns}      # noqa: E731
    (row,) = bench_fla.compare(["linear_scalar_gate"], bench_fla.Shape(1, 2, 20, 8, 4, "float32"), impl="chunk",
                               backend="chunk", backward=True, timer=timer, peak=lambda fn, device: 1.5, fns=fakes)
    assert row["ours_fwdbwd_ms"] == 2.0 and row["ours_fwdbwd_MiB"] == 1.5 and row["speedup"] == 1.0
    assert "fla_fwdbwd_ms" not in row and "grad_rel_err" not in row and "fwdbwd_speedup" not in row
    assert row["note"] == "fla's backward refused: this card and Triton give wrong gradients here"
    assert "refused" in bench_fla.format_rows([row])


def fake_compare(models, s, *, forward=True, backward=None, **kw):
    """``bench_fla.compare`` without a GPU: one row of made-up measurements for the first model."""
    from atlaslib import bench_fla
    row = {"model": models[0], **bench_fla.asdict(s), "wall_s": 1.0}
    if forward:
        row.update(ours_ms=1.0, fla_ms=2.0, speedup=2.0, rel_err=1e-6, ours_MiB=1.0, fla_MiB=1.0)
    if backward:
        row.update(ours_fwdbwd_ms=3.0, fla_fwdbwd_ms=3.0, fwdbwd_speedup=1.0, grad_rel_err=1e-6,
                   ours_fwdbwd_MiB=1.0, fla_fwdbwd_MiB=1.0, fwdbwd_wall_s=1.0)
    return [row]


@pytest.mark.parametrize("tf32", [False, True])
def test_vs_fla_says_how_our_fp32_products_were_made(tf32, monkeypatch, tmp_path):
    """On CUDA the fp32 rows compare our exact products with fla's TF32 ones unless ATLASLIB_TF32=1: the line
    under the table and the JSON's "fp32_dot" say which, as the kernels read it (``core.kernels.precision``).
    The measuring is stood in for (no GPU): only what ``run`` reports about it is checked."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    import json
    from atlaslib import bench_fla
    if tf32:
        monkeypatch.setenv("ATLASLIB_TF32", "1")
    else:
        monkeypatch.delenv("ATLASLIB_TF32", raising=False)

    monkeypatch.setattr(bench_fla, "compare", fake_compare)
    lines, path = [], tmp_path / "gpu.json"
    bench_fla.run("cuda", shapes=[bench_fla.Shape(1, 2, 64, 8, 4, "float32")], models=["linear"],
                  json_path=path, out=lines.append)
    said = [line for line in lines if line.startswith("fp32 rows:")]
    assert len(said) == 1 and ("TF32 (ATLASLIB_TF32=1)" if tf32 else "exact fp32 (ieee") in said[0], lines
    assert json.loads(path.read_text())["fp32_dot"]["ours"] == ("tf32" if tf32 else "ieee")


def test_relative_error_divides_by_the_reference():
    from atlaslib.bench_fla import relative_error
    r = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    assert relative_error(2 * r, r) == pytest.approx(1.0, rel=1e-12)          # ||2r - r|| / ||r||
    assert relative_error(r, 2 * r) == pytest.approx(0.5, rel=1e-12)          # ||r - 2r|| / ||2r||


def test_vs_fla_loop_column_is_our_per_token_loop_against_fla():
    """On a CPU, loop_rel_err is our per-token loop (backend "recurrent") against fla's reference, both computed
    here on the row's inputs: not the chunk form compared a second time."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    from atlaslib import bench_fla
    from atlaslib.delta import delta_rule
    s = bench_fla.Shape(1, 2, 64, 16, 8)
    x = bench_fla.make_inputs("deltanet", s)
    fla_fn, _, _ = bench_fla.fla_call("deltanet", "naive", torch.float32)
    ref = fla_fn(bench_fla.fla_inputs("deltanet", x, "naive")).double()
    loop = delta_rule(x["q"], x["k"], x["v"], x["beta"], backend="recurrent")[0].double()
    timer = lambda fns, *, warmup, repeats: {name: 1.0 for name in fns}      # noqa: E731
    (row,) = bench_fla.compare(["deltanet"], s, timer=timer, peak=lambda fn, device: 1.0)
    assert row["loop_rel_err"] == pytest.approx(((loop - ref).norm() / ref.norm()).item(), rel=1e-9)


def test_vs_fla_memory_columns_measure_their_own_side():
    """fla_MiB and fla_fwdbwd_MiB are the peaks of fla's calls, ours_* of ours: a stand-in peak reports 1 when
    the function it measures calls fla's op (counted by a wrapper around the stand-in op) and 0 otherwise."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    from atlaslib import bench_fla
    fakes, _ = _fake_fla_chunk_ops()
    path, calls = bench_fla.FLA_CHUNK["linear"], [0]
    original = fakes[path]

    def counted(*a, **kw):
        calls[0] += 1
        return original(*a, **kw)
    fakes[path] = counted

    def peak(fn, device):
        before = calls[0]
        fn()
        return float(calls[0] - before)
    timer = lambda fns, *, warmup, repeats: {name: 2.0 for name in fns}      # noqa: E731
    (row,) = bench_fla.compare(["linear"], bench_fla.Shape(1, 2, 20, 8, 4, "float32"), impl="chunk",
                               backend="chunk", backward=True, timer=timer, peak=peak, fns=fakes)
    assert (row["ours_MiB"], row["fla_MiB"], row["ours_fwdbwd_MiB"], row["fla_fwdbwd_MiB"]) == (0.0, 1.0, 0.0, 1.0)


@pytest.mark.parametrize("device, repeats", [("cuda", 10), ("cpu", 3)])
def test_vs_fla_times_10_rounds_on_cuda_and_3_on_a_cpu_by_default(monkeypatch, tmp_path, device, repeats):
    """Without ``repeats``, ``run`` measures 10 CUDA-event rounds on a GPU and 3 on a CPU (as ``--repeats``'s help
    says), and the JSON file records the count used. The measuring is stood in for (no GPU)."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    import json
    from atlaslib import bench_fla
    seen = []
    monkeypatch.setattr(bench_fla, "compare", lambda *a, **kw: seen.append(kw["repeats"]) or fake_compare(*a, **kw))
    path = tmp_path / "r.json"
    bench_fla.run(device, shapes=[bench_fla.Shape(1, 2, 64, 8, 4, "float32")], models=["linear"], json_path=path,
                  out=lambda line: None)
    assert seen and set(seen) == {repeats}
    assert json.loads(path.read_text())["repeats"] == repeats


def test_grad_rel_err_is_the_largest_over_the_inputs():
    """An fla stand-in whose gradient of v is twice the true one (same output): its v-gradient is off by 1/2
    against ours (||g - 2g|| / ||2g||), the others agree, and the row reports the largest, 1/2."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    from atlaslib import bench_fla
    fakes, _ = _fake_fla_chunk_ops()
    path = bench_fla.FLA_CHUNK["linear"]
    original = fakes[path]
    fakes[path] = lambda q, k, v, **kw: original(q, k, v + (v - v.detach()), **kw)
    timer = lambda fns, *, warmup, repeats: {name: 2.0 for name in fns}      # noqa: E731
    (row,) = bench_fla.compare(["linear"], bench_fla.Shape(1, 2, 20, 8, 4, "float32"), impl="chunk",
                               backend="chunk", backward=True, timer=timer, peak=lambda fn, device: 1.5, fns=fakes)
    assert row["rel_err"] < 2e-6
    assert row["grad_rel_err"] == pytest.approx(0.5, abs=1e-5)


def test_kernel_times_are_per_call_and_the_total_covers_every_operator(monkeypatch):
    """With a stand-in profiler reporting totals over 3 calls (6, 3 and 1.5 ms; 3, 6 and 3 launches): per call
    2, 1 and 0.5 ms, 1, 2 and 1 launches; with top=2 the "all (3)" row still sums all three."""
    from types import SimpleNamespace

    import torch.profiler
    from atlaslib.bench_fla import kernel_times
    events = [SimpleNamespace(key=k, self_cpu_time_total=us, count=n)
              for k, us, n in [("b", 3000.0, 6), ("a", 6000.0, 3), ("c", 1500.0, 3), ("idle", 0.0, 9)]]

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return events
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    calls = []
    rows = kernel_times(lambda: calls.append(1), "cpu", calls=3, top=2)
    assert len(calls) == 4                                                      # one untimed, then 3
    assert rows == [{"kernel": "a", "ms": 2.0, "launches": 1.0}, {"kernel": "b", "ms": 1.0, "launches": 2.0},
                    {"kernel": "all (3)", "ms": 3.5, "launches": 4.0}]


def test_fla_table_and_json_of_mixed_dtypes(tmp_path):
    """Speedups print as "1.23x" with two decimals; the JSON lists every shape's dtype."""
    from atlaslib import bench_fla
    shapes = [bench_fla.Shape(1, 2, 64, 8, 4, "bfloat16"), bench_fla.Shape(1, 2, 64, 8, 4, "float32")]
    rows = [{"model": "linear", **bench_fla.asdict(s), "fla": "chunk_linear_attn", "ours_ms": 1.0, "fla_ms": fla,
             "speedup": fla / 1.0, "rel_err": 1e-3} for s, fla in zip(shapes, [1.2345, 0.5])]
    lines = bench_fla.format_rows(rows).splitlines()
    column = lines[0].split().index("speedup")
    assert [line.split()[column] for line in lines[2:]] == [f"{r['speedup']:.2f}x" for r in rows] == ["1.23x", "0.50x"]
    doc = bench_fla.write_json(tmp_path / "f.json", rows, shapes, {"card": "fake"})
    assert doc["dtypes"] == ["bfloat16", "float32"]


@pytest.mark.parametrize("dtypes", [("bfloat16", "float32"), ("float32", "bfloat16"), ("bfloat16",)])
def test_vs_fla_notes_fp32_products_when_any_shape_is_fp32(dtypes, monkeypatch):
    """The line about our fp32 products is printed when some shape is fp32, even among bf16 ones, and only then."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    from atlaslib import bench_fla

    monkeypatch.setattr(bench_fla, "compare", fake_compare)
    lines = []
    bench_fla.run("cuda", shapes=[bench_fla.Shape(1, 2, 64, 8, 4, d) for d in dtypes], models=["linear"],
                  out=lines.append)
    said = [line for line in lines if line.startswith("fp32 rows:")]
    assert len(said) == ("float32" in dtypes)


def test_the_memory_profiler_prints_nothing_of_its_own():
    """Kineto logged a "USDT: ... profiler_start/stop" pair on stderr for every profiled row."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    run = subprocess.run([sys.executable, "-m", "atlaslib.bench", *SMALL, "--backends", "chunk"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "linear" in run.stdout, run.stderr
    assert "profiler_start" not in run.stderr and "USDT" not in run.stderr, run.stderr


def test_small_speedups_keep_two_significant_digits():
    """A backend 25x slower than its reference reads 0.04x, not 0.0x."""
    rows = [{"model": "m", "backend": b, "time_ms": t, "speedup": s} for b, t, s in
            (("recurrent", 1.0, 1.0), ("triton", 25.0, 0.04), ("chunk", 0.5, 2.0))]
    lines = bench._table(rows).splitlines()
    column = lines[0].split().index("speedup")
    assert [line.split()[column] for line in lines[2:]] == ["1.0x", "0.04x", "2.0x"]


def test_the_setting_line_needs_no_triton(monkeypatch):
    """The plain bench runs without Triton (its triton rows are then left out): so does its first line."""
    import sys

    from atlaslib import bench_fla
    monkeypatch.setitem(sys.modules, "triton", None)           # import triton raises ImportError
    env = bench_fla.environment()
    assert env["triton"] is None and env["threads"] >= 1
    line = bench.setting_line(dict(device="cpu", chunk_size=64, repeats=3, warmup=1))
    assert line.startswith("# CPU ") and "triton None" in line, line


def test_a_triton_row_that_ran_the_chunk_form_says_so(monkeypatch):
    """A card that refuses a kernel's tiles gets the chunk form with a warning (core.dispatch): the row that
    times it names what ran, instead of reporting the chunk form's time as the kernel's."""
    import warnings

    from triton.runtime.errors import OutOfResources

    import atlaslib.linear.kernel as kernel

    def refuse(*a, **kw):
        raise OutOfResources(300000, 232448, "shared memory")
    monkeypatch.setattr(kernel, "linear_attention_autograd", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = bench.run_benchmarks(["linear"], [16], backends=["chunk", "triton"], H=1, K=8, V=8,
                                    warmup=0, repeats=1, progress=False)
    assert [r["backend"] for r in rows] == ["chunk", "triton (ran chunk: kernel did not fit)"]


def test_the_table_names_what_each_speedup_divides(capsys):
    """speedup = the time of the speedup_vs backend / this row's: the loop for most cases, sdpa for deep_vs_sdpa."""
    bench.main(["--T", "16", "--H", "1", "--K", "8", "--V", "8", "--models", "linear", "deep_vs_sdpa",
                "--repeats", "1", "--warmup", "0", "--no-progress"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["model", "backend"])
    column = lines[head].split().index("speedup_vs")
    rows = [line.split() for line in lines[head + 2:] if line.strip() and not line.startswith("speedup")]
    assert {(r[0], r[-1]) for r in rows} == {("linear", "recurrent"), ("deep_vs_sdpa", "sdpa")}, rows
    assert column == len(lines[head].split()) - 1
    assert "speedup = the time of the speedup_vs backend / this row's time" in out


def test_vs_fla_header_names_the_machine_and_the_statistic():
    pytest.importorskip("fla", reason=FLA_SKIP)
    lines = []
    bench_fla.run("cpu", shapes=[bench_fla.Shape(1, 1, 64, 8, 4)], models=["linear"], warmup=0, repeats=1,
                  out=lines.append)
    env = bench_fla.environment()
    assert env["cpu"] in lines[0] and f"{env['threads']} threads" in lines[0], lines[0]
    assert "median of 1 wall-clock timings, the two sides interleaved, after 0 warm-up" in lines[0], lines[0]


@pytest.mark.parametrize("model", ["linear_channel_gate", "deltanet"])
def test_fla_references_get_their_scaled_query_outside_the_timed_call(model):
    """fla's references with a fixed K^-0.5 scale are handed q * K^0.5, made once by fla_inputs."""
    pytest.importorskip("fla", reason=FLA_SKIP)
    seen = []
    fakes = {bench_fla.FLA_NAIVE[model]: lambda q, *a, **kw: seen.append(q) or (q, None)}
    call, *_ = bench_fla.fla_call(model, "naive", torch.float32, fns=fakes)
    x = bench_fla.make_inputs(model, bench_fla.Shape(1, 1, 64, 8, 4))
    f = bench_fla.fla_inputs(model, x, "naive")
    call(f)
    assert seen[0] is f["q"]
    torch.testing.assert_close(bench_fla.from_fla(f["q"]) if model != "deltanet" else f["q"], x["q"] * 8 ** 0.5)


def test_fla_fp32_deltanet_gets_its_zero_gate_made_once():
    pytest.importorskip("fla", reason=FLA_SKIP)
    seen = []
    fakes = {bench_fla.FLA_CHUNK["gated_deltanet"]: lambda q, k, v, g, beta, **kw: seen.append(g) or (v, None)}
    call, *_ = bench_fla.fla_call("deltanet", "chunk", torch.float32, fns=fakes)
    f = bench_fla.fla_inputs("deltanet", bench_fla.make_inputs("deltanet", bench_fla.Shape(1, 1, 16, 8, 4)), "chunk")
    call(f), call(f)
    assert seen[0] is seen[1] and not seen[0].any()
