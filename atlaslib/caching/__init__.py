"""Chapter 7: Memory Caching (MC), RNNs whose memory grows with the sequence ([MC]; the book's chapter 7).

The sequence is cut into segments; any base model of the book compresses each segment into its
memory state, the final state of every segment is cached, and each token reads its own segment's
running memory together with the cached ones, mixed by an aggregator (residual, GRM, soup, SSC).
With the log-linear (Fenwick) segmentation and GRM this is Log-Linear++.

Rooms: ``segments.py`` (constant, list and log-linear segmentations, the table of what each token
reads, the count of memory reads), ``base.py`` (how a base model is called per segment and how a
cached state is read), ``recurrent.py`` (the definition: per token, an explicit list of cached
states) and ``chunk.py`` (the base's chunk form per segment, all segments of a length at once in
independent mode, then the batched readout; ``cached_readout`` is the Triton kernel's contract:
``kernel.cached_readout_triton`` with the same arguments, used by backend "triton"/"auto" on CUDA).
``kernel.py``: that Triton readout for matrix memories (the residual/GRM/SSC weights, top-k by
iterated selection, and the weighted sum of the cached states' reads), for any number of cached states
per token (a tile of 32 at a time); for fp64 or K > 256, ``memory_caching`` runs ``cached_readout`` instead.

Exactness (chapter 7 §1–4): the segment operations (bookkeeping, pooling, scores, softmax, top-k, the
readout contraction) are exact, so MC over a base inherits the base's table: chunk == recurrent for
every chunk size over linear attention, its gated family, the delta family and SWLA; only at
chunk_size = 1 for the frozen-gradient bases. Exact identities (tests/test_caching.py): one segment
is the base; residual + independent + zero start over linear attention is linear attention;
checkpoint residual is its closed form; soup is GRM for a matrix memory; SSC with top_k at least
the number of visible states is GRM.

Not here: an exact chunk form inside a segment for frozen-gradient bases beyond their own, a
checkpoint mode for the log-linear segmentation, and a batched readout for deep memories (they are
read one cached state at a time, soup one token at a time).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..core import check_chunk_size, check_flag, check_qkv
from ..core.dispatch import (choose_backend, lazy, matrix_kernel_limits, on_the_inputs_gpu, with_chunk_backward,
                             without_autocast)
from ..core.types import ModelOutput
from .base import base_name, check_base, check_per_token, run_base
from .chunk import AGGREGATES, cached_readout, memory_caching_chunk, readout_weights
from .recurrent import memory_caching_recurrent
from .segments import (SEGMENTATIONS, Layout, check_top_k, consecutive_layout, dyadic_blocks, log_layout, make_layout,
                       memory_reads, segment_lengths)

MODES = ("checkpoint", "independent")
POOLS = ("mean", "sum")
# The readout of cached matrix memories on the GPU: a Triton kernel with cached_readout's contract.
READOUT_KERNEL = lazy(f"{__name__}.kernel", "cached_readout_triton")


def kernel_readout(q, u, states, pooled, online, online_score, blocks, top_k=None, aggregate="grm", groups=None):
    """The kernel's forward, differentiated through ``cached_readout`` (as the forward-only kernels of
    chapters 3-6 are; linear attention and the delta rule have backward kernels of their own).
    A readout the kernel refuses (K too large, fp64, a feature map that makes q wider than u) runs
    ``cached_readout`` instead, the same function. groups: as in ``cached_readout`` (the layout's, so that
    the backward reads nothing from the device)."""
    args = (q, u, states, pooled, online, online_score, blocks, top_k, aggregate)
    if lazy(f"{__name__}.kernel", "kernel_limits")(q, blocks, u) is not None:
        return cached_readout(*args, groups=groups)

    def chunk_form(q, u, states, pooled, online, online_score, blocks, top_k, aggregate):
        return (cached_readout(q, u, states, pooled, online, online_score, blocks, top_k, aggregate, groups),)
    with on_the_inputs_gpu(q):
        return with_chunk_backward(lambda *a: (READOUT_KERNEL(*a),), chunk_form, *args)[0]


def check_options(mode: str, aggregate: str, pool: str | None, top_k: int | None, log: bool = False) -> None:
    """The caching options shared by ``memory_caching`` and its mixer (``nn.caching_mixers.MemoryCaching``);
    pool None: not given."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    if pool is not None and pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    if pool is not None and aggregate == "residual":
        raise ValueError(f"pool scores the cached states for grm, soup and ssc; aggregate='residual' adds them "
                         f"all with weight 1 and would ignore pool={pool!r} (leave it out)")
    check_top_k(top_k)
    if top_k is not None and aggregate != "ssc":
        raise ValueError(f"top_k is SSC's parameter; aggregate={aggregate!r} reads every cached state")
    if log and mode != "independent":
        raise ValueError("segments='log' needs mode='independent' (Log-Linear++): it caches overlapping dyadic "
                         "blocks, each compressed from the start state")


