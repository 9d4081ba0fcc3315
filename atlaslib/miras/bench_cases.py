"""Benchmark rows for chapter 3 (loaded by ``python -m atlaslib.bench``): TTT-MLP and Titans
(MLP memory, expansion 4: the per-token engine against the chunk form), and Titans with a
linear memory (also the Triton kernel on CUDA). Unit keys, eta in [0.01, 0.1], alpha in
[0.9, 1], theta in [0.5, 0.9]."""
from __future__ import annotations

import torch

from ..core.benchcases import BenchShape, register_bench_case
from ..core import random_gate, random_qkv
from . import build_parts, make_config, miras


def miras_flops(preset: str, **overrides):
    """FLOPs of the chunk form (dual readouts), per token and head, at chunk length C = min(chunk_size, T),
    summed over the memory's weights W [out, in] (P_w = out * in): the frozen gradient's factors
    (forward W x and backward W^T a, 4 P_w), the readout from the chunk-start weights (2 P_w) and
    the end-of-chunk rank-C update (2 P_w), each doubled for the momentum buffer (Titans), plus
    the in-chunk scores and their product with the factors (2C (in + out))."""
    cfg = make_config(preset, **overrides)

    def count(s: BenchShape) -> float:
        shapes = build_parts(cfg, s.K, s.V).memory.shapes.values()
        C = min(s.chunk_size, s.T)
        per_weight = 12 if cfg.optimizer == "momentum" else 8
        work = sum(per_weight * o * i + 2 * C * (o + i) for o, i in shapes)
        return s.B * s.H * s.T * work
    return count


def _io_bytes(n_gates: int):
    def count(s: BenchShape) -> float:
        itemsize = torch.empty((), dtype=s.dtype).element_size()
        return s.B * s.H * s.T * (2 * s.K + 2 * s.V + n_gates) * itemsize     # q, k, v, gates in; o out
    return count


def _builder(preset: str, **overrides):
    cfg = make_config(preset, **overrides)

    def build(s: BenchShape, gen: torch.Generator):
        q, k, v = random_qkv(s.B, s.H, s.T, s.K, s.V, dtype=s.dtype, device=s.device, generator=gen)
        gate = lambda low, high: random_gate(s.B, s.H, s.T, low=low, high=high, dtype=s.dtype,   # noqa: E731
                                             device=s.device, generator=gen)
        gates = {"eta": gate(0.01, 0.1)}
        if cfg.retention != "none":
            gates["alpha"] = gate(0.9, 1.0)
        if cfg.optimizer == "momentum":
            gates["theta"] = gate(0.5, 0.9)
        return lambda backend: miras(q, k, v, config=cfg, backend=backend, chunk_size=s.chunk_size, **gates)
    return build


register_bench_case("ttt_mlp", _builder("ttt_mlp"), flops=miras_flops("ttt_mlp"), bytes=_io_bytes(1),
                    backends=("recurrent", "chunk"))
register_bench_case("titans", _builder("titans"), flops=miras_flops("titans"), bytes=_io_bytes(3),
                    backends=("recurrent", "chunk"))
register_bench_case("titans_linear", _builder("titans", memory="linear"), flops=miras_flops("titans", memory="linear"),
                    bytes=_io_bytes(3))
