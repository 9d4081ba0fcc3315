"""Benchmark rows for chapter 7 (loaded by ``python -m atlaslib.bench``): Memory Caching over Gated
DeltaNet (chapter 2's ``delta_rule`` with a scalar retention), GRM, independent segments, unit keys,
beta in [0.1, 1], alpha in [0.9, 1], a random relevance query u_t.

Rows, one per segmentation (time and peak memory against the segment length):

* ``mc_gdn_c64``, ``mc_gdn_c256``: constant segments of 64 and 256 tokens;
* ``mc_gdn_log``: the log-linear (Fenwick) segmentation, i.e. Log-Linear++ over Gated DeltaNet.

Backends: "chunk" (the base's chunk form, all segments of one length in one batched call, then one
batched readout) and "triton" on CUDA (the base's kernel and the readout kernel); the speedup column
divides the chunk form's time by each backend's.

The per-token loop (backend "recurrent", the definition in ``caching.recurrent``) is compared in the
note under the table, not in the table: its readout runs the base from every cached state over all T
queries (N T per-token steps: T^2 / C for constant segments, ~2 T^2 for log-linear), plus a Python
loop per token over the states it sees, so at T = 4096 it takes over a minute for C = 64 (64 s in
one call, see below) and far longer for log-linear; and the benchmark would run it five times, once under
the profiler that measures CPU memory, which records each of its 10^5-10^6 small operations (60-150
times slower than the plain call: 45 s for C = 64 at T = 512). So each note times the loop (one call)
and the chunk form (median of 3) on the same first min(T, LOOP_T[segments]) tokens (1024 for C = 64, 4096
for C = 256, 256 for log-linear: at most ~10 s each) and prints both times and their ratio; where T
is longer, it says so. MC is causal, so the first n outputs of a run on T tokens are those of the run on n.

    python -m atlaslib.bench --threads 1 --T 1024 4096 --models mc_gdn_c64 mc_gdn_c256 mc_gdn_log

Measured once with that command (B = 1, H = 4, K = V = 64, fp32, chunk length 64, one thread of a
2-core CPU sandbox shared with other jobs; absolute times drift with the neighbours' load). The chunk
form, median of 3 interleaved calls, and its peak memory (log-linear re-measured on 2026-11-26 after
the readout stopped copying a state per token: it was 470 ms / 134 MiB and 2307 ms / 536 MiB):

    segments       T = 1024            T = 4096
    C = 64         66 ms,  16 MiB      295 ms,  64 MiB
    C = 256        57 ms,  17 MiB      238 ms,  68 MiB
    log-linear    164 ms,  85 MiB      815 ms, 395 MiB

Log-linear costs more in time and memory because it compresses every aligned dyadic block from the
start state (each token about log2 T times, ~2T blocks in all) and caches T / 2 - 1 of them, states of
V x K (at T = 4096: 2047 x 64 x 64 fp32 per head, 128 MiB for H = 4, plus the blocks' outputs and
the states of the blocks that are only read online), against T / C states for constant segments.
The notes, loop (one call) vs chunk (median of 3) on the same tokens:

    segments       tokens   loop      chunk      loop / chunk
    C = 64         1024     1.56 s    0.058 s    26.8x
    C = 256        1024     0.45 s    0.056 s     8.0x
    C = 256        4096     6.48 s    0.231 s    28.1x
    log-linear      256     1.90 s    0.030 s    63.0x

The target, chunk >= 10x faster than the loop at T = 4096: met for C = 256 in the note (28.1x). For
C = 64 the loop at T = 4096 was timed once outside the benchmark (``mc_builder(64)`` called directly,
same inputs and thread count, before the run above): 64.2 s in one call against 0.31 s for the chunk
form (median of 3 just before; 0.87 s in 3 calls just after, on a busier stretch), ~200x (74x against
the slower chunk median). The log-linear loop was not timed at T = 4096: ~4 s at T = 256 and ~12 s at
512 (one call each) grow about threefold per doubling, i.e. minutes at 4096; at 256 tokens it is
already 63x slower than the chunk form. At T = 1024 with C = 256 (3 cached states) the loop has little
readout to do and the chunk form wins only 8x.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..core import random_gate, random_qkv
from ..core.benchcases import BenchShape, register_bench_case
from ..delta import delta_rule
from . import memory_caching

# the loop's token budget per segmentation (at most ~10 s on one CPU core, see the module docstring)
LOOP_T = {64: 1024, 256: 4096, "log": 256}


def mc_inputs(s: BenchShape, gen):
    """q, k, v (unit keys), Gated DeltaNet's gates (beta, log alpha) and the relevance queries u."""
    q, k, v = random_qkv(s.B, s.H, s.T, s.K, s.V, dtype=s.dtype, device=s.device, generator=gen)
    beta = random_gate(s.B, s.H, s.T, low=0.1, high=1.0, dtype=s.dtype, device=s.device, generator=gen)
    log_alpha = random_gate(s.B, s.H, s.T, low=0.9, dtype=s.dtype, device=s.device, generator=gen).log()
    u = random_qkv(s.B, s.H, s.T, s.K, 1, dtype=s.dtype, device=s.device, generator=gen)[0]
    return q, k, v, beta, log_alpha, u


def mc_builder(segments):
    """call(backend, n=T): Memory Caching over Gated DeltaNet, GRM, independent, on the first n tokens."""
    def build(s: BenchShape, gen):
        q, k, v, beta, log_alpha, u = mc_inputs(s, gen)

        def call(backend, n=s.T):
            return memory_caching(q[:, :, :n], k[:, :, :n], v[:, :, :n], base=delta_rule,
                                  base_kwargs=dict(beta=beta[:, :, :n], log_alpha=log_alpha[:, :, :n]),
                                  u=u[:, :, :n], segments=segments, mode="independent", aggregate="grm",
                                  backend=backend, chunk_size=s.chunk_size)[0]
        return call
    return build


def seconds(fn, device) -> float:
    """Wall time of one call of fn (CUDA synchronised before the clock stops)."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def loop_note(segments, loop_t: int):
    """The note: the loop (one call) and the chunk form (median of 3) on the same first min(T, loop_t) tokens."""
    def note(s: BenchShape) -> str:
        n = min(s.T, loop_t)
        call = mc_builder(segments)(s, torch.Generator().manual_seed(0))
        with torch.no_grad():
            call("chunk", n)                                                    # warm-up
            t_chunk = statistics.median(seconds(lambda: call("chunk", n), s.device) for _ in range(3))
            t_loop = seconds(lambda: call("recurrent", n), s.device)
        where = "all tokens" if n == s.T else f"the first {n} tokens only (LOOP_T: the loop's cost grows as T^2)"
        return (f"loop (recurrent) {t_loop:.3g} s vs chunk {t_chunk:.3g} s on {where}: {t_loop / t_chunk:.1f}x "
                f"(loop: one call; chunk: median of 3)")
    return note


for name, segments in (("mc_gdn_c64", 64), ("mc_gdn_c256", 256), ("mc_gdn_log", "log")):
    register_bench_case(name, mc_builder(segments), backends=("chunk", "triton"), reference="chunk",
                        note=loop_note(segments, LOOP_T[segments]))