def memory_caching(q: Tensor, k: Tensor, v: Tensor, *, base: Callable[..., ModelOutput],
                   segments: int | Sequence[int] | str = 64, mode: str = "checkpoint", aggregate: str = "residual",
                   top_k: int | None = None, u: Tensor | None = None, pool: str | None = None,
                   base_kwargs: dict[str, Any] | None = None, initial_state: Any = None,
                   output_final_state: bool = False, backend: str = "auto", chunk_size: int | None = None,
                   stats: dict[str, Any] | None = None) -> ModelOutput:
    """Memory Caching over any base model ([MC] eqs. 4-17).

    Within segment s the base runs as usual, M^(s)_t = f(M^(s)_{t-1}; k_t, v_t); the final state of
    each segment is cached. A token t of segment s reads
        y_t = gamma_s(t) M^(s)_t(q_t) + sum_i gamma_i(t) M^(i)(q_t)
    over the cached segments i it sees, with r_i = <u_t, pool(S^(i))> and r_s = <u_t, pool of the
    keys of segment s up to t> (causal):
        residual: all gammas 1 (for a matrix memory (M^(s)_t + sum_i M^(i)) q_t, [MC] eq. 13);
        grm: gamma = softmax of r over the visible segments and s ([MC] eq. 9-10);
        soup: the memory whose parameters are sum gamma_i theta^(i) + gamma_s theta^(s)_t reads q_t
              ([MC] eq. 14-15); for a matrix memory exactly GRM;
        ssc: GRM over the top_k most relevant cached segments and s ([MC] eq. 16-17; top_k at least
             the number visible is GRM). Of exactly tied scores the earliest segment is kept; scores that
             tie in the definition (segments with equal keys) may come out a rounding apart from the
             chunk form's products and the kernel, which can then keep another of the tied states.

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V]. Passed to the base as they are.
        base: a model function of the book that takes ``initial_state`` and returns its final state:
            ``linear_attention``, ``delta_rule``, ``miras`` (with a preset, e.g. Titans), ``omega_rule``,
            ``swla``, ``atlas``, ``dla``. A function without initial_state: ValueError naming it.
        segments: an int C (segments of C tokens, the last one shorter), a list of lengths summing
            to T, or "log" (log-linear: token t, counted from 0, sees the popcount(t + 1) aligned dyadic
            blocks of the binary expansion of t + 1; independent mode only). Lengths that are multiples
            of chunk_size keep the base's chunk grid of the whole sequence; each segment is chunked from its own start.
        mode: "checkpoint" (segment s starts from segment s-1's final state: the plain RNN with
            snapshots, for a base whose state is all it carries; a window base, omega_rule, swla or atlas
            with c > 1, restarts its window at each segment, so a segment's first c - 1 tokens miss the
            previous segment's last pairs) or "independent" (every segment starts from ``initial_state``).
        aggregate: "residual", "grm", "soup" or "ssc". top_k: SSC's k >= 1 (None: all).
        u: [B, H, T, K] relevance queries (None: q). pool: "mean" of the keys (the library's
            choice; None, the default, means it) or "sum" ([MC] eq. 16). u and pool score the
            cached states: with aggregate="residual", which reads none of the scores, both must be None.
        base_kwargs: the base's other arguments (gates, preset, window, phi, ...). Tensors whose
            first dims are [B, H, T] are cut with the segments.
        initial_state: the base's start state (first segment in checkpoint mode, every segment in
            independent mode). output_final_state: also return the state after the last token
            (of the last segment; for "log", of the last token's own block).
        backend: "recurrent" (the definition, with the base's per-token loop), "chunk" (the base's
            chunk form, batched readout in PyTorch), "triton" (the base's backend="triton", i.e. its
            kernel, which raises for a base without one, as any explicit "triton" does, and the readout
            kernel ``kernel.cached_readout_triton`` for matrix memories) or "auto" (triton on CUDA where
            the kernel takes the inputs, else the base's "auto" and the PyTorch readout).
        chunk_size: the base's chunk length; None (the default) leaves the base's own default (e.g. 16
            for Titans, OmegaNet and ATLAS, where the chunk length is part of the model).
        stats: optional dict; "reads" is increased by the number of memory passes of the readout
            (one online read per token plus one per cached state it reads: O(L + N L), [MC] §4.2).
            The recurrent backend counts them as it reads; the others take ``memory_reads``.

    Exactness (chapter 7 §1–4): all segment operations are exact, so "chunk" equals "recurrent" to
    rounding for bases whose chunk form is exact (linear attention and its gated family, the delta
    family, SWLA) and at chunk_size = 1 for the frozen-gradient ones (Titans, MIRAS deep presets,
    OmegaNet, ATLAS, deep DLA). One segment (N = 1) is the base model itself; residual + independent
    + zero start over linear attention is linear attention; soup is GRM for a matrix memory.

    Returns:
        (o [B, H, T, V], final state or None).
    """
    B, H, T, K, V = check_qkv(q, k, v)
    check_flag("output_final_state", output_final_state)
    kw = check_base(base, base_kwargs)
    check_per_token(kw, B, H, T)
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    if u is not None and (not isinstance(u, torch.Tensor) or tuple(u.shape) != (B, H, T, K)):
        raise ValueError(f"u must be a tensor [B, H, T, K] = [{B}, {H}, {T}, {K}], "
                         f"got {list(getattr(u, 'shape', [])) or type(u).__name__}")
    if u is not None and u.dtype != q.dtype:
        raise TypeError(f"u must have q's dtype {q.dtype}, got {u.dtype}")
    if u is not None and u.device != q.device:
        raise ValueError(f"u must be on {q.device} like q, got {u.device}")
    if u is not None and aggregate == "residual":
        raise ValueError("u scores the cached states for grm, soup and ssc; aggregate='residual' adds them "
                         "all with weight 1 and would ignore it")
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats must be a dict (the read counter is added to it), got {type(stats).__name__}")
    layout = make_layout(T, segments)
    check_options(mode, aggregate, pool, top_k, log=layout.log)
    pool = "mean" if pool is None else pool
    table = {"recurrent": None, "chunk": None, "triton": None}
    name = choose_backend(backend, q, table, unsupported=lambda: matrix_kernel_limits(q), model="memory_caching")
    args = (q, k, v, base, layout, mode, aggregate, top_k, u, pool, kw, initial_state)
    base_backend = {"recurrent": "recurrent", "chunk": "auto" if backend == "auto" else "chunk"}.get(name, backend)
    try:
        with without_autocast(q):     # as ``dispatch``: the readout keeps its own precision (fp32 states)
            if name == "recurrent":
                o, state = memory_caching_recurrent(*args, chunk_size, stats)
            elif name == "chunk":
                o, state = memory_caching_chunk(*args, base_backend, chunk_size)
            else:               # the base's own kernel (explicit "triton", or "auto" chose it), the readout kernel
                o, state = memory_caching_chunk(*args, base_backend, chunk_size, readout=kernel_readout)
    except (TypeError, ValueError):
        # the base checked its arguments on the segments it was given (cut to a segment's length, batched as
        # [n B, H, L] in independent mode); run once on the whole sequence, it names the caller's own shapes
        run_base(base, q, k, v, kw, initial_state, base_backend, chunk_size)
        raise
    if stats is not None and name != "recurrent":         # the definition counts its reads one by one
        stats["reads"] = stats.get("reads", 0) + memory_reads(layout, top_k if aggregate == "ssc" else None)
    return o, (state if output_final_state else None)


