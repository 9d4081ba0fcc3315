"""The chunk-parallel forward shared by chapters 1 and 2: state pass, outputs, per-channel scores.

A chunked recurrence has one serial dependency: the state at the start of chunk c needs the
state at the start of chunk c - 1. Everything else — the scores inside a chunk, the triangular
solve of the delta rule, the outputs once the start states are known — is independent per
chunk. A kernel that walks every chunk in one program per (batch*head, value block) therefore
runs all of it serially: B*H*(V/BV) programs, often fewer than a GPU has multiprocessors, each
doing T/BT chunks' worth of work one after the other. The forward is split instead into
kernels that each run in parallel over what is independent:

(a) intra-chunk work, parallel over (batch*head, chunk): for per-channel gates the decayed
    scores (``channel_scores_kernel`` here); for the delta rule the WY factors w, u
    (``delta.kernel``). The chunk-local cumulative log-gates g are computed on the host
    (``core.kernels.chunk_gates``: a cumsum inside each chunk, itself parallel over chunks; fp64
    for fp32 inputs, so that ``core.kernels.decay`` rounds each difference g_i - g_j only after
    taking it);
(b) ``chunk_state_kernel``, the only serial part: parallel over (batch*head, value block, key
    block), sequential over chunks, with only the state update in the loop. It writes every
    chunk's start state h[c] (``state_dtype``: the inputs' dtype when 16-bit, else fp32) and the
    final state (fp32); for the delta rule it also forms the corrected values v_new = u - w h^T
    of each chunk (stored for (c));
(c) ``chunk_output_kernel``, parallel over (batch*head, chunk, value block):
    o = (q * e^g) h[c]^T + ((q k^T) * D, causal) v_new, with v_new = v for linear attention.

Per-channel gates (GLA, KDA) put the decay inside the q.k sum,
A[i, j] = sum_c q_ic k_jc e^{g_ic - g_jc}, which is not a product of two matrices. The chunk of
BT = 64 tokens is cut into sub-chunks of BC = 16; for a row i in sub-chunk I and a column j in
an earlier sub-chunk, with r the first token of I (g is non-increasing, so g_i <= g_r <= g_j),

    A[i, j] = sum_c (q_ic e^{g_ic - g_rc}) (k_jc e^{g_rc - g_jc}),

one tl.dot with every exponent <= 0; only the diagonal 16 x 16 blocks are summed elementwise,
one column per step. Gates of 0 are clamped to log -60 on the host, so nothing overflows.

Precision: q, k, v are loaded in their own dtype; bf16/fp16 tiles go to tl.dot as they are
(fp32 accumulation), and fp32 intermediates (decayed keys, scores, states) are cast to the input
dtype before a product, as FlashLinearAttention does. fp32 inputs stay fp32 with exact products
(``input_precision="ieee"``; ``core.kernels.precision`` explains the TF32 opt-in). One cost of fp16: its
range ends at 65504, so a state entry past it becomes inf in its product (the fp32 state itself stays
finite); bf16 has fp32's range. The kernels of chapters 3, 4 and 7 round their states the same way; in
chapter 3's (Titans) the rounded state also enters the next chunk's gradients, so there a state past
65504 turns the fp32 state itself non-finite (a diverging memory: fp32 or bf16 inputs keep it finite).

``unit_lower_inverse`` (the delta rule's triangular inverse, also used by chapter 6) lives
here too, since it is a building block of (a).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernels import GATE_CHANNEL, GATE_NONE, GATE_SCALAR, at_head, channel_block, chunk_block_program, \
    chunk_log_gates, chunk_program, chunk_state, chunk_tokens, decay, dot_tile, head_program, load_block, load_state, \
    load_state_tile, narrow_tiles, register_share, state_slice, store_tile
from .alloc import empty

# Tokens per chunk, and per sub-chunk of the per-channel scores.
CHUNK = 64
SUB_CHUNK = 16
# Key channels per step of the output and scores kernels (they loop over wider K), and per
# program of the linear-attention state pass (whose key blocks are independent).
KEY_BLOCK = 64


@triton.jit
def unit_lower_inverse(b_A, BT: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^{-1} for a strictly lower-triangular [BT, BT] fp32 tile A (BT a multiple of SUB).

    Two phases. Phase 1 inverts the SUB x SUB diagonal blocks by forward substitution, all of
    them at once as a batch [BT / SUB, SUB, SUB]: step i finishes row i of every block,
    R_r = e_r - sum_{j<r} A_rj R_j, which reads only rows finished in earlier steps (a batched
    SUB x SUB product per step, not a BT x BT one that is mostly zeros: at BT = 64, 16 times
    fewer flops). Phase 2 joins the blocks: with D the inverted diagonal blocks and N = D A_off
    (A's off-diagonal blocks), I + A = (I + A_diag)(I + N), and N is strictly block-lower, so
    (I + N)^{-1} is the finite sum I - N + N^2 - ... of BT / SUB terms; BT / SUB products of
    BT x BT tiles in all (4 at BT = 64; block row by block row took 6).
    """
    NB: tl.constexpr = BT // SUB
    o_i = tl.arange(0, BT)
    o_blk = o_i // SUB                                  # the diagonal block of each row
    b_I = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    # the diagonal blocks of A as a batch: entry (b, r, c) = A[b SUB + r, b SUB + c]
    o_b, o_s = tl.arange(0, NB), tl.arange(0, SUB)
    m_same = o_b[:, None, None, None] == o_b[None, None, :, None]     # [NB, 1, NB, 1]: a diagonal block
    b_A3 = tl.sum(tl.where(m_same, tl.reshape(b_A, [NB, SUB, NB, SUB]), 0.0), axis=2)
    b_I3 = tl.where((o_s[:, None] == o_s[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NB, SUB, SUB], tl.float32)
    b_R3 = b_I3
    for i in range(1, SUB):
        b_step = b_I3 - tl.dot(b_A3, b_R3, input_precision=PRECISION)
        b_R3 = tl.where((o_s == i)[None, :, None], b_step, b_R3)
    b_D = tl.reshape(tl.where(m_same, b_R3[:, :, None, :], 0.0), [BT, BT])   # the inverted diagonal blocks
    if NB == 1:
        return b_D
    # I + A = (I + A_diag)(I + N) with N = D A_off, strictly block-lower, so N^NB = 0 and
    # (I + A)^{-1} = (I - N + N^2 - ... (-N)^(NB-1)) D, the sum in Horner's form
    b_N = tl.dot(b_D, tl.where(o_blk[:, None] == o_blk[None, :], 0.0, b_A), input_precision=PRECISION)
    b_P = b_I - b_N
    for _ in range(2, NB):
        b_P = b_I - tl.dot(b_N, b_P, input_precision=PRECISION)
    return tl.dot(b_P, b_D, input_precision=PRECISION)


# ---------------------------------------------------------------------------------------
# (a) per-channel gates: the decayed scores of every chunk, by sub-chunks
# ---------------------------------------------------------------------------------------
@triton.jit
def channel_scores_kernel(
    q_ptr, k_ptr, g_ptr, aq_ptr, ak_ptr,
    s_q, s_k,
    T, H, Tp, K, NT,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """Rows of sub-chunk i_s of chunk i_c: Aq[i, j] = sum_c q_ic k_jc e^{g_ic - g_jc} for j <= i
    and, when ``ak_ptr`` is given, Ak[i, j] = the same with k_i for q_i, for j < i (0 elsewhere);
    both fp32 [B*H, Tp, BT] (row: token, column: token within its chunk)."""
    i_bh, i_c, i_b, i_h = chunk_program(NT, H)
    i_s = tl.program_id(1)
    q_ptr, k_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h)
    g_ptr += i_bh * Tp * K
    dt = k_ptr.dtype.element_ty

    o_i = tl.arange(0, BC)
    o_j = tl.arange(0, BT)
    t_r = i_c * BT + i_s * BC               # the reference token r: first of the sub-chunk
    o_r = t_r + o_i                         # this program's rows
    o_c = i_c * BT + o_j                    # the chunk's tokens (columns)
    m_r, m_c = o_r < T, o_c < T
    m_before = o_j < i_s * BC               # columns in earlier sub-chunks

    b_Aq = tl.zeros([BC, BT], dtype=tl.float32)
    b_Ak = tl.zeros([BC, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k, m_k = channel_block(i_k, BK, K)
        b_gr = tl.load(g_ptr + o_r[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_gc = tl.load(g_ptr + o_c[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_gn = tl.load(g_ptr + t_r * K + o_k, mask=m_k, other=0.0)
        b_q = load_block(q_ptr, s_q, o_r, o_k, m_r, m_k)
        b_kr = load_block(k_ptr, s_k, o_r, o_k, m_r, m_k)
        b_kc = load_block(k_ptr, s_k, o_c, o_k, m_c, m_k)
        # earlier sub-chunks: (x_i e^{g_i - g_r}) (k_j e^{g_r - g_j})^T, both exponents <= 0
        b_kd = (b_kc * decay(tl.where(m_before[:, None], b_gn[None, :] - b_gc, float("-inf")))).to(dt)
        b_dr = decay(b_gr - b_gn[None, :])
        b_Aq += tl.dot((b_q * b_dr).to(dt), tl.trans(b_kd), input_precision=PRECISION)
        if ak_ptr is not None:
            b_Ak += tl.dot((b_kr * b_dr).to(dt), tl.trans(b_kd), input_precision=PRECISION)
        # the diagonal block, one column j (token t_r + jj) per step, elementwise in fp32
        b_qf, b_kf = b_q.to(tl.float32), b_kr.to(tl.float32)
        for jj in range(0, BC):
            m_j = t_r + jj < T
            b_kj = tl.load(k_ptr + (t_r + jj) * s_k[2] + o_k * s_k[3], mask=m_k & m_j, other=0.0).to(tl.float32)
            b_gj = tl.load(g_ptr + (t_r + jj) * K + o_k, mask=m_k, other=0.0)
            b_e = decay(tl.where((o_i >= jj)[:, None], b_gr - b_gj[None, :], float("-inf")))
            m_col = (o_j == i_s * BC + jj)[None, :]
            b_Aq += tl.where(m_col, tl.sum(b_qf * b_kj[None, :] * b_e, axis=1)[:, None], 0.0)
            if ak_ptr is not None:
                b_col = tl.where(o_i > jj, tl.sum(b_kf * b_kj[None, :] * b_e, axis=1), 0.0)
                b_Ak += tl.where(m_col, b_col[:, None], 0.0)
    p_A = i_bh * Tp * BT + o_r[:, None] * BT + o_j[None, :]
    tl.store(aq_ptr + p_A, b_Aq)
    if ak_ptr is not None:
        tl.store(ak_ptr + p_A, b_Ak)


# ---------------------------------------------------------------------------------------
# (b) the state pass: sequential over chunks only
# ---------------------------------------------------------------------------------------
@triton.jit
def state_pass_start(init_ptr, H, V, K, BV: tl.constexpr, BK: tl.constexpr):
    """Program (i_bh, i_v, i_k) of a state pass (or its reverse): (i_bh, i_b, i_h), its value and key channels and
    their masks, its slice (o_s, m_s) of a [B, H, V, K] state, and that slice of ``init_ptr`` in fp32 (0 if None)."""
    i_bh, i_b, i_h = head_program(H)
    o_v, m_v = channel_block(tl.program_id(1), BV, V)
    o_k, m_k = channel_block(tl.program_id(2), BK, K)
    o_s, m_s = state_slice(i_bh, o_v, o_k, V, K)
    return i_bh, i_b, i_h, o_v, o_k, m_v, m_k, o_s, m_s, load_state(init_ptr, o_s, m_s, BV, BK)


@triton.jit
def store_chunk_state(h_ptr, i_bh, i_c, NT, V, K, o_v, o_k, m_s, b_M):
    """Write the program's slice of the running state as h[c] of a [B*H, NT, V, K] buffer, in its dtype."""
    p_h = chunk_state(h_ptr, i_bh, i_c, NT, V, K) + o_v[:, None] * K + o_k[None, :]       # 64-bit to h[c]
    tl.store(p_h, b_M.to(h_ptr.dtype.element_ty), mask=m_s)


@triton.jit
def chunk_state_kernel(
    k_ptr, v_ptr, w_ptr, g_ptr, h0_ptr, h_ptr, ht_ptr, vn_ptr,
    s_k, s_v, s_w, s_vn,
    T, H, Tp, K, V, NT,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (i_bh, i_v, i_k) carries the [BV, BK] slice of one head's state through the chunks:

        h[c] = M;   v_new = u - w M^T  (delta rule: ``w_ptr`` given; ``v_ptr`` holds u)
        M <- M Diag(e^{g_n}) + v_new^T (k * e^{g_n - g})          (v_new = v otherwise)

    h [B*H, NT, V, K] (``state_dtype``); the delta rule needs all K key channels in one program (BK >= K).
    """
    i_bh, i_b, i_h, o_v, o_k, m_v, m_k, o_s, m_s, b_M = state_pass_start(h0_ptr, H, V, K, BV, BK)
    k_ptr, v_ptr = at_head(k_ptr, s_k, i_b, i_h), at_head(v_ptr, s_v, i_b, i_h)
    if w_ptr is not None:
        w_ptr, vn_ptr = at_head(w_ptr, s_w, i_b, i_h), at_head(vn_ptr, s_vn, i_b, i_h)
    dt = k_ptr.dtype.element_ty

    for i_c in range(0, NT):
        store_chunk_state(h_ptr, i_bh, i_c, NT, V, K, o_v, o_k, m_s, b_M)
        _, o_t, m_t = chunk_tokens(i_c, BT, T)
        b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
        b_v = load_block(v_ptr, s_v, o_t, o_v, m_t, m_v).to(tl.float32)
        if w_ptr is not None:
            b_w = load_block(w_ptr, s_w, o_t, o_k, m_t, m_k)
            b_v -= tl.dot(b_w, tl.trans(b_M).to(dt), input_precision=PRECISION)
            store_tile(vn_ptr, s_vn, o_t, o_v, m_t, m_v, b_v)
        if GATE != GATE_NONE:
            b_g, b_g_last = chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT, GATE)
        if GATE == GATE_NONE:
            b_M += tl.dot(tl.trans(b_v.to(dt)), b_k, input_precision=PRECISION)
        elif GATE == GATE_SCALAR:
            b_v_end = (b_v * decay(b_g_last - b_g)[:, None]).to(dt)
            b_M = b_M * decay(b_g_last) + tl.dot(tl.trans(b_v_end), b_k, input_precision=PRECISION)
        else:
            b_k_end = (b_k * decay(b_g_last[None, :] - b_g)).to(dt)
            b_M = b_M * decay(b_g_last)[None, :] + tl.dot(tl.trans(b_v.to(dt)), b_k_end, input_precision=PRECISION)

    tl.store(ht_ptr + o_s, b_M, mask=m_s)


# ---------------------------------------------------------------------------------------
# (c) the outputs: every (chunk, value block) at once
# ---------------------------------------------------------------------------------------
@triton.jit
def chunk_output_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, a_ptr, h_ptr, o_ptr,
    s_q, s_k, s_v, s_o,
    T, H, Tp, K, V, NT,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """o = (q * e^g) h[c]^T + (A * causal) v for chunk c, value block i_v. A = (q k^T) * e^{g_i - g_j}
    computed here for no gate and scalar gates; read from ``a_ptr`` (``channel_scores_kernel``)
    for per-channel gates. ``v_ptr``: v, or the delta rule's corrected values v_new."""
    i_bh, i_c, i_b, i_h, o_i, o_t, m_t, o_v, m_v = chunk_block_program(NT, H, T, BT, BV, V)
    q_ptr, k_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h)
    v_ptr, o_ptr = at_head(v_ptr, s_v, i_b, i_h), at_head(o_ptr, s_o, i_b, i_h)
    h_ptr = chunk_state(h_ptr, i_bh, i_c, NT, V, K)
    dt = q_ptr.dtype.element_ty

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k, m_k = channel_block(i_k, BK, K)
        b_q = load_block(q_ptr, s_q, o_t, o_k, m_t, m_k)
        if GATE == GATE_CHANNEL:
            b_g, _ = chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT, GATE)
            b_q = (b_q * decay(b_g)).to(dt)
        else:
            b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
            b_A += tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
        b_h = load_state_tile(h_ptr, o_v, o_k, m_v, m_k, K)
        b_o += tl.dot(b_q, tl.trans(b_h).to(dt), input_precision=PRECISION)
    m_causal = o_i[:, None] >= o_i[None, :]
    if GATE == GATE_NONE:
        b_A = tl.where(m_causal, b_A, 0.0)
    elif GATE == GATE_SCALAR:
        b_g, _ = chunk_log_gates(g_ptr, i_bh, i_c, o_t, None, None, Tp, K, BT, GATE)
        b_o *= decay(b_g)[:, None]
        b_A *= decay(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))
    else:
        b_A = tl.load(a_ptr + i_bh * Tp * BT + o_t[:, None] * BT + o_i[None, :])
    b_v = load_block(v_ptr, s_v, o_t, o_v, m_t, m_v)
    b_o += tl.dot(b_A.to(dt), b_v, input_precision=PRECISION)
    store_tile(o_ptr, s_o, o_t, o_v, m_t, m_v, b_o)


# ---------------------------------------------------------------------------------------
# On the host
# ---------------------------------------------------------------------------------------
def num_chunks(T: int) -> int:
    return triton.cdiv(T, CHUNK)


def key_block(K: int, x: torch.Tensor) -> int:
    """Key channels per step of the loops over K (and per state-pass program of linear attention), for
    inputs like ``x``: ``KEY_BLOCK``, or half that for fp32 inputs on a card that lets a program use less
    shared memory than an A100 (``core.kernels.narrow_tiles``). There the per-chunk kernels with
    per-channel gates would not fit: the output kernel holds fp32 q and state tiles and the fp64 gate
    tile of 64 key channels, 144 KB, and the WY kernel 128 KB (sm_86 builds, 99 KB allowed); with 32 at a
    time, 72 KB. Only the order of the sums over K changes."""
    narrow = x.element_size() == 4 and narrow_tiles(x)
    return min(dot_tile(K), KEY_BLOCK // 2 if narrow else KEY_BLOCK)


def channel_scores(run, g, with_keys: bool):
    """(a) for per-channel gates: Aq (and Ak when ``with_keys``) [B*H, Tp, CHUNK] fp32 (see the kernel)."""
    Tp, NT = g.shape[2], num_chunks(run.T)
    aq = empty(run.B * run.H, Tp, CHUNK, dtype=torch.float32, device=run.q.device)
    ak = empty(run.B * run.H, Tp, CHUNK, dtype=torch.float32, device=run.q.device) if with_keys else None
    channel_scores_kernel[(run.B * run.H * NT, CHUNK // SUB_CHUNK)](
        run.q, run.k, g, aq, ak, run.strides[0], run.strides[1],
        run.T, run.H, Tp, run.K, NT,
        BT=CHUNK, BC=SUB_CHUNK, BK=key_block(run.K, run.q), PRECISION=run.precision,
        num_warps=chunk_warps(run.q.element_size()),
    )
    return aq, ak


def chunk_warps(element_size: int) -> int:
    """Warps of a per-chunk program that sums [64, 64] products into fp32 tiles: the output kernel, the
    backward's dv kernels, and the per-channel scores and dq, dk kernels. fp32 inputs take 8: their exact
    products hold whole operand fragments in registers, and at 4 warps the programs spill (sm_90 builds at
    K = 64: the output kernel 852 B a thread at 4 warps, 12 B at 8; the per-channel dq, dk kernel 608 B,
    none; the delta rule's per-channel scores 624 B, 52 B). The output and dv kernels take 8 for 16-bit
    inputs too when their value blocks are 128 wide (``chunk_value_tiles``)."""
    return 8 if element_size == 4 else 4


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the stored chunk states h[c] (and of their gradients dh[c]): the inputs' when 16-bit,
    since every product that reads them takes 16-bit operands anyway (the running state itself stays
    fp32 in registers); fp32 otherwise. Halves the largest buffer of a bf16 call."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def state_pass_tiles(K: int, V: int, element_size: int, delta: bool, reverse: bool = False,
                     narrow: bool = False) -> tuple[int, int, int]:
    """(BV, num_stages, num_warps) of a state pass, forward or ``reverse`` (the backward's): the delta rule's
    (``delta``), which holds all K key channels, or linear attention's, whose programs hold [BV, 64] blocks;
    ``narrow``: on a card with less shared memory than an A100 (``core.kernels.narrow_tiles``).

    Triton software-pipelines the loop over chunks: every stage keeps its own copy of the chunk's
    [64, K] tiles (k, w, the per-channel gates, and q backward), so shared memory grows with the
    stages times the bytes of a key row. For 16-bit inputs: three stages while a row is at most
    128 bytes, two up to 256, then one (linear attention: three). Every configuration then fits an
    A100 (163 KB; ``make aot`` builds them at several chunks, where the pipeline exists: at one chunk
    Triton drops the loop and the size reads several times smaller). The delta rule's 16-bit passes take
    8 warps from 128 key channels on (sm_90 builds at K = 128 with per-channel gates: 128 B spilled a
    thread forward and 684 B reverse at 4 warps, 0 and 40 B at 8; K = 256: 0.6-2.3 KB at 4, 0-160 B at 8).

    fp32 inputs take one stage (linear attention's pass keeps its 4 warps; the delta rule's take more).
    Their exact products run on FMA units with whole operand fragments in registers, and when a thread
    would need more than 255 registers ptxas falls back to 32 and spills kilobytes (sm_90 builds of the
    delta rule at K = 64: 32 registers and 13.7 KB spilled a thread at two stages and 4 warps, 254
    registers and none at one stage; linear attention's pass with per-channel gates, 7.9 KB at three
    stages). The delta rule's forward pass takes 8 warps from 64 key channels on (K = 128: 24 B spilled;
    27 KB at 4 warps), its reverse pass, which holds q, k and w tiles too, 16 from 32 key channels (tiles
    of 32) on (K = 64 and 128: 16-52 B; 10-23 KB at 8 warps); 1 KB rows (K = 256) hold 16 value channels
    instead of 64, at 4 warps.

    Every state pass is launched with ``core.kernels.register_share`` as ``maxnreg``, which keeps ptxas
    out of that fallback where the rules above do not (sm_90: fp32 at K = 60, V = 100, 8-10 KB spilled a
    thread -> 1.3-3.2 KB; the delta rule's reverse pass at K = 256 fp32, 30 KB -> 7.5 KB).

    On a ``narrow`` card the delta rule's fp32 passes with rows of 65 to 128 key channels hold 32 value
    channels (sm_86 builds of the reverse pass at K = 128: 112 KB at 64, 88 KB at 32; 99 KB allowed).
    At K = 256 its [64, 256] fp32 tiles of k and w alone take 128 KB whatever BV is: there those passes do
    not fit, and the chunk form runs instead (``core.dispatch.forward_or_fallback``).
    """
    if not delta:
        return min(dot_tile(V), 64), 3 if element_size < 4 else 1, 4
    row = dot_tile(K) * element_size
    BV = min(dot_tile(V), 16 if row > 512 else 64)
    if element_size < 4:
        return BV, 3 if row <= 128 else 2 if row <= 256 else 1, 8 if dot_tile(K) >= 128 else 4
    if BV <= 16:
        return BV, 1, 4
    if narrow and row > 256:
        BV = min(BV, 32)
    if reverse:
        return BV, 1, 16 if dot_tile(K) >= 32 else 4
    return BV, 1, 8 if dot_tile(K) >= 64 else 4


def state_pass(run, gate, g, Tp, h0, u=None, w=None):
    """(b): (h [B*H, NT, V, K] in ``state_dtype``, final state [B, H, V, K] fp32, v_new or None).

    Linear attention (``w`` None) splits the state into [BV, BK] blocks of 64 x 64 at most;
    the delta rule (``u``, ``w`` [B, H, T, V or K] from its WY kernel) holds all K channels.
    """
    B, H, K, V, NT = run.B, run.H, run.K, run.V, num_chunks(run.T)
    BK_all = dot_tile(K)
    delta = w is not None
    BK = BK_all if delta else key_block(K, run.q)
    BV, stages, warps = state_pass_tiles(K, V, run.q.element_size(), delta, narrow=narrow_tiles(run.q))
    h = empty(B * H, NT, V, K, dtype=state_dtype(run.q.dtype), device=run.q.device)
    ht = run.state()
    vn = empty(B, H, run.T, V, dtype=run.q.dtype, device=run.q.device) if delta else None
    src = u if delta else run.v
    zero = (0, 0, 0, 0)
    chunk_state_kernel[(B * H, triton.cdiv(V, BV), triton.cdiv(K, BK))](
        run.k, src, w, g, h0, h, ht, vn,
        run.strides[1], tuple(src.stride()), tuple(w.stride()) if delta else zero,
        tuple(vn.stride()) if delta else zero,
        run.T, H, Tp, K, V, NT,
        GATE=gate, BT=CHUNK, BK=BK, BV=BV, PRECISION=run.precision, num_stages=stages, num_warps=warps,
        maxnreg=register_share(warps),
    )
    return h, ht, vn


def chunk_value_tiles(V: int, element_size: int) -> tuple[int, int]:
    """(BV, num_warps) of the per-chunk kernels that form the chunk's scores Q K^T and multiply them
    into a block of values: the output kernel, and the backward's dv kernels (dv = A^T do, its mirror).
    Every value block recomputes the scores and reloads the chunk's q and k, so fewer, wider blocks do
    less work: at K = V = 128 in bf16 one block of 128 instead of two of 64 multiplies 20 % fewer flops
    in the output kernel and moves 25 % fewer bytes (these kernels read far more bytes than their flops
    need, so the bytes set their time). 16-bit inputs take up to 128 value channels, at 8 warps (sm_90
    builds of the output kernel: 96-116 registers, no spills, 96 KB of shared memory; 168-181 registers
    at 4 warps). fp32 inputs keep 64 at ``chunk_warps``: their exact products hold whole operand
    fragments in registers."""
    if element_size < 4:
        BV = min(dot_tile(V), 128)
        return BV, 8 if BV > 64 else chunk_warps(element_size)
    return min(dot_tile(V), 64), chunk_warps(element_size)


def output_pass(run, gate, g, Tp, h, aq=None, vn=None):
    """(c): fills run.o from the chunk start states h (and the corrected values ``vn`` of the delta rule)."""
    NT = num_chunks(run.T)
    BV, warps = chunk_value_tiles(run.V, run.q.element_size())
    src, s_src = (run.v, run.strides[2]) if vn is None else (vn, tuple(vn.stride()))
    chunk_output_kernel[(run.B * run.H * NT, triton.cdiv(run.V, BV))](
        run.q, run.k, src, g, aq, h, run.o,
        run.strides[0], run.strides[1], s_src, run.strides[3],
        run.T, run.H, Tp, run.K, run.V, NT,
        GATE=gate, BT=CHUNK, BK=key_block(run.K, run.q), BV=BV, PRECISION=run.precision, num_warps=warps,
    )
    return run.o
