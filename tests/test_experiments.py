"""The MQAR sweep runner: protocol coverage, resume, shards, the report and reproduction."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atlaslib import experiments as ex
from atlaslib.nn import available_mixers

TWO = ["linear", "swa"]          # two cheap mixers for the real runs


def test_every_registered_mixer_is_in_the_protocol():
    names = {name for _, name, _ in ex.mixer_specs(window=16)}
    assert set(available_mixers()) <= names, f"missing from the protocol: {set(available_mixers()) - names}"
    for size in ex.SIZES:
        assert {c["mixer_name"] for c in ex.grid(size)} >= set(available_mixers())


def test_grid_is_the_product_and_keys_are_unique():
    s = ex.SIZES["small"]
    cells = ex.grid("small")
    assert len(cells) == len(s.tasks) * len(ex.mixer_specs(s.window)) * len(s.lrs) * len(s.seeds)
    assert len({ex.cell_key(c) for c in cells}) == len(cells)
    with pytest.raises(ValueError, match="unknown mixers"):
        ex.grid("small", mixers=["nope"])
    with pytest.raises(ValueError, match="unknown size"):
        ex.grid("huge")


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_shards_partition_the_grid(count):
    cells = ex.grid("paper")
    parts = [ex.shard(cells, i, count) for i in range(count)]
    keys = [ex.cell_key(c) for part in parts for c in part]
    assert sorted(keys) == sorted(ex.cell_key(c) for c in cells)       # every cell once, no cell twice
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(ValueError):
        ex.shard(cells, count, count)


def test_shard_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert ex._parse_shard(None) == (3, 4)
    assert ex._parse_shard("1/2") == (1, 2)
    with pytest.raises(ValueError, match="i/N"):
        ex._parse_shard("1-2")


@pytest.mark.parametrize("argv, message", [
    (["mqar", "--shard", "abc"], "error: --shard wants i/N (e.g. 0/2), got 'abc'"),
    (["mqar", "--shard", "5/2"], "error: --shard 5/2: need 0 <= i < N"),
    (["mqar", "--mixers", "linear,nosuch"], "error: unknown --mixers nosuch; mqar --size tiny has softmax, linear,"),
    (["inversion", "--mixers", "nosuch"], "error: unknown --mixers nosuch; inversion has linear, deltanet,"),
    (["mqar", "--steps", "0"], "error: --steps must be >= 1, got 0"),
    (["mqar", "--device", "foo"], "error: --device 'foo' is not a torch device"),
    (["filler", "--size", "paper"], "error: --size chooses the mqar grid; filler has its own fixed grid"),
    (["mqar", "--merge", "--out", "/nonexistent/x.jsonl"], "error: --merge: no folder /nonexistent"),
    (["mqar", "--out", "/tmp"], "error: --out /tmp is a folder; give a file name"),
])
def test_bad_arguments_are_one_line_usage_errors(capsys, argv, message):
    size = ["--size", "tiny"] if argv[0] == "mqar" else []
    with pytest.raises(SystemExit) as exit_:
        ex.main([*argv, *size, "--list"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.strip().splitlines()[-1], err


def test_a_rank_outside_the_world_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        ex.main(["mqar", "--size", "tiny", "--list"])
    assert exit_.value.code == 2 and "error: RANK/WORLD_SIZE 2/2: need 0 <= i < N" in capsys.readouterr().err


def _record(mixer, seq_len, pairs, lr, seed, acc):
    cell = dict(ex.grid("tiny")[0], mixer=mixer, seq_len=seq_len, num_kv_pairs=pairs, lr=lr, seed=seed)
    return {**cell, "accuracy": acc}


def test_report_keeps_the_best_lr_and_averages_seeds(tmp_path):
    import random
    rng = random.Random(0)
    acc = {(m, p, lr, s): rng.random() for m in ("a", "b") for p in (2, 4) for lr in (1e-3, 1e-2, 1e-1)
           for s in (0, 1, 2)}
    out = tmp_path / "r.jsonl"
    rank1 = tmp_path / "r.rank1.jsonl"           # a shard's file is read as well
    with open(out, "w") as f, open(rank1, "w") as g:
        for i, ((m, p, lr, s), a) in enumerate(acc.items()):
            (f if i % 2 else g).write(json.dumps(_record(m, 16, p, lr, s, a)) + "\n")
    rows = {r["mixer"]: r for r in ex.leaderboard(ex.read_results(str(out)))}
    for m in ("a", "b"):
        for p in (2, 4):
            expected = sum(max(acc[m, p, lr, s] for lr in (1e-3, 1e-2, 1e-1)) for s in (0, 1, 2)) / 3
            assert rows[m][f"T16 kv{p} d16"] == pytest.approx(expected, abs=1e-12)
    text = ex.report(str(out))
    assert "kv2" in text and "kv4" in text and f"{rows['a']['T16 kv2 d16']:.3f}" in text


def test_the_code_fingerprint_follows_the_sources_a_run_depends_on(tmp_path):
    """A run records a fingerprint of the library's code: it changes with any source a run executes (a reordered
    sum moves chaotic runs), not with the exercises or the tools, nor with comments and docstrings."""
    import shutil
    root = tmp_path / "atlaslib"
    shutil.copytree(Path(ex.__file__).parent, root, ignore=shutil.ignore_patterns("__pycache__"))
    before = ex.code_fingerprint(str(root))
    assert before == ex.code_fingerprint()
    for tool in ("grade.py", "bench.py", "exercises/ch01.py", "core/benchcases.py", "delta/bench_cases.py"):
        (root / tool).write_text((root / tool).read_text() + "\n# a comment\n")
        assert ex.code_fingerprint.__wrapped__(str(root)) == before, tool
    chunk = root / "delta" / "chunk.py"
    source = chunk.read_text()
    # text around the code: a comment, a docstring's wording, a blank line
    doc = ast.get_docstring(ast.parse(source), clean=False)
    chunk.write_text(source.replace(doc, doc + " More words.", 1) + "\n\n# a comment\n")
    assert ex.code_fingerprint.__wrapped__(str(root)) == before
    chunk.write_text(source + "\nUNUSED = 1\n")                 # code, even code no run executes
    assert ex.code_fingerprint.__wrapped__(str(root)) != before


def test_a_report_says_when_its_runs_come_from_two_states_of_the_code(tmp_path):
    out = tmp_path / "r.jsonl"
    records = [dict(_record(m, 16, 2, lr, 0, 0.5), code="aaa") for m in ("a", "b") for lr in (1e-3, 1e-2)]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "MIXED CODE" not in ex.report(str(out))
    records[0]["code"] = "bbb"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "MIXED CODE: these runs come from 2 states of the library's code (aaa: 3 runs, bbb: 1 runs)" \
        in ex.report(str(out))
    del records[0]["code"]                              # stored before runs carried a fingerprint
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "unrecorded: 1 runs" in ex.report(str(out))


def test_real_tiny_runs_resume_and_reproduce(tmp_path):
    out = str(tmp_path / "res.jsonl")
    new = ex.sweep("tiny", out, mixers=TWO, steps=3, progress=False)
    assert [r["mixer"] for r in new] == TWO
    lines = [json.loads(x) for x in open(out)]
    assert lines == json.loads(json.dumps(new))
    for r in lines:
        for f in (*ex.KEY_FIELDS, "accuracy", "final_loss", "seconds", "state_size", "params", "torch", "atlaslib",
                  "code"):
            assert f in r, f
        assert r["code"] == ex.code_fingerprint()
        assert 0 <= r["accuracy"] <= 1 and r["final_loss"] > 0 and r["params"] > 0 and r["steps"] == 3

    assert ex.sweep("tiny", out, mixers=TWO, steps=3, progress=False) == []     # nothing re-runs
    with open(out, "a") as f:
        f.write(json.dumps(lines[0])[:40])                                       # a torn line is ignored
    assert ex.sweep("tiny", out, mixers=TWO, steps=3, progress=False) == []
    with open(out, "w") as f:                                                    # drop the first line
        f.write(json.dumps(lines[1]) + "\n" + json.dumps(lines[0])[:40])        # and tear the last
    again = ex.sweep("tiny", out, mixers=TWO, steps=3, progress=False)
    assert [ex.cell_key(r) for r in again] == [ex.cell_key(lines[0])]           # exactly that run
    assert len(open(out).readlines()) == 3 and len(ex.read_results(out)) == 2  # the re-run is readable

    check = ex.reproduce(lines[0], tol=1e-6)
    assert check["ok"] and check["diff"] <= 1e-6
    assert ex.reproduce(lines[0], tol=0.0)["ok"]                 # the same run in the same process: equal
    assert not ex.reproduce(dict(lines[0], accuracy=lines[0]["accuracy"] + 0.5), tol=1e-6)["ok"]


def test_final_loss_is_the_mean_of_the_last_ten_losses(monkeypatch):
    from types import SimpleNamespace
    losses = [float(i * i) for i in range(25)]
    fake = SimpleNamespace(losses=losses, accuracy=0.5, seconds=1.0, state_size=4, n_params=10)
    monkeypatch.setattr(ex, "train_mqar", lambda *a, **k: fake)
    record = ex.run_cell(ex.grid("tiny")[0], progress=False)
    assert record["final_loss"] == pytest.approx(sum(i * i for i in range(15, 25)) / 10)
    assert record["accuracy"] == 0.5


def test_run_cell_trains_on_the_cells_own_data_and_initial_weights(monkeypatch):
    """A cell's data are ``mqar`` with the cell's sizes and filler (seed 2 s for training, 2 s + 1 held out) and its
    model starts from ``torch.manual_seed(s)``: a filler=False cell (the filler study, inversion's random_filler
    knob) that trained on random filler, or a seed-1 cell that started from seed 0's weights, would rerun another
    cell under this one's key. Checked on the data and the weights ``train_mqar`` receives."""
    from types import SimpleNamespace

    from atlaslib.nn import TinyLM
    from atlaslib.tasks import mqar
    seen = {}
    fake = SimpleNamespace(losses=[1.0], accuracy=0.0, seconds=0.0, state_size=0, n_params=0)

    def spy(model, data, **kw):
        seen.update(data=data, weights={k: v.clone() for k, v in model.state_dict().items()})
        return fake
    monkeypatch.setattr(ex, "train_mqar", spy)
    inversion = ex.grid("inversion", mixers=["deltanet"])
    cells = [ex.grid("filler", mixers=["linear"])[0],
             next(c for c in inversion if c["seed"] == 1 and not c["random_filler"]),
             next(c for c in ex.grid("caching", mixers=["gated_deltanet"]) if c["seed"] == 1)]
    assert [c["random_filler"] for c in cells] == [False, False, True]
    for cell in cells:
        ex.run_cell(cell, progress=False)
        s, kw = cell["seed"], dict(random_non_queries=cell["random_filler"])
        sizes = (cell["seq_len"], cell["num_kv_pairs"], cell["vocab_size"])
        want = (*mqar(cell["num_train"], *sizes, seed=2 * s, **kw),
                *mqar(cell["num_test"], *sizes, seed=2 * s + 1, **kw))
        assert len(seen["data"]) == 4 and all(torch.equal(a, b) for a, b in zip(seen["data"], want)), cell["mixer"]
        torch.manual_seed(s)
        ref = TinyLM(cell["vocab_size"], cell["d_model"], cell["n_layers"], cell["mixer_name"], cell["n_heads"],
                     **cell["mixer_kwargs"]).state_dict()
        assert seen["weights"].keys() == ref.keys()
        assert all(torch.equal(seen["weights"][k], ref[k]) for k in ref), (cell["mixer"], s)


