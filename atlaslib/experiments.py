"""Chapter 8's experiments: one MQAR protocol over every mixer of the book (in the spirit of Zoology),
and the study of why chapter 2's ranking came out inverted.

    python -m atlaslib.experiments mqar --size small                 # one process
    python -m atlaslib.experiments mqar --size small --shard 0/2     # one of two (make experiments runs both)
    torchrun --nproc_per_node=8 -m atlaslib.experiments mqar --size paper   # shards from RANK / WORLD_SIZE
    python -m atlaslib.experiments mqar --size small --report        # the leaderboard
    python -m atlaslib.experiments inversion                         # chapter 2's setting, one knob at a time
    python -m atlaslib.experiments filler                            # the small grid's 8 pairs, token-0 filler
    python -m atlaslib.experiments caching                           # Memory Caching's row with three seeds

The grid is (sequence length, key-value pairs, d_model) x mixer x learning rate x seed, every
cell one ``train_mqar`` run of a ``TinyLM``. After every run one JSON line is appended to the
results file, holding the cell's full key and its outcome, so an interrupted sweep resumes: a cell
whose key is already in a results file is skipped. N processes split the grid by cell index
(cell i goes to shard i mod N); each writes ``<out>.rank<i>.jsonl``, the report reads them all, and
``--merge`` moves them into ``<out>``. Under torchrun every process trains its own cells on its own
device (no DDP, no process group). A record also holds ``code``, a fingerprint of the library's code
(``code_fingerprint``; comments and docstrings do not count): training at this budget is chaotic, a change
that only reorders floating-point sums moves some runs, and the report says when a file mixes runs of two
states of the code.

The report keeps, per mixer, task and seed, the best accuracy over the learning rates, then
averages over seeds (Zoology's protocol: each architecture gets its own best learning rate).

Time, measured on this project's 2-core CPU machine with two shards of one thread each (the sweep whose
runs are committed; other jobs shared the machine for part of it): ``mqar --size small`` (156 runs) took
36 min of wall time, 71 min of summed run time; ATLAS++ is the slowest mixer by far (276-370 s a run),
against 4-14 s for most matrix memories. ``inversion`` (42 runs of chapter 2's model, 500-2000 steps) took
30 min, 59 min summed. ``filler`` (42 runs) took 3.3 min, 6.3 min summed. ``caching`` (24 runs) took 2 min,
3.6 min summed; its seed-0 runs of the board's two mixers reproduced the board's accuracies exactly. All
four: 71 min.
"""
from __future__ import annotations

import argparse
import ast
import collections
import functools
import glob
import hashlib
import importlib.metadata
import io
import itertools
import json
import os
import tokenize
import warnings
from dataclasses import dataclass

import torch

from .nn import TinyLM
from .tables import format_table
from .train import MQARTask, train_mqar


def mixer_specs(window: int) -> list[tuple[str, str, dict]]:
    """(label, registered name, kwargs) for every mixer of the book; ``window`` is the sliding
    window of the attention-like mixers (swa, swdt, the attention branch of mag / mal), chosen
    smaller than the sequence so that they cannot see every pair. The Omega windows (c = 8) and
    Memory Caching's segments (16) follow chapters 4, 5 and 7."""
    return [
        # chapter 1
        ("softmax", "softmax", {}),
        ("linear", "linear", {}),
        ("retnet", "retnet", {}),
        ("mamba2", "mamba2", {}),
        ("gla", "gla", {}),
        # chapter 2
        ("deltanet", "deltanet", {}),
        ("gated_deltanet", "gated_deltanet", {}),
        ("kda", "kda", {}),
        # chapter 3
        ("ttt_linear", "ttt_linear", {}),
        ("ttt_mlp", "ttt_mlp", {}),
        ("titans", "titans", {}),
        ("moneta", "moneta", {}),
        ("yaad", "yaad", {}),
        ("memora", "memora", {}),
        # chapter 4
        ("omeganet", "omeganet", {"window": 8}),
        ("swla", "swla", {"window": 8}),
        # chapter 5
        ("atlas", "atlas", {"window": 8}),
        ("atlas++", "atlas++", {"window": 8}),
        # chapter 6
        ("deep_transformer", "deep_transformer", {}),
        ("swdt", "swdt", {"window": window}),
        ("dot", "dot", {}),
        ("dla", "dla", {}),
        # chapter 7
        ("memory_caching", "memory_caching", {"base": "gated_deltanet", "segments": 16}),
        # hybrids
        ("swa", "swa", {"window": window}),
        ("mag", "mag", {"memory": "atlas", "window": window, "memory_window": 8}),
        ("mal", "mal", {"memory": "atlas", "window": window, "memory_window": 8}),
    ]


