"""Memory Caching, the algorithm: the base's own chunk form per segment, then one batched readout.

1. **Compress.** Each segment is one call of the base (its chunk form, or its kernel on CUDA). In
   independent mode all segments of one length run as one batch (the segments become batch rows);
   the log-linear segmentation runs one batch per block length 2^j (the T aligned blocks that some
   token reads, one ending at each token: each token is in about log2(T)/2 + 1 of them). In
   checkpoint mode the segments run one after the other, each from the previous final state.
2. **Read out.** The relevance of cached state n to token t is r_tn = <u_t, pool(S^(n))> (one
   product [T, K] x [K, N] for a few states; only the J ~ log T each token reads for log-linear
   segments, whose N ~ T / 2 would make it O(T^2)); the aggregator turns the visible scores into
   weights (``readout_weights``);
   for a matrix memory the N cached readouts of all tokens are one contraction
   y_t = gamma_s online_t + sum_n W_tn M^(n) phi(q_t) (``cached_readout``, the contract of the Triton
   kernel). Deep memories are read by running the base from each cached state with learning off
   (``base.probe``), and soup mixes their parameters token by token.

Exactness (chapter 7 §1–4): every step after the base's chunk form is exact (segment bookkeeping, scores,
softmax, contraction), so MC over X is exactly as exact as X's chunk form: exact for every chunk
size over linear attention, its gated family, DeltaNet/Gated DeltaNet/KDA and SWLA; for the
frozen-gradient bases (Titans and the MIRAS deep presets, OmegaNet, ATLAS, deep DLA) it equals the
recurrent definition only at chunk_size = 1 (each segment is chunked from its own start).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.chunking import compute_dtype
from ..core.validation import _value_check
from .base import (cut_segments, linear_features, memory_part, mix_states, probe, run_base, run_segment, slice_kwargs,
                   state_bh)
from .segments import Layout, check_top_k, reader_groups, reader_spans

AGGREGATES = ("residual", "grm", "soup", "ssc")


def readout_weights(u, pooled, online_score, blocks, top_k=None, aggregate="grm"):
    """Weights of the cached states each token reads, and of its online memory.

    u [B, H, T, K], pooled [B, H, N, K], online_score [B, H, T] (r_s), blocks int64 [T, J] (-1 padded).
    Returns (w [B, H, T, J], the weight of the state blocks[t, j] (0 on padding), gamma_s [B, H, T]):
    residual gives 1 to every visible state and to the online memory; grm/soup the softmax of r over
    the visible states and s; ssc the same softmax over the top_k visible states and s.
    """
    B, H, T = u.shape[:3]
    J = blocks.shape[1]
    cd = u.dtype
    valid = (blocks >= 0).expand(B, H, T, J)
    if aggregate == "residual":
        return valid.to(cd), torch.ones(B, H, T, dtype=cd, device=u.device)
    if pooled.shape[2] == 0:                            # one segment: the online memory alone
        return u.new_zeros(B, H, T, J), torch.ones(B, H, T, dtype=cd, device=u.device)
    slots = blocks.clamp(min=0)
    if pooled.shape[2] <= 2 * J:                        # few states (constant segments): all scores, then gather
        r = torch.einsum("bhtk,bhnk->bhtn", u, pooled).gather(-1, slots.expand(B, H, T, J))
    else:                                               # many (log-linear, N ~ T / 2): each token's J only
        r = torch.stack([(u * pooled[:, :, slots[:, j]]).sum(-1) for j in range(J)], dim=-1)
    logits = r.masked_fill(~valid, float("-inf"))
    if aggregate == "ssc" and top_k is not None and top_k < J:
        # only the top_k most relevant cached states take part ([MC] eq. 16-17); padding has -inf. A stable
        # sort: of equal scores the lowest slot wins, as in the definition and the kernel (topk picks any)
        chosen = logits.sort(dim=-1, descending=True, stable=True).indices[..., :top_k]
        keep = torch.zeros_like(valid).scatter(-1, chosen, True) & valid
        logits = logits.masked_fill(~keep, float("-inf"))
    p = torch.softmax(torch.cat([logits, online_score[..., None].to(cd)], dim=-1), dim=-1)
    return p[..., :J] * valid, p[..., J]


def dense_weights(w, blocks, N):
    """W [B, H, T, N] with W_tn the weight of cached state n for token t (0 where t does not read n)."""
    B, H, T, J = w.shape
    W = w.new_zeros(B, H, T, N)
    return W.scatter_add(-1, blocks.clamp(min=0).expand(B, H, T, J), w) if N else W


def cached_readout(q, u, states, pooled, online, online_score, blocks, top_k=None, aggregate="grm", groups=None):
    """y_t = gamma_s(t) online_t + sum_{n in blocks[t]} gamma_n(t) M^(n) q_t for matrix memories.

    q [B, H, T, K] (features phi(q)), u [B, H, T, Ku] (None: q), states [B, H, N, V, K] (cached final
    states, fp32 or fp64), pooled [B, H, N, Ku] (pooled keys of each cached segment), online [B, H, T, V] (the
    base's output inside the current segment), online_score [B, H, T] (r_s = <u_t, pooled online
    keys>), blocks int64 [T, J] (the cached states token t reads, -1 padded). aggregate: "residual",
    "grm", "soup" (== grm for a matrix memory) or "ssc" (with top_k). Returns y [B, H, T, V] in q's
    dtype; computed in fp32 (fp64 for fp64 inputs). Exact: the readouts of every token are one
    contraction with the dense weight matrix W [T, N] (or, when each token reads few of many states,
    one product per state over the tokens that read it). groups: ``reader_groups(blocks, N)`` when the
    caller has them (a layout's ``Layout.reader_groups``); None finds them in blocks, which reads it on
    the host, so a readout that torch.compile traces must be given them.
    """
    u = q if u is None else u
    B, H, T, K = q.shape
    check_readout(q, u, states, pooled, online, online_score, blocks, top_k, aggregate)
    cd = compute_dtype(q)
    blocks = blocks.to(q.device)
    w, g_s = readout_weights(u.to(cd), pooled.to(cd), online_score.to(cd), blocks, top_k,
                             "grm" if aggregate == "soup" else aggregate)
    y = g_s[..., None] * online.to(cd) + weighted_reads(w, states.to(cd), q.to(cd), blocks, groups)
    return y.to(q.dtype)


def weighted_reads(w, states, q, blocks, groups=None):
    """sum_j w_tj M^(blocks[t, j]) q_t. Few states (constant segments, N <= 2J): one dense contraction
    over n, through whichever is smaller per token, the N reads or the weighted memory sum_n W_tn M^(n).
    Many states that each token reads a few of (log-linear, N ~ T / 2, J ~ log T): each state reads only
    the tokens that see it, ``readers_of`` (a contiguous run of tokens in the library's
    layouts), as one product per state; the states whose runs have one length go as one batch. So the
    cost is O(T J V K), not O(T N V K), and no state is copied once per token. groups: as in
    ``cached_readout``."""
    N, J = states.shape[2], blocks.shape[1]
    if N <= 2 * J:
        W = dense_weights(w, blocks, N)
        if N <= states.shape[4]:   # each token's N reads M^(n) q_t are fewer numbers than its mixed memory [V, K]
            return torch.einsum("bhtn,bhtnv->bhtv", W, torch.einsum("bhnvk,bhtk->bhtnv", states, q))
        return torch.einsum("bhtn,bhnvk,bhtk->bhtv", W, states, q)
    B, H, T, _ = q.shape
    y = q.new_zeros(B, H, T, states.shape[3])
    for n_len, ns, tokens in reader_groups(blocks, N) if groups is None else groups:   # tokens [g, n_len]
        seen = blocks[tokens] == ns[:, None, None]                          # [g, n_len, J]: slot j holds n
        weight = (w[:, :, tokens] * seen).sum(-1)                            # [B, H, g, n_len]
        reads = torch.einsum("bhgvk,bhglk->bhglv", states[:, :, ns], q[:, :, tokens])
        y.index_add_(2, tokens.flatten(), (weight[..., None] * reads).flatten(2, 3))
    return y


def check_readout(q, u, states, pooled, online, online_score, blocks, top_k, aggregate, aggregates=AGGREGATES):
    """Shapes and values of a readout's arguments (``cached_readout`` and its kernel), with the expected
    shape in the message. ``aggregates``: the aggregations the caller reads; for "residual", u, pooled
    and online_score are not read and may be None."""
    if aggregate not in aggregates:
        raise ValueError(f"aggregate must be one of {tuple(aggregates)}, got {aggregate!r}")
    check_top_k(top_k)
    if top_k is not None and aggregate != "ssc":
        raise ValueError(f"top_k selects cached states for aggregate='ssc' only, got aggregate={aggregate!r}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H, T, K], got {list(q.shape)}")
    B, H, T, K = q.shape
    if states.dim() != 5 or tuple(states.shape[:2]) != (B, H) or states.shape[-1] != K:
        raise ValueError(f"states must be [B, H, N, V, K] = [{B}, {H}, N, V, {K}], got {list(states.shape)}")
    N, V = states.shape[2:4]
    Ku = K if u is None else u.shape[-1]
    want = {"u": (u, (B, H, T, Ku)), "pooled": (pooled, (B, H, N, Ku)), "online": (online, (B, H, T, V)),
            "online_score": (online_score, (B, H, T))}
    for name, (x, shape) in want.items():
        if x is None and aggregate == "residual" and name != "online":
            continue
        if x is None or tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {None if x is None else list(x.shape)}")
    others = {"u": u, "states": states, "pooled": pooled, "online": online, "online_score": online_score}
    away = [f"{name} on {x.device}" for name, x in others.items() if x is not None and x.device != q.device]
    if away:                                        # blocks, a table of indices, may be anywhere
        raise ValueError(f"the readout's tensors must be on q's device ({q.device}), got {', '.join(away)}")
    if blocks.dtype != torch.int64 or blocks.dim() != 2 or blocks.shape[0] != T:
        raise ValueError(f"blocks must be an int64 tensor [T, J] = [{T}, J], got {blocks.dtype} {list(blocks.shape)}")
    # read on the host for CPU tensors; on an accelerator a device-side assert (no host sync); not while
    # torch.compile traces (the library's own tables are valid by construction)
    how = _value_check(blocks)
    if blocks.numel() and how == "host":
        lo, hi = (int(x) for x in torch.aminmax(blocks))
        if lo < -1 or hi >= N:
            raise ValueError(f"blocks must hold indices in [0, N={N}) or -1 (padding), got [{lo}, {hi}]")
    elif blocks.numel() and how == "device":
        torch._assert_async(((blocks >= -1) & (blocks < N)).all(), f"blocks must hold indices in [0, N={N}) or -1")


# ---- step 1: the segments' states ----

def batch_rows(x, spans, shape3):
    """Tokens of each span as extra batch rows: [B, H, T, ...] -> [n B, H, L, ...] (spans of one length L)."""
    if not (isinstance(x, torch.Tensor) and x.dim() >= 3 and tuple(x.shape[:3]) == shape3):
        return x
    starts, L = [a for a, _ in spans], spans[0][1] - spans[0][0]
    stride = starts[1] - starts[0] if len(starts) > 1 else L
    if stride > 0 and starts == list(range(starts[0], starts[0] + stride * len(starts), stride)):
        # evenly spaced spans (constant segments; the log-linear blocks of one length): one strided view
        rows = x[:, :, starts[0]:].unfold(2, L, stride)[:, :, :len(starts)].movedim(-1, 3).movedim(2, 0)
        return rows.reshape(-1, *rows.shape[2:])
    return torch.cat([x[:, :, a:b] for a, b in spans], dim=0)


def run_batched(base, q, k, v, kw, initial_state, spans, backend, chunk_size):
    """The base over spans of one length, all at once from ``initial_state``. Returns the outputs
    [n, B, H, L, V] and the final state of each span."""
    shape3, B, n = tuple(q.shape[:3]), q.shape[0], len(spans)
    qs, ks, vs = (batch_rows(x, spans, shape3) for x in (q, k, v))
    kws = {name: batch_rows(x, spans, shape3) for name, x in kw.items()}
    init = state_bh(initial_state, lambda x: torch.cat([x] * n, dim=0))
    o, state = run_base(base, qs, ks, vs, kws, init, backend, chunk_size)
    # each state's rows cut once (split): slicing x[i B:(i + 1) B] per span would zero-fill a gradient
    # of the whole batched state per span in the backward, O(n^2) for the n spans
    leaves, spec = tree_flatten(state)
    parts = [x.split(B, dim=0) if isinstance(x, torch.Tensor) else [x] * n for x in leaves]
    finals = [tree_unflatten([p[i] for p in parts], spec) for i in range(n)]
    return o.reshape(n, B, *o.shape[1:]), finals


def compress(base, q, k, v, kw, layout: Layout, mode, initial_state, backend, chunk_size):
    """(online outputs [B, H, T, V], cached final states, final state, init of each online segment).

    Every span the layout names (cached segments and the tokens' own segments) is run once.
    """
    B, H, T = q.shape[:3]
    spans = sorted(set(layout.cached) | set(layout.online))
    out, lasts, finals = {}, {}, {}
    if mode == "checkpoint":
        state = initial_state
        for (a, b), piece in zip(spans, cut_segments(q, k, v, kw, spans)):   # consecutive segments, in order
            o, new = run_segment(base, q, k, v, kw, a, b, state, state is not initial_state, backend, chunk_size,
                                 piece)
            out[(a, b)], finals[(a, b)] = o, new
            state = new
    else:
        for L in sorted({b - a for a, b in spans}):
            group = [s for s in spans if s[1] - s[0] == L]
            o, states = run_batched(base, q, k, v, kw, initial_state, group, backend, chunk_size)
            for s, o_s, last, state in zip(group, o.unbind(0), o.select(3, -1).unbind(0), states):   # cut once
                out[s], lasts[s], finals[s] = o_s, last, state
    if layout.log:                                  # t is the last token of its own block
        online = torch.stack([lasts[s] for s in layout.online], dim=2)
    else:                                           # the segments tile the sequence
        online = torch.cat([out[s] for s in sorted(set(layout.online))], dim=2)
    inits = segment_inits(layout, mode, finals, initial_state)
    return online, [finals[s] for s in layout.cached], finals[layout.online[-1]], inits


def segment_inits(layout: Layout, mode, finals, initial_state) -> dict:
    """The start state of every online segment: the previous segment's final state (checkpoint) or
    the shared initial state (independent)."""
    spans = sorted(set(layout.online))
    if mode == "independent":
        return {s: initial_state for s in spans}
    prev = [initial_state] + [finals[s] for s in spans[:-1]]
    return dict(zip(spans, prev))


def pooled_keys(k, layout: Layout, pool: str):
    """pool(S^(n)) [B, H, N, K] of the cached segments and the causal pool of each token's online
    segment (tokens of the segment up to t) [B, H, T, K], from one prefix sum. The sum runs in fp64: a
    difference of two fp32 prefix sums over the whole sequence loses digits as T grows (keys of mean 1:
    relative error 1e-3 at T = 32768, against 1e-7 for each segment's own mean). It holds an fp64 copy
    of the keys for the moment (a segmented sum in fp32 would not; not needed at the book's sizes)."""
    P = torch.cat([torch.zeros_like(k[:, :, :1], dtype=torch.float64), k.to(torch.float64).cumsum(2)], dim=2)

    def pooled(a, b):                            # keys of tokens [a, b) pooled, one row per span
        s = P[:, :, b] - P[:, :, a]
        return (s / (b - a).to(s.dtype)[:, None] if pool == "mean" else s).to(k.dtype)
    cached_a, cached_b, online_a, online_b = layout.bounds(k.device)
    return pooled(cached_a, cached_b), pooled(online_a, online_b)


# ---- step 2: the readout ----

def memory_caching_chunk(q, k, v, base, layout: Layout, mode, aggregate, top_k, u, pool, kw, initial_state,
                         backend, chunk_size, readout=None):
    """Memory Caching with the base's chunk form (``backend`` is the base's) and batched readouts.
    ``readout``: the matrix-memory readout, a function with ``cached_readout``'s signature (default)."""
    cd = compute_dtype(q)
    online, cached, final, inits = compress(base, q, k, v, kw, layout, mode, initial_state, backend, chunk_size)
    pooled, online_pool = pooled_keys(k.to(cd), layout, pool)
    u = (q if u is None else u).to(cd)
    r_s = (u * online_pool).sum(-1)
    blocks = layout.blocks(q.device)
    fq = linear_features(base, kw, final, q, k)
    if fq is not None and cached:
        states = torch.stack([memory_part(s).to(cd) for s in cached], dim=2)
        many = states.shape[2] > 2 * blocks.shape[1]         # the readout's per-state path needs the groups
        y = (readout or cached_readout)(fq, u, states, pooled, online, r_s, blocks, top_k, aggregate,
                                        groups=layout.reader_groups(q.device) if many else None)
        return y.to(online.dtype), final
    if fq is not None:                                  # one segment: MC is the base itself
        return online, final
    w, g_s = readout_weights(u, pooled, r_s, blocks, top_k, "grm" if aggregate == "soup" else aggregate)
    if aggregate == "soup":
        return soup_readout(base, q, k, v, kw, layout, inits, cached, w, g_s, backend, chunk_size), final
    y = g_s[..., None] * online.to(cd)
    B, H, T, V = *q.shape[:3], v.shape[-1]
    # The readers' rows of q, w and the per-token gates gathered once and cut (split), the reads added once:
    # slicing per state and assigning into y[:, :, a:b] would cost O(T) per state in the backward, O(T N).
    spans = reader_spans(layout)
    if not spans:
        return y.to(online.dtype), final
    lengths = [b - a for a, b in spans]
    idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(q.device)
    gather = lambda x: (x.index_select(2, idx).split(lengths, 2) if isinstance(x, torch.Tensor)  # noqa: E731
                        and x.dim() >= 3 and tuple(x.shape[:3]) == (B, H, T) else [x] * len(spans))
    qs, ws, kws = gather(q), gather(w), {name: gather(x) for name, x in kw.items()}
    reads = []
    for n, (a, b) in enumerate(spans):                  # one memory pass per cached state and reader
        read = probe(base, cached[n], qs[n], V, {name: x[n] for name, x in kws.items()}, chunk_size, backend)
        weight = (ws[n] * (blocks[a:b] == n)).sum(-1)     # state n's weight for its readers (no [T, N])
        reads.append(weight[..., None] * read.to(cd))
    return y.index_add(2, idx, torch.cat(reads, dim=2)).to(online.dtype), final


def soup_readout(base, q, k, v, kw, layout, inits, cached, w, g_s, backend, chunk_size):
    """Memory soup for any memory ([MC] eq. 14-15): token t reads the memory whose parameters are
    sum_n W_tn theta^(n) + gamma_s theta^(s)_t, where theta^(s)_t is its online state after token t
    (the base over the segment's prefix); w [B, H, T, J] holds W_tn for the n in layout.visible[t]."""
    B, H, T = q.shape[:3]
    ys = []
    for t in range(T):
        a, _ = layout.online[t]
        _, online_state = run_base(base, q[:, :, a:t + 1], k[:, :, a:t + 1], v[:, :, a:t + 1],
                                   slice_kwargs(kw, (B, H, T), a, t + 1), inits[layout.online[t]], backend,
                                   chunk_size)
        seen = layout.visible[t]                         # slot j of blocks[t] holds seen[j]
        weights = torch.cat([w[:, :, t, :len(seen)], g_s[:, :, t, None]], dim=-1)
        mixed = mix_states(weights, [cached[n] for n in seen] + [online_state])
        ys.append(probe(base, mixed, q[:, :, t:t + 1], v.shape[-1], slice_kwargs(kw, (B, H, T), t, t + 1),
                        chunk_size, backend))
    return torch.cat(ys, dim=2)
