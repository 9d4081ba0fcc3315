"""Segmentations of a sequence for Memory Caching (chapter 7 §1 and §4).

Two kinds, both described by one ``Layout``:

* **consecutive segments** (a constant length C, or a user list of lengths): segment s covers
  tokens [start_s, end_s); a token of segment s reads the cached final states of all earlier
  segments i < s, and its own segment's running state (the "online" memory).
* **log-linear** (Fenwick / dyadic, [MC] §4.2): write the 1-based position t = sum_j 2^{b_j} with
  b_1 > b_2 > ...; the segments of t are the consecutive blocks of those lengths, largest first.
  Every block is aligned (its 0-based start is a multiple of its length), so only the ~2T aligned
  dyadic blocks exist; t's own block is the last one (length lowbit(t)), and t is its last token.

Positions here are 0-based token indices: token index i is the 1-based position i + 1.
"""
from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import torch

from ..core.validation import check_int, process_constant, static_int

SEGMENTATIONS = ("constant", "list", "log")


class Layout(NamedTuple):
    """Which cached states each token reads.

    ``cached``: the cached segments as (start, end) half-open token ranges, index n = 0..N-1.
    ``visible``: per token, the indices n of the cached states it reads (earlier segments only).
    ``online``: per token, the (start, end) range of its own (online) segment; end > token.
    ``log``: True for the log-linear segmentation.
    """
    cached: list
    visible: list
    online: list
    log: bool

    def blocks(self, device="cpu") -> torch.Tensor:
        """The int64 table [T, J] of visible cached states (J = the most any token reads), -1 padded.
        Built once per layout and device (``make_layout`` returns one layout per (T, segments)), so a
        forward pass copies nothing from the host; treat it as read-only."""
        return self._kept(_BLOCKS, self._table, device)

    def _table(self, device) -> torch.Tensor:
        J = max([len(v) for v in self.visible] + [1])
        return torch.tensor([vis + [-1] * (J - len(vis)) for vis in self.visible], dtype=torch.int64, device=device)

    def bounds(self, device="cpu") -> tuple:
        """int64 tensors (starts, ends) of the cached segments [N] and (starts, ends) of each token's online
        prefix [T] (its segment's start, t + 1): what pooling the keys reads. Kept as ``blocks`` is."""
        return self._kept(_BOUNDS, self._bounds, device)

    def _bounds(self, device) -> tuple:
        def ints(xs):
            return torch.tensor(xs, dtype=torch.int64, device=device)
        return (ints([a for a, _ in self.cached]), ints([b for _, b in self.cached]),
                ints([a for a, _ in self.online]), ints(list(range(1, len(self.online) + 1))))

    def reader_runs(self) -> tuple[list, list]:
        """(first reader, number of tokens from it to the last reader) of each cached state, as ``readers_of``
        finds them in the table, from the layout's own lists (no tensor is read)."""
        T, N = len(self.visible), len(self.cached)
        first, last = [T] * N, [-1] * N
        for t, vis in enumerate(self.visible):
            for n in vis:
                first[n], last[n] = min(first[n], t), max(last[n], t)
        return [min(a, T - 1) for a in first], [max(b - a + 1, 0) for a, b in zip(first, last)]

    def reader_groups(self, device="cpu") -> list:
        """``reader_groups`` of the layout's table, from its own lists: nothing is read from a device, and
        torch.compile can trace a readout that is given them (the table's values are unknown to it). Built
        once per layout and device, like the table."""
        return self._kept(_GROUPS, lambda d: _groups(*self.reader_runs(), d), device)

    def _kept(self, cache: dict, build, device):
        """build(device), once per layout and device (a copy from the host on every call waits for the GPU
        each time); built in the graph while torch.compile traces."""
        if torch.compiler.is_compiling():
            return build(device)
        key = (id(self.visible), str(torch.device(device)))
        hit = cache.get(key)
        if hit is not None and hit[0] is self.visible:
            return hit[1]
        with process_constant():              # kept: a table an eval pass built must serve a training pass
            value = build(device)
        _remember(cache, key, (self.visible, value))
        return value


