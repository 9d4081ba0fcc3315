"""The GPU kernel: Memory Caching's readout for linear memories (residual, GRM, SSC) in Triton.

Token t of segment s reads its own segment's memory (the base's output, computed beforehand)
and the cached final states M^(i) of the earlier segments it sees:

    y_t = gamma_s online_t + sum_{i visible to t} gamma_i M^(i) q_t,

    r_i = <u_t, p_i> (p_i: segment i's pooled key, the mean of its keys or their sum),   r_s = online_score_t
    residual: every gamma = 1
    GRM:      gamma = softmax over {visible i} and the online segment of (r_i, r_s)
    SSC:      the same softmax over the top_k visible r_i and the online segment only.

Which states a token sees is a table ``blocks`` [T, J] of indices into the N cached states, -1
padded, shared over batch and heads: constant segments (token t sees every earlier segment) and
log-linear ones (t sees the popcount(t) dyadic blocks of its prefix) are both such a table. There is
no recurrence left, so the tokens are independent:

* one program per (batch*head, block of BT = 16 tokens) on grid axis 0 and block of BV value
  channels on axis 1. The grid grows with T (B*H*cdiv(T, 16) programs, axis 0 takes 2^31 - 1):
  unlike the other chapters' kernels there is no state to carry from one block to the next, and a
  grid over tokens keeps a card busy at small B*H (tests/test_aot.py exempts the family);
* pass 1, the weights: for each of the J slots, the token's pooled key p_i is gathered row by row
  ([BT, BK]) and r_i = <u_t, p_i> kept in a [BT, BJ] register tile (BJ = next power of two >= J), with
  the block's state indices beside it. SSC keeps the top_k visible scores of each row by selection:
  top_k rounds of "take the row's largest remaining score" (ties go to the lowest slot), O(top_k * BJ)
  per row. Every score is known before any weight is formed, so the softmax subtracts the exact row
  max over the kept scores and r_s (no running rescale needed): stable for scores of any size;
* pass 2, the read: the program walks the *distinct* states its block uses, in increasing index
  order (a ``while`` loop: next = the least index above the current one). Each state's [BV, BK]
  tile is loaded once and multiplied with all BT queries (tl.dot, K in slices of BKC = 32), and
  each row adds the product with its weight for that state (0 for the rows that do not use it).
  Slots whose weight is 0 (SSC's dropped ones, softmax underflow) are skipped, so SSC loads only
  the states some token of the block selected.

Cost per block of BT tokens: D distinct states loaded ([BV, BK] fp32 each) and D products of
BT x BK x BV, where D is the number of distinct states the block's tokens use. With constant
segments all tokens of a block share their earlier segments (D <= J, one more at a segment
boundary inside the block); with log-linear segments the blocks of length >= 16 are shared and the
shorter ones differ per token (D about J + 15: 8 + 4 + 2 + 1 blocks below 16 tokens in one block
of 16). The order of a token's slots does not matter. So the state traffic is about (T / 16) * D * V *
K * 4 bytes per head, against N * V * K * 4 for reading each cached state once: the price of a grid
over tokens (BT = 16, the least tl.dot takes, keeps D small under log-linear segmentation). Pass 1
gathers T * J pooled keys, J / V of that.

More slots than one tile holds (J > SLOT_TILE = 32: constant segments of C tokens give
J = ceil(T / C) - 1, log-linear ones floor(log2(T + 1)) - 1, one tile for any T < 2^33): the slots are
walked a tile of BJ = 32 at a time, three sweeps per block of tokens, each recomputing its tile's
scores: a running max and a rescaled sum over the tiles (online softmax), then the weights and the
reads tile by tile. SSC first finds each row's top_k-th score (top_k sweeps of "the next score in
the order larger score, lower slot"), then keeps the slots at or above it. J <= 32 keeps the single
tile above (one sweep). K <= MAX_KEY = 256 (every program holds whole queries and keys), BV <= 64
(32 at BK = 256; a wider V is split across programs). fp64 is refused (fp32 accumulation). q, u,
online are read through their strides; states, pooled and online_score are made contiguous fp32,
blocks contiguous int32. Offsets of states, of heads and of the block table are 64-bit (B*H*N*V*K
passes 2^31 easily: N = 1024 segments at V = K = 128 and B*H = 128).

BUILDS (``python -m atlaslib.aot --family caching``, Triton 3.7.1, 8 warps, blocks with J = 32
columns so the score tiles are the widest single tile, BJ = 32; ranges over sm_80 and sm_90):

    K = V   dtype   shared     registers (residual / GRM / SSC)    spills
    16      fp32    2 KB       40-48 / 40-50 / 40-47               0
    16      bf16    1.5 KB     48 / 40-48 / 40-48                  0
    64      fp32    10 KB      140-144 / 184 / 144-180             0
    64      bf16    9 KB       64 / 80-93 / 80                     0
    128     fp32    10 KB      145-151 / 190-192 / 191-193         0
    128     bf16    9 KB       64-76 / 102-118 / 102-123           0
    256     fp32    6 KB       146-150 / 195 / 195-198             0
    256     bf16    5 KB       75-80 / 149-157 / 149-153           0

Precision: for fp32 inputs the products are exact fp32 (FMA units; TF32 only under ATLASLIB_TF32=1). For
bf16/fp16 queries each state tile is rounded to their dtype before its product, which runs on tensor cores
with fp32 sums (the weights, the scores and y's sum stay fp32; fp16's range: ``core.chunk_kernels``): in the
interpreter, which rounds as a card does, y is off by 1.2x-1.4x what rounding it to bf16/fp16 costs anyway.
Hence the lighter bf16 builds. More than one slot tile (J = 65, three tiles) builds with 62-255 registers: GRM
and SSC at K >= 128 in fp32 take up to 255 and spill up to 100 B a thread (SSC, K = 256, fp32, sm_90),
residual at K = 64 up to 28 B, K = 16 at most 4 B; bf16 at most 28 B.

Why 8 warps and K slices: exact fp32 products run on FMA units, which hold a whole K slice of their
operands per thread. At 4 warps and BK = 128 in one piece the build spilled 4-5 KB a thread; slicing K
by 32 at 4 warps still used all 255 registers; 8 warps and slices of 32 bring it to the table's.

Forward only: the library takes gradients through the PyTorch form. Runs under
``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.kernels import (as_fp32, at_head, channel_block, chunk_program, feature_tile, forward_launch, load_block,
                            load_tile, store_tile, value_tile)
from ..core.memory_kernels import key_channels
from .chunk import check_readout

MAX_KEY = 256
SLOT_TILE = 32                   # slots per [BT, BJ] tile; more slots per token are read a tile at a time
TOKENS_PER_PROGRAM = 16          # BT: the least tl.dot takes; keeps the distinct states per block few

AGG_RESIDUAL = tl.constexpr(0)
AGG_GRM = tl.constexpr(1)
AGG_SSC = tl.constexpr(2)
# soup over matrix memories is GRM (the soup's parameters read q: sum_i gamma_i M_i q)
AGGREGATE_CODES = {"residual": AGG_RESIDUAL.value, "grm": AGG_GRM.value, "soup": AGG_GRM.value, "ssc": AGG_SSC.value}


@triton.jit
def top_k_rows(b_R, b_keep, o_j, TOP_K, BJ: tl.constexpr):
    """The TOP_K largest entries of each row of b_R among those in b_keep (ties: the lowest column)."""
    b_sel = tl.zeros_like(b_keep)
    for _ in range(TOP_K):
        b_cand = tl.where(b_keep & ~b_sel, b_R, float("-inf"))
        b_best = tl.max(b_cand, axis=1)
        m_best = b_keep & ~b_sel & (b_cand == b_best[:, None])
        b_first = tl.min(tl.where(m_best, o_j[None, :], BJ), axis=1)   # BJ: the row has none left
        b_sel = b_sel | (o_j[None, :] == b_first[:, None])
    return b_sel


@triton.jit
def slot_block(blocks_ptr, pooled_ptr, b_u, o_t, m_t, o_j, o_k, m_k, j0, J, K, SCORES: tl.constexpr,
               BT: tl.constexpr, BJ: tl.constexpr):
    """Slots j0 .. j0 + BJ - 1 of the block's tokens: the state indices [BT, BJ] (int64, -1 where none)
    and, with SCORES, the scores r_i = <u_t, p_i> [BT, BJ] (the pooled keys gathered row by row)."""
    o_s = j0 + o_j
    p_idx = blocks_ptr + (o_t.to(tl.int64)[:, None] * J + o_s.to(tl.int64)[None, :])   # one 64-bit offset
    b_idx = tl.load(p_idx, mask=m_t[:, None] & (o_s < J)[None, :], other=-1).to(tl.int64)
    b_R = tl.zeros([BT, BJ], dtype=tl.float32)
    if SCORES:
        m_vis = b_idx >= 0
        for j in range(0, tl.minimum(BJ, J - j0)):
            b_col = tl.sum(tl.where(o_j[None, :] == j, b_idx, 0), axis=1)
            m_col = m_vis & (o_j[None, :] == j)
            b_p = tl.load(pooled_ptr + b_col[:, None] * K + o_k[None, :],
                          mask=(b_col >= 0)[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            b_R = tl.where(m_col, tl.sum(b_u * b_p, axis=1)[:, None], b_R)
    return b_idx, b_R


@triton.jit
def read_states(b_y, b_idx, b_W, q_ptr, s_q, states_ptr, o_t, m_t, o_v, m_v, N, K, V,
                BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """b_y + sum over the distinct states of b_idx (with a nonzero weight) of (its weight per row) M q."""
    b_idx = tl.where(b_W != 0.0, b_idx, -1)                 # zero weights load nothing (SSC's dropped slots)
    o_c = tl.arange(0, BKC)
    i_cur = tl.min(tl.where(b_idx >= 0, b_idx, N), axis=None)
    dt = q_ptr.dtype.element_ty             # tl.dot's operand dtype: the queries' (the states are rounded to it)
    while i_cur < N:
        b_w = tl.sum(tl.where(b_idx == i_cur, b_W, 0.0), axis=1)
        b_Mq = tl.zeros([BT, BV], dtype=tl.float32)
        for k0 in tl.static_range(0, BK, BKC):
            # K in slices of BKC: fp32 products run on FMA units, which hold a whole slice per thread
            o_kc = k0 + o_c
            m_kc = o_kc < K
            b_q = load_block(q_ptr, s_q, o_t, o_kc, m_t, m_kc)
            b_M = tl.load(states_ptr + i_cur * V * K + o_v[:, None] * K + o_kc[None, :],
                          mask=m_v[:, None] & m_kc[None, :], other=0.0).to(dt)
            b_Mq += tl.dot(b_q, tl.trans(b_M), input_precision=PRECISION)
        b_y += b_w[:, None] * b_Mq
        i_cur = tl.min(tl.where(b_idx > i_cur, b_idx, N), axis=None)
    return b_y


@triton.jit
def kept_slots(b_idx, b_R, o_s, b_kv, b_ks, SELECT: tl.constexpr):
    """The visible slots that take part: all, or (SSC over several slot blocks) those at or above the
    row's threshold (b_kv, b_ks) in the order "larger score first, then lower slot"."""
    m_vis = b_idx >= 0
    if SELECT:
        m_vis = m_vis & ((b_R > b_kv[:, None]) | ((b_R == b_kv[:, None]) & (o_s[None, :] <= b_ks[:, None])))
    return m_vis


