"""Chapter 7: Memory Caching over the book's base models.

The reference (``mc_reference``) is written here from the definition ([MC] eqs. 4-17, chapter 7 §1–2)
for a gated linear-attention base, in fp64 and token by token: its own segmentation (including the
binary expansion of each position for log-linear), its own states, scores and softmax. Both backends
of ``memory_caching`` are checked against it, then the exact identities of chapter 7: one segment
is the base; residual + independent + zero start over linear attention is linear attention (and
checkpoint residual is the closed form, not linear attention); soup is GRM for a matrix memory;
SSC with top_k >= the number visible is GRM; constant gammas give residual; log-linear blocks are
aligned, disjoint and cover [1, t]; reads are counted against O(L + N L); recurrent == chunk over
other bases and odd shapes; gradients; bad input.
"""
import math

import pytest
import torch

from atlaslib.caching import (cached_readout, dyadic_blocks, log_layout, make_layout, memory_caching,
                              memory_reads)
from atlaslib.atlas import atlas
from atlaslib.core import random_gate, random_qkv, rel_rmse, softmax_attention
from atlaslib.deep import dla
from atlaslib.delta import delta_rule
from atlaslib.linear import linear_attention
from atlaslib.miras import miras
from atlaslib.omega import omega_rule, swla

F64 = dict(dtype=torch.float64)
AGGS = ["residual", "grm", "soup", "ssc"]


# ---- the reference, from the definition ----

def binary_blocks(t):
    """Log-linear segments of the 1-based position t: lengths = powers of two of t, largest first,
    as 1-based inclusive (start, end)."""
    out, start = [], 1
    for bit in range(t.bit_length() - 1, -1, -1):
        if t & (1 << bit):
            out.append((start, start + 2 ** bit - 1))
            start += 2 ** bit
    return out


def segments_of(t, T, segments):
    """1-based inclusive segments (start, end) that position t sees: earlier ones, then its own."""
    if segments == "log":
        return binary_blocks(t)
    lengths = [segments] * math.ceil(T / segments) if isinstance(segments, int) else list(segments)
    out, a = [], 1
    for n in lengths:
        e = min(a + n - 1, T)
        out.append((a, e))
        if a <= t <= e:
            return out
        a = e + 1
    raise AssertionError


def gla_run(M, q, k, v, alpha, a, e):
    """Gated linear attention M <- alpha_t M + v_t k_t^T from position a to e (1-based, inclusive); the
    output of the last position and the state."""
    y = None
    for t in range(a, e + 1):
        M = alpha[t - 1] * M + torch.outer(v[t - 1], k[t - 1])
        y = M @ q[t - 1]
    return y, M