# Tables built from layouts, per (layout, device), and what is derived from them: the entries hold their
# keys' objects, so an id is never reused while its entry lives. Bounded: the oldest entry goes first.
_BLOCKS: dict = {}
_GROUPS: dict = {}
_BOUNDS: dict = {}
CACHE_ENTRIES = 64


def _remember(cache: dict, key, value):
    if len(cache) >= CACHE_ENTRIES:
        cache.pop(next(iter(cache)))
    cache[key] = value


def check_length(T) -> int:
    """T must be an int >= 1, as the models' sequences are: a layout of no tokens has no table of reads.
    (While torch.compile traces with dynamic shapes T is a SymInt.)"""
    return check_int("T (the number of tokens)", T, 1)


def check_top_k(top_k):
    if top_k is not None:
        check_int("top_k", top_k, 1, " (or None: all visible states)")


def check_lengths(lengths) -> list:
    """Segment lengths given as a list (or tuple): at least one, each an int >= 1 (any integral type, as a
    single length may be: numpy's ints too)."""
    if not isinstance(lengths, (list, tuple)) or not lengths or any(
            isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in lengths):
        raise ValueError(f"segments as a list must hold positive int lengths, got {lengths!r}")
    return [int(n) for n in lengths]


def segment_lengths(T: int, segments) -> list:
    """The lengths of consecutive segments: an int C (the last segment takes the remainder) or a list
    that must sum to T (T >= 1)."""
    check_length(T)
    if isinstance(segments, bool) or not isinstance(segments, (numbers.Integral, list, tuple)):
        raise ValueError(f"segments must be an int >= 1, a list of lengths summing to T, or 'log'; got {segments!r}")
    if isinstance(segments, numbers.Integral):
        segments = int(segments)
        if segments < 1:
            raise ValueError(f"segments (the segment length) must be >= 1, got {segments}")
        return [segments] * (T // segments) + ([T % segments] if T % segments else [])
    lengths = check_lengths(segments)
    if sum(lengths) != T:
        raise ValueError(f"the segment lengths {lengths} sum to {sum(lengths)}, but the sequence has T = {T} tokens")
    return lengths


def consecutive_layout(lengths: list) -> Layout:
    """Token t of segment s reads the cached final states of segments 0..s-1 (so N = segments - 1
    states are cached: the last segment is only ever online)."""
    lengths = check_lengths(lengths)
    starts = [sum(lengths[:s]) for s in range(len(lengths))]
    spans = [(a, a + n) for a, n in zip(starts, lengths)]
    visible, online = [], []
    for s, (a, b) in enumerate(spans):
        for _ in range(a, b):
            visible.append(list(range(s)))
            online.append((a, b))
    return Layout(spans[:-1], visible, online, False)     # no token reads the last segment as a cache


def dyadic_blocks(position: int) -> list:
    """The log-linear segments of a 1-based position: aligned blocks (start, end) 0-based half-open,
    largest first; their lengths are the powers of two of ``position``'s binary expansion."""
    check_int("position", position, 1, " (positions are 1-based)")
    out, start = [], 0
    for bit in reversed(range(position.bit_length())):
        if position >> bit & 1:
            out.append((start, start + (1 << bit)))
            start += 1 << bit
    return out


def log_layout(T: int) -> Layout:
    """The Fenwick layout of T >= 1 tokens: every complete aligned block that some token reads as a cached state."""
    check_length(T)
    index, cached, visible, online = {}, [], [], []
    for t in range(T):
        blocks = dyadic_blocks(t + 1)
        vis = []
        for blk in blocks[:-1]:
            if blk not in index:
                index[blk] = len(cached)
                cached.append(blk)
            vis.append(index[blk])
        visible.append(vis)
        online.append(blocks[-1])
    return Layout(cached, visible, online, True)


def make_layout(T: int, segments) -> Layout:
    """Layout of T >= 1 tokens for ``segments`` = int | list of lengths | "log"; one object per (T, segments),
    built once (while torch.compile traces, built afresh: the trace holds it as a constant)."""
    check_length(T)                           # before the cache, where True would find the entry of 1
    if torch.compiler.is_compiling():
        # the layout's lists are Python structure, built for one T: a length that torch.compile traces as
        # symbolic (T, or a segment length under dynamic=True) is fixed to its value (a guard: each length
        # compiles its own graph)
        fixed = [static_int(n) for n in segments] if isinstance(segments, (list, tuple)) else static_int(segments)
        return _build_layout(static_int(T), fixed)
    if isinstance(segments, (int, str)) and not isinstance(segments, bool):
        return _cached_layout(T, type(segments).__name__, segments)
    if isinstance(segments, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in segments):
        return _cached_layout(T, "list", tuple(segments))
    return _build_layout(T, segments)


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def _cached_layout(T: int, kind: str, segments) -> Layout:
    return _build_layout(T, list(segments) if kind == "list" else segments)


def _build_layout(T: int, segments) -> Layout:
    if isinstance(segments, str):
        if segments != "log":
            raise ValueError(f"segments must be an int, a list of lengths or 'log', got {segments!r}")
        return log_layout(T)
    return consecutive_layout(segment_lengths(T, segments))


def readers_of(blocks, N):
    """(first token, number of tokens) of the run of tokens that read each cached state, from the
    table [T, J]. The run from the first reader to the last covers every reader; a token inside it
    that does not read the state gets the weight 0."""
    T, J = blocks.shape
    t = torch.arange(T, device=blocks.device)[:, None].expand(T, J)
    seen = blocks >= 0
    n, t = blocks[seen], t[seen]
    first = torch.full((N,), T, dtype=torch.int64, device=blocks.device).scatter_reduce(0, n, t, "amin")
    last = torch.full((N,), -1, dtype=torch.int64, device=blocks.device).scatter_reduce(0, n, t, "amax")
    return first.clamp(max=T - 1), (last - first + 1).clamp(min=0)


def reader_groups(blocks, N) -> list:
    """The cached states grouped by the length of their run of readers (``readers_of``): a list of
    (length, states [g], tokens [g, length]), by increasing length. It reads the lengths on the host
    (a sync on an accelerator; impossible while torch.compile traces): a layout's own groups,
    ``Layout.reader_groups``, are built from its lists instead, once."""
    first, length = readers_of(blocks, N)
    return _groups(first.tolist(), length.tolist(), blocks.device)


def _groups(first: list, length: list, device) -> list:
    """(length, states [g], tokens [g, length]) per distinct run length, from each state's run (Python ints)."""
    groups = []
    for n_len in sorted(set(length)):
        ns = [n for n, x in enumerate(length) if x == n_len]                # states read by n_len tokens
        tokens = [[first[n] + i for i in range(n_len)] for n in ns]
        groups.append((n_len, torch.tensor(ns, dtype=torch.int64, device=device),
                       torch.tensor(tokens, dtype=torch.int64, device=device).reshape(len(ns), n_len)))
    return groups


def reader_spans(layout: Layout) -> list:
    """For each cached state, the token range [first, last + 1) of the tokens that read it (so a memory
    is run on those queries only: O(T log T) passes for log-linear, not O(T^2))."""
    return [(a, a + n) for a, n in zip(*layout.reader_runs())]


def memory_reads(layout: Layout, top_k=None) -> int:
    """Memory passes the readout makes: one online read per token plus one per cached state it reads
    (at most top_k >= 1 with SSC; None: all). [MC] §4.2 bounds it by O(L + N L)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a Layout (make_layout's result), got {type(layout).__name__}")
    check_top_k(top_k)
    return sum(1 + (len(v) if top_k is None else min(top_k, len(v))) for v in layout.visible)