# Where each mixer of the protocol sits: (chapter, memory, attentional bias, retention, algorithm),
# the four MIRAS axes plus the chapter that builds it, for the mixer as ``mixer_specs`` builds it.
# "grows" marks memories whose size grows with the sequence (a KV cache, or Memory Caching's one
# state per segment). "in phi*" marks a bias on the exponential kernel's features (chapter 6): the
# DeepTransformer and SWDT are chapter 1's Hebbian memory on phi* (normalised, with the forget gate
# alpha_t that their mixers learn by default), DOT is the delta rule on phi* (window c = 1 here, with
# the same gate). "window" as a retention means eviction (a pair older than the window is dropped);
# the Omega window of OmegaNet, SWLA and ATLAS is a window of the *loss*, listed under the bias, and
# evicts nothing. "gate" is a learned, data-dependent alpha_t. The algorithm is chapter 3's optimizer
# axis, as MIRAS's Table 1 names it: the chunked mixers (TTT, the MIRAS presets, OmegaNet, ATLAS) all take
# mini-batch gradients of their chunk (b = 16), and Memora's KL geometry is its retention, so all are "GD".
MIXER_AXES = {
    "softmax": (1, "grows: every pair", "attention", "none", "exact"),
    "linear": (1, "matrix", "dot product", "none", "GD"),
    "retnet": (1, "matrix", "dot product", "fixed decay", "GD"),
    "mamba2": (1, "matrix", "dot product", "scalar gate", "GD"),
    "gla": (1, "matrix", "dot product", "channel gate", "GD"),
    "deltanet": (2, "matrix", "l2", "none", "GD"),
    "gated_deltanet": (2, "matrix", "l2", "scalar gate", "GD"),
    "kda": (2, "matrix", "l2", "channel gate", "GD"),
    "ttt_linear": (3, "matrix", "l2", "none", "GD"),
    "ttt_mlp": (3, "MLP", "l2", "none", "GD"),
    "titans": (3, "MLP", "l2", "scalar gate", "GD + momentum"),
    "moneta": (3, "MLP", "lp (p=3)", "lq normalisation", "GD"),
    "yaad": (3, "MLP", "Huber", "scalar gate", "GD"),
    "memora": (3, "MLP", "l2", "KL (simplex)", "GD"),
    "omeganet": (4, "matrix", "l2 over a window", "scalar gate", "GD"),
    "swla": (4, "matrix", "dot product over a window", "scalar gate", "GD"),
    "atlas": (5, "matrix", "l2 over a window", "scalar gate", "Muon"),
    "atlas++": (5, "MLP", "l2 over a window", "scalar gate", "Muon"),
    "deep_transformer": (6, "grows: every pair", "dot product in phi*", "scalar gate", "GD"),
    "swdt": (6, "window of pairs", "dot product in phi*", "window + gate", "GD"),
    "dot": (6, "grows: every pair", "l2 in phi*", "scalar gate", "GD"),
    "dla": (6, "MLP", "dot product", "scalar gate", "GD"),
    "memory_caching": (7, "grows: one matrix per segment", "l2", "scalar gate", "GD"),
    "swa": ("hybrid", "window of pairs", "attention", "window", "exact"),
    "mag": ("hybrid", "window + matrix", "attention + l2 over a window", "window + gate", "Muon"),
    "mal": ("hybrid", "window + matrix", "attention + l2 over a window", "window + gate", "Muon"),
}


@dataclass(frozen=True)
class Size:
    """One grid: the task configurations, model shape, learning rates, seeds and training budget."""

    tasks: tuple            # (seq_len, num_kv_pairs, d_model) triples
    lrs: tuple
    seeds: tuple
    steps: int
    batch_size: int
    window: int             # the sliding window of swa / swdt / mag / mal
    vocab_size: int = MQARTask.vocab_size   # the data's defaults are MQARTask's
    n_layers: int = 2
    n_heads: int = 4
    num_train: int = MQARTask.num_train
    num_test: int = MQARTask.num_test
    warmup: int = 50


