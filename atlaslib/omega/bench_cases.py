"""Benchmark rows for chapter 4 (loaded by ``python -m atlaslib.bench``): the Omega rule and
SWLA with a linear memory, unit keys, per-offset window gates gamma in [0.5, 1], retention
alpha in [0.9, 1] and a step eta in [0.1, 1] / c (stable: eta * c < 2, see ``omega_rule``).

Rows:

* ``omega`` and ``swla``: window c = 8, every backend (recurrent, chunk, and triton on a GPU);
* ``omega_c1``, ``omega_c4``, ``omega_c16``, ``omega_c64``: the Omega rule at c = 1, 4, 16, 64,
  chunk and triton backends only, for the **cost of the window** table. The per-token loop
  is left out there: it evaluates c gradients per token, so its flops grow in proportion to
  c, while on a CPU its per-token overhead dominates and its time barely moves (chapter 4 §12).

    python -m atlaslib.bench --models omega swla --T 4096                   # chunk vs loop
    python -m atlaslib.bench --models omega_c1 omega_c4 omega_c16 omega_c64 --T 4096

With chunk size b, a chunk reads b + c - 1 window rows (it reaches c - 1 rows into the
previous chunk), so the chunk form's work per token grows like b + c rather than c.
"""
from __future__ import annotations

import torch

from ..core.benchcases import BenchShape, register_bench_case
from ..core import random_gate, random_qkv
from . import omega_rule, swla

WINDOW = 8
WINDOW_SWEEP = (1, 4, 16, 64)


def window_flops(c: int, hebbian: bool = False):
    """FLOPs of the chunk form per call, at chunk length b = min(chunk_size, T) and W = b + c - 1
    window rows per chunk. Per chunk and head: the weights C = (D diag(eta)) Gamma (2 b^2 W), the
    scores Q K_win^T (2 b W K), the start-state read Q S^T (2 b K V), the errors K_win S^T
    (2 W K V; not for SWLA, whose errors are -V), the output scores @ E (2 b W V) and the state
    update E^T K_win (2 W V K)."""
    def count(s: BenchShape) -> float:
        b = min(s.chunk_size, s.T)
        W = b + c - 1
        per_chunk = 2 * b * b * W + 2 * b * W * s.K + 2 * b * s.K * s.V + 2 * b * W * s.V + 2 * W * s.V * s.K
        if not hebbian:
            per_chunk += 2 * W * s.K * s.V
        n_chunks = -(-s.T // b)
        return s.B * s.H * n_chunks * per_chunk
    return count


def window_bytes(c: int):
    def count(s: BenchShape) -> float:
        itemsize = torch.empty((), dtype=s.dtype).element_size()
        # q, k, v, the c window gates, alpha and eta in; o out
        return s.B * s.H * s.T * (2 * s.K + 2 * s.V + c + 2) * itemsize
    return count


def window_builder(c: int, rule):
    def build(s: BenchShape, gen: torch.Generator):
        q, k, v = random_qkv(s.B, s.H, s.T, s.K, s.V, dtype=s.dtype, device=s.device, generator=gen)
        gamma = random_gate(s.B, s.H, s.T, c, low=0.5, dtype=s.dtype, device=s.device, generator=gen)
        alpha = random_gate(s.B, s.H, s.T, low=0.9, dtype=s.dtype, device=s.device, generator=gen)
        eta = random_gate(s.B, s.H, s.T, low=0.1, dtype=s.dtype, device=s.device, generator=gen) / c
        return lambda backend: rule(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, backend=backend,
                                    chunk_size=s.chunk_size)
    return build


register_bench_case("omega", window_builder(WINDOW, omega_rule), flops=window_flops(WINDOW),
                    bytes=window_bytes(WINDOW))
register_bench_case("swla", window_builder(WINDOW, swla), flops=window_flops(WINDOW, hebbian=True),
                    bytes=window_bytes(WINDOW))
for _c in WINDOW_SWEEP:
    register_bench_case(f"omega_c{_c}", window_builder(_c, omega_rule), flops=window_flops(_c),
                        bytes=window_bytes(_c), backends=("chunk", "triton"))