def test_the_leaderboard_shows_a_dash_where_a_mixer_has_no_run(tmp_path):
    out = tmp_path / "r.jsonl"
    records = [_record("a", 16, 2, 1e-2, 0, 0.25), _record("a", 16, 4, 1e-2, 0, 0.75),
               _record("b", 16, 2, 1e-2, 0, 0.5)]                  # b has no run with 4 pairs
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = ex.report(str(out)).splitlines()
    assert lines[1].split() == ["mixer", "T16", "kv2", "d16", "T16", "kv4", "d16"]
    assert [line.split() for line in lines[3:5]] == [["a", "0.250", "0.750"], ["b", "0.500", "-"]]
    assert lines[5].startswith("INCOMPLETE: ")            # made-up mixers: none of the grid's runs is here


@pytest.mark.parametrize("size", ["small", "inversion", "caching"])
def test_a_partial_sweep_is_reported_as_incomplete(tmp_path, size):
    """An interrupted sweep (or one run with --mixers) tabulates the runs it has, and says how many of the
    grid's runs are missing and of which mixers; a complete one says nothing of it."""
    records = ex.read_results(str(RESULTS / f"mqar_{size}.jsonl"))
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "INCOMPLETE" not in ex.report(str(out))
    dropped = records[3:8]
    out.write_text("".join(json.dumps(r) + "\n" for r in records[:3] + records[8:]))
    last = ex.report(str(out)).splitlines()[-1]
    assert last.startswith("INCOMPLETE: 5 runs of the grid are missing"), last
    assert set(last.split("of mixers ")[1].split(")")[0].split(", ")) == {r["mixer"] for r in dropped}