SIZES = {
    # 2 CPU cores: 26 mixers x 3 tasks x 2 lrs x 1 seed = 156 runs of 300 steps, split over 2 shards
    # (one thread each): 34-39 min measured (see the module docstring), ATLAS++ about 40% of it.
    "small": Size(tasks=((32, 2, 32), (32, 4, 32), (32, 8, 32)), lrs=(1e-2, 3e-2), seeds=(0,),
                  steps=300, batch_size=32, window=8, n_heads=2, num_train=4_000, num_test=256, warmup=30),
    # A GPU (defined, not run here): Zoology-like lengths, pairs (T / kv >= 8) and widths, 4 log-spaced
    # learning rates, 2 seeds: 12 tasks x 26 mixers x 4 lrs x 2 seeds = 2496 runs.
    "paper": Size(tasks=tuple((t, kv, d) for t, kv in ((128, 8), (256, 16), (512, 32), (512, 64))
                              for d in (64, 128, 256)),
                  lrs=(3e-4, 1e-3, 3e-3, 1e-2), seeds=(0, 1), steps=5_000, batch_size=64, window=64,
                  vocab_size=8_192, num_train=100_000, num_test=3_000, warmup=500),
    # Tests only: one tiny task, two steps.
    "tiny": Size(tasks=((16, 2, 16),), lrs=(1e-2,), seeds=(0,), steps=2, batch_size=4, window=4,
                 vocab_size=32, n_layers=1, num_train=16, num_test=8, warmup=1),
}


# The inversion study (chapter 8): chapter 2's MQAR setting, the same data, model and schedule as
# its ``compare_mixers`` table (T=64, 8 pairs, vocabulary 128, TinyLM d_model=64 with 4 heads of
# 16 x 16, batch 32, warm-up 50), varied one knob at a time around a base of 1000 steps at lr 1e-2.
CHAPTER2 = Size(tasks=((64, 8, 64),), lrs=(1e-2,), seeds=(0, 1), steps=1000, batch_size=32, window=16,
                num_train=20_000, num_test=1_000, warmup=50)
INVERSION_MIXERS = (("linear", "linear", {}), ("deltanet", "deltanet", {}),
                    ("gated_deltanet", "gated_deltanet", {}))
INVERSION_KNOBS = {
    "random_filler": (False,),                # filler = token 0: the delta rule's writes of noise vanish
    "steps": (500, 2000),                     # the budget: does the ranking move with training time?
    "num_kv_pairs": (16, 4),                  # pairs per key dimension: 1 or 1/4 (base 1/2)
    "lr": (3e-2, 3e-3),                       # each mixer's best learning rate may differ
    "qk_norm": (True,),                       # linear attention with l2-normalised q, k, as the delta rule
}


# The study's base: chapter 2's run at 1000 steps; each other run changes one of these (or qk_norm).
INVERSION_BASE = {"steps": 1000, "lr": 1e-2, "num_kv_pairs": 8, "random_filler": True}


def inversion_cell(spec: tuple, seed: int, *, qk_norm: bool = False, **knobs) -> dict:
    """One run of the inversion study: chapter 2's setting with the given knobs (INVERSION_BASE's keys)."""
    s = CHAPTER2
    steps, lr, num_kv_pairs, random_filler = ({**INVERSION_BASE, **knobs}[k] for k in INVERSION_BASE)
    if qk_norm:
        label, name, kw = spec
        spec = (f"{label}+qk_norm", name, {**kw, "qk_norm": True})
    return make_cell("inversion", s, (64, num_kv_pairs, 64), spec, lr, seed, steps, random_filler)


def inversion_grid(steps: int | None = None) -> list[dict]:
    """The base runs and one-knob variations (seeds 0 and 1), the most telling first: qk_norm for linear
    attention only (the delta rule needs unit keys to be stable), Gated DeltaNet for the budget and the
    filler only (it costs as much as DeltaNet and moves with it).

    ``steps`` sets every run's budget (warm-up capped at it, as in every grid), so the budget is no
    longer a knob: its variations would repeat the base runs and are left out."""
    knobs = {k: v for k, v in INVERSION_KNOBS.items() if steps is None or k != "steps"}
    conditions = [{}] + [{knob: v} for knob, values in knobs.items() for v in values]
    budget = {} if steps is None else {"steps": steps}
    cells = []
    for cond, spec, seed in itertools.product(conditions, INVERSION_MIXERS, CHAPTER2.seeds):
        knob = next(iter(cond), None)
        if (knob == "qk_norm" and spec[0] != "linear") or (
                spec[0] == "gated_deltanet" and knob not in (None, "steps", "random_filler")):
            continue
        cells.append(inversion_cell(spec, seed, **cond, **budget))
    return cells