def log_linear_pp(q: Tensor, k: Tensor, v: Tensor, *, base: Callable[..., ModelOutput], u: Tensor | None = None,
                  pool: str = "mean", base_kwargs: dict[str, Any] | None = None, initial_state: Any = None,
                  output_final_state: bool = False, backend: str = "auto", chunk_size: int | None = None,
                  stats: dict[str, Any] | None = None) -> ModelOutput:
    """Log-Linear++ ([MC] §4.3): GRM over the log-linear segmentation with independent compressors,
    i.e. ``memory_caching(segments="log", mode="independent", aggregate="grm")``; the other arguments
    (u, pool, base_kwargs, initial_state, output_final_state, backend, chunk_size, stats) as there."""
    return memory_caching(q, k, v, base=base, segments="log", mode="independent", aggregate="grm", u=u, pool=pool,
                          base_kwargs=base_kwargs, initial_state=initial_state, output_final_state=output_final_state,
                          backend=backend, chunk_size=chunk_size, stats=stats)


__all__ = ["memory_caching", "log_linear_pp", "memory_caching_recurrent", "memory_caching_chunk", "cached_readout",
           "readout_weights", "Layout", "make_layout", "consecutive_layout", "log_layout", "dyadic_blocks",
           "segment_lengths", "memory_reads", "AGGREGATES", "MODES", "SEGMENTATIONS", "base_name"]