def mc_reference(q, k, v, alpha, M0, segments, mode, aggregate, top_k=None, u=None, pool="mean"):
    """Memory caching over gated linear attention, written out per (b, h, t) in fp64."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    y = torch.zeros(B, H, T, V, **F64)
    u = q if u is None else u
    for b in range(B):
        for h in range(H):
            qq, kk, vv, aa = q[b, h], k[b, h], v[b, h], alpha[b, h]
            M_start = torch.zeros(V, K, **F64) if M0 is None else M0[b, h].double()

            def start_of(a):       # checkpoint: the plain RNN's state before position a
                return gla_run(M_start, qq, kk, vv, aa, 1, a - 1)[1] if mode == "checkpoint" else M_start

            def poolk(a, e):
                s = kk[a - 1:e].sum(0)
                return s / (e - a + 1) if pool == "mean" else s
            for t in range(1, T + 1):
                segs = segments_of(t, T, segments)
                cached, (a, _) = segs[:-1], segs[-1]
                online, M_on = gla_run(start_of(a), qq, kk, vv, aa, a, t)
                Ms = [gla_run(start_of(i), qq, kk, vv, aa, i, j)[1] for i, j in cached]
                r = [float(u[b, h, t - 1] @ poolk(i, j)) for i, j in cached]
                r_s = float(u[b, h, t - 1] @ poolk(a, t))
                if aggregate == "residual":
                    g, g_s = [1.0] * len(r), 1.0
                else:
                    chosen = sorted(range(len(r)), key=lambda i: -r[i])
                    chosen = chosen[:top_k] if aggregate == "ssc" and top_k is not None else chosen
                    z = sum(math.exp(r[i]) for i in chosen) + math.exp(r_s)
                    g = [math.exp(r[i]) / z if i in chosen else 0.0 for i in range(len(r))]
                    g_s = math.exp(r_s) / z
                if aggregate == "soup":    # mix the parameters, then read
                    Mstar = g_s * M_on + sum((w * M for w, M in zip(g, Ms)), torch.zeros(V, K, **F64))
                    y[b, h, t - 1] = Mstar @ qq[t - 1]
                else:
                    y[b, h, t - 1] = g_s * online + sum((w * (M @ qq[t - 1]) for w, M in zip(g, Ms)),
                                                        torch.zeros(V, **F64))
    return y


def inputs(gen, B=2, H=2, T=11, K=5, V=4, h0=False):
    q, k, v = random_qkv(B, H, T, K, V, generator=gen, **F64)
    alpha = random_gate(B, H, T, low=0.7, generator=gen, **F64)
    M0 = torch.randn(B, H, V, K, generator=gen, **F64) if h0 else None
    return q, k, v, alpha, M0


@pytest.mark.parametrize("segments,mode", [(4, "checkpoint"), (4, "independent"), ([2, 6, 3], "checkpoint"),
                                           ("log", "independent"),
                                           # equal lengths evenly spaced with gaps, and unevenly spaced
                                           ([2, 3, 2, 3, 1], "independent"), ([2, 5, 2, 2], "independent")])
@pytest.mark.parametrize("aggregate", AGGS)
def test_matches_definition(gen, segments, mode, aggregate):
    q, k, v, alpha, M0 = inputs(gen, h0=True)
    u = torch.randn(q.shape, generator=gen, **F64) if aggregate == "grm" else None
    top_k = 1 if aggregate == "ssc" else None
    want = mc_reference(q, k, v, alpha, M0, segments, mode, aggregate, top_k, u)
    for backend, b in [("recurrent", 64), ("chunk", 2), ("chunk", 3)]:
        got, _ = memory_caching(q, k, v, base=linear_attention, segments=segments, mode=mode, aggregate=aggregate,
                                top_k=top_k, u=u, base_kwargs=dict(alpha=alpha), initial_state=M0,
                                backend=backend, chunk_size=b)
        assert rel_rmse(got, want) < 1e-12, (backend, b)


@pytest.mark.parametrize("top_k", [1, 2])
def test_ssc_ties_go_to_the_earliest_state(gen, top_k):
    """Segments with the same keys (so the same pooled key and exactly tied scores) and different values:
    which of the tied states SSC keeps changes the output. Every form keeps the earliest, as the
    definition's stable sort does. The ties must be exact in every form: q and k are multiples of 1/8 and
    the keys are summed (pool="sum"), so every pooled key and score is exact in fp64 whatever the order of
    the sums (the chunk form pools by differences of a cumulative sum; a mean's division by 3, or random
    keys, left ties a rounding apart, broken one way or the other by the machine's summation order)."""
    q, k, v, alpha, _ = inputs(gen, T=24)
    q, k = (torch.randint(-8, 9, x.shape, generator=gen).to(x.dtype) / 8 for x in (q, k))
    k = k[:, :, :3].repeat(1, 1, 8, 1)                                     # eight segments of 3 with one key set
    want = mc_reference(q, k, v, alpha, None, 3, "independent", "ssc", top_k, pool="sum")
    for backend in ("recurrent", "chunk"):
        got, _ = memory_caching(q, k, v, base=linear_attention, segments=3, mode="independent", aggregate="ssc",
                                top_k=top_k, pool="sum", base_kwargs=dict(alpha=alpha), backend=backend)
        assert rel_rmse(got, want) < 1e-12, backend


def test_sum_pooling(gen):
    q, k, v, alpha, _ = inputs(gen)
    want = mc_reference(q, k, v, alpha, None, 3, "checkpoint", "grm", pool="sum")
    for backend in ("recurrent", "chunk"):
        got, _ = memory_caching(q, k, v, base=linear_attention, segments=3, aggregate="grm", pool="sum",
                                base_kwargs=dict(alpha=alpha), backend=backend)
        assert rel_rmse(got, want) < 1e-12


# ---- exact identities ----

def leaves(state):
    """Every tensor of a state (tensor, dict of weights, MirasState with momentum), flattened into one."""
    if isinstance(state, torch.Tensor):
        return state.reshape(-1)
    if isinstance(state, dict):
        return torch.cat([leaves(state[n]) for n in sorted(state)])
    return torch.cat([leaves(s) for s in state if s is not None])


BASES = {
    "linear_attention": (linear_attention, lambda g, B, H, T, K: dict(alpha=random_gate(B, H, T, generator=g, **F64))),
    "delta_rule": (delta_rule, lambda g, B, H, T, K: dict(beta=torch.rand(B, H, T, generator=g, **F64),
                                                          alpha=random_gate(B, H, T, K, generator=g, **F64))),
    "swla": (swla, lambda g, B, H, T, K: dict(window=2, eta=torch.rand(B, H, T, generator=g, **F64), phi="elu+1")),
    "omega": (omega_rule, lambda g, B, H, T, K: dict(window=2, eta=0.5 * torch.rand(B, H, T, generator=g, **F64))),
    "atlas_linear": (atlas, lambda g, B, H, T, K: dict(memory="linear", eta=0.1, theta=0.5, alpha=0.9)),
    "dla_mlp": (dla, lambda g, B, H, T, K: dict(memory="mlp", eta=0.1)),
    "titans_mlp": (miras, lambda g, B, H, T, K: dict(preset="titans", memory="mlp", eta=0.2, theta=0.5, alpha=0.9)),
    "titans_linear": (miras, lambda g, B, H, T, K: dict(preset="titans", memory="linear", eta=0.2, theta=0.5,
                                                        alpha=0.9)),
    "memora_linear": (miras, lambda g, B, H, T, K: dict(preset="memora", memory="linear", eta=0.2, alpha=0.9)),
    # the l_q retention: a cached state is read as (Z / nu) phi(q) (caching.base.NONLINEAR_READ)
    "moneta_linear": (miras, lambda g, B, H, T, K: dict(preset="moneta", memory="linear", layer_norm=False, eta=0.2,
                                                        alpha=0.9)),
}


@pytest.mark.parametrize("name", list(BASES))
@pytest.mark.parametrize("aggregate", ["residual", "grm"])
def test_one_segment_is_the_base(gen, name, aggregate):
    base, make_kw = BASES[name]
    B, H, T, K, V = 1, 2, 9, 5, 5
    q, k, v = random_qkv(B, H, T, K, V, generator=gen, **F64)
    kw = make_kw(gen, B, H, T, K)
    want, s_want = base(q, k, v, output_final_state=True, backend="recurrent", **kw)
    for backend in ("recurrent", "chunk"):
        got, s_got = memory_caching(q, k, v, base=base, segments=T, aggregate=aggregate, base_kwargs=kw,
                                    backend=backend, chunk_size=1, output_final_state=True)
        assert rel_rmse(got, want) < 1e-12, backend
        assert rel_rmse(leaves(s_got), leaves(s_want)) < 1e-12


@pytest.mark.parametrize("name", list(BASES))
def test_default_chunk_size_is_the_bases_own(gen, name):
    """Without chunk_size the base runs at its own default chunk length (16 for Titans, OmegaNet and
    ATLAS, where it is part of the model), not at one length forced on every base."""
    base, make_kw = BASES[name]
    B, H, T, K, V = 1, 1, 40, 4, 4
    q, k, v = random_qkv(B, H, T, K, V, generator=gen, **F64)
    kw = make_kw(gen, B, H, T, K)
    want, s_want = base(q, k, v, output_final_state=True, backend="chunk", **kw)
    got, s_got = memory_caching(q, k, v, base=base, segments=T, aggregate="residual", base_kwargs=kw,
                                backend="chunk", output_final_state=True)
    assert rel_rmse(got, want) < 1e-12
    assert rel_rmse(leaves(s_got), leaves(s_want)) < 1e-12


@pytest.mark.parametrize("segments", [3, [5, 1, 4], "log"])
def test_residual_independent_is_linear_attention(gen, segments):
    """The segments of token t partition [1, t], so the residual sum of their memories is M_t."""
    q, k, v = random_qkv(2, 2, 10, 4, 3, generator=gen, **F64)
    want, _ = linear_attention(q, k, v)
    for backend in ("recurrent", "chunk"):
        got, _ = memory_caching(q, k, v, base=linear_attention, segments=segments, mode="independent",
                                aggregate="residual", backend=backend, chunk_size=2)
        assert rel_rmse(got, want) < 1e-12


def test_checkpoint_residual_is_its_closed_form(gen):
    """Checkpoints count earlier segments again: y_t = (M_t + sum_{i<s} M_{e_i}) q_t, with M_t the
    linear-attention prefix state and e_i the end of segment i."""
    T, C = 10, 3
    q, k, v = random_qkv(1, 2, T, 4, 3, generator=gen, **F64)
    la, _ = linear_attention(q, k, v)
    prefix = torch.einsum("bhtv,bhtk->bhtvk", v, k).cumsum(2)
    want = la.clone()
    for t in range(T):
        for e in range(C - 1, t - t % C, C):           # ends of the segments before t's
            want[:, :, t] += torch.einsum("bhvk,bhk->bhv", prefix[:, :, e], q[:, :, t])
    for backend in ("recurrent", "chunk"):
        got, _ = memory_caching(q, k, v, base=linear_attention, segments=C, mode="checkpoint",
                                aggregate="residual", backend=backend)
        assert rel_rmse(got, want) < 1e-12
        assert rel_rmse(got, la) > 1e-2


@pytest.mark.parametrize("name", ["linear_attention", "delta_rule", "swla"])
def test_soup_is_grm_for_a_matrix_memory(gen, name):
    """The recurrent soup mixes parameters literally; for a matrix memory that is GRM."""
    base, make_kw = BASES[name]
    q, k, v = random_qkv(1, 2, 9, 5, 5, generator=gen, **F64)
    kw = make_kw(gen, 1, 2, 9, 5)
    grm, _ = memory_caching(q, k, v, base=base, segments=2, aggregate="grm", base_kwargs=kw, backend="chunk")
    soup, _ = memory_caching(q, k, v, base=base, segments=2, aggregate="soup", base_kwargs=kw, backend="recurrent")
    assert rel_rmse(soup, grm) < 1e-12


def test_soup_differs_from_grm_for_a_deep_memory(gen):
    base, make_kw = BASES["titans_mlp"]
    q, k, v = random_qkv(1, 1, 8, 4, 4, generator=gen, **F64)
    kw = make_kw(gen, 1, 1, 8, 4)
    out = {}
    for agg in ("grm", "soup"):
        for backend in ("recurrent", "chunk"):
            out[agg, backend], _ = memory_caching(q, k, v, base=base, segments=3, aggregate=agg, base_kwargs=kw,
                                                  backend=backend, chunk_size=1)
        assert rel_rmse(out[agg, "chunk"], out[agg, "recurrent"]) < 1e-12
    assert rel_rmse(out["soup", "chunk"], out["grm", "chunk"]) > 1e-3


@pytest.mark.parametrize("segments", [2, "log"])
def test_ssc_with_enough_states_is_grm(gen, segments):
    q, k, v = random_qkv(1, 2, 12, 4, 3, generator=gen, **F64)
    mode = "independent"
    grm, _ = memory_caching(q, k, v, base=linear_attention, segments=segments, mode=mode, aggregate="grm")
    most = max(len(vis) for vis in make_layout(12, segments).visible)
    for backend in ("recurrent", "chunk"):
        ssc, _ = memory_caching(q, k, v, base=linear_attention, segments=segments, mode=mode, aggregate="ssc",
                                top_k=most, backend=backend)
        assert rel_rmse(ssc, grm) < 1e-12
        fewer, _ = memory_caching(q, k, v, base=linear_attention, segments=segments, mode=mode, aggregate="ssc",
                                  top_k=1, backend=backend)
        assert rel_rmse(fewer, grm) > 1e-4


def test_constant_gamma_is_residual(gen):
    """u = 0 makes every score 0, so GRM's weights are 1 / (visible + 1): residual scaled per token."""
    T = 10
    q, k, v = random_qkv(2, 1, T, 4, 3, generator=gen, **F64)
    res, _ = memory_caching(q, k, v, base=linear_attention, segments=3, aggregate="residual")
    grm, _ = memory_caching(q, k, v, base=linear_attention, segments=3, aggregate="grm", u=torch.zeros_like(q))
    n = torch.tensor([t // 3 + 1 for t in range(T)], **F64)
    assert rel_rmse(grm * n[:, None], res) < 1e-12


# ---- log-linear segmentation and read counts ----

@pytest.mark.parametrize("t", [1, 2, 3, 7, 8, 37, 100, 255, 256])
def test_log_linear_blocks(t):
    blocks = dyadic_blocks(t)
    assert len(blocks) == bin(t).count("1") <= int(math.log2(t)) + 1
    assert blocks[0][0] == 0 and blocks[-1][1] == t                      # cover [1, t] ...
    assert all(b[1] == c[0] for b, c in zip(blocks, blocks[1:]))          # ... disjoint and consecutive
    lengths = [e - s for s, e in blocks]
    assert lengths == sorted(lengths, reverse=True) and all(n & (n - 1) == 0 for n in lengths)
    assert all(s % (e - s) == 0 for s, e in blocks)                       # aligned
    assert [(s + 1, e) for s, e in blocks] == binary_blocks(t)


def test_cached_tables_are_rebuilt_when_an_id_is_reused(monkeypatch):
    """The caches of a layout's table and of its reader groups are keyed by id(); an entry whose object is gone
    (its id now another object's) must not be served: here such a stale entry sits under the key."""
    import atlaslib.caching.segments as segments
    layout = make_layout(8, [3, 3, 2])
    expect = torch.tensor([[-1, -1]] * 3 + [[0, -1]] * 3 + [[0, 1]] * 2)  # token t reads the segments before its own
    monkeypatch.setitem(segments._BLOCKS, (id(layout.visible), "cpu"), ([[0]], torch.full((8, 2), 7)))
    blocks = layout.blocks()
    assert torch.equal(blocks, expect)
    monkeypatch.setitem(segments._GROUPS, (id(layout.visible), "cpu"), ([[0]], [(5, None, None)]))
    groups = layout.reader_groups()
    # state 0 is read by tokens 3..7, state 1 by tokens 6..7
    assert [(n, ns.tolist(), tokens.tolist()) for n, ns, tokens in groups] == [(2, [1], [[6, 7]]),
                                                                               (5, [0], [[3, 4, 5, 6, 7]])]


@pytest.mark.parametrize("T,segments", [(1, "log"), (13, "log"), (64, "log"), (100, "log"), (9, 3), (10, [4, 1, 5]),
                                        (5, 5)])
def test_layout_reader_groups_are_the_tables(T, segments):
    """A layout's reader groups, from its own lists, are those found in its table (``reader_groups``), and
    its reader spans are the tables' runs: each state's first and last reader."""
    import atlaslib.caching.segments as seg
    layout = make_layout(T, segments)
    blocks, N = layout.blocks(), len(layout.cached)
    as_lists = lambda groups: [(n, ns.tolist(), tok.tolist()) for n, ns, tok in groups]  # noqa: E731
    assert as_lists(layout.reader_groups()) == as_lists(seg.reader_groups(blocks, N))
    readers = [[t for t, vis in enumerate(layout.visible) if n in vis] for n in range(N)]
    assert seg.reader_spans(layout) == [(r[0], r[-1] + 1) for r in readers]


def test_log_linear_has_about_2L_blocks():
    for T in (1, 7, 64, 100):
        layout = log_layout(T)
        assert len(layout.cached) + len(set(layout.online)) <= 2 * T
        assert len(set(layout.cached)) == len(layout.cached)
        # the cached blocks are exactly the dyadic blocks some position reads before its own (0-based, end excl.)
        read = {(a - 1, e) for t in range(1, T + 1) for a, e in binary_blocks(t)[:-1]}
        assert set(layout.cached) == read, T


@pytest.mark.parametrize("segments,aggregate,top_k", [(3, "grm", None), ([1, 2, 6], "residual", None),
                                                      ("log", "grm", None), (2, "ssc", 2)])
def test_memory_reads_are_counted(gen, segments, aggregate, top_k):
    T = 9
    q, k, v = random_qkv(1, 1, T, 3, 2, generator=gen, **F64)
    stats = {}
    memory_caching(q, k, v, base=linear_attention, segments=segments, mode="independent", aggregate=aggregate,
                   top_k=top_k, backend="recurrent", stats=stats)
    layout = make_layout(T, segments)
    N = len(layout.cached)
    want = T + sum(len(segments_of(t, T, segments)) - 1 if top_k is None
                   else min(top_k, len(segments_of(t, T, segments)) - 1) for t in range(1, T + 1))
    assert stats["reads"] == want == memory_reads(layout, top_k)
    assert stats["reads"] <= T + N * T
    if segments == "log":
        assert stats["reads"] <= T * (math.log2(T) + 1)


# ---- recurrent vs chunk over the bases, odd shapes, gradients ----

@pytest.mark.parametrize("name", list(BASES))
@pytest.mark.parametrize("B,H,T,K,V,segments", [(1, 1, 1, 3, 2, 4), (2, 2, 13, 5, 5, 5), (1, 3, 10, 6, 6, "log")])
def test_recurrent_equals_chunk(gen, name, B, H, T, K, V, segments):
    base, make_kw = BASES[name]
    if name in ("titans_mlp", "dla_mlp") and H * T > 13:
        H = 1
    q, k, v = random_qkv(B, H, T, K, V, generator=gen, **F64)
    kw = make_kw(gen, B, H, T, K)
    mode = "independent" if segments == "log" else "checkpoint"
    exact = name in ("linear_attention", "delta_rule", "swla")
    b = 3 if exact else 1                       # frozen-gradient bases agree with their loop at b = 1
    for agg in ("grm", "ssc"):
        top_k = 1 if agg == "ssc" else None
        a, sa = memory_caching(q, k, v, base=base, segments=segments, mode=mode, aggregate=agg, top_k=top_k,
                               base_kwargs=kw, backend="recurrent", output_final_state=True)
        c, sc = memory_caching(q, k, v, base=base, segments=segments, mode=mode, aggregate=agg, top_k=top_k,
                               base_kwargs=kw, backend="chunk", chunk_size=b, output_final_state=True)
        assert rel_rmse(c, a) < 1e-10, agg
        assert sa is not None and sc is not None


def test_fp32_chunk_is_close(gen):
    q, k, v = random_qkv(2, 2, 20, 8, 6, generator=gen)
    want, _ = memory_caching(q.double(), k.double(), v.double(), base=linear_attention, segments=8,
                             aggregate="grm", backend="recurrent")
    got, _ = memory_caching(q, k, v, base=linear_attention, segments=8, aggregate="grm", backend="chunk",
                            chunk_size=4)
    assert got.dtype == torch.float32 and rel_rmse(got, want) < 1e-5


def test_gradients(gen):
    q, k, v = random_qkv(1, 2, 9, 4, 3, generator=gen, **F64)
    alpha = random_gate(1, 2, 9, generator=gen, **F64)
    w = torch.randn(1, 2, 9, 3, generator=gen, **F64)
    grads = {}
    for backend in ("recurrent", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, alpha)]
        o, _ = memory_caching(*xs[:3], base=linear_attention, segments=4, aggregate="grm",
                              base_kwargs=dict(alpha=xs[3]), backend=backend, chunk_size=2)
        grads[backend] = torch.autograd.grad((o * w).sum(), xs)
    for g_r, g_c in zip(grads["recurrent"], grads["chunk"]):
        assert g_c.abs().sum() > 0 and rel_rmse(g_c, g_r) < 1e-10


# ---- cached_readout (the kernel's contract) ----

@pytest.mark.parametrize("aggregate,top_k", [("residual", None), ("grm", None), ("soup", None), ("ssc", 2)])
@pytest.mark.parametrize("segments", ["log", 3])
def test_cached_readout_against_a_loop(gen, aggregate, top_k, segments):
    """Against a per-token loop; T = 20 with log-linear segments takes the gathered path (N = 9 > 2J = 6),
    constant segments the dense contraction."""
    B, H, T, K, V = 2, 1, 20, 5, 3
    layout = make_layout(T, segments)
    N = len(layout.cached)
    q, u = torch.randn(B, H, T, K, generator=gen, **F64), torch.randn(B, H, T, K, generator=gen, **F64)
    states = torch.randn(B, H, N, V, K, generator=gen, **F64)
    pooled = torch.randn(B, H, N, K, generator=gen, **F64)
    online = torch.randn(B, H, T, V, generator=gen, **F64)
    r_s = torch.randn(B, H, T, generator=gen, **F64)
    y = cached_readout(q, u, states, pooled, online, r_s, layout.blocks(), top_k, aggregate)
    want = torch.zeros_like(online)
    for b in range(B):
        for t in range(T):
            vis = layout.visible[t]
            r = {n: float(u[b, 0, t] @ pooled[b, 0, n]) for n in vis}
            keep = sorted(vis, key=lambda n: -r[n])[:top_k] if top_k else vis
            if aggregate == "residual":
                g, g_s = {n: 1.0 for n in vis}, 1.0
            else:
                z = sum(math.exp(r[n]) for n in keep) + math.exp(float(r_s[b, 0, t]))
                g, g_s = {n: math.exp(r[n]) / z for n in keep}, math.exp(float(r_s[b, 0, t])) / z
            want[b, 0, t] = g_s * online[b, 0, t] + sum((w * states[b, 0, n] @ q[b, 0, t] for n, w in g.items()),
                                                        torch.zeros(V, **F64))
    assert rel_rmse(y, want) < 1e-12


def test_cached_readout_bad_shapes():
    q = torch.zeros(1, 1, 4, 3)
    with pytest.raises(ValueError, match="states"):
        cached_readout(q, None, torch.zeros(1, 1, 2, 2, 4), torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 4, 2),
                       torch.zeros(1, 1, 4), torch.zeros(4, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="blocks"):
        cached_readout(q, None, torch.zeros(1, 1, 2, 2, 3), torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 4, 2),
                       torch.zeros(1, 1, 4), torch.full((4, 1), 5, dtype=torch.int64))


# ---- bad input ----

def test_bad_input(gen):
    q, k, v = random_qkv(1, 1, 8, 3, 2, generator=gen)
    call = dict(base=linear_attention)
    with pytest.raises(ValueError, match="sum to 7"):
        memory_caching(q, k, v, segments=[3, 4], **call)
    with pytest.raises(ValueError, match="top_k"):
        memory_caching(q, k, v, aggregate="ssc", top_k=0, **call)
    with pytest.raises(ValueError, match="top_k"):
        memory_caching(q, k, v, aggregate="grm", top_k=2, **call)
    with pytest.raises(ValueError, match="softmax_attention"):
        memory_caching(q, k, v, base=softmax_attention)
    with pytest.raises(ValueError, match="independent"):
        memory_caching(q, k, v, segments="log", mode="checkpoint", **call)
    with pytest.raises(ValueError, match="mode"):
        memory_caching(q, k, v, mode="parallel", **call)
    with pytest.raises(ValueError, match="aggregate"):
        memory_caching(q, k, v, aggregate="mean", **call)
    with pytest.raises(ValueError, match="u must"):
        memory_caching(q, k, v, u=torch.zeros(1, 1, 8, 2), **call)
    with pytest.raises(ValueError, match="segments"):
        memory_caching(q, k, v, segments=0, **call)
    with pytest.raises(ValueError, match="base_kwargs"):
        memory_caching(q, k, v, base_kwargs=dict(initial_state=None), **call)
    with pytest.raises(ValueError, match="backend"):
        memory_caching(q, k, v, backend="fast", **call)
    with pytest.raises(TypeError, match="base"):
        memory_caching(q, k, v, base="linear_attention")
    with pytest.raises(ValueError, match="pool"):
        memory_caching(q, k, v, pool="max", **call)
    with pytest.raises(ValueError, match="aggregate='residual' adds them all"):
        memory_caching(q, k, v, aggregate="residual", u=torch.zeros_like(q), **call)
    with pytest.raises(TypeError, match="u must have q's dtype"):
        memory_caching(q, k, v, u=torch.zeros_like(q).double(), **call)
    with pytest.raises(ValueError, match="u must be on cpu like q"):
        memory_caching(q, k, v, u=torch.zeros_like(q, device="meta"), **call)
    with pytest.raises(TypeError, match="base_kwargs must be a dict"):
        memory_caching(q, k, v, base=linear_attention, base_kwargs=[1])
    with pytest.raises(TypeError, match="stats must be a dict"):
        memory_caching(q, k, v, stats=[], **call)
    with pytest.raises(ValueError, match=r"base_kwargs\['alpha'\] must have shape \[B, H, T, ...\]"):
        memory_caching(q, k, v, base_kwargs=dict(alpha=torch.full((1, 1, 4), 0.9)), segments=2, **call)
    with pytest.raises(ValueError, match="normalize"):
        memory_caching(q, k, v, base_kwargs=dict(normalize=True), **call)
    with pytest.raises(ValueError, match="alpha"):                  # the base's own checks still apply
        memory_caching(q, k, v, base_kwargs=dict(alpha=torch.ones(1, 1, 5)), segments=4, **call)


@pytest.mark.parametrize("base", [linear_attention, delta_rule])
@pytest.mark.parametrize("segments, mode", [(2, "independent"), ("log", "independent"), (3, "checkpoint")])
@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_the_bases_refusals_name_the_callers_shapes(gen, base, segments, mode, backend):
    """A bad initial state or gate reaches the base cut into segments (batched as [n B, H, L] in independent
    mode), whose message named the segments' shapes; memory caching's message is the base's own on the
    whole sequence, the shapes the caller passes and should pass."""
    B, H, T, K, V = 2, 2, 6, 4, 3
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    bad = [dict(initial_state=torch.zeros(B, H, K, V)), dict(alpha=torch.rand(B, H, generator=gen)),
           dict(alpha=torch.rand(B, H, T, K + 1, generator=gen))]
    for kw in bad:
        kw |= {"beta": 0.5} if base is delta_rule else {}
        with pytest.raises(ValueError) as own:
            base(q, k, v, **kw)
        state = kw.pop("initial_state", None)
        with pytest.raises(ValueError) as cached:
            memory_caching(q, k, v, base=base, segments=segments, mode=mode, initial_state=state, base_kwargs=kw,
                           backend=backend)
        assert str(cached.value) == str(own.value)


@pytest.mark.parametrize("segments", ["log", 3])
def test_a_layout_first_built_in_inference_mode_still_trains(gen, segments):
    """A layout's read tables are kept for the process; built by a first call under torch.inference_mode
    (an evaluation pass), they were inference tensors and a later training call failed ("Inference tensors
    cannot be saved for backward"). The training call's gradients are those of a fresh process."""
    import atlaslib.caching.segments as seg
    q, k, v = random_qkv(1, 2, 11, 4, 3, dtype=torch.float64, generator=gen)
    call = dict(base=linear_attention, segments=segments, mode="independent", aggregate="grm", backend="chunk")
    grads = []
    for evaluate_first in (False, True):
        seg._cached_layout.cache_clear()
        seg._BLOCKS.clear()
        seg._GROUPS.clear()
        if evaluate_first:
            with torch.inference_mode():
                memory_caching(q, k, v, **call)
        leaf = q.clone().requires_grad_(True)
        memory_caching(leaf, k, v, **call)[0].square().sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


# ---- deep memories: read and mixed by their definition ----

def mlp_read(params, x, K, V):
    """M_theta(x) of Titans' MLP memory, from chapter 3's memory module (x [B, H, R, K])."""
    from atlaslib.miras import build_memory, make_config
    memory = build_memory(make_config("titans", memory="mlp"), K, V)
    B, H = x.shape[:2]
    flat = {n: w.reshape(B * H, *w.shape[2:]) for n, w in params.items()}
    return memory(flat, x.reshape(B * H, -1, K)).reshape(B, H, -1, V)


def test_deep_grm_and_soup_by_definition(gen):
    """Two segments of Titans (MLP memory): cached parameters theta^(1), online theta_t; GRM reads
    both memories and mixes the outputs, soup mixes the parameters and reads once."""
    B, H, T, K, V, C = 1, 2, 6, 4, 4, 3
    q, k, v = random_qkv(B, H, T, K, V, generator=gen, **F64)
    kw = dict(preset="titans", memory="mlp", eta=0.3, theta=0.5, alpha=0.9)
    _, s1 = miras(q[:, :, :C], k[:, :, :C], v[:, :, :C], output_final_state=True, backend="recurrent", **kw)
    want = {agg: torch.zeros(B, H, T - C, V, **F64) for agg in ("grm", "soup")}
    for t in range(C, T):
        _, st = miras(q[:, :, C:t + 1], k[:, :, C:t + 1], v[:, :, C:t + 1], initial_state=s1,
                      output_final_state=True, backend="recurrent", **kw)
        r = torch.stack([(q[:, :, t] * k[:, :, :C].mean(2)).sum(-1), (q[:, :, t] * k[:, :, C:t + 1].mean(2)).sum(-1)])
        g = torch.softmax(r, dim=0)[..., None, None]          # [2, B, H, 1, 1]
        qt = q[:, :, t:t + 1]
        want["grm"][:, :, t - C] = (g[0, ..., 0] * mlp_read(s1.memory, qt, K, V)[:, :, 0]
                                    + g[1, ..., 0] * mlp_read(st.memory, qt, K, V)[:, :, 0])
        mixed = {n: g[0] * s1.memory[n] + g[1] * st.memory[n] for n in s1.memory}
        want["soup"][:, :, t - C] = mlp_read(mixed, qt, K, V)[:, :, 0]
    for agg in ("grm", "soup"):
        for backend in ("recurrent", "chunk"):
            got, _ = memory_caching(q, k, v, base=miras, segments=C, aggregate=agg, base_kwargs=kw,
                                    backend=backend, chunk_size=1)
            assert rel_rmse(got[:, :, C:], want[agg]) < 1e-12, (agg, backend)


def test_triton_backend_calls_the_readout_kernel(gen, monkeypatch):
    """The wiring of backend="triton": the readout kernel (stood in for by a recording wrapper of
    cached_readout, since kernel.py is its own room) is called, and gradients come from the chunk form."""
    import atlaslib.caching as mc
    calls = []

    def fake_kernel(*args):
        calls.append(args[2].shape)
        return cached_readout(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    monkeypatch.setattr(mc, "READOUT_KERNEL", fake_kernel)
    q, k, v = random_qkv(1, 2, 9, 4, 3, generator=gen)
    q.requires_grad_()
    want, _ = memory_caching(q, k, v, base=linear_attention, segments=3, aggregate="grm", backend="chunk")
    got, _ = memory_caching(q, k, v, base=linear_attention, segments=3, aggregate="grm", backend="triton")
    assert calls == [(1, 2, 2, 3, 4)] and rel_rmse(got, want) < 1e-6
    g_want, = torch.autograd.grad(want.sum(), q)
    g_got, = torch.autograd.grad(got.sum(), q)
    assert rel_rmse(g_got, g_want) < 1e-6


def test_checkpoint_states_are_chunk_end_states(gen):
    """A frozen-gradient base (Titans, MLP memory): with segment lengths that are multiples of the chunk
    size, the checkpoint chain of segments is the base's own chunk form over the whole sequence, so its
    final state is the base's; with other lengths the chunk grid moves and the state differs."""
    B, H, T, K, V = 1, 2, 8, 4, 4
    q, k, v = random_qkv(B, H, T, K, V, generator=gen, **F64)
    kw = dict(preset="titans", memory="mlp", eta=0.3, theta=0.5, alpha=0.9)
    _, want = miras(q, k, v, output_final_state=True, backend="chunk", chunk_size=2, **kw)
    _, got = memory_caching(q, k, v, base=miras, segments=4, base_kwargs=kw, backend="chunk", chunk_size=2,
                            output_final_state=True)
    assert rel_rmse(leaves(got), leaves(want)) < 1e-12
    _, moved = memory_caching(q, k, v, base=miras, segments=[3, 5], base_kwargs=kw, backend="chunk", chunk_size=2,
                              output_final_state=True)
    assert rel_rmse(leaves(moved), leaves(want)) > 1e-6


@pytest.mark.parametrize("aggregate", ["grm", "soup"])
def test_gradients_deep(gen, aggregate):
    """Deep memory (Titans, MLP): gradients of the chunk form (b = 1) equal the definition's."""
    q, k, v = random_qkv(1, 1, 6, 4, 4, generator=gen, **F64)
    w = torch.randn(1, 1, 6, 4, generator=gen, **F64)
    kw = dict(preset="titans", memory="mlp", eta=0.3, theta=0.5, alpha=0.9)
    grads = {}
    for backend in ("recurrent", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o, _ = memory_caching(*xs, base=miras, segments=2, aggregate=aggregate, base_kwargs=kw, backend=backend,
                              chunk_size=1)
        grads[backend] = torch.autograd.grad((o * w).sum(), xs)
    for g_r, g_c in zip(grads["recurrent"], grads["chunk"]):
        assert g_c.abs().sum() > 0 and rel_rmse(g_c, g_r) < 1e-10


@pytest.mark.parametrize("aggregate", ["grm", "soup", "ssc", "residual"])
def test_deep_memory_over_log_segments_equals_the_definition(gen, aggregate):
    """Titans (MLP memory) over log-linear segments, T = 21: 9 cached blocks, each token reads at most 3
    of them (slot j of its row names which), so the chunk form weights each state through the slots
    (no [T, N] table) and soup mixes only the states a token reads."""
    q, k, v = random_qkv(1, 2, 21, 4, 4, generator=gen, **F64)
    kw = dict(preset="titans", memory="mlp", eta=0.3, theta=0.5, alpha=0.9)
    top_k = 2 if aggregate == "ssc" else None
    got = {backend: memory_caching(q, k, v, base=miras, segments="log", mode="independent", aggregate=aggregate,
                                   top_k=top_k, base_kwargs=kw, backend=backend, chunk_size=1)[0]
           for backend in ("recurrent", "chunk")}
    assert rel_rmse(got["chunk"], got["recurrent"]) < 1e-12


def test_log_linear_readout_memory_grows_as_T_log_T(gen):
    """Log-linear segments cache about T / 2 states and each token reads about log2 T of them: the scores
    of those alone, never a [T, N] matrix (N ~ T / 2 made it O(T^2): 8M numbers at T = 4096)."""
    from atlaslib.caching import log_linear_pp
    from atlaslib.core.testing import largest_tensor
    T = 1024
    q, k, v = random_qkv(1, 1, T, 8, 8, generator=gen)
    for base, kw in ((linear_attention, {}), (miras, dict(preset="ttt_mlp", expansion=1, eta=0.1))):
        most = largest_tensor(lambda: log_linear_pp(q, k, v, base=base, base_kwargs=kw, chunk_size=16))
        assert most <= T * T // 8, (base.__name__, most)


def test_constant_segments_readout_never_mixes_a_memory_per_token(gen):
    """Constant segments, few states (N = 7 < K = 32): the readout takes each token's N reads M^(n) q_t and
    weights them ([T, N, V]); it built sum_n W_tn M^(n) for every token first, a [T, V, K] tensor."""
    from atlaslib.core.testing import largest_tensor
    B, H, T, K = 1, 2, 512, 32
    q, k, v = random_qkv(B, H, T, K, K, generator=gen)
    most = largest_tensor(lambda: memory_caching(q, k, v, base=linear_attention, segments=64, aggregate="grm",
                                                 backend="chunk"))
    assert most < B * H * T * K * K // 2, most


def test_log_linear_pp_is_grm_over_log_segments(gen):
    from atlaslib.caching import log_linear_pp
    q, k, v, alpha, M0 = inputs(gen, T=13, h0=True)
    want = mc_reference(q, k, v, alpha, None, "log", "independent", "grm")
    got, _ = log_linear_pp(q, k, v, base=linear_attention, base_kwargs=dict(alpha=alpha), chunk_size=2)
    assert rel_rmse(got, want) < 1e-12
    want = mc_reference(q, k, v, alpha, M0, "log", "independent", "grm")     # every segment starts at M0
    got, _ = log_linear_pp(q, k, v, base=linear_attention, base_kwargs=dict(alpha=alpha), initial_state=M0,
                           chunk_size=2)
    assert rel_rmse(got, want) < 1e-12
    with pytest.raises(TypeError, match="segments"):          # it fixes the segmentation: no such argument
        log_linear_pp(q, k, v, base=linear_attention, segments=4)


def test_gates_of_zero_and_one_and_non_contiguous_inputs(gen):
    """Retention gates of exactly 0 (forget everything) and 1, an initial state, and inputs that are
    transposed views."""
    q, k, v, alpha, M0 = inputs(gen, T=12, h0=True)
    alpha[..., 3] = 0.0
    alpha[..., 5:9] = 1.0
    want = mc_reference(q, k, v, alpha, M0, 5, "checkpoint", "grm")
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qt.is_contiguous() or q.shape[1] == 1
    for backend in ("recurrent", "chunk"):
        got, _ = memory_caching(qt, kt, vt, base=linear_attention, segments=5, aggregate="grm",
                                base_kwargs=dict(alpha=alpha), initial_state=M0, backend=backend, chunk_size=2)
        assert rel_rmse(got, want) < 1e-12


def test_log_segments_readout_and_gradients_on_a_longer_sequence(gen):
    """Log-linear over T = 40 caches 19 blocks, each token reads at most 4: the readout's per-state
    path (each state times the run of tokens that read it). Outputs and gradients equal the definition."""
    q, k, v, alpha, _ = inputs(gen, B=1, H=2, T=40, K=4, V=3)
    u = torch.randn(q.shape, generator=gen, **F64)
    w = torch.randn(1, 2, 40, 3, generator=gen, **F64)
    want = mc_reference(q, k, v, alpha, None, "log", "independent", "grm", None, u)
    grads = {}
    for backend in ("recurrent", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, u)]
        o, _ = memory_caching(*xs[:3], base=linear_attention, segments="log", mode="independent", aggregate="grm",
                              u=xs[3], base_kwargs=dict(alpha=alpha), backend=backend, chunk_size=4)
        assert rel_rmse(o, want) < 1e-12, backend
        grads[backend] = torch.autograd.grad((o * w).sum(), xs)
    for g_r, g_c in zip(grads["recurrent"], grads["chunk"]):
        assert g_c.abs().sum() > 0 and rel_rmse(g_c, g_r) < 1e-10


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_a_diverged_segment_is_named_in_checkpoint_mode(gen, backend):
    """A base whose state blows up in segment 1 hands segment 2 a non-finite start state: the error says
    the earlier segment diverged, rather than blaming an initial_state the caller never passed."""
    q, k, v = random_qkv(1, 1, 8, 3, 2, generator=gen, **F64)
    alpha = torch.full((1, 1, 8), 0.9, **F64)
    v = v.clone()
    v[:, :, 1] = float("nan")                                   # the first segment's final state holds NaN
    with pytest.raises(ValueError, match=r"segment \[4, 8\) starts from the final state of the segment before"):
        memory_caching(q, k, v, base=linear_attention, segments=4, mode="checkpoint", base_kwargs=dict(alpha=alpha),
                       backend=backend)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_a_diverged_cached_state_is_named_when_it_is_read(gen, backend):
    """A deep memory whose first segment holds NaN caches a non-finite state; reading it (with learning off)
    made the base refuse an initial_state the caller never passed: the error says a segment diverged."""
    q, k, v = random_qkv(1, 1, 8, 4, 4, generator=gen, **F64)
    v = v.clone()
    v[:, :, 1] = float("nan")
    kw = dict(preset="titans", memory="mlp", eta=0.3, theta=0.5, alpha=0.9)
    with pytest.raises(ValueError, match="the base diverged while compressing a segment"):
        memory_caching(q, k, v, base=miras, segments=4, mode="independent", base_kwargs=kw, backend=backend,
                       chunk_size=1)


def test_pooled_keys_keep_their_digits_at_long_lengths(gen):
    """The pooled keys of the chunk form (one prefix sum over the sequence) against each segment's own mean,
    for fp32 keys of mean 1 at T = 16384: a difference of fp32 prefix sums lost about 5e-4 there."""
    from atlaslib.caching.chunk import pooled_keys
    T = 16384
    k = 1 + 0.1 * torch.randn(1, 1, T, 4, generator=gen)
    layout = make_layout(T, 64)
    cached, online = pooled_keys(k, layout, "mean")
    kd = k.double()
    ref_cached = torch.stack([kd[0, 0, a:b].mean(0) for a, b in layout.cached])
    ref_online = torch.stack([kd[0, 0, layout.online[t][0]:t + 1].mean(0) for t in range(T - 64, T)])
    assert cached.dtype == online.dtype == torch.float32
    assert (cached[0, 0].double() - ref_cached).abs().max() < 1e-6
    assert (online[0, 0, T - 64:].double() - ref_online).abs().max() < 1e-6