def inversion_table(records: list[dict]) -> list[dict]:
    """One row per condition (the base and each knob value), one column per mixer: mean accuracy over
    seeds, with the per-seed values."""
    def condition(r):
        diffs = [f"{k}={r[k]}" for k, base in INVERSION_BASE.items() if r[k] != base]
        if r["mixer_kwargs"].get("qk_norm"):
            diffs.append("qk_norm=True")
        return ", ".join(diffs) or order[0]

    # the grid's order of conditions and seeds, whatever order the files hold the records in (a sweep
    # split into shards writes each shard's runs to its own file)
    order = ["base (1000 steps, lr 1e-2, 8 pairs)"] + [f"{k}={v}" for k, vs in INVERSION_KNOBS.items() for v in vs]

    one_budget = len({r["steps"] for r in records}) == 1     # a --steps sweep: every condition says steps=S

    def place(r):
        cond = ", ".join(d for d in condition(r).split(", ") if not (one_budget and d.startswith("steps=")))
        cond = cond or order[0]
        return (order.index(cond) if cond in order else len(order), r["seed"])

    cells = {}
    for r in sorted(records, key=place):
        cells.setdefault(condition(r), {}).setdefault(r["mixer"].removesuffix("+qk_norm"), []).append(r["accuracy"])
    rows = []
    for cond, by_mixer in cells.items():
        row = {"condition": cond}
        for label, _, _ in INVERSION_MIXERS:
            accs = by_mixer.get(label)
            row[label] = (f"{sum(accs) / len(accs):.2f} (" + " ".join(f"{a:.2f}" for a in accs) + ")"
                          if accs else "-")
        rows.append(row)
    return rows


# The filler check (chapter 8): the small grid's hardest task with token 0 as filler instead of random
# tokens, every mixer but the five slowest (over 40 s a run; about 7 min on two cores instead of about 15).
FILLER_SKIP = ("moneta", "memora", "atlas++", "mag", "mal")


# The caching check (chapter 8): the small board's Memory Caching row (over Gated DeltaNet, segments of 16)
# and its base on the hardest task, with three seeds instead of one, and with segments of 8 and of 12
# (16-token segments end exactly after the 8 pairs of T = 32; 12-token ones do not).
CACHING_SEEDS = (0, 1, 2)
CACHING_SEGMENTS = (8, 12)


def caching_specs(window: int) -> list[tuple[str, str, dict]]:
    """Gated DeltaNet and Memory Caching as the board has them, then Memory Caching with other segments."""
    base, cached = (spec for spec in mixer_specs(window) if spec[0] in ("gated_deltanet", "memory_caching"))
    label, name, kw = cached
    return [base, cached] + [(f"{label}_c{c}", name, {**kw, "segments": c}) for c in CACHING_SEGMENTS]


def check_one_setting(records: list[dict], task_fields: tuple = ()) -> None:
    """The runs a table compares differ only in the learning rate, the seed and ``task_fields`` (its columns):
    a file holding runs of another budget, data or model (an ``--steps`` trial appended to a sweep's file)
    would otherwise take its best over both. ValueError naming the fields that differ."""
    settings = {}                                        # mixer -> {field: values}
    for r in records:
        for f in KEY_FIELDS:
            if f not in ("lr", "seed", *task_fields):
                settings.setdefault(r["mixer"], {}).setdefault(f, set()).add(json.dumps(r[f], sort_keys=True))
    mixed = sorted({f for fields in settings.values() for f, values in fields.items() if len(values) > 1})
    if mixed:
        raise ValueError(f"these results mix runs that differ in {', '.join(mixed)} (not only in lr and seed): "
                         "keep trial runs in a file of their own (--out)")


def seed_table(records: list[dict]) -> list[dict]:
    """One row per mixer: the best accuracy over learning rates for each seed, their mean, and the lr that
    gave each (Zoology's protocol, as ``leaderboard``, with the seeds kept apart)."""
    check_one_setting(records)
    best = {}                                            # (mixer, seed) -> (accuracy, lr)
    for r in records:
        k = (r["mixer"], r["seed"])
        if k not in best or r["accuracy"] > best[k][0]:
            best[k] = (r["accuracy"], r["lr"])
    rows = []
    for mixer in dict.fromkeys(m for m, _ in best):
        per_seed = [best[m, seed] for m, seed in sorted(best) if m == mixer]
        accs = [a for a, _ in per_seed]
        segments = next(r["mixer_kwargs"].get("segments", "-") for r in records if r["mixer"] == mixer)
        rows.append({"mixer": mixer, "segments": segments, "mean": f"{sum(accs) / len(accs):.2f}",
                     "per seed": " ".join(f"{a:.2f}" for a in accs),
                     "best lr": " ".join(f"{lr:g}" for _, lr in per_seed)})
    return rows


