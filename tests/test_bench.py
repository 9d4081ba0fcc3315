"""Smoke tests of ``python -m atlaslib.bench`` (no timing assertions) and of its memory meter."""
import pytest
import torch

from atlaslib import bench

COLUMNS = ["model", "backend", "device", "dtype", "B", "H", "T", "K", "V", "time_ms", "peak_MiB", "speedup"]


def test_table_prints_all_columns(capsys):
    bench.main(["--quick", "--T", "20", "--B", "1", "--H", "2", "--K", "6", "--V", "5", "--no-progress"])
    table, notes = capsys.readouterr().out.strip().split("\n\n")
    lines = table.splitlines()
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
    lines = capsys.readouterr().out.strip().splitlines()
    assert "MiB_per_1k_tokens" in lines[0].split()
    assert len(lines) == 4 and all(line.split()[1] == "chunk" for line in lines[2:])


def test_peak_memory_sees_a_known_allocation():
    """A call that holds a 4 MiB buffer and a 2 MiB temporary peaks at 6 MiB and returns 4 MiB."""
    def fn():
        out = torch.ones(2**20)                 # 4 MiB, returned
        tmp = torch.ones(2**19)                 # 2 MiB, freed before returning
        out += tmp.sum()
        del tmp
        return out
    assert bench.peak_memory_mib(fn, "cpu") == pytest.approx(6.0, abs=0.1)


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
