"""The GPU kernel: the kernel-trick DeepTransformer (and SWDT), tiled as FlashAttention tiles it.

With phi_star="kernel" the linear DeepTransformer reads

    y_t = sum_{i in window(t)} eta_i e^{g_t - g_i} exp(k_i^T q_t) v_i,     g_t = sum_{j<=t} log alpha_j,

optionally divided by the same sum with v_i replaced by 1 (``normalize``), where window(t) is
i <= t, and i > t - c with a window c (SWDT). That is causal attention with a per-token
log-decay in the exponent and a per-key weight eta_i, so the kernel is FlashAttention's forward:

* one program per (block of BM queries, batch*head, block of BV value channels): query blocks
  share nothing, so the grid (B*H*cdiv(T, BM), cdiv(V, BV)) grows with T and fills the GPU even
  at one head. Each program walks the key blocks of BN rows its queries can see: from the block
  holding its oldest visible key (t0 - c + 1) up to the diagonal. The last query blocks of every
  head (the most keys) get the first program indices, so the longest programs start first.
* the exponent of a tile is S = Q K^T + (g_t - g_i), masked to -inf outside the window *before*
  the exponential (the chunk form's ``kernel_weights``). The decays come from the host as the fp64
  running sum g; each query block subtracts g at its first row, in fp64, before rounding to fp32,
  so a decay between nearby tokens keeps its digits however long the sequence (far pairs, whose
  decays lose digits, are the ones that vanish); a strong decay inside the query block itself still
  costs digits, as in the chunk form (``chunk.split_decay``);
* ``normalize``: FlashAttention's online softmax. A running row max m and running sum
  l = sum_i eta_i e^{S - m} in fp32; each new tile rescales the accumulator by e^{m_old - m_new},
  so exp never overflows whatever the scores (the factor e^{-m} cancels in acc / l);
* without ``normalize`` the weights are e^{S} themselves: like the chunk form, no shift (there is
  no quotient for it to cancel in), so ``deep_transformer`` refuses scores above MAX_EXPONENT
  (``validation.check_exponents``: on CUDA, where the norm bound fails, an asynchronous device-side assert).
* fp16/bf16 inputs reach ``tl.dot`` in their own dtype (tensor-core products, fp32 accumulation), and
  the weights P are rounded to that dtype for the product with V, as FlashAttention does; except
  unnormalised fp16, whose weights e^{S} can pass fp16's largest value (65504), so P stays fp32 there
  and V is cast to fp32 for a TF32 product (``weights_precision``), on tensor cores: TF32 keeps fp32's
  range and every mantissa bit of an fp16 value. In the interpreter (which drops TF32's bits as a card
  does) that o is off an fp64 run on the same inputs by 2.0x-2.7x what rounding it to fp16 costs (1.0x
  with exact products), bf16's by 1.3x-1.6x. fp32 inputs stay exact fp32 products (``ieee``; TF32 only
  with ATLASLIB_TF32=1); DOT's fp32 coefficients are read with "tf32x3" for 16-bit inputs (see DOT
  below).

q, k, v are read through their strides (views need no copy); absent inputs (no alpha, no eta)
are ``None`` pointers, which Triton compiles away. Tiles: BK = dot_tile(K) with K <= 256 (every
program holds whole keys), BM = BN = 64 for half-precision inputs up to BK = 128, else 32 (see
TILES below: fp32's FMA-based products spill registers at 64), BV <= 64 (a wider V is split
across programs, each recomputing the scores). Launched with num_stages=1, as chapter 4's kernel.

``hebbian_triton``: phi_star=("taylor", P) without a window is chapter 1's matrix memory on the
features phi*_P with values eta_t v_t, so it runs chapter 1's kernel on them (D <= 256).

``dot_kernel_triton``: DOT with c = 1 and phi_star="kernel" (the delta rule on phi*), in three
kernels. The coefficients solve u_t = eta_t (v_t - sum_{j<t} e^{g_{t-1} - g_j} exp(k_j^T k_t) u_j),
a unit lower-triangular system on tokens that never mixes value channels, so splitting V is exact
(each value block solves the same system on its own columns). An fp32 buffer U [B, H, T, V] starts as
v and ends as the coefficients. The solve is recursive (DOT SOLVE below): the first half of a range of
tokens is solved, then ``dot_recall_kernel`` subtracts what it recalls at the second half's keys,
sum_j e^{g_{t-1} - g_j} exp(k_j^T k_t) u_j over the first half, from the second half's rows of U (a
program per block of BT tokens and head: parallel, O(T^2) in all, as attention), then the second half
is solved. A range of at most DOT_LEAF tokens is solved by ``dot_solve_kernel``, ``chunk.dot_chunk``'s
block solve in one program per (batch*head, block of BV value channels), walking blocks of BT tokens
in order; for each block:

* recall: the same sum over the leaf's earlier blocks, their keys and coefficients read back from U;
* the block's own system (I + Diag(eta) L) U = Diag(eta) (U - recall), L[t, j] = e^{g_{t-1} - g_j}
  exp(k_j^T k_t) for j < t, solved in registers with chapter 2's ``unit_lower_inverse`` (its 16 x 16
  diagonal blocks by forward substitution, then joined); U is written back;
* a barrier (``tl.debug_barrier``) before the next block, whose threads read back what others wrote.

The read y_t = sum_{j<=t} e^{g_t - g_j} exp(k_j^T q_t) u_j needs every coefficient up to t and
nothing else, so it waits for the solve and then runs in parallel: it is the kernel-trick
DeepTransformer's forward above (no window, no eta, unnormalised) with the coefficients as values,
one program per block of queries. The coefficients stay fp32 (the solve's, whose error would feed every
later one, and the read's). The read's terms cancel where little decays, so how its products round
shows. Measured in the interpreter (which rounds as a card does), bf16 outputs without gates, K = 64, as a
multiple of their own rounding: coefficients rounded to bf16 for bf16 products (FlashAttention's choice
for its weights) 21x at T = 256, 43x at T = 1024 (3.1x-3.3x with gates at T = 200); one TF32 product of
the fp32 coefficients 3.1x and 5.6x (fp16 outputs: 20x, fp16's mantissa being as long as TF32's); exact
products 1.0x at every T. So 16-bit inputs read with "tf32x3" (``weights_precision``): each fp32 operand
split into its TF32 part and the rest, three TF32 products on tensor cores (small x small left out),
about 2^-21 relative on a card (the interpreter computes it exactly), far below a 16-bit output's
rounding. Only the leaves of the solve are sequential.

Exponents are masked to -inf before the exponential; the exp kernel is unnormalised, so ``dot``
refuses scores above MAX_EXPONENT first (``validation.check_exponents``, for k.q and k.k). The
log-decays g_t and g_{t-1} come from the host in fp64 and are taken relative to g at the block's
first row before rounding, as above. Rows past T get eta = 0 and zero rows of L, so they write
nothing and their rows of the inverse stay finite. Tiles: K <= 128 (DOT_MAX_KEY), BV <= 64,
BT = 32, or 16 past BK = 32; see DOT TILES below.

Forward only: ``deep_transformer(..., backend="triton")`` and ``dot(..., backend="triton")`` get their
gradients from ``core.with_chunk_backward`` (autograd through ``chunk.masked_chunk``, ``chunk.dot_chunk``,
recomputed from the saved inputs; ``chunk.hebbian_chunk`` for the features). Runs under
``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.chunking import gate_logs
from ..core.dispatch import matrix_kernel_limits
from ..core.kernels import (as_fp32, at_head, channel_block, chunk_program, feature_tile, forward_launch,
                            load_block, load_tile, precision, store_tile, value_tile)
from ..core.memory_kernels import chunk_rows, head_value_block, key_channels, qkvo_at_head
from ..core.alloc import empty
from ..delta.kernel import unit_lower_inverse

# Every program holds whole keys and queries ([BN, BK] and [BM, BK] tiles): K <= 256.
MAX_KEY = 256
# TILES. Query and key blocks BM = BN = 64 when q, k and v are all fp16/bf16 with BK <= 128, else 32;
# 8 warps for fp32 tiles past BK = 64, else 4. Measured by building for sm_90 (``atlaslib.aot``,
# num_stages=1, gates and eta on): with fp32 tiles (exact fp32 products, tl.dot on FMA units) 64-row
# blocks spill 3-17 KB a thread at 4 warps, and 32-row blocks at 4 warps spill 0.6 KB (K = 128) to
# 2.2 KB (K = 256) in the one-query-block-per-program form, none at 8 warps (76-186 registers; at
# K = 64 and 4 warps, 118-128 registers and 4 B on sm_80); bf16 q, k, v at 64-row blocks and K = 64:
# 16-24 KB shared, 128-204 registers, no spills (sm_80 and sm_90). On an H100
# (B=1, H=4, T=2048, K=V=64, fp32) the earlier form, one program walking every query block, took
# 8.4 ms where the chunk form took 7.2 ms; the grid over query blocks has not been timed yet.


@triton.jit
def deep_kernel_fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, eta_ptr, o_ptr,
    s_q, s_k, s_v, s_o,
    T, H, K, V, c, NQ,
    NORMALIZE: tl.constexpr, P_IN_INPUT_DTYPE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
    P_PRECISION: tl.constexpr,
):
    # axis 0 enumerates (query block, batch*head) pairs, the last query block of every head first: those
    # see the most keys, so the longest programs start first; axis 1, blocks of value channels
    i_p = tl.program_id(0).to(tl.int64)
    BH = tl.num_programs(0) // NQ
    i_bh = i_p % BH
    i_b, i_h = i_bh // H, i_bh % H
    start = ((NQ - 1 - i_p // BH) * BM).to(tl.int32)             # tokens within a head: T < 2^31
    o_v, m_v = channel_block(tl.program_id(1), BV, V)
    q_ptr, k_ptr, v_ptr, o_ptr = qkvo_at_head(q_ptr, k_ptr, v_ptr, o_ptr, s_q, s_k, s_v, s_o, i_b, i_h)
    o_k, m_k = key_channels(BK, K)
    o_m = tl.arange(0, BM)                  # rows of a query block
    o_n = tl.arange(0, BN)                  # rows of a key block

    o_t = start + o_m                   # the query block's tokens
    m_t = o_t < T
    b_q = load_block(q_ptr, s_q, o_t, o_k, m_t, m_k)          # in the inputs' dtype: tensor-core products
    if g_ptr is not None:
        # log-decays relative to g at the block's first row: subtracted in fp64, then fp32
        b_gref = tl.load(g_ptr + i_bh * T + start)
        b_gq = (tl.load(g_ptr + i_bh * T + o_t, mask=m_t, other=0.0) - b_gref).to(tl.float32)
    b_acc = tl.zeros([BM, BV], dtype=tl.float32)
    b_m = tl.full([BM], float("-inf"), tl.float32)          # running row max (normalize)
    b_l = tl.zeros([BM], dtype=tl.float32)                  # running sum of eta_i e^{S - m}

    lo = tl.maximum(start - c + 1, 0)                       # the oldest key the block sees
    lo = (lo // BN) * BN
    hi = tl.minimum(start + BM, T)                          # past the block's last row
    for kstart in range(lo, hi, BN):
        o_s = kstart + o_n              # the key block's tokens
        m_s = o_s < T
        b_k = load_block(k_ptr, s_k, o_s, o_k, m_s, m_k)
        b_v = load_block(v_ptr, s_v, o_s, o_v, m_s, m_v)
        b_S = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
        if g_ptr is not None:
            b_gk = (tl.load(g_ptr + i_bh * T + o_s, mask=m_s, other=0.0) - b_gref).to(tl.float32)
            b_S += b_gq[:, None] - b_gk[None, :]
        # causal, in the window, a real key, a real query (rows past T see nothing: their decays are
        # not those of any token, and unmasked they could overflow a 16-bit cast of the unstored rows)
        m_ok = (o_s[None, :] <= o_t[:, None]) & (o_s[None, :] > o_t[:, None] - c) & m_s[None, :] & m_t[:, None]
        b_S = tl.where(m_ok, b_S, float("-inf"))            # masked before the exponential
        if NORMALIZE:
            b_m_new = tl.maximum(b_m, tl.max(b_S, 1))
            b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)   # rows that see nothing yet
            b_p = tl.exp(b_S - b_shift[:, None])
            b_scale = tl.exp(b_m - b_shift)
            b_m = b_m_new
        else:
            b_p = tl.exp(b_S)
        if eta_ptr is not None:
            b_p = b_p * tl.load(eta_ptr + i_bh * T + o_s, mask=m_s, other=0.0)[None, :]
        if NORMALIZE:
            b_l = b_l * b_scale + tl.sum(b_p, 1)
            b_acc = b_acc * b_scale[:, None]
        if P_IN_INPUT_DTYPE:
            b_acc += tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
        else:
            b_acc += tl.dot(b_p, b_v.to(tl.float32), input_precision=P_PRECISION)
    if NORMALIZE:
        # 0/0 where every visible eta is 0, as in the chunk form; rows past T (which may see
        # no key at all with a window) are not stored and divide by 1
        b_acc = b_acc / tl.where(m_t, b_l, 1.0)[:, None]
    store_tile(o_ptr, s_o, o_t, o_v, m_t, m_v, b_acc)


def weights_precision(q_dtype: torch.dtype, v_dtype: torch.dtype) -> str:
    """``input_precision`` of the read's product P V where the weights P stay fp32 (unused where they are
    rounded to the inputs' dtype): TF32 for fp16 values, which TF32 holds exactly (unnormalised fp16; the
    weights keep TF32's 11-bit mantissa, fp16's length, the dtype the output is rounded to);
    "tf32x3" for fp32 values read with 16-bit queries (DOT's coefficients, whose sum cancels: see DOT
    below); ``precision`` for fp32 inputs (exact)."""
    if v_dtype == torch.float16:
        return "tf32"
    if v_dtype == torch.float32 and q_dtype in (torch.float16, torch.bfloat16):
        return "tf32x3"
    return precision(v_dtype)


def kernel_limits(q) -> str | None:
    """What the kernel refuses (``backend="auto"`` on CUDA then runs the chunk form): fp64, K > MAX_KEY."""
    if q.dtype == torch.float64:
        return "fp64 inputs (it computes in fp32)"
    if q.shape[-1] > MAX_KEY:
        return f"head size K={q.shape[-1]} (at most {MAX_KEY})"
    return None


def deep_kernel_triton(q, k, v, alpha=None, eta=None, log_alpha=None, window=None, normalize=False):
    """Triton forward of the kernel-trick DeepTransformer; returns (o [B, H, T, V] in q's dtype, None).

    Same function as ``chunk.masked_chunk`` with kernel="exp" and, with ``normalize``, its shift and
    quotient by the normaliser: v holds the values only.
    """
    run = forward_launch(q, k, v, BV=value_tile(v.shape[-1], 64), name="the DeepTransformer kernel")
    BK = feature_tile(run.K, MAX_KEY)
    # fp16/bf16 q, k and v (DOT's read has fp16/bf16 q, k and fp32 coefficients as v: fp32 tiles)
    half = run.q.dtype in (torch.float16, torch.bfloat16) and run.v.dtype == run.q.dtype
    BM = BN = 64 if (half and BK <= 128) else 32                      # see TILES above
    logs = gate_logs(alpha, log_alpha, torch.float64)
    g = None if logs is None else logs.cumsum(-1).contiguous()       # fp64: see the module's docstring
    c = run.T if window is None else min(int(window), run.T)         # c >= T: no window
    NQ = triton.cdiv(run.T, BM)                                      # query blocks per head
    deep_kernel_fwd_kernel[(run.B * run.H * NQ, triton.cdiv(run.V, run.BV))](
        run.q, run.k, run.v, g, as_fp32(eta), run.o, *run.strides,
        run.T, run.H, run.K, run.V, c, NQ,
        NORMALIZE=bool(normalize), P_IN_INPUT_DTYPE=half and (bool(normalize) or run.q.dtype == torch.bfloat16),
        BM=BM, BN=BN, BK=BK, BV=run.BV, PRECISION=run.precision,
        P_PRECISION=weights_precision(run.q.dtype, run.v.dtype), num_stages=1,
        num_warps=8 if (not half and BK > 64) else 4,
    )
    return run.o, None


def hebbian_triton(fq, fk, v, alpha=None, eta=None, initial_state=None, log_alpha=None):
    """phi_star=("taylor", P) without a window: chapter 1's kernel (``linear_attention_triton``) on the
    features phi*_P(q), phi*_P(k) with values eta_t v_t. Same arguments and results as
    ``chunk.hebbian_chunk`` (without chunk_size): (o in fq's dtype, final state [B, H, V, D] in fp32).
    The features have D = C(K + P, P) channels: at most 256 (chapter 1's MAX_KEY)."""
    from ..linear.kernel import MAX_KEY as MAX_FEATURES, linear_attention_triton
    if fq.shape[-1] > MAX_FEATURES:
        raise ValueError(f"the Triton kernel of phi_star=('taylor', P) (chapter 1's, on the features) supports "
                         f"D = C(K + P, P) <= {MAX_FEATURES} feature channels, got D={fq.shape[-1]}; use a smaller "
                         f"P, phi_star='kernel' (exact, its own kernel) or backend='chunk'")
    if eta is not None:
        v = eta[..., None].to(torch.float32) * v.to(torch.float32)       # the write eta_t v_t
    return linear_attention_triton(fq, fk, v.to(fq.dtype), alpha, initial_state, log_alpha)   # one dtype per tl.dot


# ---------------------------------------------------------------------------------------
# DOT with c = 1 (the delta rule on phi*): the coefficient solve, block by block
# ---------------------------------------------------------------------------------------
# Every program holds a block's keys (or queries) beside an earlier block's keys, the block's
# inverse and two accumulators: K <= 128.
DOT_MAX_KEY = 128
# DOT TILES. The keys are loaded in their own dtype (exact products, fp32 sums), the coefficients and the
# block's system in fp32, so one rule serves every dtype: blocks of BT = 32 tokens up to BK = 32, else 16;
# BV <= 64; 8 warps for the leaves, 4 for the recall. Measured by building for sm_80 and sm_90
# (``atlaslib.aot``, num_stages=1, gates and eta on): shared memory 7-16 KB; the leaf kernel 128-196
# registers, no spills, except fp32 at K = 128: 112 B a thread (140-156 B before the recursive split,
# whatever the tiles tried: BV 16-64, 8 or 16 warps; bf16 keys at K = 128 spilled 128 B while they were
# loaded as fp32, none now); the recall kernel 53-124 registers, no spills; the read of bf16 inputs
# ("tf32x3": the bf16 scores and three TF32 products, all on tensor cores) 123-161 registers, no spills
# (one TF32 product: 94-126). On an H100 (B=1, H=4, T=2048, K=V=64, fp32) the first kernel, one program
# walking every block and reading as it went, took 45.5 ms where the chunk form took 28.7 ms; the
# parallel read and the recursive solve have not been timed on a card yet.
# DOT SOLVE. The tokens are split in halves recursively, as a blocked triangular solve (TRSM) does:
# solve the first half; subtract what it recalls from the second half's right-hand sides
# (``dot_recall_kernel``, a program per block of BT tokens: parallel); solve the second half. Halves of
# DOT_LEAF tokens or fewer are leaves, solved by ``dot_solve_kernel`` (one program per head and value
# block, BT tokens at a time). A head's serial work is then the leaves (T * DOT_LEAF / 2 key-row visits
# instead of T^2 / 2 in one pass over all earlier blocks); the rest, about log2(T / DOT_LEAF) passes over
# the tokens, runs in programs of BT rows. 2 cdiv(T, DOT_LEAF) - 1 launches (leaves and recalls): 31 at
# T = 2048; the read is one more.
DOT_LEAF = 128


@triton.jit
def log_decay_from(g_ptr, o_t, m_t, b_gref):
    """g[o_t] - g_ref for the fp64 running log-decays g: subtracted in fp64, then fp32 (0 where masked)."""
    return tl.where(m_t, (tl.load(g_ptr + o_t, mask=m_t, other=0.0) - b_gref).to(tl.float32), 0.0)


@triton.jit
def earlier_blocks(b_acc, b_k, b_gp, lo, start, k_ptr, s_k, u_ptr, s_u, g_ptr, b_gref, o_k, m_k, o_v, m_v, T,
                   BT: tl.constexpr, PRECISION: tl.constexpr):
    """b_acc + sum_{lo <= j < start} e^{gp_t - g_j} exp(k_j . k_t) u_j for the block's keys b_k (gp = g_{t-1}):
    what the blocks of BT tokens from lo up to start recall, their keys and coefficients read back from
    this head's k and u. Decays (g_ptr: this head's g, None without gates) relative to b_gref, as b_gp."""
    for kstart in range(lo, start, BT):
        o_s = kstart + tl.arange(0, BT)
        m_s = o_s < T
        b_kj = load_block(k_ptr, s_k, o_s, o_k, m_s, m_k)
        b_S = tl.dot(b_k, tl.trans(b_kj), input_precision=PRECISION)
        if g_ptr is not None:
            b_S += b_gp[:, None] - log_decay_from(g_ptr, o_s, m_s, b_gref)[None, :]
        b_acc += tl.dot(tl.exp(b_S), load_tile(u_ptr, s_u, o_s, o_v, m_s, m_v), input_precision=PRECISION)
    return b_acc


@triton.jit
def block_keys_and_decays(k_ptr, s_k, g_ptr, gp_ptr, start, o_t, m_t, o_k, m_k):
    """The keys of the block of tokens o_t from ``start`` (in their dtype: a product of two fp16/bf16 numbers
    is exact in fp32, so k.k on tensor cores with fp32 sums loses nothing) and, with gates, g at its
    first row, g_t and g_{t-1} relative to it (0.0 without)."""
    b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
    b_gref, b_gq, b_gp = 0.0, 0.0, 0.0      # no decays (never read)
    if g_ptr is not None:
        b_gref = tl.load(g_ptr + start)
        b_gq = log_decay_from(g_ptr, o_t, m_t, b_gref)
        b_gp = log_decay_from(gp_ptr, o_t, m_t, b_gref)
    return b_k, b_gref, b_gq, b_gp


@triton.jit
def dot_solve_kernel(
    k_ptr, g_ptr, gp_ptr, eta_ptr, u_ptr,
    s_k, s_u,
    T, H, K, V, LO, HI,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """The coefficients of tokens LO .. HI - 1 (a leaf of the solve), blocks of BT in order. u holds the
    right-hand sides v_t - (what the tokens before LO recall) on entry, the coefficients on return."""
    i_bh, i_b, i_h, o_v, m_v = head_value_block(H, V, BV)        # this program's head and value channels
    k_ptr, u_ptr = at_head(k_ptr, s_k, i_b, i_h), at_head(u_ptr, s_u, i_b, i_h)
    if g_ptr is not None:
        g_ptr, gp_ptr = g_ptr + i_bh * T, gp_ptr + i_bh * T    # this head's g_t and g_{t-1}
    o_k, m_k = key_channels(BK, K)
    o_i, _ = chunk_rows(BT)
    m_strict = o_i[:, None] > o_i[None, :]                         # j < t inside a block

    for start in range(LO, HI, BT):
        o_t = start + o_i                   # the block's tokens
        m_t = o_t < HI
        b_k, b_gref, b_gq, b_gp = block_keys_and_decays(k_ptr, s_k, g_ptr, gp_ptr, start, o_t, m_t, o_k, m_k)
        if eta_ptr is not None:
            b_eta = tl.load(eta_ptr + i_bh * T + o_t, mask=m_t, other=0.0)
        else:
            b_eta = tl.where(m_t, 1.0, 0.0)  # rows past HI write nothing
        # what the leaf's earlier blocks (coefficients known) recall at k_t under the state M_{t-1}:
        # weights e^{g_{t-1} - g_j} exp(k_j.k_t)
        b_recall = earlier_blocks(tl.zeros([BT, BV], dtype=tl.float32), b_k, b_gp, LO, start,
                                  k_ptr, s_k, u_ptr, s_u, g_ptr, b_gref, o_k, m_k, o_v, m_v, T, BT, PRECISION)

        # the block's own system (I + Diag(eta) L) U = Diag(eta) (V - recall), L strictly lower; masked to
        # -inf before the exponential, rows past HI zero (so their rows of the inverse stay finite)
        b_S = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
        if g_ptr is not None:
            b_S += b_gp[:, None] - b_gq[None, :]
        b_L = tl.exp(tl.where(m_strict & m_t[:, None], b_S, float("-inf")))
        b_R = unit_lower_inverse(b_eta[:, None] * b_L, BT, 16, PRECISION)
        b_rhs = load_tile(u_ptr, s_u, o_t, o_v, m_t, m_v)
        b_u = tl.dot(b_R, b_eta[:, None] * tl.where(m_t[:, None], b_rhs - b_recall, 0.0), input_precision=PRECISION)
        store_tile(u_ptr, s_u, o_t, o_v, m_t, m_v, b_u)
        # the next blocks read this block's coefficients back: every thread's stores first
        tl.debug_barrier()


@triton.jit
def dot_recall_kernel(
    k_ptr, g_ptr, gp_ptr, u_ptr,
    s_k, s_u,
    T, H, K, V, LO, MID, HI, NQ,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """u_t -= sum_{LO <= j < MID} e^{g_{t-1} - g_j} exp(k_j . k_t) u_j for the tokens MID <= t < HI: what the
    solved tokens LO .. MID - 1 recall, taken from the right-hand sides of the later ones. One program
    per (block of BT tokens, batch*head) on axis 0 and block of value channels on axis 1: the blocks
    share nothing."""
    i_bh, i_q, i_b, i_h = chunk_program(NQ, H)
    o_v, m_v = channel_block(tl.program_id(1), BV, V)
    k_ptr, u_ptr = at_head(k_ptr, s_k, i_b, i_h), at_head(u_ptr, s_u, i_b, i_h)
    if g_ptr is not None:
        g_ptr, gp_ptr = g_ptr + i_bh * T, gp_ptr + i_bh * T
    o_k, m_k = key_channels(BK, K)
    start = MID + i_q.to(tl.int32) * BT     # tokens within a head: T < 2^31
    o_t = start + tl.arange(0, BT)
    m_t = o_t < HI
    b_k, b_gref, _, b_gp = block_keys_and_decays(k_ptr, s_k, g_ptr, gp_ptr, start, o_t, m_t, o_k, m_k)
    b_recall = earlier_blocks(tl.zeros([BT, BV], dtype=tl.float32), b_k, b_gp, LO, MID,
                              k_ptr, s_k, u_ptr, s_u, g_ptr, b_gref, o_k, m_k, o_v, m_v, T, BT, PRECISION)
    store_tile(u_ptr, s_u, o_t, o_v, m_t, m_v, load_tile(u_ptr, s_u, o_t, o_v, m_t, m_v) - b_recall)


def dot_kernel_limits(q) -> str | None:
    """What the DOT kernel refuses (``backend="auto"`` on CUDA then runs the chunk form): fp64, K > DOT_MAX_KEY."""
    return matrix_kernel_limits(q, DOT_MAX_KEY)


def dot_coefficients(run, g, gp, eta, BT: int, BK: int, leaf: int):
    """The coefficients u_t [B, H, T, V] fp32 of DOT's solve for ``run``'s keys and values (DOT SOLVE above):
    U starts as v; a range of one leaf is solved in place by the serial kernel, a longer one in halves,
    the first half's recall subtracted from the second half's rows of U in between."""
    U = empty(run.B, run.H, run.T, run.V, dtype=torch.float32, device=run.k.device).copy_(run.v)
    tiles = dict(BT=BT, BK=BK, BV=run.BV, PRECISION=run.precision, num_stages=1)

    def solve(lo, hi):
        n = triton.cdiv(hi - lo, leaf)                               # leaves in [lo, hi)
        if n == 1:
            dot_solve_kernel[run.grid](run.k, g, gp, eta, U, run.strides[1], tuple(U.stride()),
                                       run.T, run.H, run.K, run.V, lo, hi, num_warps=8, **tiles)
            return
        mid = lo + (n // 2) * leaf
        solve(lo, mid)
        NQ = triton.cdiv(hi - mid, BT)
        dot_recall_kernel[(run.B * run.H * NQ, run.grid[1])](
            run.k, g, gp, U, run.strides[1], tuple(U.stride()),
            run.T, run.H, run.K, run.V, lo, mid, hi, NQ, num_warps=4, **tiles)
        solve(mid, hi)

    if run.T:
        solve(0, run.T)
    return U


def dot_kernel_triton(q, k, v, alpha=None, eta=None, leaf=DOT_LEAF):
    """Triton forward of DOT with c = 1 and phi_star="kernel"; returns (o [B, H, T, V] in q's dtype, None).

    Same arguments and results as ``chunk.dot_chunk`` with kernel="exp" (without chunk_size: the
    kernel's block is its own, and every block size gives the same function). alpha must be > 0.
    ``leaf``: tokens the serial kernel solves at a time (rounded up to its block); see DOT SOLVE above.
    """
    run = forward_launch(q, k, v, BV=value_tile(v.shape[-1], 64), name="the DOT kernel")
    BK = feature_tile(run.K, DOT_MAX_KEY)
    BT = 16 if BK > 32 else 32                                       # see DOT TILES above
    leaf = triton.cdiv(max(int(leaf), 1), BT) * BT
    logs = gate_logs(alpha, None, torch.float64)
    g = None if logs is None else logs.cumsum(-1).contiguous()       # g_t, fp64
    gp = None if logs is None else (g - logs).contiguous()           # g_{t-1}
    U = dot_coefficients(run, g, gp, as_fp32(eta), BT, BK, leaf)
    # the read: the kernel-trick forward on the coefficients, a program per block of queries (it
    # allocates its own output, so run's unused one is freed first), on the fp32 coefficients: their
    # sum cancels, so 16-bit inputs read them with "tf32x3" (``weights_precision``), not rounded
    q, k = run.q, run.k
    del run
    return deep_kernel_triton(q, k, U, alpha)