def grid(size: str, mixers: list[str] | None = None, steps: int | None = None) -> list[dict]:
    """Every cell of the protocol as its key (a JSON-able dict), in a fixed order.

    ``mixers`` keeps only those labels (in the protocol's order); ``steps`` overrides the budget (the
    inversion study's then drops its budget knob, see ``inversion_grid``).
    """
    if size == "inversion":
        return [c for c in inversion_grid(steps) if mixers is None or c["mixer"] in mixers]
    if size == "caching":
        s = SIZES["small"]
        return [make_cell("caching", s, s.tasks[-1], spec, lr, seed, steps or s.steps)
                for spec, lr, seed in itertools.product(caching_specs(s.window), s.lrs, CACHING_SEEDS)
                if mixers is None or spec[0] in mixers]
    if size == "filler":
        s = SIZES["small"]
        return [make_cell("filler", s, s.tasks[-1], spec, lr, seed, steps or s.steps, random_filler=False)
                for spec, lr, seed in itertools.product(mixer_specs(s.window), s.lrs, s.seeds)
                if spec[0] not in FILLER_SKIP and (mixers is None or spec[0] in mixers)]
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}, 'inversion', 'filler' or 'caching'")
    s = SIZES[size]
    specs = mixer_specs(s.window)
    if mixers is not None:
        labels = [label for label, _, _ in specs]
        unknown = [m for m in mixers if m not in labels]
        if unknown:
            raise ValueError(f"unknown mixers {unknown}; the protocol has {labels}")
        specs = [spec for spec in specs if spec[0] in mixers]
    steps = s.steps if steps is None else steps
    return [make_cell(size, s, task, spec, lr, seed, steps)
            for task, spec, lr, seed in itertools.product(s.tasks, specs, s.lrs, s.seeds)]


def make_cell(size: str, s: Size, task: tuple, spec: tuple, lr: float, seed: int, steps: int,
              random_filler: bool = True) -> dict:
    """One cell's key: the grid ``size`` (its name and ``Size``), a (T, pairs, d_model) task, a mixer spec."""
    (seq_len, pairs, d_model), (label, name, kw) = task, spec
    return {"size": size, "vocab_size": s.vocab_size, "seq_len": seq_len, "num_kv_pairs": pairs,
            "random_filler": random_filler, "num_train": s.num_train, "num_test": s.num_test,
            "d_model": d_model, "n_layers": s.n_layers, "n_heads": s.n_heads, "mixer": label, "mixer_name": name,
            "mixer_kwargs": kw, "lr": lr, "seed": seed, "steps": steps, "batch_size": s.batch_size,
            "warmup": min(s.warmup, steps)}


KEY_FIELDS = ("size", "vocab_size", "seq_len", "num_kv_pairs", "random_filler", "num_train", "num_test", "d_model",
              "n_layers", "n_heads", "mixer", "mixer_name", "mixer_kwargs", "lr", "seed", "steps", "batch_size",
              "warmup")


def cell_key(record: dict) -> str:
    """The identity of a cell (a results record or a grid cell): its key fields as canonical JSON."""
    return json.dumps({f: record[f] for f in KEY_FIELDS}, sort_keys=True)


