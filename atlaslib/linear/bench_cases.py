"""Benchmark rows for chapter 1 (loaded by ``python -m atlaslib.bench``): linear attention
without gates, with a scalar gate per token (RetNet/Mamba2) and with per-channel gates (GLA)."""
from __future__ import annotations

import torch

from ..core import random_gate, random_qkv
from ..core.benchcases import BenchShape, register_bench_case
from . import linear_attention


def linear_flops(s: BenchShape) -> float:
    """Chunkwise linear attention, per token and head: q k^T and scores v inside the chunk
    (2b(K+V), b the chunk size), the inter-chunk read q M^T and the memory update v^T k (4KV).
    The Triton kernel picks its own tile (64, or 16 for per-channel gates), so for it this
    is the work of the algorithm at b = chunk_size, not a count of its instructions."""
    return s.B * s.H * s.T * (2 * min(s.chunk_size, s.T) * (s.K + s.V) + 4 * s.K * s.V)


def _io_bytes(gate_width: int):
    def count(s: BenchShape) -> float:
        itemsize = torch.empty((), dtype=s.dtype).element_size()
        return s.B * s.H * s.T * (2 * s.K + 2 * s.V + gate_width(s)) * itemsize   # q, k, v, gate in; o out
    return count


def _linear_builder(gate: str):
    def build(s: BenchShape, gen: torch.Generator):
        q, k, v = random_qkv(s.B, s.H, s.T, s.K, s.V, dtype=s.dtype, device=s.device, generator=gen)
        alpha = None
        if gate != "none":
            alpha = random_gate(s.B, s.H, s.T, s.K if gate == "channel" else None, low=0.9,
                                dtype=s.dtype, device=s.device, generator=gen)
        return lambda backend: linear_attention(q, k, v, alpha=alpha, backend=backend, chunk_size=s.chunk_size)
    return build


register_bench_case("linear", _linear_builder("none"), flops=linear_flops, bytes=_io_bytes(lambda s: 0))
register_bench_case("linear_scalar_gate", _linear_builder("scalar"), flops=linear_flops,
                    bytes=_io_bytes(lambda s: 1))
register_bench_case("linear_channel_gate", _linear_builder("channel"), flops=linear_flops,
                    bytes=_io_bytes(lambda s: s.K))


