"""Benchmark rows for chapter 5 (loaded by ``python -m atlaslib.bench``): ATLAS with a linear
memory, unit keys, retention alpha in [0.9, 1], momentum decay theta in [0.5, 0.9], an outer
step eta in [0.05, 0.3] (NS_5(S) has singular values near 1, so eta is the step's spectral size)
and k = 5 Newton–Schulz steps.

Rows:

* ``atlas``: window c = 1, every backend (recurrent, chunk, and triton on a GPU);
* ``atlas_c4``, ``atlas_c8``: windows c = 4 and 8 with per-offset gates gamma in [0.5, 1].

    python -m atlaslib.bench --models atlas atlas_c8 --T 1024 4096

Under the table each row prints the share of the chunk form's time spent in Newton–Schulz
(``ns_share``: the time inside ``core.newton_schulz`` over the time of the call).

Newton–Schulz sets a floor under every backend: each token's momentum is orthogonalised, k
rounds of three small matrix products per token, in the per-token loop and in the chunk form
alike (the chunk form batches them, it does not remove them). On a CPU, where batching buys
little, the chunk form is therefore only somewhat faster than the loop at K = V = 64: for
B = 1, H = 4, T = 1024, fp32, chunk length 64, one CPU thread, 1.47 s vs
1.84 s at c = 1 and 1.06 s vs 1.41 s at c = 8, with Newton–Schulz 83% and 82% of the chunk
form's time (T = 4096: 4.82 s vs 6.68 s and 4.57 s vs 6.69 s, 84% and 83%); the gap is the
rest of the rule. (With two threads on a machine that another job
also loads, the per-token loop's small operations slow down erratically, up to 50-fold: time
it with ``--threads 1`` there.)
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ..core import random_gate, random_qkv
from ..core.benchcases import BenchShape, register_bench_case
from . import atlas

NS_STEPS = 5


def atlas_flops(c: int):
    """FLOPs of the chunk form per call, at chunk length b = min(chunk_size, T), W = b + c - 1 window
    rows and momenta [V, K] with m = min(V, K), n = max(V, K). Per chunk and head: the errors at the
    chunk-start memory (2 W K V), the momentum weights D_theta Gamma (2 b^2 W), all b momenta
    (2 b W V K), Newton–Schulz on them (b NS_STEPS (4 m^2 n + 2 m^3)), the scan for M (2 b^2 V K)
    and the readout (2 b V K)."""
    def count(s: BenchShape) -> float:
        b = min(s.chunk_size, s.T)
        W = b + c - 1
        m, n = min(s.V, s.K), max(s.V, s.K)
        per_chunk = (2 * W * s.K * s.V + 2 * b * b * W + 2 * b * W * s.V * s.K
                     + b * NS_STEPS * (4 * m * m * n + 2 * m ** 3) + 2 * b * b * s.V * s.K + 2 * b * s.V * s.K)
        return s.B * s.H * -(-s.T // b) * per_chunk
    return count


def atlas_bytes(c: int):
    def count(s: BenchShape) -> float:
        itemsize = torch.empty((), dtype=s.dtype).element_size()
        # q, k, v, alpha, eta, theta and (c > 1) the c window gates in; o out
        return s.B * s.H * s.T * (2 * s.K + 2 * s.V + 3 + (c if c > 1 else 0)) * itemsize
    return count


def atlas_builder(c: int):
    def build(s: BenchShape, gen: torch.Generator):
        q, k, v = random_qkv(s.B, s.H, s.T, s.K, s.V, dtype=s.dtype, device=s.device, generator=gen)
        def gate(low, high, *width):
            return random_gate(s.B, s.H, s.T, *width, low=low, high=high, dtype=s.dtype, device=s.device,
                               generator=gen)
        alpha, eta, theta = gate(0.9, 1.0), gate(0.05, 0.3), gate(0.5, 0.9)
        gamma = gate(0.5, 1.0, c) if c > 1 else None
        return lambda backend: atlas(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, theta=theta,
                                     ns_steps=NS_STEPS, backend=backend, chunk_size=s.chunk_size)
    return build


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed_newton_schulz(device: str = "cpu"):
    """Count the seconds the chunk form spends in ``newton_schulz`` while the block runs: yields a
    one-element list that holds the running total."""
    from . import chunk

    spent = [0.0]
    original = chunk.newton_schulz

    def timed(*args, **kwargs):
        _sync(device)
        start = time.perf_counter()
        out = original(*args, **kwargs)
        _sync(device)
        spent[0] += time.perf_counter() - start
        return out

    chunk.newton_schulz = timed
    try:
        yield spent
    finally:
        chunk.newton_schulz = original


def ns_share(s: BenchShape, window: int = 1, repeats: int = 3) -> float:
    """Share of the chunk form's time spent in Newton–Schulz (J = ``NS_STEPS``) at shape ``s``: the
    median over ``repeats`` calls, after one warm-up call, of (time in NS_J) / (time of the call)."""
    call = atlas_builder(window)(s, torch.Generator().manual_seed(0))
    shares = []
    with torch.no_grad():
        call("chunk")
        for _ in range(repeats):
            with timed_newton_schulz(s.device) as spent:
                _sync(s.device)
                start = time.perf_counter()
                call("chunk")
                _sync(s.device)
                total = time.perf_counter() - start
            shares.append(spent[0] / total)
    return statistics.median(shares)


def ns_note(c: int):
    def note(s: BenchShape) -> str:
        return f"Newton-Schulz (J = {NS_STEPS}) takes {ns_share(s, c):.0%} of the chunk form's time"
    return note


for _c, _name in ((1, "atlas"), (4, "atlas_c4"), (8, "atlas_c8")):
    register_bench_case(_name, atlas_builder(_c), flops=atlas_flops(_c), bytes=atlas_bytes(_c), note=ns_note(_c))
