"""Benchmark rows for chapter 2 (loaded by ``python -m atlaslib.bench``): DeltaNet,
Gated DeltaNet and KDA at the bench shape, unit keys, beta in [0.1, 1]."""
from __future__ import annotations

import torch

from ..core.benchcases import BenchShape, register_bench_case
from ..core import random_gate, random_qkv
from . import delta_rule


def delta_flops(s: BenchShape) -> float:
    """The WY chunk form of the delta rule, per token and head, at chunk length C = min(chunk_size, T):
    the chunk's k k^T and q k^T (2 * 2CK), the inverse R of the unit lower triangular [C, C] system
    (about C^2/3 per token: inverting an n x n triangular matrix takes n^3/3), the WY pair W = Rb (K e^g) and U0 = Rb V
    (2CK + 2CV), the start-memory terms U = U0 - W M_0^T and Q M_0^T (2 * 2KV), the intra-chunk
    output P U (2CV) and the state update U^T K (2KV). Gates change only elementwise work."""
    C = min(s.chunk_size, s.T)
    return s.B * s.H * s.T * (6 * C * s.K + 4 * C * s.V + C * C / 3 + 6 * s.K * s.V)


def _io_bytes(gate_width):
    def count(s: BenchShape) -> float:
        itemsize = torch.empty((), dtype=s.dtype).element_size()
        # q, k, v, beta and the gate in; o out
        return s.B * s.H * s.T * (2 * s.K + 2 * s.V + 1 + gate_width(s)) * itemsize
    return count


def _delta_builder(gate: str):
    def build(s: BenchShape, gen: torch.Generator):
        q, k, v = random_qkv(s.B, s.H, s.T, s.K, s.V, dtype=s.dtype, device=s.device, generator=gen)
        beta = random_gate(s.B, s.H, s.T, low=0.1, high=1.0, dtype=s.dtype, device=s.device, generator=gen)
        alpha = None
        if gate != "none":
            alpha = random_gate(s.B, s.H, s.T, s.K if gate == "channel" else None, low=0.9,
                                dtype=s.dtype, device=s.device, generator=gen)
        return lambda backend: delta_rule(q, k, v, beta, alpha=alpha, backend=backend, chunk_size=s.chunk_size)
    return build


register_bench_case("deltanet", _delta_builder("none"), flops=delta_flops, bytes=_io_bytes(lambda s: 0))
register_bench_case("gated_deltanet", _delta_builder("scalar"), flops=delta_flops, bytes=_io_bytes(lambda s: 1))
register_bench_case("kda", _delta_builder("channel"), flops=delta_flops, bytes=_io_bytes(lambda s: s.K))
