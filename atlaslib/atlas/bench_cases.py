"""Benchmark rows for chapter 5 (loaded by ``python -m atlaslib.bench``): ATLAS with a linear
memory, unit keys, retention alpha in [0.9, 1], momentum decay theta in [0.5, 0.9] and an outer
step eta in [0.05, 0.3] (NS_5(S) has singular values near 1, so eta is the step's spectral size).

Rows:

* ``atlas``: window c = 1, every backend (recurrent, chunk, and triton on a GPU);
* ``atlas_c4``: window c = 4 with per-offset gates gamma in [0.5, 1].

    python -m atlaslib.bench --models atlas atlas_c4 --T 4096

Newton–Schulz sets a floor under every backend: each token's momentum is orthogonalised, k
rounds of three small matrix products per token, in the per-token loop and in the chunk form
alike (the chunk form batches them, it does not remove them). On a CPU, where batching buys
little, the chunk form is therefore only somewhat faster than the loop at K = V = 64 (measured
2.5 s vs 2.8 s for B = 1, H = 4, T = 1024 on one core); the gap is the rest of the rule.
"""
from __future__ import annotations

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


register_bench_case("atlas", atlas_builder(1), flops=atlas_flops(1), bytes=atlas_bytes(1))
register_bench_case("atlas_c4", atlas_builder(4), flops=atlas_flops(4), bytes=atlas_bytes(4))
