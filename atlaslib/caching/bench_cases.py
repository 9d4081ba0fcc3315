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
note under the table, not in the table: its readout runs the base from each cached state over the
tokens that read it (sum_t n_t per-token steps: ~T^2 / (2C) for constant segments, ~T log2 T / 2 for
log-linear), plus a Python loop per token over the states it sees, so at T = 4096 it takes ~25 s for
C = 64; and the benchmark would run it five times, once under the profiler that measures CPU memory,
which records each of its 10^5-10^6 small operations (60-150 times slower than the plain call). So
each note times the loop (one call) and the chunk form (median of 3) on the same first
min(T, LOOP_T[segments]) tokens (1024 for C = 64, all 4096 for C = 256 and log-linear: at most ~10 s
each) and prints both times and their ratio; where T is longer, it says so. MC is causal, so the first
n outputs of a run on T tokens are those of the run on n.

    python -m atlaslib.bench --threads 1 --T 1024 4096 --models mc_gdn_c64 mc_gdn_c256 mc_gdn_log

What that command reports on one CPU thread (B = 1, H = 4, K = V = 64, fp32, chunk length 64; the
absolute times depend on the machine, the ratios much less). The chunk form, median of 3 interleaved
calls, and its peak memory:

    segments       T = 1024            T = 4096
    C = 64         58 ms,  16 MiB      289 ms,  64 MiB
    C = 256        51 ms,  17 MiB      235 ms,  68 MiB
    log-linear    151 ms,  85 MiB      746 ms, 395 MiB

Log-linear costs more in time and memory because it compresses every aligned dyadic block from the
start state (each token about log2 T times, ~2T blocks in all, each with a V x K final state) and
caches T / 2 - 1 of them, against T / C states for constant segments. The notes, loop (one call) vs
chunk (median of 3) on the same tokens:

    segments       tokens   loop      chunk      loop / chunk
    C = 64         1024     1.12 s    0.056 s    20.1x
    C = 256        1024     0.37 s    0.053 s     7.0x
    C = 256        4096     4.84 s    0.220 s    22.0x
    log-linear     1024     1.27 s    0.155 s     8.2x
    log-linear     4096     6.19 s    0.744 s     8.3x

The target, chunk >= 10x faster than the loop at T = 4096: met for C = 256 (22x, in the note) and for
C = 64 (the loop timed once outside the benchmark, ``mc_builder(64)`` called directly with the same
inputs and thread count: 24.2 s against 0.28-0.43 s for the chunk form, 57-86x).
Not met for log-linear: 8.3x. Its chunk form does the loop's base work too (every block compressed
from the start state, T log2 T tokens in short blocks), so the loop's overhead is a smaller share; a
linear base could sum the large blocks' states from the small ones, the delta rule cannot. At T = 1024
with C = 256 (3 cached states) the loop has little readout to do and the chunk form wins only 7x.
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
LOOP_T = {64: 1024, 256: 4096, "log": 4096}


def mc_inputs(s: BenchShape, gen):
    """q, k, v (unit keys), Gated DeltaNet's gates (beta, log alpha) and the relevance queries u, in the
    shape's dtype except log alpha (fp32, or fp64 for fp64 runs)."""
    q, k, v = random_qkv(s.B, s.H, s.T, s.K, s.V, dtype=s.dtype, device=s.device, generator=gen)
    beta = random_gate(s.B, s.H, s.T, low=0.1, high=1.0, dtype=s.dtype, device=s.device, generator=gen)
    # log-gates stay fp32 (fp64 for fp64 runs) whatever the activation dtype: memory_caching refuses a
    # log-gate rounded to bf16/fp16, whose small decays would be lost
    log_dtype = torch.float64 if s.dtype == torch.float64 else torch.float32
    log_alpha = random_gate(s.B, s.H, s.T, low=0.9, dtype=log_dtype, device=s.device, generator=gen).log()
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