def shard(cells: list[dict], index: int, count: int) -> list[dict]:
    """Shard ``index`` of ``count``: the cells i with i mod count == index (a partition of the grid)."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: need 0 <= index < count")
    return cells[index::count]


def library_version() -> str:
    from . import __version__ as v
    return v or importlib.metadata.version("atlaslib")


# Not part of what a run computes: the exercises, the grader, and the build and timing tools.
NOT_TRAINING = ("exercises", "grade.py", "aot.py", "bench.py", "bench_fla.py", "bench_cases.py", "benchcases.py")


def code_only(source: str) -> str:
    """``source`` without its comments, docstrings and blank lines: what the fingerprint hashes, so that a
    change to the text around the code does not count as a change of the code."""
    tree = ast.parse(source)
    spans = []                               # (start, end) as (line, column) pairs, 1-based lines
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            doc = body[0]
            spans.append(((doc.lineno, doc.col_offset), (doc.end_lineno, doc.end_col_offset)))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            spans.append((tok.start, tok.end))
    lines = source.splitlines()
    for (l0, c0), (l1, c1) in sorted(spans, reverse=True):    # from the end: earlier positions stay valid
        lines[l0 - 1:l1] = [lines[l0 - 1][:c0] + lines[l1 - 1][c1:]]
    return "\n".join(line.rstrip() for line in lines if line.strip())


@functools.lru_cache(maxsize=None)
def code_fingerprint(root: str | None = None) -> str:
    """12 hex digits of a SHA-256 over the library's Python code (paths, and sources without their comments
    and docstrings: ``code_only``) but ``NOT_TRAINING``: runs with one fingerprint ran the same code. The
    version number cannot tell: training at this budget is chaotic, and a change that only reorders
    floating-point sums moves some runs by a tenth (chapter 8, section 6)."""
    base = os.path.dirname(os.path.abspath(__file__)) if root is None else root
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(base, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, base)
        if any(part in NOT_TRAINING for part in rel.split(os.sep)):
            continue
        with open(path, encoding="utf-8") as f:
            digest.update(rel.replace(os.sep, "/").encode() + b"\0" + code_only(f.read()).encode() + b"\0")
    return digest.hexdigest()[:12]


def code_states(records: list[dict]) -> collections.Counter:
    """Runs per code fingerprint ("unrecorded": records stored before runs carried one)."""
    return collections.Counter(r.get("code", "unrecorded") for r in records)


def mixed_code_note(records: list[dict]) -> str:
    states = code_states(records)
    if len(states) < 2:
        return ""
    return (f"\nMIXED CODE: these runs come from {len(states)} states of the library's code ("
            + ", ".join(f"{code}: {n} runs" for code, n in states.most_common())
            + "); a change that only reorders floating-point sums moves some runs, so compare runs of one state")


def run_cell(cell: dict, device: str | torch.device = "cpu", progress: bool = True) -> dict:
    """Train one cell; return its record (the key plus the outcome)."""
    task = MQARTask(cell["vocab_size"], cell["seq_len"], cell["num_kv_pairs"], cell["num_train"], cell["num_test"],
                    random_filler=cell["random_filler"])
    data = tuple(t.to(device) for t in task.data(cell["seed"]))
    torch.manual_seed(cell["seed"])
    model = TinyLM(task.vocab_size, cell["d_model"], cell["n_layers"], cell["mixer_name"], cell["n_heads"],
                   **cell["mixer_kwargs"]).to(device)
    res = train_mqar(model, data, steps=cell["steps"], batch_size=cell["batch_size"], lr=cell["lr"],
                     warmup=cell["warmup"], seed=cell["seed"], progress=progress,
                     name=f"{cell['mixer']} T={cell['seq_len']} kv={cell['num_kv_pairs']} "
                          f"d={cell['d_model']} lr={cell['lr']:g} seed={cell['seed']}")
    tail = res.losses[-10:]
    return {**{f: cell[f] for f in KEY_FIELDS}, "accuracy": res.accuracy, "final_loss": sum(tail) / len(tail),
            "seconds": res.seconds, "state_size": res.state_size, "params": res.n_params,
            "device": str(device), "torch": torch.__version__, "atlaslib": library_version(),
            "code": code_fingerprint()}


def shard_path(out: str, index: int, count: int) -> str:
    """``results.jsonl`` for one process, ``results.rank<i>.jsonl`` for shard i of several."""
    if count == 1:
        return out
    root, ext = os.path.splitext(out)
    return f"{root}.rank{index}{ext or '.jsonl'}"


def result_files(out: str) -> list[str]:
    """The results file and every shard's file of ``out``."""
    root, ext = os.path.splitext(out)
    return sorted(p for p in {out, *glob.glob(f"{glob.escape(root)}.rank*{ext or '.jsonl'}")} if os.path.exists(p))


def read_results(out: str) -> list[dict]:
    """Every record of every results file of ``out``, once per cell (a merged file repeats the shards'),
    in file order; a torn last line, from a kill mid-write, is skipped."""
    records = {}
    for path in result_files(out):
        with open(path) as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(r, dict) or not all(k in r for k in KEY_FIELDS):
                    warnings.warn(f"{path}: a line that is not a results record was skipped", stacklevel=2)
                    continue
                records.setdefault(cell_key(r), r)
    return list(records.values())


