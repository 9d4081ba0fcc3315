"""The benchmark's registry of cases (``python -m atlaslib.bench`` reads it; chapters fill it).

Each chapter registers its rows in ``atlaslib/<chapter>/bench_cases.py``; the benchmark
imports those modules, so the chapters never import the benchmark.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BenchShape:
    B: int
    H: int
    T: int
    K: int
    V: int
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    chunk_size: int = 64


@dataclass
class BenchCase:
    name: str
    builder: callable                 # (BenchShape, Generator) -> call(backend)
    flops: callable = None            # BenchShape -> FLOPs of one call (chunkwise algorithm)
    bytes: callable = None            # BenchShape -> bytes read + written by one call
    backends: tuple = ("recurrent", "chunk", "triton")
    note: callable = None             # BenchShape -> a line printed under the table (e.g. a time share)
    reference: str = "recurrent"      # the backend the speedup column divides by (a baseline such as "sdpa")


BENCH_CASES: dict[str, BenchCase] = {}


def register_bench_case(name: str, builder, *, flops=None, bytes=None,
                        backends=("recurrent", "chunk", "triton"), note=None, reference="recurrent"):
    """Add a row family to the benchmark. ``builder(shape, generator) -> call(backend)``;
    ``note(shape) -> str``, if given, is printed under the table for each T. ``backends`` may name
    baselines beside the library's backends (e.g. "sdpa"); names starting with "triton" run on CUDA
    only. ``reference``: the backend whose time the speedup column divides (default the loop; a
    case without it timed gets no speedup)."""
    if name in BENCH_CASES:
        raise ValueError(f"bench case {name!r} is already registered")
    BENCH_CASES[name] = BenchCase(name, builder, flops, bytes, tuple(backends), note, reference)
    return builder