@triton.jit
def cached_readout_fwd_kernel(
    q_ptr, u_ptr, states_ptr, pooled_ptr, online_ptr, score_ptr, blocks_ptr, y_ptr,
    s_q, s_u, s_on, s_y,
    T, H, N, K, V, J, TOP_K, NT,
    AGG: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr,
    BJ: tl.constexpr, ONE_BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_bh, i_tb, i_b, i_h = chunk_program(NT, H)        # int64: offsets of later heads can exceed 2^31
    i_tb = i_tb.to(tl.int32)                           # this program's block of BT tokens
    q_ptr, online_ptr, y_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(online_ptr, s_on, i_b, i_h), \
        at_head(y_ptr, s_y, i_b, i_h)
    states_ptr += i_bh * N * V * K

    o_t = i_tb * BT + tl.arange(0, BT)      # the block's tokens
    m_t = o_t < T
    o_k, m_k = key_channels(BK, K)
    o_v, m_v = channel_block(tl.program_id(1), BV, V)
    o_j = tl.arange(0, BJ)
    SCORES: tl.constexpr = AGG != AGG_RESIDUAL
    b_u = tl.zeros([BT, BK], dtype=tl.float32)
    b_rs = tl.zeros([BT], dtype=tl.float32)
    if SCORES:
        u_ptr = at_head(u_ptr, s_u, i_b, i_h)
        pooled_ptr += i_bh * N * K
        b_u = load_tile(u_ptr, s_u, o_t, o_k, m_t, m_k)
        b_rs = tl.load(score_ptr + i_bh * T + o_t, mask=m_t, other=0.0)
    b_y = load_tile(online_ptr, s_on, o_t, o_v, m_t, m_v)

    if ONE_BLOCK:
        # every slot in one [BT, BJ] tile: the weights at once, then the read
        b_idx, b_R = slot_block(blocks_ptr, pooled_ptr, b_u, o_t, m_t, o_j, o_k, m_k, 0, J, K, SCORES, BT, BJ)
        m_vis = b_idx >= 0
        if AGG == AGG_RESIDUAL:
            b_W = tl.where(m_vis, 1.0, 0.0)
        else:
            if AGG == AGG_SSC:
                m_vis = top_k_rows(b_R, m_vis, o_j, TOP_K, BJ)
            # softmax over the kept scores and r_s, shifted by the row's exact max (no overflow)
            b_max = tl.maximum(tl.max(tl.where(m_vis, b_R, float("-inf")), axis=1), b_rs)
            b_W = tl.exp(tl.where(m_vis, b_R - b_max[:, None], float("-inf")))   # -inf first: no overflow
            b_ws = tl.exp(b_rs - b_max)
            b_z = b_ws + tl.sum(b_W, axis=1)
            b_W, b_ws = b_W / b_z[:, None], b_ws / b_z
            b_y = b_y * b_ws[:, None]
        b_y = read_states(b_y, b_idx, b_W, q_ptr, s_q, states_ptr, o_t, m_t, o_v, m_v, N, K, V,
                          BT, BK, BKC, BV, PRECISION)
    else:
        # more slots than one tile holds: the slots in blocks of BJ, scores recomputed per sweep
        SELECT: tl.constexpr = AGG == AGG_SSC
        b_kv = tl.full([BT], float("inf"), tl.float32)     # SSC's threshold: score, then slot
        b_ks = tl.full([BT], -1, tl.int32)
        if SELECT:
            # TOP_K rounds of "the row's next score in the order (larger score, lower slot)"
            for _ in range(TOP_K):
                b_bv = tl.full([BT], float("-inf"), tl.float32)
                b_bs = tl.full([BT], J, tl.int32)
                for j0 in range(0, J, BJ):
                    o_s = j0 + o_j
                    b_idx, b_R = slot_block(blocks_ptr, pooled_ptr, b_u, o_t, m_t, o_j, o_k, m_k, j0, J, K,
                                            SCORES, BT, BJ)
                    m_c = (b_idx >= 0) & ((b_R < b_kv[:, None]) |
                                          ((b_R == b_kv[:, None]) & (o_s[None, :] > b_ks[:, None])))
                    b_c = tl.where(m_c, b_R, float("-inf"))
                    b_best = tl.max(b_c, axis=1)
                    b_slot = tl.min(tl.where(m_c & (b_c == b_best[:, None]), o_s[None, :], J), axis=1)
                    m_up = (b_slot < J) & ((b_best > b_bv) | (b_bs == J))   # earlier blocks win ties
                    b_bv, b_bs = tl.where(m_up, b_best, b_bv), tl.where(m_up, b_slot, b_bs)
                m_found = b_bs < J                                 # a row out of slots keeps its threshold
                b_kv, b_ks = tl.where(m_found, b_bv, b_kv), tl.where(m_found, b_bs, b_ks)
        b_max = b_rs
        b_z = tl.full([BT], 1.0, tl.float32)                      # sum of exp(r - b_max), r_s included
        if SCORES:
            # online softmax over the slot blocks: a running max, the sum rescaled when it grows
            for j0 in range(0, J, BJ):
                b_idx, b_R = slot_block(blocks_ptr, pooled_ptr, b_u, o_t, m_t, o_j, o_k, m_k, j0, J, K,
                                        SCORES, BT, BJ)
                m_vis = kept_slots(b_idx, b_R, j0 + o_j, b_kv, b_ks, SELECT)
                b_new = tl.maximum(b_max, tl.max(tl.where(m_vis, b_R, float("-inf")), axis=1))
                b_e = tl.exp(tl.where(m_vis, b_R - b_new[:, None], float("-inf")))
                b_z = b_z * tl.exp(b_max - b_new) + tl.sum(b_e, axis=1)
                b_max = b_new
            b_y = b_y * (tl.exp(b_rs - b_max) / b_z)[:, None]
        for j0 in range(0, J, BJ):
            b_idx, b_R = slot_block(blocks_ptr, pooled_ptr, b_u, o_t, m_t, o_j, o_k, m_k, j0, J, K,
                                    SCORES, BT, BJ)
            m_vis = kept_slots(b_idx, b_R, j0 + o_j, b_kv, b_ks, SELECT)
            if SCORES:
                b_W = tl.exp(tl.where(m_vis, b_R - b_max[:, None], float("-inf"))) / b_z[:, None]
            else:
                b_W = tl.where(m_vis, 1.0, 0.0)
            b_y = read_states(b_y, b_idx, b_W, q_ptr, s_q, states_ptr, o_t, m_t, o_v, m_v, N, K, V,
                              BT, BK, BKC, BV, PRECISION)
    store_tile(y_ptr, s_y, o_t, o_v, m_t, m_v, b_y)


def kernel_limits(q, blocks, u=None) -> str | None:
    """What the kernel refuses (a dispatch then runs the PyTorch form): fp64, K > MAX_KEY, and a router u
    narrower or wider than q (a base with a feature map reads phi(q), while u keeps the key width)."""
    if u is not None and u.shape[-1] != q.shape[-1]:
        return f"a router of width {u.shape[-1]} with queries of width {q.shape[-1]} (a feature map on the base)"
    if q.dtype == torch.float64:
        return "fp64 inputs (it computes in fp32)"
    if q.shape[-1] > MAX_KEY:
        return f"head size K={q.shape[-1]} (at most {MAX_KEY})"
    return None


def launch_aggregate(q, u, states, pooled, online, online_score, blocks, top_k, aggregate):
    """Refuse what the kernel cannot read (``chunk.check_readout``, and u of q's size); returns (AGG, TOP_K)
    for the launch (SSC with top_k >= J is GRM)."""
    check_readout(q, u, states, pooled, online, online_score, blocks, top_k, aggregate, AGGREGATE_CODES)
    if u is not None and u.shape[-1] != q.shape[-1]:
        raise ValueError(f"u must have q's size K={q.shape[-1]} for the kernel, got {u.shape[-1]}")
    if aggregate == "ssc" and (top_k is None or top_k >= blocks.shape[1]):
        return AGG_GRM.value, 0                             # every visible state kept: GRM
    return AGGREGATE_CODES[aggregate], top_k or 0


def cached_readout_triton(q, u, states, pooled, online, online_score, blocks, top_k=None, aggregate="grm"):
    """Memory Caching's readout y [B, H, T, V] (in q's dtype) from the cached states of linear memories.

    q, u [B, H, T, K]; states [B, H, N, V, K] (the cached final states); pooled [B, H, N, K] (pooled keys);
    online [B, H, T, V] (the base's output inside the token's own segment); online_score [B, H, T]
    (r_s); blocks [T, J] (the states each token reads, -1 padded); top_k for aggregate="ssc". For
    "residual", u, pooled and online_score are not read and may be None; u None is q, as in ``cached_readout``.
    See the module docstring.
    """
    u = q if u is None else u
    agg, top = launch_aggregate(q, u, states, pooled, online, online_score, blocks, top_k, aggregate)
    B, H, T, K = q.shape
    N, V, J = states.shape[2], states.shape[3], blocks.shape[1]
    BK = feature_tile(K, MAX_KEY)
    run = forward_launch(q, u, online, BV=value_tile(V, 64 if BK <= 128 else 32))
    NT = triton.cdiv(T, TOKENS_PER_PROGRAM)
    BJ = max(2, min(SLOT_TILE, triton.next_power_of_2(J)))
    cached_readout_fwd_kernel[(B * H * NT, run.grid[1])](
        run.q, run.k, as_fp32(states), as_fp32(pooled), run.v,
        as_fp32(online_score), blocks.to(device=q.device, dtype=torch.int32).contiguous(), run.o, *run.strides,
        T, H, N, K, V, J, top, NT,
        AGG=agg, BT=TOKENS_PER_PROGRAM, BK=BK, BKC=min(BK, 32), BV=run.BV, BJ=BJ, ONE_BLOCK=J <= BJ,
        PRECISION=run.precision, num_warps=8,
    )
    return run.o