def _end_torn_line(path: str) -> None:
    """Close a line torn by a kill mid-write, so that the next record starts on a line of its own."""
    if os.path.exists(path) and os.path.getsize(path):
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def sweep(size: str, out: str, *, mixers=None, steps=None, shard_index=0, shard_count=1, device="cpu",
          progress=True) -> list[dict]:
    """Run this shard's cells that no results file of ``out`` holds yet; return the new records."""
    stored = read_results(out)
    done = {cell_key(r) for r in stored}
    todo = [c for c in shard(grid(size, mixers, steps), shard_index, shard_count) if cell_key(c) not in done]
    if todo and stored and set(code_states(stored)) != {code_fingerprint()}:
        warnings.warn(f"{out} holds runs of another state of the library's code ({dict(code_states(stored))}; "
                      f"this one is {code_fingerprint()}): the report will say so", stacklevel=2)
    path = shard_path(out, shard_index, shard_count)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _end_torn_line(path)
    new = []
    for i, cell in enumerate(todo):
        if progress:
            print(f"[shard {shard_index}/{shard_count}] run {i + 1}/{len(todo)}", flush=True)
        record = run_cell(cell, device, progress)
        with open(path, "a") as f:                       # after every run: an interrupted sweep loses one run
            f.write(json.dumps(record) + "\n")
        new.append(record)
    return new


def leaderboard(records: list[dict]) -> list[dict]:
    """One row per mixer: per task (T, pairs, d_model) the best accuracy over learning rates, mean over seeds."""
    check_one_setting(records, ("seq_len", "num_kv_pairs", "d_model"))
    best = {}                                            # (mixer, task, seed) -> max accuracy over lrs
    for r in records:
        k = (r["mixer"], (r["seq_len"], r["num_kv_pairs"], r["d_model"]), r["seed"])
        best[k] = max(best.get(k, -1.0), r["accuracy"])
    tasks = sorted({t for _, t, _ in best})
    rows = []
    for mixer in dict.fromkeys(m for m, _, _ in best):   # first-seen order
        row = {"mixer": mixer}
        for t in tasks:
            accs = [a for (m, tt, _), a in best.items() if m == mixer and tt == t]
            row[f"T{t[0]} kv{t[1]} d{t[2]}"] = sum(accs) / len(accs) if accs else None
        rows.append(row)
    return rows


def report(out: str) -> str:
    records = read_results(out)
    if not records:
        return f"no results in {out} (nor its .rank* files)"
    try:
        return _report(out, records)
    except ValueError as e:                              # runs of two settings in one file
        return f"{out}: {e}"


def missing_cells(records: list[dict]) -> list[dict]:
    """The cells of the records' grid (their size, and their step budget if a ``--steps`` run's) that no
    record holds: an interrupted sweep's, or one run with ``--mixers``."""
    done = {cell_key(r) for r in records}
    cells = grid(records[0]["size"])
    if not done & {cell_key(c) for c in cells}:                     # a --steps run: its own budget
        cells = grid(records[0]["size"], steps=records[0]["steps"])
    return [c for c in cells if cell_key(c) not in done]


def _report(out: str, records: list[dict]) -> str:
    missing = missing_cells(records)
    partial = "" if not missing else (
        f"\nINCOMPLETE: {len(missing)} runs of the grid are missing (of mixers "
        f"{', '.join(dict.fromkeys(c['mixer'] for c in missing))}); the table holds the runs there are")
    partial += mixed_code_note(records)
    if records[0]["size"] == "inversion":
        return ("MQAR, chapter 2's setting: accuracy per condition, mean over seeds (seed 0, seed 1)\n"
                + format_table(inversion_table(records)) + partial)
    if records[0]["size"] == "caching":
        return (f"MQAR, T=32, 8 pairs: best of lr {SIZES['small'].lrs} per seed; seeds {CACHING_SEEDS} in order\n"
                + format_table(seed_table(records)) + partial)
    rows = leaderboard(records)
    text = format_table(rows, digits=3).replace("grows with T", "-")
    return (f"MQAR accuracy: best learning rate per mixer, task and seed, mean over seeds "
            f"({len(records)} runs from {', '.join(result_files(out))})\n{text}{partial}")


