"""The chunk-parallel backward shared by chapters 1 and 2: the reverse state pass, and the intra-chunk
gradients of per-channel gates (``channel_dqk_kernel``).

The forward (``core.chunk_kernels``) carries a state h [V, K] per head through the chunks; with
g the log-gate accumulated from each chunk's start (g_n its last row, the chunk's whole decay),
chunk c does

    o_c      = (q_c * e^{g_c}) h[c]^T + (A_c * causal decay) v_c
    h[c+1]   = h[c] Diag(e^{g_n}) + v_c^T (k_c * e^{g_n - g_c})

where v_c is the chunk's values (linear attention) or the delta rule's corrected values
v_new_c = u_c - w_c h[c]^T. Read backward, the gradient of the loss with respect to the state
follows the same chain in reverse. Call dH_c the gradient with respect to h[c+1], the state at
the END of chunk c (for the last chunk, the gradient of the final state, ``dht``, or zero).
Everything chunk c does with h[c] adds to the gradient of h[c], which is dH_{c-1}:

    (delta rule)  dv_new_c = dv_local_c + (k_c * e^{g_n - g_c}) dH_c^T
    dH_{c-1}     = dH_c Diag(e^{g_n}) + do_c^T (q_c * e^{g_c}) [ - dv_new_c^T w_c ]

The first term carries the state's gradient back through the decay of chunk c, the second is
what chunk c's outputs read from h[c], and the third (the delta rule only) is how h[c] entered
the corrected values: v_new = u - w h^T. ``dv_local`` is the gradient of v_new from inside the
chunk (the intra-chunk output term), which the delta rule's own kernels compute first; the
state term of dv_new needs dH_c, so it is added here, in the only serial loop, and stored.

This is the only serial part of the backward, and it is the mirror image of the forward's state
pass: one program per (batch*head, value block[, key block]) walks the chunks from last to first
with its slice of dH in registers. Once every dH_c is stored, the per-chunk gradient kernels run
in parallel over chunks: the gradients of k and v of chunk c see the future only through dH_c,
since h[c+1] is the one place chunk c's keys and values leave the chunk.

Without the delta rule no term mixes key channels, so key blocks are independent programs, as
in the forward; the delta rule's term dv_new^T w needs the whole of dv_new, hence all K key
channels in one program (K <= 256, the forward's limit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .alloc import empty
from .chunk_kernels import CHUNK, SUB_CHUNK, chunk_warps, key_block, num_chunks, state_dtype, state_pass_start, \
    state_pass_tiles, store_chunk_state
from .kernels import GATE_CHANNEL, GATE_NONE, GATE_SCALAR, at_head, channel_block, chunk_log_gates, chunk_program, \
    chunk_tokens, decay, dot_tile, load_block, load_state_tile, narrow_tiles, precision, register_share, store_tile, \
    within_head_span

# The delta rule holds all K key channels of dH in one program, like the forward's state pass.
MAX_DELTA_KEY = 256


@triton.jit
def chunk_dstate_kernel(
    q_ptr, k_ptr, w_ptr, du_ptr, do_ptr, g_ptr, dht_ptr, dh_ptr, dh0_ptr, dv2_ptr,
    s_q, s_k, s_w, s_du, s_do, s_dv2,
    T, H, Tp, K, V, NT,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (i_bh, i_v, i_k) carries the [BV, BK] slice of dH through the chunks, last to first:

        dh[c] = dH                                            (gradient of the state after chunk c)
        dv2_c = du_c + (k_c * e^{g_n - g_c}) dH^T              (delta rule: ``w_ptr`` given)
        dH   <- dH Diag(e^{g_n}) + do_c^T (q_c * e^{g_c}) - dv2_c^T w_c   (last term: delta rule)

    and writes the gradient of the initial state to ``dh0_ptr``. dh [B*H, NT, V, K] (``state_dtype``).
    """
    i_bh, i_b, i_h, o_v, o_k, m_v, m_k, o_s, m_s, b_dh = state_pass_start(dht_ptr, H, V, K, BV, BK)
    q_ptr, do_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(do_ptr, s_do, i_b, i_h)
    if w_ptr is not None:
        k_ptr, w_ptr = at_head(k_ptr, s_k, i_b, i_h), at_head(w_ptr, s_w, i_b, i_h)
        du_ptr, dv2_ptr = at_head(du_ptr, s_du, i_b, i_h), at_head(dv2_ptr, s_dv2, i_b, i_h)
    dt = q_ptr.dtype.element_ty

    for i_r in range(0, NT):
        i_c = NT - 1 - i_r
        store_chunk_state(dh_ptr, i_bh, i_c, NT, V, K, o_v, o_k, m_s, b_dh)
        _, o_t, m_t = chunk_tokens(i_c, BT, T)
        b_q = load_block(q_ptr, s_q, o_t, o_k, m_t, m_k)
        b_do = load_block(do_ptr, s_do, o_t, o_v, m_t, m_v)
        if w_ptr is not None:
            b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
        # the chunk's decays: q * e^g (what the outputs read) and k * e^{g_n - g} (what the state keeps)
        if GATE != GATE_NONE:
            b_g, b_g_last = chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT, GATE)
        if GATE == GATE_NONE:
            b_qg = b_q
            if w_ptr is not None:
                b_kd = b_k
        elif GATE == GATE_SCALAR:
            b_qg = (b_q * decay(b_g)[:, None]).to(dt)
            if w_ptr is not None:
                b_kd = (b_k * decay(b_g_last - b_g)[:, None]).to(dt)
        else:
            b_qg = (b_q * decay(b_g)).to(dt)
            if w_ptr is not None:
                b_kd = (b_k * decay(b_g_last[None, :] - b_g)).to(dt)
        if w_ptr is not None:
            # dv_new = dv_local + (k * e^{g_n - g}) dH^T, with dH the gradient of the state after this chunk
            b_dv2 = load_block(du_ptr, s_du, o_t, o_v, m_t, m_v).to(tl.float32)
            b_dv2 += tl.dot(b_kd, tl.trans(b_dh).to(dt), input_precision=PRECISION)
            store_tile(dv2_ptr, s_dv2, o_t, o_v, m_t, m_v, b_dv2)
            b_w = load_block(w_ptr, s_w, o_t, o_k, m_t, m_k)
        # dH <- dH Diag(e^{g_n}) + do^T (q e^g) [- dv_new^T w]
        if GATE == GATE_SCALAR:
            b_dh *= decay(b_g_last)
        elif GATE == GATE_CHANNEL:
            b_dh *= decay(b_g_last)[None, :]
        b_dh += tl.dot(tl.trans(b_do), b_qg, input_precision=PRECISION)
        if w_ptr is not None:
            b_dh -= tl.dot(tl.trans(b_dv2.to(dt)), b_w, input_precision=PRECISION)

    if dh0_ptr is not None:
        tl.store(dh0_ptr + o_s, b_dh, mask=m_s)