def test_tables_refuse_runs_of_two_settings(tmp_path):
    """A trial with another step budget appended to a sweep's file would join its best-of-lr: the tables refuse to
    mix runs that differ in anything but lr, seed and their columns, and say which field differs."""
    records = [_record("a", 16, 2, 1e-2, 0, 0.25), _record("a", 16, 4, 1e-2, 0, 0.75)]
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in [*records, dict(records[0], steps=1, accuracy=0.9)]))
    assert "differ in steps (not only in lr and seed)" in ex.report(str(out))
    with pytest.raises(ValueError, match="differ in steps"):
        ex.seed_table([records[0], dict(records[0], steps=1)])
    assert ex.leaderboard(records)                                       # tasks and lrs alone: one table


def test_a_step_override_needs_its_own_results_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                  # were it accepted, its runs would go to results/ under here
    with pytest.raises(SystemExit) as exit_:
        ex.main(["mqar", "--size", "tiny", "--steps", "3", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "--steps changes the runs' budget: give --out" in err, err


@pytest.mark.parametrize("size, steps, warmup", [
    ("small", 5, 5), ("small", 100, 30), ("paper", 100, 100), ("filler", 3, 3), ("caching", 3, 3), ("inversion", 7, 7),
    ("inversion", 70, 50), ("tiny", 1, 1)])
def test_warmup_never_exceeds_the_steps(size, steps, warmup):
    cells = ex.grid(size, steps=steps)
    assert cells and {(c["steps"], c["warmup"]) for c in cells} == {(steps, warmup)}


def test_command_line_shards_and_report(tmp_path):
    out = str(tmp_path / "cli.jsonl")
    base = [sys.executable, "-m", "atlaslib.experiments", "mqar", "--size", "tiny", "--mixers", ",".join(TWO),
            "--steps", "2", "--out", out, "--no-progress"]
    for i in range(2):
        subprocess.run(base + ["--shard", f"{i}/2"], check=True, capture_output=True)
    files = ex.result_files(out)
    assert [p.rsplit(".", 2)[-2] for p in files] == ["rank0", "rank1"]
    assert sorted(r["mixer"] for r in ex.read_results(out)) == sorted(TWO)
    text = subprocess.run(base + ["--report"], check=True, capture_output=True, text=True).stdout
    assert all(m in text for m in TWO) and "(2 runs" in text
    subprocess.run(base + ["--merge"], check=True, capture_output=True)
    assert len(open(out).readlines()) == 2 and len(ex.read_results(out)) == 2     # merged, not doubled
    assert ex.result_files(out) == [out]                                         # the shard files are gone


def test_inversion_grid_varies_one_knob_at_a_time():
    cells = ex.grid("inversion")
    assert len({ex.cell_key(c) for c in cells}) == len(cells)
    base = ex.INVERSION_BASE
    for c in cells:
        changed = [k for k, v in base.items() if c[k] != v] + (["qk_norm"] if c["mixer_kwargs"].get("qk_norm") else [])
        assert len(changed) <= 1, (c["mixer"], changed)
        assert (c["seq_len"], c["d_model"], c["n_heads"], c["vocab_size"]) == (64, 64, 4, 128)  # chapter 2's setting
    for label, _, _ in ex.INVERSION_MIXERS:                      # every mixer has its base run for every seed
        for seed in ex.CHAPTER2.seeds:
            assert any(c["mixer"] == label and c["seed"] == seed and all(c[k] == v for k, v in base.items())
                       for c in cells)
    assert {c["mixer"] for c in cells if c["mixer_kwargs"].get("qk_norm")} == {"linear+qk_norm"}


@pytest.mark.parametrize("steps", [None, 1, 10, 500, 1000, 2000])
def test_inversion_with_a_step_budget_runs_each_cell_once(steps):
    cells = ex.grid("inversion", steps=steps)
    keys = [ex.cell_key(c) for c in cells]
    assert len(set(keys)) == len(keys)
    assert all(c["warmup"] <= c["steps"] for c in cells)
    if steps is None:
        return
    assert {c["steps"] for c in cells} == {steps}
    assert all(c["warmup"] == min(steps, ex.CHAPTER2.warmup) for c in cells)
    # every run of the study but those varying the budget, now at this budget
    unbudgeted = [c for c in ex.grid("inversion") if c["steps"] == ex.INVERSION_BASE["steps"]]
    assert sorted(keys) == sorted(ex.cell_key(dict(c, steps=steps, warmup=min(steps, c["warmup"])))
                                  for c in unbudgeted)
    assert ex.grid("inversion", mixers=["deltanet"], steps=steps) == [c for c in cells if c["mixer"] == "deltanet"]


def test_inversion_table_has_one_row_per_knob_value():
    records = [dict(c, accuracy=0.5) for c in ex.grid("inversion")]
    conditions = [r["condition"] for r in ex.inversion_table(records)]
    expected = {f"{knob}={v}" for knob, values in ex.INVERSION_KNOBS.items() for v in values}
    assert len(conditions) == len(set(conditions)) == 1 + sum(map(len, ex.INVERSION_KNOBS.values()))
    assert set(conditions) - expected == {"base (1000 steps, lr 1e-2, 8 pairs)"}
    assert expected <= set(conditions)


def test_inversion_table_averages_seeds_per_condition():
    cells = ex.grid("inversion")
    records = [dict(c, accuracy=0.1 * (c["seed"] + 1) + (0.5 if not c["random_filler"] else 0)) for c in cells]
    rows = {r["condition"]: r for r in ex.inversion_table(records)}
    assert rows["random_filler=False"]["deltanet"] == "0.65 (0.60 0.70)"
    assert rows["qk_norm=True"]["linear"] == "0.15 (0.10 0.20)" and rows["qk_norm=True"]["deltanet"] == "-"
    assert rows["lr=0.03"]["gated_deltanet"] == "-"
    assert "random_filler=False" in ex.report.__globals__["format_table"](ex.inversion_table(records))


def test_inversion_table_keeps_the_grids_order_whatever_the_files_order():
    # a sweep in three shards writes each shard's runs to its own file: records arrive out of order
    cells = ex.grid("inversion")
    records = [dict(c, accuracy=0.1 * (c["seed"] + 1)) for c in cells]
    in_order = ex.inversion_table(records)
    by_shard = [r for i in range(3) for r in ex.shard(records, i, 3)][::-1]
    assert ex.inversion_table(by_shard) == in_order
    assert in_order[0]["condition"].startswith("base") and in_order[0]["deltanet"] == "0.15 (0.10 0.20)"
    budget = [dict(c, accuracy=0.1 * (c["seed"] + 1)) for c in ex.grid("inversion", steps=50)]   # --steps 50
    in_order = ex.inversion_table(budget)
    assert [r["condition"] for r in in_order][:2] == ["steps=50", "steps=50, random_filler=False"]
    assert ex.inversion_table([r for i in range(3) for r in ex.shard(budget, i, 3)][::-1]) == in_order


def test_caching_grid_is_the_board_row_with_three_seeds_and_other_segments():
    cells = ex.grid("caching")
    s = ex.SIZES["small"]
    assert len(cells) == 4 * len(s.lrs) * len(ex.CACHING_SEEDS) and len({ex.cell_key(c) for c in cells}) == len(cells)
    board = {(c["mixer"], c["lr"]): c for c in ex.grid("small") if c["num_kv_pairs"] == 8}
    for c in cells:                 # the same run as the board's but for the size label, the seed and the segments
        if (c["mixer"], c["lr"]) in board:
            assert {**c, "size": "small", "seed": 0} == board[c["mixer"], c["lr"]]
        else:
            assert c["mixer_name"] == "memory_caching"
            assert {**c["mixer_kwargs"], "segments": 16} == board["memory_caching", c["lr"]]["mixer_kwargs"]
    assert {c["mixer_kwargs"].get("segments") for c in cells} == {None, 16, *ex.CACHING_SEGMENTS}
    assert ex.grid("caching", mixers=["gated_deltanet"], steps=3) == [
        dict(c, steps=3, warmup=3) for c in cells if c["mixer"] == "gated_deltanet"]


def test_seed_table_keeps_the_best_lr_of_each_seed():
    cells = ex.grid("caching", mixers=["memory_caching"])
    # accuracy: seed 0 best at lr 0.03, seeds 1 and 2 best at lr 0.01
    acc = {(0, 0.01): 0.1, (0, 0.03): 0.4, (1, 0.01): 0.3, (1, 0.03): 0.2, (2, 0.01): 0.5, (2, 0.03): 0.0}
    rows = ex.seed_table([dict(c, accuracy=acc[c["seed"], c["lr"]]) for c in cells])
    assert rows == [{"mixer": "memory_caching", "segments": 16, "mean": "0.40", "per seed": "0.40 0.30 0.50",
                     "best lr": "0.03 0.01 0.01"}]


def test_filler_knob():
    from atlaslib.train import MQARTask
    x, y, _, _ = MQARTask(vocab_size=64, seq_len=32, num_kv_pairs=4, num_train=50, num_test=5,
                          random_filler=False).data(0)
    filler = (y == -100) & (torch.arange(32) >= 8)                  # the query region, minus the queries
    assert (x[filler] == 0).all()
    xr, yr, _, _ = MQARTask(vocab_size=64, seq_len=32, num_kv_pairs=4, num_train=50, num_test=5).data(0)
    assert (xr[filler] != 0).float().mean() > 0.9 and torch.equal(yr, y)      # same keys, values and queries


def test_every_mixer_has_its_axes():
    labels = [label for label, _, _ in ex.mixer_specs(window=8)]
    assert sorted(ex.MIXER_AXES) == sorted(labels)
    assert all(len(axes) == 5 for axes in ex.MIXER_AXES.values())


def test_retention_labels_match_the_built_mixers():
    # A mixer labelled without a learned retention ("none", "fixed decay", or an evicting "window"
    # alone) must build no gate projection; every other one must build one (for a hybrid, its memory's).
    from atlaslib.nn import make_mixer
    ungated = {"none", "fixed decay", "window"}
    for label, name, kw in ex.mixer_specs(window=8):
        mixer = make_mixer(name, 32, 2, **kw)
        gated = any(n.split(".")[-2] == "gate_proj" for n, _ in mixer.named_parameters() if "." in n)
        assert gated == (ex.MIXER_AXES[label][3] not in ungated), (label, ex.MIXER_AXES[label][3])


RESULTS = Path(__file__).resolve().parent.parent / "results"


@pytest.mark.parametrize("size", ["small", "inversion", "filler", "caching"])
def test_committed_results_cover_their_grid(size):
    records = ex.read_results(str(RESULTS / f"mqar_{size}.jsonl"))
    assert sorted(map(ex.cell_key, records)) == sorted(map(ex.cell_key, ex.grid(size)))   # every cell, once
    assert len(open(RESULTS / f"mqar_{size}.jsonl").readlines()) == len(records)        # one merged file
    for r in records:
        assert 0 <= r["accuracy"] <= 1 and r["atlaslib"] and r["torch"] and r["device"] == "cpu"
    if size == "small":                                          # every model of the book is on the board
        assert {r["mixer"] for r in records} == set(ex.MIXER_AXES)
        assert {r["mixer_name"] for r in records} >= set(available_mixers())


# One committed cell, re-run from its key. On the machine that ran the sweep the accuracy came back
# equal, with 1 or 2 threads and with ATEN_CPU_CAPABILITY=default (measured on 4 cells: differences
# 0, 0, 0 and, for softmax on the default code path, 0.002). REPLAY_TOL leaves room for other CPUs,
# whose last-bit differences training amplifies.
REPLAY = dict(mixer="linear", num_kv_pairs=2, lr=3e-2)
REPLAY_TOL = 0.03


def test_a_committed_cell_reproduces():
    record = next(r for r in ex.read_results(str(RESULTS / "mqar_small.jsonl"))
                  if all(r[k] == v for k, v in REPLAY.items()))
    check = ex.reproduce(record, tol=REPLAY_TOL)
    assert check["ok"], check


def markdown_of(notebook: str) -> str:
    cells = json.loads((RESULTS.parent / "book" / notebook).read_text())["cells"]
    return " ".join(" ".join("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")


def test_the_chapters_quote_the_committed_studies():
    """Chapters 2, 4 and 7 quote chapter 8's inversion study and caching check: the numbers they print are
    the committed runs' (a re-run sweep that moves one fails here, naming the sentence to update)."""
    runs = {}
    for r in ex.read_results(str(RESULTS / "mqar_inversion.jsonl")):
        knobs = (r["steps"], r["num_kv_pairs"], r["random_filler"], r["lr"], bool(r["mixer_kwargs"].get("qk_norm")))
        runs[r["mixer"].removesuffix("+qk_norm"), knobs, r["seed"]] = f"{r['accuracy']:.2f}"

    def acc(mixer, seed, steps=1000, pairs=8, random_filler=True):
        return runs[mixer, (steps, pairs, random_filler, 1e-2, False), seed]
    lin, dn, gdn = "linear", "deltanet", "gated_deltanet"
    seeds = {row["mixer"]: row for row in ex.seed_table(ex.read_results(str(RESULTS / "mqar_caching.jsonl")))}
    quotes = {
        "ch02_delta_rule.ipynb": [
            f"seed 0 gives linear attention {acc(lin, 0)}, DeltaNet {acc(dn, 0)} and Gated DeltaNet {acc(gdn, 0)}",
            f"(linear attention {acc(lin, 1)}, DeltaNet {acc(dn, 1)})",
            f"falls to {acc(lin, 0, random_filler=False)} with seed 0 and still answers "
            f"{acc(lin, 1, random_filler=False)} with seed 1",
            f"DeltaNet gets {acc(dn, 0, pairs=16)} and {acc(dn, 1, pairs=16)} and linear attention "
            f"{acc(lin, 0, pairs=16)} and {acc(lin, 1, pairs=16)}",
        ],
        "ch04_omega_rule.ipynb": [
            f"(Gated DeltaNet goes from {acc(gdn, 0)} to {acc(gdn, 0, random_filler=False)})",
        ],
        "ch07_memory_caching.ipynb": [
            f"({seeds['memory_caching_c8']['mean']} on average against {seeds['gated_deltanet']['mean']})",
        ],
    }
    for notebook, phrases in quotes.items():
        text = markdown_of(notebook)
        for phrase in phrases:
            assert phrase in text, (notebook, phrase)


def test_chapter_8s_figure_descriptions_quote_the_committed_grid():
    """The figures' alt texts (what a screen reader says for them, and the page shows when an image fails)
    give ATLAS++'s accuracy at the most pairs: the committed grid's, as the figures plot it."""
    board = {row["mixer"]: row for row in ex.leaderboard(ex.read_results(str(RESULTS / "mqar_small.jsonl")))}
    hardest = list(board["atlas++"])[-1]
    cells = json.loads((RESULTS.parent / "book" / "ch08_leaderboard.ipynb").read_text())["cells"]
    alts = [c["metadata"].get("mystnb", {}).get("image", {}).get("alt", "") for c in cells]
    quoted = [m for a in alts for m in re.findall(r"ATLAS\+\+[^()]*\((\d\.\d\d)", a)]
    assert quoted and set(quoted) == {f"{board['atlas++'][hardest]:.2f}"}, quoted


def test_a_line_that_is_not_a_record_is_skipped_with_a_warning(tmp_path):
    """A results file holding another JSON line (train's losses, a stray object) still reports its records."""
    out = tmp_path / "r.jsonl"
    good = _record("linear", 16, 2, 1e-3, 0, 0.5)
    out.write_text(json.dumps({"a": 1}) + "\n" + json.dumps([1, 2]) + "\n" + json.dumps(good) + "\n")
    with pytest.warns(UserWarning, match="not a results record"):
        records = ex.read_results(str(out))
    assert records == [good]


def test_cuda_without_cuda_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        ex.main(["mqar", "--size", "tiny", "--device", "cuda", "--list"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "CUDA is not available" in err.strip().splitlines()[-1], err