def reproduce(record: dict, tol: float = 1e-6, device="cpu", progress: bool = False) -> dict:
    """Re-run one stored cell with its seed; compare the accuracy with the stored one.

    Returns {"stored", "accuracy", "diff", "ok"} with ok = |accuracy - stored| <= tol.
    """
    new = run_cell(record, device, progress)
    diff = abs(new["accuracy"] - record["accuracy"])
    return {"stored": record["accuracy"], "accuracy": new["accuracy"], "diff": diff, "ok": diff <= tol}


def _parse_shard(text: str | None) -> tuple[int, int]:
    """``--shard i/N``, else torchrun's RANK / WORLD_SIZE, else 0/1; ValueError unless 0 <= i < N."""
    if text:
        try:
            i, n = (int(p) for p in text.split("/"))
        except ValueError:
            raise ValueError(f"--shard wants i/N (e.g. 0/2), got {text!r}") from None
        where = "--shard"
    else:
        i, n = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        where = "RANK/WORLD_SIZE"
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"{where} {i}/{n}: need 0 <= i < N")
    return i, n


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m atlaslib.experiments", description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", choices=["mqar", "inversion", "filler", "caching"],
                   help="mqar: the leaderboard grid (--size); inversion: the study of chapter 2's ranking; "
                        "filler: the small grid's hardest task with token-0 filler; caching: Memory Caching's "
                        "row and its base with three seeds and three segment lengths")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="mqar only: the grid (default small)")
    p.add_argument("--mixers", help="comma-separated labels (default: every mixer of the protocol)")
    p.add_argument("--steps", type=int, help="override the size's step budget")
    p.add_argument("--out", help="results file (default results/mqar_<size>.jsonl for mqar, "
                                 "results/mqar_<experiment>.jsonl otherwise)")
    p.add_argument("--shard", help="i/N: run the cells i, i+N, ... (default: torchrun's RANK/WORLD_SIZE)")
    p.add_argument("--device", help="default: cuda:LOCAL_RANK when CUDA is available, else cpu")
    p.add_argument("--report", action="store_true", help="print the leaderboard of the results and exit")
    p.add_argument("--merge", action="store_true", help="move every shard's records into --out and exit")
    p.add_argument("--list", action="store_true", help="print this shard's cells and exit")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.device is not None:
        try:
            torch.device(args.device)
        except RuntimeError:
            p.error(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)")
        if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            p.error(f"--device {args.device}: CUDA is not available on this machine (use --device cpu)")
    if args.experiment != "mqar" and args.size is not None:
        p.error(f"--size chooses the mqar grid; {args.experiment} has its own fixed grid")
    args.size = args.experiment if args.experiment != "mqar" else args.size or "small"
    if args.steps is not None and args.out is None and not (args.report or args.merge or args.list):
        p.error(f"--steps changes the runs' budget: give --out, so that they do not join the sweep's "
                f"results/mqar_{args.size}.jsonl")
    out = args.out or os.path.join("results", f"mqar_{args.size}.jsonl")     # a sweep makes its folder
    if os.path.isdir(out):
        p.error(f"--out {out} is a folder; give a file name")
    if args.report:
        print(report(out))
        return
    if args.merge:
        if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            p.error(f"--merge: no folder {os.path.dirname(os.path.abspath(out))} for {out}")
        records = read_results(out)
        with open(out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        for path in result_files(out):               # the shards' files are now copies: one file to commit
            if path != out:
                os.remove(path)
        print(f"{len(records)} records merged into {out}")
        return
    mixers = args.mixers.split(",") if args.mixers else None
    labels = list(dict.fromkeys(c["mixer"] for c in grid(args.size)))
    unknown = [m for m in mixers or () if m not in labels]
    if unknown:
        what = f"mqar --size {args.size}" if args.experiment == "mqar" else args.experiment
        p.error(f"unknown --mixers {', '.join(unknown)}; {what} has {', '.join(labels)}")
    try:
        index, count = _parse_shard(args.shard)
    except ValueError as e:
        p.error(str(e))
    if args.list:
        for c in shard(grid(args.size, mixers, args.steps), index, count):
            print(cell_key(c))
        return
    device = args.device or (f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    new = sweep(args.size, out, mixers=mixers, steps=args.steps, shard_index=index, shard_count=count,
                device=device, progress=not args.no_progress)
    print(f"{len(new)} new runs written to {shard_path(out, index, count)}")
    if count == 1:
        print(report(out))


if __name__ == "__main__":
    main()