@triton.jit
def state_grad_terms(do_ptr, s_do, v_ptr, s_v, dv2_ptr, s_dv2, h_ptr, dh_ptr, o_t, m_t, o_k, m_k, V, K,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk c's products with its states, summed over value blocks (fp32): do v^T [BT, BT], do h[c] and v dh[c]
    [BT, BK] on key channels o_k; with ``dv2_ptr`` (the delta rule, v = v_new) also -dv2 h[c] and sum_v h[c] * dh[c]."""
    dt = do_ptr.dtype.element_ty
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v, m_v = channel_block(i_v, BV, V)
        b_h = load_state_tile(h_ptr, o_v, o_k, m_v, m_k, K)
        b_dh = load_state_tile(dh_ptr, o_v, o_k, m_v, m_k, K)
        b_do = load_block(do_ptr, s_do, o_t, o_v, m_t, m_v)
        b_v = load_block(v_ptr, s_v, o_t, o_v, m_t, m_v)
        b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
        b_dq += tl.dot(b_do, b_h.to(dt), input_precision=PRECISION)
        b_dk += tl.dot(b_v, b_dh.to(dt), input_precision=PRECISION)
        if dv2_ptr is not None:
            b_dv2 = load_block(dv2_ptr, s_dv2, o_t, o_v, m_t, m_v)
            b_dw -= tl.dot(b_dv2, b_h.to(dt), input_precision=PRECISION)
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=0)
    return b_dA, b_dq, b_dk, b_dw, b_hdh


@triton.jit
def channel_dqk_kernel(
    q_ptr, k_ptr, g_ptr, da_ptr, dq32_ptr, dk32_ptr, dq_ptr, dk_ptr, dg_ptr, dgn_ptr,
    s_q, s_k, s_dq, s_dk,
    T, H, Tp, K, NT,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PAIRS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Per-channel gates, rows of sub-chunk i_s of chunk i_c, key block i_k: the intra-chunk terms

        dq_i = sum_{j<=i} dA[i, j] k_j * e^{g_i - g_j},   dk_j = sum_{i>=j} dA[i, j] q_i * e^{g_i - g_j}

    added to the state terms dq32, dk32 (fp32 [B*H, Tp, K]: ``linear_dqk_kernel``'s, or the delta rule's
    ``delta_bwd_state_kernel``); writes dq, dk (in their buffers' dtypes; dk may be dk32 itself, each element
    is read before it is written by the same program) and dL/dB = q * dq - k * dk (fp32 [B*H, Tp, K]),
    plus, with ``dgn_ptr`` (fp32 [B*H, NT, K]: the delta rule's), a term on each chunk's last row.
    ``PAIRS``: the scores are k.k pairs (q is k, dA the delta rule's dL, zero on the diagonal), so both
    terms are gradients of the same keys: dk = dk32 + dq_i + dk_j terms, and dg (holding the WY kernel's
    share) += k * (dq terms - dk terms); dq32, dq and dgn are unused.
    Earlier sub-chunks (for dq) go through one tl.dot against the sub-chunk's first token r,
    e^{g_i - g_j} = e^{g_i - g_r} e^{g_r - g_j}; later ones (for dk) against its last token e,
    e^{g_i - g_j} = e^{g_i - g_e} e^{g_e - g_j}: every exponent <= 0. The diagonal 16 x 16 block is
    summed elementwise, one token per step.
    """
    i_bh, i_c, i_b, i_h = chunk_program(NT, H)
    i_s, i_k = tl.program_id(1), tl.program_id(2)
    q_ptr, k_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h)
    dk_ptr = at_head(dk_ptr, s_dk, i_b, i_h)
    if not PAIRS:
        dq_ptr = at_head(dq_ptr, s_dq, i_b, i_h)
    g_ptr += i_bh * Tp * K
    da_ptr += i_bh * Tp * BT
    dt = k_ptr.dtype.element_ty

    o_i = tl.arange(0, BC)
    o_j = tl.arange(0, BT)
    t_r = i_c * BT + i_s * BC               # first token of the sub-chunk
    t_e = t_r + BC - 1                      # its last (exists: g and dA are padded to Tp)
    o_r = t_r + o_i                         # this program's rows
    o_c = i_c * BT + o_j                    # the chunk's tokens
    m_r, m_c = o_r < T, o_c < T
    m_before = o_j < i_s * BC
    m_after = o_j >= (i_s + 1) * BC
    o_k, m_k = channel_block(i_k, BK, K)

    b_q = load_block(q_ptr, s_q, o_r, o_k, m_r, m_k)
    b_k = load_block(k_ptr, s_k, o_r, o_k, m_r, m_k)
    b_qc = load_block(q_ptr, s_q, o_c, o_k, m_c, m_k)
    b_kc = load_block(k_ptr, s_k, o_c, o_k, m_c, m_k)
    b_gr = tl.load(g_ptr + o_r[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    b_gc = tl.load(g_ptr + o_c[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    b_gf = tl.load(g_ptr + t_r * K + o_k, mask=m_k, other=0.0)
    b_ge = tl.load(g_ptr + t_e * K + o_k, mask=m_k, other=0.0)
    # dA rows of this sub-chunk [BC, BT] (query i, key j), and its columns transposed [BC, BT] (key j, query i)
    b_dA = tl.load(da_ptr + o_r[:, None] * BT + o_j[None, :])
    b_dAt = tl.load(da_ptr + o_c[None, :] * BT + (i_s * BC + o_i)[:, None])

    # earlier sub-chunks: (dA k_j e^{g_r - g_j}) e^{g_i - g_r}
    b_kd = (b_kc * decay(tl.where(m_before[:, None], b_gf[None, :] - b_gc, float("-inf")))).to(dt)
    b_dq = tl.dot(b_dA.to(dt), b_kd, input_precision=PRECISION) * decay(b_gr - b_gf[None, :])
    # later sub-chunks: (dA^T q_i e^{g_i - g_e}) e^{g_e - g_j}
    b_qd = (b_qc * decay(tl.where(m_after[:, None], b_gc - b_ge[None, :], float("-inf")))).to(dt)
    b_dk = tl.dot(b_dAt.to(dt), b_qd, input_precision=PRECISION) * decay(b_ge[None, :] - b_gr)
    # the diagonal block, one token t_r + jj per step, elementwise in fp32
    for jj in range(0, BC):
        t_j = t_r + jj
        m_j = t_j < T
        b_kj = tl.load(k_ptr + t_j * s_k[2] + o_k * s_k[3], mask=m_k & m_j, other=0.0).to(tl.float32)
        b_qj = tl.load(q_ptr + t_j * s_q[2] + o_k * s_q[3], mask=m_k & m_j, other=0.0).to(tl.float32)
        b_gj = tl.load(g_ptr + t_j * K + o_k, mask=m_k, other=0.0)
        b_col = tl.load(da_ptr + o_r * BT + i_s * BC + jj)          # dA[i, t_j] for the rows i
        b_row = tl.load(da_ptr + t_j * BT + i_s * BC + o_i)         # dA[t_j, j] for the rows j
        m_lo = (o_i >= jj)[:, None]
        m_hi = (o_i <= jj)[:, None]
        b_dq += tl.where(m_lo, b_col[:, None] * b_kj[None, :] * decay(tl.where(m_lo, b_gr - b_gj[None, :], 0.0)), 0.0)
        b_dk += tl.where(m_hi, b_row[:, None] * b_qj[None, :] * decay(tl.where(m_hi, b_gj[None, :] - b_gr, 0.0)), 0.0)

    p_x = i_bh * Tp * K + o_r[:, None] * K + o_k[None, :]
    if PAIRS:
        b_dg = tl.load(dg_ptr + p_x, mask=m_k[None, :], other=0.0) + b_k.to(tl.float32) * (b_dq - b_dk)
        b_dk += b_dq + tl.load(dk32_ptr + p_x, mask=m_k[None, :], other=0.0)
        store_tile(dk_ptr, s_dk, o_r, o_k, m_r, m_k, b_dk)
    else:
        b_dq += tl.load(dq32_ptr + p_x, mask=m_k[None, :], other=0.0)
        b_dk += tl.load(dk32_ptr + p_x, mask=m_k[None, :], other=0.0)
        store_tile(dq_ptr, s_dq, o_r, o_k, m_r, m_k, b_dq)
        store_tile(dk_ptr, s_dk, o_r, o_k, m_r, m_k, b_dk)
        b_dg = b_q.to(tl.float32) * b_dq - b_k.to(tl.float32) * b_dk
        if dgn_ptr is not None:
            if i_s == BT // BC - 1:
                b_dgn = tl.load(dgn_ptr + (i_bh * NT + i_c) * K + o_k, mask=m_k, other=0.0)
                b_dg += tl.where((o_i == BC - 1)[:, None], b_dgn[None, :], 0.0)
    tl.store(dg_ptr + p_x, b_dg, mask=m_k[None, :])


def state_grad_tiles(V: int, element_size: int) -> tuple[int, int]:
    """(BV, num_warps) of a kernel that calls ``state_grad_terms``: the value channels per step of its loop
    and its warps. Such a program holds four [64, 64] fp32 sums (dA, dq, dk, the delta rule's dw) besides its
    operands. sm_90 builds at K = V = 64: at 4 warps and 64-channel steps, fp32 ptxas falls back to 32
    registers and spills 31-46 KB a thread (bf16 K = 128 with per-channel gates: 1.9 KB); at 8 warps, with
    32-channel steps for fp32 (whose exact products hold whole operand fragments in registers), 0-0.6 KB."""
    return min(dot_tile(V), 32 if element_size == 4 else 64), 8


def channel_grads(q, k, g, da, dq32, dk32, dq, dk, dg, dgn=None, pairs=False):
    """Per-channel gates: launch ``channel_dqk_kernel`` on every (chunk, sub-chunk, key block) (see it).
    q, k [B, H, T, K]; g [B, H, Tp, K]; da [B*H, Tp, 64]; dq32, dk32, dg [B*H, Tp, K] fp32 contiguous;
    dq, dk [B, H, T, K] outputs (any strides); dgn None or [B*H, NT, K] fp32; ``pairs``: k.k scores
    (q is k; dq32, dq None)."""
    B, H, T, K = q.shape
    NT, Tp = num_chunks(T), g.shape[2]
    BK = key_block(K, q)
    channel_dqk_kernel[(B * H * NT, CHUNK // SUB_CHUNK, triton.cdiv(K, BK))](
        q, k, g, da, dq32, dk32, dq, dk, dg, dgn,
        _strides(q), _strides(k), _strides(dq), _strides(dk),
        T, H, Tp, K, NT,
        BT=CHUNK, BC=SUB_CHUNK, BK=BK, PAIRS=pairs, PRECISION=precision(q.dtype),
        num_warps=chunk_warps(q.element_size()),
    )


def _strides(x):
    return tuple(x.stride()) if x is not None else (0, 0, 0, 0)


def dstate_pass(q, do, gate, g, dht=None, *, k=None, w=None, dv_local=None, dv2_dtype=None, want_dh0=True):
    """The reverse state pass: the gradients of the chunk states, last chunk to first.

    Args:
        q: [B, H, T, K] queries (any strides), fp32/fp16/bf16: its dtype is the dtype of the
            kernel's products (bf16/fp16 tiles meet on tensor cores with fp32 sums; fp32 is exact).
        do: [B, H, T, V] gradient of the outputs (any strides), best in q's dtype.
        gate: the gate mode, an int as ``core.kernels.chunk_gates`` returns it (0 none, 1 scalar,
            2 per channel).
        g: None (no gate), or the forward's chunk-local cumulative log-gates, fp32 contiguous,
            [B, H, Tp] (scalar) or [B, H, Tp, K] (per channel), Tp = T padded to whole chunks
            of ``CHUNK`` = 64 with log-gate 0 (``core.kernels.chunk_gates(..., CHUNK, q.dtype)``).
        dht: None, or [B, H, V, K] gradient of the final state (any float dtype; read as fp32).
        k, w, dv_local: the delta rule (``w`` given; then all three): k [B, H, T, K] its keys, w
            [B, H, T, K] the WY factor with v_new = u - w h[c]^T, dv_local [B, H, T, V]
            the gradient of v_new from the intra-chunk output term, in the input dtype (any
            strides; rows t >= T are never read). Needs K <= 256 (all key channels in one program).
        dv2_dtype: dtype of the stored dv_new (default: dv_local's).
        want_dh0: also return the gradient of the initial state.

    Returns ``(dh, dh0, dv2)``:
        dh: [B*H, NT, V, K] in ``state_dtype`` (bf16/fp16 inputs: theirs; else fp32), NT = cdiv(T, 64):
            dh[:, c] is the gradient of the loss with respect to the state AFTER chunk c (= the state at the start of
            chunk c + 1; for the last chunk, ``dht`` or zero). These are what chunk c's gradient kernels need
            for the terms through h[c+1]: dv_c += (k_c e^{g_n-g_c}) dh[c]^T, dk_c += (v_c dh[c]) e^{g_n-g_c}.
            The same size as the forward's stored chunk states h.
        dh0: [B, H, V, K] fp32, the gradient of the initial state (the state at the start of
            chunk 0), or None when ``want_dh0`` is False.
        dv2: delta rule only (else None): [B, H, T, V] in ``dv2_dtype``, the whole gradient of
            v_new, dv_local + (k * e^{g_n - g}) dh[c]^T per chunk.
    """
    delta = w is not None
    if delta and (k is None or dv_local is None):
        raise ValueError("dstate_pass: the delta rule needs k, w and dv_local together")
    q, do = within_head_span(q, do)
    if delta:
        k, w, dv_local = within_head_span(k, w, dv_local)
    B, H, T, K = q.shape
    V = do.shape[-1]
    NT = num_chunks(T)
    if delta and K > MAX_DELTA_KEY:
        raise ValueError(f"dstate_pass: the delta rule holds all K key channels in one program, K <= "
                         f"{MAX_DELTA_KEY}, got K={K}")
    Tp = g.shape[2] if g is not None else NT * CHUNK
    BK = dot_tile(K) if delta else key_block(K, q)
    # the delta rule's program holds [64, K] tiles of q, k, w (and the decayed k) per pipeline stage
    BV, stages, warps = state_pass_tiles(K, V, q.element_size(), delta, reverse=True, narrow=narrow_tiles(q))
    dh = empty(B * H, NT, V, K, dtype=state_dtype(q.dtype), device=q.device)
    dh0 = empty(B, H, V, K, dtype=torch.float32, device=q.device) if want_dh0 else None
    dht = None if dht is None else dht.to(torch.float32).contiguous()
    dv2 = None
    if delta:
        dv2 = empty(B, H, T, V, dtype=dv2_dtype or dv_local.dtype, device=q.device)
    chunk_dstate_kernel[(B * H, triton.cdiv(V, BV), triton.cdiv(K, BK))](
        q, k, w, dv_local, do, g, dht, dh, dh0, dv2,
        _strides(q), _strides(k) if delta else (0, 0, 0, 0), _strides(w), _strides(dv_local), _strides(do),
        _strides(dv2),
        T, H, Tp, K, V, NT,
        GATE=gate, BT=CHUNK, BK=BK, BV=BV, PRECISION=precision(q.dtype), num_stages=stages, num_warps=warps,
        maxnreg=register_share(warps),
    )
    return dh, dh0, dv2
