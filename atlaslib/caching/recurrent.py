"""Memory Caching, the definition ([MC] eqs. 4-17, chapter 7 §1–2): token by token, with an explicit list
of cached states.

Segment by segment the base runs its own per-token loop (backend "recurrent"); at each segment end
its final state is appended to the cache. Then, for every token t of segment s:

    r_i = <u_t, pool(S^(i))> for the cached segments i it sees,  r_s = <u_t, pool(S^(s) up to t)>
    residual: gamma = 1;  GRM: gamma = softmax over {i} + {s};  SSC: softmax over top_k {i} + {s}
    y_t = gamma_s M^(s)_t(q_t) + sum_i gamma_i M^(i)(q_t)                 (residual, GRM, SSC)
    y_t = M*_t(q_t),  M*_t = sum_i gamma_i M^(i) + gamma_s M^(s)_t        (soup: parameters mixed)

A cached memory is read with the base itself, started from it with learning off (``base.probe``).
This is the reference the chunk form is tested against; it is slow on purpose.
"""
from __future__ import annotations


import torch

from ..core.chunking import compute_dtype
from .base import mix_states, probe, run_base, run_segment, slice_kwargs
from .segments import Layout, reader_spans


def segment_states(base, q, k, v, kw, layout: Layout, mode, initial_state, chunk_size):
    """Run the base per segment (per dyadic block for log-linear): {span: (outputs, final state, init)}."""
    B, H, T = q.shape[:3]
    runs, state = {}, initial_state
    for a, b in sorted(set(layout.cached) | set(layout.online)):
        init = state if mode == "checkpoint" else initial_state
        o, final = run_segment(base, q, k, v, kw, a, b, init, init is not initial_state, "recurrent", chunk_size)
        runs[(a, b)] = (o, final, init)
        state = final
    return runs


def token_weights(u_t, pooled_i: list, pooled_s, aggregate, top_k):
    """(gamma_i for the cached segments i, gamma_s) of one token, from the scores <u_t, pool>.
    Unselected segments of SSC get the weight 0."""
    r = [(u_t * p).sum() for p in pooled_i]
    r_s = (u_t * pooled_s).sum()
    if aggregate == "residual":
        return [1.0] * len(r), 1.0
    chosen = list(range(len(r)))
    if aggregate == "ssc" and top_k is not None:
        chosen = sorted(chosen, key=lambda i: -float(r[i].detach()))[:top_k]
    p = torch.softmax(torch.stack([r[i] for i in chosen] + [r_s]), dim=0)
    weight = dict(zip(chosen, p[:-1]))
    return [weight.get(i, 0.0) for i in range(len(r))], p[-1]


def pool_keys(k_seg, pool):
    """pool(S): the mean (library choice) or the sum ([MC] eq. 16) of a segment's keys [B, H, L, K]."""
    return k_seg.mean(2) if pool == "mean" else k_seg.sum(2)


def caching_step(online_t, cached_t: list, g: list, g_s):
    """One token's output: y_t = gamma_s M^(s)_t(q_t) + sum_i gamma_i M^(i)(q_t)."""
    y_t = g_s * online_t
    for read, w in zip(cached_t, g):
        y_t = y_t + w * read
    return y_t


def weights_at(u, kc, layout: Layout, b, h, t, pool, aggregate, top_k):
    """(gamma_i over the cached segments token t sees, gamma_s) for batch row b, head h."""
    a = layout.online[t][0]
    pooled_i = [pool_keys(kc[b:b + 1, h:h + 1, i:j], pool)[0, 0] for i, j in (layout.cached[n]
                                                                            for n in layout.visible[t])]
    return token_weights(u[b, h, t], pooled_i, pool_keys(kc[b:b + 1, h:h + 1, a:t + 1], pool)[0, 0], aggregate,
                         top_k)


def memory_caching_recurrent(q, k, v, base, layout: Layout, mode, aggregate, top_k, u, pool, kw,
                             initial_state, chunk_size, stats=None):
    """The definition, per token. ``stats`` (a dict) receives the number of memory reads under "reads"."""
    B, H, T = q.shape[:3]
    V = v.shape[-1]
    cd = compute_dtype(q)
    runs = segment_states(base, q, k, v, kw, layout, mode, initial_state, chunk_size)
    cache = [runs[s][1] for s in layout.cached]
    u = (q if u is None else u).to(cd)
    kc = k.to(cd)
    vis_reads = sum(len(vis) if aggregate != "ssc" or top_k is None else min(top_k, len(vis))
                    for vis in layout.visible)
    if stats is not None:
        stats["reads"] = stats.get("reads", 0) + T + vis_reads
    if aggregate == "soup":
        y = soup_recurrent(base, q, k, v, kw, layout, runs, cache, u, kc, pool, chunk_size)
        return y.to(runs[layout.online[0]][0].dtype), runs[layout.online[-1]][1]
    # the readout of each cached memory at the queries that see it (the base's own readout, learning off)
    spans = reader_spans(layout)
    reads = [probe(base, M, q[:, :, a:e], V, slice_kwargs(kw, (B, H, T), a, e), chunk_size, "recurrent").to(cd)
             for M, (a, e) in zip(cache, spans)]
    rows = []
    for b in range(B):
        for h in range(H):
            for t in range(T):
                a, e = layout.online[t]
                g, g_s = weights_at(u, kc, layout, b, h, t, pool, aggregate, top_k)
                rows.append(caching_step(runs[(a, e)][0][b, h, t - a].to(cd),
                                         [reads[n][b, h, t - spans[n][0]] for n in layout.visible[t]], g, g_s))
    y = torch.stack(rows).reshape(B, H, T, V)
    return y.to(runs[layout.online[0]][0].dtype), runs[layout.online[-1]][1]


def soup_recurrent(base, q, k, v, kw, layout, runs, cache, u, kc, pool, chunk_size):
    """Soup by its definition: per token, the base over the segment prefix gives M^(s)_t, the
    parameters of all memories are mixed with the GRM weights, and the mixture reads q_t."""
    B, H, T = q.shape[:3]
    cd = u.dtype
    ys = []
    for t in range(T):
        a, e = layout.online[t]
        vis = layout.visible[t]
        _, online_state = run_base(base, q[:, :, a:t + 1], k[:, :, a:t + 1], v[:, :, a:t + 1],
                                   slice_kwargs(kw, (B, H, T), a, t + 1), runs[(a, e)][2], "recurrent", chunk_size)
        weights = torch.stack([torch.stack([torch.stack(list(g) + [g_s]) for g, g_s in
                                            (weights_at(u, kc, layout, b, h, t, pool, "grm", None) for h in range(H))])
                               for b in range(B)])
        mixed = mix_states(weights, [cache[n] for n in vis] + [online_state])
        ys.append(probe(base, mixed, q[:, :, t:t + 1], v.shape[-1], slice_kwargs(kw, (B, H, T), t, t + 1),
                        chunk_size, "recurrent").to(cd))
    return torch.cat(ys, dim=2)
