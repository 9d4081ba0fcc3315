"""Benchmark rows for chapter 7 (loaded by ``python -m atlaslib.bench``): Memory Caching over Gated
DeltaNet (chapter 2's ``delta_rule`` with a scalar retention), GRM, independent segments, unit keys,
beta in [0.1, 1], alpha in [0.9, 1], a random relevance query u_t.

Rows, one per segmentation (time and peak memory against the segment length):

* ``mc_gdn_c64``, ``mc_gdn_c256``: constant segments of 64 and 256 tokens;
* ``mc_gdn_log``: the log-linear (Fenwick) segmentation, i.e. Log-Linear++ over Gated DeltaNet.

Backends: "recurrent" (the definition, ``caching.recurrent``: the base's per-token loop per segment, then
per token an explicit list of cached states, each read by running the base from it with learning off),
"chunk" (the base's chunk form, all segments of one length in one batched call, and one batched
readout) and "triton" on CUDA (the base's kernel and the readout kernel).

The loop is too slow for the long rows: its readout runs the base from every cached state over all T
queries, N T per-token steps (T^2 / C for constant segments, ~2 T^2 for log-linear), plus per token a
Python loop over the states it sees; and the benchmark runs it five times, once under the profiler
that measures CPU memory, which records every one of its ~10^5-10^6 small operations (60-150 times
slower than the plain call: ~45 s for C = 64 at T = 512). So the loop runs on the first
``LOOP_T[segments]`` tokens only (512 for C = 64 and 256, 64 for "log"; under a second each) and the
chunk form on all T. Where T is longer, the recurrent row's time_ms and peak_MiB are those of the
shorter run and its speedup (loop on LOOP_T tokens / chunk on T) is not a speedup at T; the note under
the table says so. Where T <= LOOP_T both run the same tokens and the speedup is exact.

    python -m atlaslib.bench --threads 1 --T 1024 4096 --models mc_gdn_c64 mc_gdn_c256 mc_gdn_log

Measured with that command: see the README's chapter 7 line and the table below (filled in from one
run on a shared 2-core CPU sandbox loaded by other jobs, one thread; ratios only).
"""
from __future__ import annotations

from ..core import random_gate, random_qkv
from ..core.benchcases import BenchShape, register_bench_case
from ..delta import delta_rule
from . import memory_caching

# the loop's token budget per segmentation (a few seconds on one CPU core, see the module docstring)
LOOP_T = {64: 512, 256: 512, "log": 64}


def mc_builder(segments, loop_t: int):
    """call(backend): Memory Caching over Gated DeltaNet, GRM, independent, with ``segments``; the
    recurrent backend on the first min(T, loop_t) tokens, the others on all T."""
    def build(s: BenchShape, gen):
        q, k, v = random_qkv(s.B, s.H, s.T, s.K, s.V, dtype=s.dtype, device=s.device, generator=gen)
        beta = random_gate(s.B, s.H, s.T, low=0.1, high=1.0, dtype=s.dtype, device=s.device, generator=gen)
        log_alpha = random_gate(s.B, s.H, s.T, low=0.9, dtype=s.dtype, device=s.device, generator=gen).log()
        u = random_qkv(s.B, s.H, s.T, s.K, 1, dtype=s.dtype, device=s.device, generator=gen)[0]
        n = min(s.T, loop_t)

        def call(backend):
            m = n if backend == "recurrent" else s.T
            return memory_caching(q[:, :, :m], k[:, :, :m], v[:, :, :m], base=delta_rule,
                                  base_kwargs=dict(beta=beta[:, :, :m], log_alpha=log_alpha[:, :, :m]),
                                  u=u[:, :, :m], segments=segments, mode="independent", aggregate="grm",
                                  backend=backend, chunk_size=s.chunk_size)[0]
        return call
    return build


def loop_note(loop_t: int):
    def note(s: BenchShape) -> str:
        n = min(s.T, loop_t)
        if n == s.T:
            return "recurrent and chunk on the same tokens"
        return (f"recurrent ran on the first {n} tokens only (LOOP_T; the loop's cost grows as T^2), chunk on all "
                f"{s.T}: the recurrent row's time and memory are at T={n} and its speedup compares different T; "
                f"--T {n} times both on the same tokens")
    return note


for name, segments in (("mc_gdn_c64", 64), ("mc_gdn_c256", 256), ("mc_gdn_log", "log")):
    register_bench_case(name, mc_builder(segments, LOOP_T[segments]), note=loop_note(LOOP_T[segments]))
