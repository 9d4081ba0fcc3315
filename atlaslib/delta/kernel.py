"""The GPU kernels: the chunkwise delta rule (DeltaNet, Gated DeltaNet, KDA) in Triton.

With g the log-retention accumulated from each chunk's start (computed on the host, padded
with zeros), chunk c of BT = 64 tokens with start state h[c] does what ``chunk.chunk_step``
does, rewritten in the WY (UT transform) form that separates what depends on the state from
what does not:

    L   = (K K^T) * e^{g_t - g_j}  (j < t)              strictly lower, [BT, BT]
    R   = (I + Diag(beta) L)^{-1}                        unit lower-triangular
    w   = R Diag(beta) (K * e^g),   u = R Diag(beta) V   the WY factors: no state in them
    v_new = u - w h[c]^T                                 the corrected values the chunk writes
    o   = (Q * e^g) h[c]^T + ((Q K^T) * e^{g_t - g_j}, j <= t) v_new
    h[c+1] = h[c] Diag(e^{g_n}) + v_new^T (K * e^{g_n - g})

Three kernels run it, each parallel over everything that is independent:

(a) ``delta_wy_kernel``, one program per (batch*head, chunk): builds L, inverts
    I + Diag(beta) L in registers (``core.chunk_kernels.unit_lower_inverse``: the 16 x 16
    diagonal blocks by forward substitution as one batch, one row of every block per step, then
    joined by a finite Neumann sum in four 64 x 64 products) and writes w and u. The
    inverse depends only on the chunk's keys, betas and gates, so no chunk waits for another.
    For KDA (per-channel gates) L needs the decay inside the k.k sum: it comes from
    ``core.chunk_kernels.channel_scores_kernel`` (sub-chunks of 16 tokens, the decay folded
    into the keys against a reference token so every exponent is <= 0), which also gives the
    decayed q.k scores of the output;
(b) chapter 1's state pass (``core.chunk_kernels.chunk_state_kernel``): the only sequential
    part, over chunks, parallel over (batch*head, value block). It forms v_new chunk by chunk,
    stores it and every h[c]. Value columns never mix in the delta rule (the triangular system
    acts on tokens), so splitting V across programs is exact; each program needs all K keys;
(c) chapter 1's output kernel (``core.chunk_kernels.chunk_output_kernel``) with v_new for v,
    parallel over (batch*head, chunk, value block).

Padded tokens (t >= T) carry beta = 0 and k = v = 0, so they write nothing. Gates of exactly 1
give g = 0 and gates of 0 are clamped to log = -60 on the host, so every exponent is a
non-positive difference.

q, k, v are read through their strides (a [B, T, H, K] tensor transposed to [B, H, T, K]
needs no copy) and in their own dtype (bf16/fp16 tiles go to tl.dot as they are; w and u are
stored in it, as the fp32 inverse is cast before its products); absent inputs (no gate, no
initial state) are ``None`` pointers, which Triton compiles away.

The backward (``DeltaRuleFunction``, what ``delta_rule(..., backend="triton")`` differentiates
through) has the forward's three-phase shape in reverse. Only the inputs are saved; the backward
first reruns (a), which this time also stores each chunk's R (fp32, as R^T: (g) reads it instead
of inverting again), and (b) to get w, u, every h[c] and v_new. Write dH_c for the gradient of the
state after chunk c (the final state's gradient, or 0, after the last chunk) and dv2 for the whole
gradient of v_new. Then:

(d) ``delta_dv_local_kernel``, per (chunk, value block): the part of dv2 from the chunk's own
    outputs, dv_local = (A * causal decay)^T do (A recomputed, or KDA's Aq);
(e) the reverse state pass (``core.chunk_backward.dstate_pass``), the only serial part, chunks last
    to first: dv2 = dv_local + (K e^{g_n - g}) dH_c^T, and dH_{c-1} = dH_c e^{g_n} + do^T (Q e^g)
    - dv2^T w, the last term because h[c] also entered v_new = u - w h[c]^T;
(f) ``delta_bwd_state_kernel``, per (chunk, key block), everything that reads a state:
    dq = (do h[c]) e^g + (dS * D) K  with dS = do v_new^T (causal) and D the decays of A,
    dk = (v_new dH_c) e^{g_n - g} + (dS * D)^T Q,   and dw = -dv2 h[c] (from v_new = u - w h^T);
(g) ``delta_bwd_wy_kernel``, per chunk, back through the WY factors with du = dv2. For X = R Z
    (Z = Diag(beta)(K e^g) or Diag(beta) V) the gradient of Z is R^T dX, and the gradient of the
    system matrix I + Diag(beta) L is -R^T dX X^T, summed over both factors: R is the one (a)
    stored and is never differentiated itself. Its strictly lower part, times beta,
    is the gradient of L, which sends k.k gradients to both keys of every pair; the row sums of
    the same products give dbeta.

Log-gates: g is the cumulative sum of the log-gates inside each chunk, and every place g enters
multiplies a q-side factor by e^{g_i} and a k-side factor by e^{-g_j}. So the gradient of g_t is
a difference of two row sums per channel, q_t * dq_t - k_t * dk_t over the terms (f) and (g) build
(for the WY factors, K e^g * d(K e^g) and the row-minus-column sums of dL * L), plus, on the
chunk's last row, what g_n itself scales: e^{g_n} <dH_c, h[c]> and the keys of the state update.
The gradient of the log-gates is then the reverse cumulative sum of dg inside each chunk.

KDA's per-channel decays sit inside the k.k and q.k sums, so their gradients (dq, dk from dS,
and dk from dL) are not single products. Both run in chapter 1's
``core.chunk_backward.channel_dqk_kernel``, a program per (chunk, sub-chunk of 16 tokens, key
block), once after (f) for dS and once after (g) for dL (whose two sides are both keys): one
product per earlier sub-chunk through a reference token (every exponent <= 0) and the diagonal
blocks elementwise, never a [BT, BT, BK] tile. (f) and (g) store what those need: the state
terms, dS and dL, and their shares of dk and dg.

Products take the inputs' dtype (bf16 tiles, fp32 sums); the inverse, dA and the gradients' accumulators
are fp32 (dv_local, dv2 and the returned gradients take the inputs' dtype). The inverse's own products,
and dA's product with it, are exact for fp32 inputs and TF32 for 16-bit ones
(``core.kernels.intermediate_precision``: R is rounded to the inputs' dtype right after, and exact fp32
products would run on CUDA cores, slower than all the chunk's bf16 products together).
Runs under ``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.chunk_kernels import (CHUNK, channel_scores, chunk_value_tiles, key_block, num_chunks, output_pass,
                                  state_pass, unit_lower_inverse)
from ..core.chunking import gate_logs
from ..core.chunk_backward import channel_grads, state_grad_terms, state_grad_tiles
from ..core.kernels import (GATE_CHANNEL, GATE_NONE, GATE_SCALAR, ForwardLaunch, as_fp32, at_head, channel_block,
                            chunk_block_program, chunk_gates, chunk_log_gates, chunk_program, chunk_state, chunk_tokens,
                            decay, dot_tile, feature_tile, forward_launch, intermediate_precision, load_block,
                            precision, refuse_nested_transforms, store_tile, unwrapped, within_head_span)
from ..core.alloc import empty
from ..core.dispatch import backward_or_fallback, chunk_grads, second_order_requested
from .chunk import delta_rule_chunk

# The state pass holds all K key channels of its state slice in registers: K <= 256.
MAX_KEY = 256


@triton.jit
def decayed_scores(x_ptr, s_x, y_ptr, s_y, a_ptr, b_g, i_bh, o_i, o_t, m_t, Tp, K, STRICT: tl.constexpr,
                   GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """(X Y^T) * e^{g_t - g_j} on the chunk's pairs j <= t (j < t if STRICT), else 0, fp32 [BT, BT]: X = Y = K
    gives L, X = Q, Y = K the output scores A. b_g: scalar log-gates; per-channel gates read it from ``a_ptr``."""
    if STRICT:
        m_lower = o_i[:, None] > o_i[None, :]
    else:
        m_lower = o_i[:, None] >= o_i[None, :]
    if GATE == GATE_CHANNEL:
        b_A = tl.load(a_ptr + i_bh * Tp * BT + o_t[:, None] * BT + o_i[None, :])
    else:
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k, m_k = channel_block(i_k, BK, K)
            b_x = load_block(x_ptr, s_x, o_t, o_k, m_t, m_k)
            b_y = b_x                                   # y_ptr None: Y = X, loaded once
            if y_ptr is not None:
                b_y = load_block(y_ptr, s_y, o_t, o_k, m_t, m_k)
            b_A += tl.dot(b_x, tl.trans(b_y), input_precision=PRECISION)
        if GATE == GATE_SCALAR:
            b_A *= decay(tl.where(m_lower, b_g[:, None] - b_g[None, :], float("-inf")))
        else:
            b_A = tl.where(m_lower, b_A, 0.0)
    return b_A


@triton.jit
def delta_wy_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr, ak_ptr, w_ptr, u_ptr, r_ptr,
    s_k, s_v, s_w, s_u,
    T, H, Tp, K, V, NT,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
    INV_PRECISION: tl.constexpr,
):
    """w = R Diag(beta) (K e^g) and u = R Diag(beta) V for chunk i_c, R = (I + Diag(beta) L)^{-1}, the
    inverse's products at ``INV_PRECISION`` (``core.kernels.intermediate_precision``: TF32 for 16-bit inputs).
    With ``r_ptr`` (the backward's recomputation) also stores R, fp32 [B*H, Tp, BT], for ``delta_bwd_wy_kernel``."""
    i_bh, i_c, i_b, i_h = chunk_program(NT, H)
    k_ptr, v_ptr = at_head(k_ptr, s_k, i_b, i_h), at_head(v_ptr, s_v, i_b, i_h)
    w_ptr, u_ptr = at_head(w_ptr, s_w, i_b, i_h), at_head(u_ptr, s_u, i_b, i_h)
    dt = k_ptr.dtype.element_ty
    o_i, o_t, m_t = chunk_tokens(i_c, BT, T)
    b_g = None
    if GATE == GATE_SCALAR:
        b_g, _ = chunk_log_gates(g_ptr, i_bh, i_c, o_t, None, None, Tp, K, BT, GATE)
    # L: strictly lower decayed k.k products of the chunk
    b_L = decayed_scores(k_ptr, s_k, None, s_k, ak_ptr, b_g, i_bh, o_i, o_t, m_t, Tp, K, True, GATE, BT, BK, PRECISION)

    # R Diag(beta): the inverse in fp32, cast to the inputs' dtype for its products
    b_beta = tl.load(beta_ptr + i_bh * T + o_t, mask=m_t, other=0.0)
    b_R = unit_lower_inverse(b_beta[:, None] * b_L, BT, 16, INV_PRECISION)
    if r_ptr is not None:
        tl.store(r_ptr + i_bh * Tp * BT + o_t[None, :] * BT + o_i[:, None], b_R)   # as R^T
    b_Rb = (b_R * b_beta[None, :]).to(dt)

    for i_k in range(0, tl.cdiv(K, BK)):
        o_k, m_k = channel_block(i_k, BK, K)
        b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
        if GATE == GATE_SCALAR:
            b_k = (b_k * decay(b_g)[:, None]).to(dt)
        elif GATE == GATE_CHANNEL:
            b_gk, _ = chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT, GATE)
            b_k = (b_k * decay(b_gk)).to(dt)
        store_tile(w_ptr, s_w, o_t, o_k, m_t, m_k, tl.dot(b_Rb, b_k, input_precision=PRECISION))
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v, m_v = channel_block(i_v, BV, V)
        b_v = load_block(v_ptr, s_v, o_t, o_v, m_t, m_v)
        store_tile(u_ptr, s_u, o_t, o_v, m_t, m_v, tl.dot(b_Rb, b_v, input_precision=PRECISION))


# ---------------------------------------------------------------------------------------
# The backward kernels (no gate and scalar gates)
# ---------------------------------------------------------------------------------------
@triton.jit
def delta_dv_local_kernel(
    q_ptr, k_ptr, do_ptr, g_ptr, a_ptr, dv_ptr,
    s_q, s_k, s_do, s_dv,
    T, H, Tp, K, V, NT,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """dv_local = (A * causal decay)^T do for chunk i_c, value block i_v: the gradient of v_new from
    the chunk's own outputs. A = q k^T (times e^{g_i - g_j}) is recomputed, or read from ``a_ptr``
    (per-channel gates)."""
    i_bh, i_c, i_b, i_h, o_i, o_t, m_t, o_v, m_v = chunk_block_program(NT, H, T, BT, BV, V)
    q_ptr, k_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h)
    do_ptr, dv_ptr = at_head(do_ptr, s_do, i_b, i_h), at_head(dv_ptr, s_dv, i_b, i_h)
    dt = q_ptr.dtype.element_ty
    b_g = None
    if GATE == GATE_SCALAR:
        b_g, _ = chunk_log_gates(g_ptr, i_bh, i_c, o_t, None, None, Tp, K, BT, GATE)
    b_A = decayed_scores(q_ptr, s_q, k_ptr, s_k, a_ptr, b_g, i_bh, o_i, o_t, m_t, Tp, K, False, GATE, BT, BK, PRECISION)
    b_do = load_block(do_ptr, s_do, o_t, o_v, m_t, m_v)
    b_dv = tl.dot(tl.trans(b_A.to(dt)), b_do, input_precision=PRECISION)
    store_tile(dv_ptr, s_dv, o_t, o_v, m_t, m_v, b_dv)


@triton.jit
def delta_bwd_state_kernel(
    q_ptr, k_ptr, vn_ptr, do_ptr, dv2_ptr, g_ptr, h_ptr, dh_ptr,
    dq_ptr, dk_ptr, dw_ptr, dg_ptr, ds_ptr, dgn_ptr,
    s_q, s_k, s_vn, s_do, s_dv2, s_dq, s_dk, s_dw,
    T, H, Tp, K, V, NT,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Chunk i_c, key block i_k: every gradient that reads the chunk states (see the module docstring).

        dq = (do h[c]) * e^g + (dS * D) k,        dS = do v_new^T (causal), D = e^{g_i - g_j}
        dk = (v_new dH) * e^{g_n - g} + (dS * D)^T q     (partial: the WY kernel adds its terms)
        dw = -dv2 h[c]
        dg = rowsum(q dq - k dk), plus e^{g_n} <dH, h[c]> + <v_new dH e^{g_n - g}, k> on the last row

    dq in q's dtype (final); dk, dw fp32 [B, H, T, K]; dg fp32 [B*H, NK, Tp], one row per key block.
    Per-channel gates (KDA) stop at the state terms: dq and dk (both fp32 [B*H, Tp, K] then), the causal dS
    (fp32 [B*H, Tp, BT], from key block 0) and the last row's dg term (fp32 [B*H, NT, K]) go to
    ``core.chunk_backward.channel_dqk_kernel``, which adds the (dS * D) terms channel by channel.
    """
    i_bh, i_c, i_b, i_h, o_i, o_t, m_t, o_k, m_k = chunk_block_program(NT, H, T, BT, BK, K)
    q_ptr, k_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h)
    vn_ptr, do_ptr = at_head(vn_ptr, s_vn, i_b, i_h), at_head(do_ptr, s_do, i_b, i_h)
    dv2_ptr, dq_ptr = at_head(dv2_ptr, s_dv2, i_b, i_h), at_head(dq_ptr, s_dq, i_b, i_h)
    dk_ptr, dw_ptr = at_head(dk_ptr, s_dk, i_b, i_h), at_head(dw_ptr, s_dw, i_b, i_h)
    h_ptr, dh_ptr = chunk_state(h_ptr, i_bh, i_c, NT, V, K), chunk_state(dh_ptr, i_bh, i_c, NT, V, K)
    dt = q_ptr.dtype.element_ty
    m_causal = o_i[:, None] >= o_i[None, :]

    # dS = do v_new^T, the state terms of dq and dk, dw = -dv2 h[c], and <h[c], dH> per key channel
    b_dS, b_dq, b_dk, b_dw, b_hdh = state_grad_terms(do_ptr, s_do, vn_ptr, s_vn, dv2_ptr, s_dv2, h_ptr, dh_ptr,
                                                     o_t, m_t, o_k, m_k, V, K, BT, BK, BV, PRECISION)
    store_tile(dw_ptr, s_dw, o_t, o_k, m_t, m_k, b_dw)      # dw is complete here
    b_q = load_block(q_ptr, s_q, o_t, o_k, m_t, m_k)
    b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
    b_last = o_i == BT - 1
    if GATE != GATE_NONE:
        b_g, b_g_last = chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT, GATE)
    if GATE == GATE_SCALAR:
        b_dq *= decay(b_g)[:, None]
        b_dk *= decay(b_g_last - b_g)[:, None]
        # the last row's g_n scales h[c] and every k * e^{g_n - g} of the state update
        b_dgn = tl.sum(b_hdh) * decay(b_g_last) + tl.sum(b_dk * b_k.to(tl.float32))
        b_dS *= decay(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))   # masked first
    elif GATE == GATE_CHANNEL:
        b_dq *= decay(b_g)
        b_dk *= decay(b_g_last[None, :] - b_g)
        b_dgn = b_hdh * decay(b_g_last) + tl.sum(b_dk * b_k.to(tl.float32), axis=0)
        # every row of the padded chunk (rows past T hold zeros): channel_dqk_kernel reads them all
        p_s = o_t[:, None] * s_dq[2] + o_k[None, :] * s_dq[3]
        tl.store(dq_ptr + p_s, b_dq, mask=m_k[None, :])
        tl.store(dk_ptr + o_t[:, None] * s_dk[2] + o_k[None, :] * s_dk[3], b_dk, mask=m_k[None, :])
        tl.store(dgn_ptr + (i_bh * NT + i_c) * K + o_k, b_dgn, mask=m_k)
        if tl.program_id(1) == 0:
            tl.store(ds_ptr + i_bh * Tp * BT + o_t[:, None] * BT + o_i[None, :], tl.where(m_causal, b_dS, 0.0))
    else:
        b_dS = tl.where(m_causal, b_dS, 0.0)
    if GATE != GATE_CHANNEL:
        b_dq += tl.dot(b_dS.to(dt), b_k, input_precision=PRECISION)
        b_dk += tl.dot(tl.trans(b_dS).to(dt), b_q, input_precision=PRECISION)
        store_tile(dq_ptr, s_dq, o_t, o_k, m_t, m_k, b_dq)
        store_tile(dk_ptr, s_dk, o_t, o_k, m_t, m_k, b_dk)
    if GATE == GATE_SCALAR:
        b_dg = tl.sum(b_dq * b_q.to(tl.float32) - b_dk * b_k.to(tl.float32), axis=1) + tl.where(b_last, b_dgn, 0.0)
        tl.store(dg_ptr + (i_bh * tl.num_programs(1) + tl.program_id(1)) * Tp + o_t, b_dg)


@triton.jit
def wy_factor_grads(dx_ptr, s_dx, x_ptr, s_x, b_Rt, o_t, m_t, o_n, m_n, PRECISION: tl.constexpr):
    """One block of channels of a WY factor X = R Z, from dX: (dX X^T, its share of G; dZ = R^T dX), fp32."""
    b_dx = load_block(dx_ptr, s_dx, o_t, o_n, m_t, m_n).to(b_Rt.dtype)
    b_x = load_block(x_ptr, s_x, o_t, o_n, m_t, m_n)
    return tl.dot(b_dx, tl.trans(b_x), input_precision=PRECISION), tl.dot(b_Rt, b_dx, input_precision=PRECISION)


@triton.jit
def delta_bwd_wy_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr, ak_ptr, r_ptr, w_ptr, u_ptr, dw_ptr, du_ptr, dk1_ptr,
    dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, dl_ptr,
    s_k, s_v, s_w, s_u, s_dw, s_du, s_dk1, s_dk, s_dv,
    T, H, Tp, K, V, NT,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
    INV_PRECISION: tl.constexpr,
):
    """Chunk i_c: from dw, du (= dv2) back through w = R Diag(beta)(K e^g), u = R Diag(beta) V.

    With Z = Diag(beta)(K e^g) or Diag(beta) V and X = R Z: dZ = R^T dX, and
    d(Diag(beta) L) = strictly lower part of -R^T (dw w^T + du u^T), with R^T as ``delta_wy_kernel`` stored
    it (fp32 [B*H, Tp, BT]). Adds dk1 (the state kernel's
    partial dk) and writes dk, dv in their dtypes, dbeta fp32 [B*H, T], dg fp32 [B*H, Tp].
    Per-channel gates (KDA): the decays sit inside L's k.k sums, so the terms of dL go to
    ``core.chunk_backward.channel_dqk_kernel`` (``PAIRS``): this kernel writes dL (fp32 [B*H, Tp, BT]),
    the rest of dk (fp32, into ``dk_ptr``, which is then the padded buffer behind dk1) and of dg
    (fp32 [B*H, Tp, K]).
    """
    i_bh, i_c, i_b, i_h = chunk_program(NT, H)
    k_ptr, v_ptr = at_head(k_ptr, s_k, i_b, i_h), at_head(v_ptr, s_v, i_b, i_h)
    w_ptr, u_ptr = at_head(w_ptr, s_w, i_b, i_h), at_head(u_ptr, s_u, i_b, i_h)
    dw_ptr, du_ptr = at_head(dw_ptr, s_dw, i_b, i_h), at_head(du_ptr, s_du, i_b, i_h)
    dk1_ptr, dk_ptr = at_head(dk1_ptr, s_dk1, i_b, i_h), at_head(dk_ptr, s_dk, i_b, i_h)
    dv_ptr = at_head(dv_ptr, s_dv, i_b, i_h)
    dt = k_ptr.dtype.element_ty

    o_i, o_t, m_t = chunk_tokens(i_c, BT, T)
    m_strict = o_i[:, None] > o_i[None, :]
    b_beta = tl.load(beta_ptr + i_bh * T + o_t, mask=m_t, other=0.0)

    # L as in the forward; R = (I + Diag(beta) L)^{-1} as the recomputing delta_wy_kernel stored it
    b_g = None
    if GATE == GATE_SCALAR:
        b_g, _ = chunk_log_gates(g_ptr, i_bh, i_c, o_t, None, None, Tp, K, BT, GATE)
    b_L = decayed_scores(k_ptr, s_k, None, s_k, ak_ptr, b_g, i_bh, o_i, o_t, m_t, Tp, K, True, GATE, BT, BK, PRECISION)
    b_Rt32 = tl.load(r_ptr + i_bh * Tp * BT + o_t[:, None] * BT + o_i[None, :])     # R^T
    b_Rt = b_Rt32.to(dt)

    # dZ = R^T dX for both factors; G = dw w^T + du u^T; the diagonal parts of dbeta
    b_G = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbk = tl.zeros([BT], dtype=tl.float32)           # sum_k dZw * (K e^g): dbeta's part through w
    b_dbv = tl.zeros([BT], dtype=tl.float32)           # sum_v dZu * V: dbeta's part through u
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k, m_k = channel_block(i_k, BK, K)
        b_dww, b_dZ = wy_factor_grads(dw_ptr, s_dw, w_ptr, s_w, b_Rt, o_t, m_t, o_k, m_k, PRECISION)
        b_G += b_dww
        b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k).to(tl.float32)
        if GATE == GATE_SCALAR:
            b_k *= decay(b_g)[:, None]
        elif GATE == GATE_CHANNEL:
            b_gk, _ = chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT, GATE)
            b_k *= decay(b_gk)
        b_dbk += tl.sum(b_dZ * b_k, axis=1)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v, m_v = channel_block(i_v, BV, V)
        b_duu, b_dZ = wy_factor_grads(du_ptr, s_du, u_ptr, s_u, b_Rt, o_t, m_t, o_v, m_v, PRECISION)
        b_G += b_duu
        b_v = load_block(v_ptr, s_v, o_t, o_v, m_t, m_v)
        b_dbv += tl.sum(b_dZ * b_v.to(tl.float32), axis=1)
        store_tile(dv_ptr, s_dv, o_t, o_v, m_t, m_v, b_dZ * b_beta[:, None])

    # d(Diag(beta) L) = strict lower part of -R^T G; dL = Diag(beta) of it
    b_dBL = tl.where(m_strict, -tl.dot(b_Rt32, b_G, input_precision=INV_PRECISION), 0.0)
    b_dL = b_dBL * b_beta[:, None]
    tl.store(dbeta_ptr + i_bh * T + o_t, b_dbk + b_dbv + tl.sum(b_dBL * b_L, axis=1), mask=m_t)
    if GATE == GATE_CHANNEL:
        tl.store(dl_ptr + i_bh * Tp * BT + o_t[:, None] * BT + o_i[None, :], b_dL)
    if GATE == GATE_SCALAR:
        b_dLL = b_dL * b_L
        b_dg = b_beta * b_dbk + tl.sum(b_dLL, axis=1) - tl.sum(b_dLL, axis=0)
        tl.store(dg_ptr + i_bh * Tp + o_t, b_dg)
        # the gradient of the plain k.k products: times L's decays e^{g_t - g_j}
        b_dL *= decay(tl.where(m_strict, b_g[:, None] - b_g[None, :], float("-inf")))

    # dk = dk1 + beta e^g (R^T dw) + the k.k products' two sides (decayed per channel for KDA)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k, m_k = channel_block(i_k, BK, K)
        b_dw = load_block(dw_ptr, s_dw, o_t, o_k, m_t, m_k).to(dt)
        b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
        b_dkg = tl.dot(b_Rt, b_dw, input_precision=PRECISION) * b_beta[:, None]     # d(K e^g)
        if GATE == GATE_CHANNEL:
            # d(K e^g) here; dL's terms are added by channel_dqk_kernel
            b_gk, _ = chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT, GATE)
            b_dk = b_dkg * decay(b_gk)
            tl.store(dg_ptr + i_bh * Tp * K + o_t[:, None] * K + o_k[None, :], b_dk * b_k.to(tl.float32),
                     mask=m_k[None, :])
        else:
            b_dk = b_dkg
            if GATE == GATE_SCALAR:
                b_dk *= decay(b_g)[:, None]
            b_dk += tl.dot(b_dL.to(dt), b_k, input_precision=PRECISION)
            b_dk += tl.dot(tl.trans(b_dL).to(dt), b_k, input_precision=PRECISION)
        b_dk += load_block(dk1_ptr, s_dk1, o_t, o_k, m_t, m_k)
        store_tile(dk_ptr, s_dk, o_t, o_k, m_t, m_k, b_dk)


# ---------------------------------------------------------------------------------------
# On the host
# ---------------------------------------------------------------------------------------
def _backward_launch(q, k, v, do):
    """``forward_launch``'s set-up for the backward's recomputation, with ``do`` in place of an output."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    return ForwardLaunch(q, k, v, do, tuple(tuple(x.stride()) for x in (q, k, v, do)), (B * H, triton.cdiv(V, 64)),
                         64, precision(q.dtype), B, H, T, K, V)


def wy_factors(run, gate, g, beta, ak, keep_inverse=False):
    """(a): the WY factors w [B, H, T, K] and u [B, H, T, V] of every chunk, in q's dtype, and with
    ``keep_inverse`` each chunk's R = (I + Diag(beta) L)^{-1}, stored transposed (fp32 [B*H, Tp, 64], else
    None), which the backward reads instead of inverting again. w, u, v_new and their gradients have T rows, and every
    kernel masks the rows past T: a short sequence (memory caching runs its blocks of 1-32 tokens as
    batch rows) pays for no padded chunk. Only the log-gates g, the per-channel scores A and R are
    padded to whole chunks (their kernels read whole chunks)."""
    NT = num_chunks(run.T)
    Tp = NT * CHUNK
    w = empty(run.B, run.H, run.T, run.K, dtype=run.q.dtype, device=run.q.device)
    u = empty(run.B, run.H, run.T, run.V, dtype=run.q.dtype, device=run.q.device)
    r = empty(run.B * run.H, Tp, CHUNK, dtype=torch.float32, device=run.q.device) if keep_inverse else None
    delta_wy_kernel[(run.B * run.H * NT,)](
        run.k, run.v, beta, g, ak, w, u, r,
        run.strides[1], run.strides[2], tuple(w.stride()), tuple(u.stride()),
        run.T, run.H, Tp, run.K, run.V, NT,
        GATE=gate, BT=CHUNK, BK=key_block(run.K, run.k), BV=min(dot_tile(run.V), 64), PRECISION=run.precision,
        INV_PRECISION=intermediate_precision(run.q.dtype), num_warps=8,
    )
    return w, u, r


def _forward(q, k, v, beta, logs, initial_state):
    """The forward on fp32 log-gates ``logs`` (None, [B, H, T] or [B, H, T, K]): (o, final state)."""
    feature_tile(q.shape[-1], MAX_KEY)
    run = forward_launch(q, k, v, BV=64)
    gate, g, _ = chunk_gates(None, logs, run.T, CHUNK, q.dtype)
    Tp = num_chunks(run.T) * CHUNK
    aq, ak = channel_scores(run, g, with_keys=True) if gate == GATE_CHANNEL else (None, None)
    w, u, _ = wy_factors(run, gate, g, as_fp32(beta), ak)               # (a) every chunk at once
    h, ht, vn = state_pass(run, gate, g, Tp, as_fp32(initial_state), u=u, w=w)   # (b) v_new and h[c]
    return output_pass(run, gate, g, Tp, h, aq, vn), ht                # (c)


def wy_backward_tiles(K: int, V: int, element_size: int) -> tuple[int, int, int]:
    """(BK, BV, num_warps) of ``delta_bwd_wy_kernel``. Its program keeps L, R^T, G and dL (64 x 64, fp32)
    through loops over key and value blocks, so the blocks are what is left to size: 32 channels at most.
    sm_90 builds: 16-bit inputs take 8 warps (K = V = 128: 0-232 B spilled a thread; blocks of 64 spill
    160-310 B and take 90 KB of shared memory against 64); fp32 takes 16 warps from 64 key channels on
    (K = V = 64 to 256, no gate / scalar / per channel: 292 / 340 / 0 B spilled under Triton 3.7.1,
    168 / 152 / 0 B under 3.6, and 64 KB of shared memory; blocks of 64 spilled 1.0-1.7 KB and took
    96 KB; at K = 16, 8 warps spill less)."""
    warps = 8 if element_size < 4 or dot_tile(K) < 64 else 16
    return min(dot_tile(K), 32), min(dot_tile(V), 32), warps


def delta_rule_backward(do, dht, q, k, v, beta, logs, initial_state):
    """The gradients (dq, dk, dv, dbeta, dlogs, dh0) of the chunked delta rule (every gate mode).

    ``do`` [B, H, T, V], ``dht`` [B, H, V, K] or None: the gradients of the outputs and the final state.
    Recomputes the WY factors and the state pass (h[c], v_new), then runs the reverse state pass
    (``core.chunk_backward.dstate_pass``) and the two per-chunk gradient kernels. dq, dk, dv come
    in the inputs' dtype, dbeta, dlogs and dh0 in fp32.
    """
    from ..core.chunk_backward import dstate_pass

    q, k, v, do = within_head_span(q, k, v, do.to(q.dtype))
    run = _backward_launch(q, k, v, do)
    B, H, T, K, V = run.B, run.H, run.T, run.K, run.V
    gate, g, _ = chunk_gates(None, logs, T, CHUNK, q.dtype)
    NT = num_chunks(T)
    Tp = NT * CHUNK
    BK, (BV, dv_warps) = key_block(K, q), chunk_value_tiles(V, q.element_size())
    NK = triton.cdiv(K, BK)
    dev, dt = q.device, q.dtype
    beta = as_fp32(beta)
    # recompute: the WY factors (keeping R), then h[c] and v_new (the forward's kernels; nothing was stored)
    aq, ak = channel_scores(run, g, with_keys=True) if gate == GATE_CHANNEL else (None, None)
    w, u, r = wy_factors(run, gate, g, beta, ak, keep_inverse=True)
    h, _, vn = state_pass(run, gate, g, Tp, as_fp32(initial_state), u=u, w=w)
    # dv_local, then the reverse state pass: dH per chunk, dv2 = the whole gradient of v_new, dh0
    dv_local = empty(B, H, T, V, dtype=dt, device=dev)
    delta_dv_local_kernel[(B * H * NT, triton.cdiv(V, BV))](
        run.q, run.k, do, g, aq, dv_local,
        run.strides[0], run.strides[1], tuple(do.stride()), tuple(dv_local.stride()),
        T, H, Tp, K, V, NT,
        GATE=gate, BT=CHUNK, BK=BK, BV=BV, PRECISION=run.precision, num_warps=dv_warps,
    )
    dh, dh0, dv2 = dstate_pass(run.q, do, gate, g, dht, k=run.k, w=w, dv_local=dv_local)
    # per chunk: the terms through the states, then back through the WY factors
    channel = gate == GATE_CHANNEL
    dq = empty(B, H, T, K, dtype=dt, device=dev)
    dw = empty(B, H, T, K, dtype=torch.float32, device=dev)
    # dg: fp32 [B*H, NK, Tp] (scalar gates: one row per key block) or [B*H, Tp, K] (per channel)
    dg_shape = (B * H, NK, Tp) if gate == GATE_SCALAR else (B * H, Tp, K) if channel else None
    dg1 = None if dg_shape is None else empty(*dg_shape, dtype=torch.float32, device=dev)
    if channel:
        # the state terms of dq, dk over whole chunks, dS and the last rows' dg for channel_dqk_kernel
        dq_state, dk_state = (empty(B, H, Tp, K, dtype=torch.float32, device=dev) for _ in range(2))
        ds = empty(B * H, Tp, CHUNK, dtype=torch.float32, device=dev)
        dgn = empty(B * H, NT, K, dtype=torch.float32, device=dev)
        dk1 = dk_state[:, :, :T]
    else:
        dq_state = dq
        dk_state = dk1 = empty(B, H, T, K, dtype=torch.float32, device=dev)
        ds = dgn = None
    BV_step, warps = state_grad_tiles(V, q.element_size())
    delta_bwd_state_kernel[(B * H * NT, NK)](
        run.q, run.k, vn, do, dv2, g, h, dh, dq_state, dk_state, dw, dg1, ds, dgn,
        run.strides[0], run.strides[1], tuple(vn.stride()), tuple(do.stride()), tuple(dv2.stride()),
        tuple(dq_state.stride()), tuple(dk_state.stride()), tuple(dw.stride()),
        T, H, Tp, K, V, NT,
        GATE=gate, BT=CHUNK, BK=BK, BV=BV_step, PRECISION=run.precision, num_warps=warps,
    )
    del h, dh
    if channel:
        # dk lands in dk_state itself (fp32), which the WY kernel reads as dk1
        channel_grads(run.q, run.k, g, ds, dq_state, dk_state, dq, dk1, dg1, dgn)
        del dq_state, ds, dgn
    dk = empty(B, H, T, K, dtype=dt, device=dev)
    dv = empty(B, H, T, V, dtype=v.dtype, device=dev)
    dbeta = empty(B, H, T, dtype=torch.float32, device=dev)
    dg2 = None if dg_shape is None else empty(B * H, Tp, *dg_shape[2:] if gate == GATE_CHANNEL else (),
                                             dtype=torch.float32, device=dev)
    dl = empty(B * H, Tp, CHUNK, dtype=torch.float32, device=dev) if channel else None
    dk_wy = dk1 if channel else dk            # KDA: the WY kernel's share of dk joins dk1 in its buffer
    wy_BK, wy_BV, wy_warps = wy_backward_tiles(K, V, q.element_size())
    delta_bwd_wy_kernel[(B * H * NT,)](
        run.k, run.v, beta, g, ak, r, w, u, dw, dv2, dk1, dk_wy, dv, dbeta, dg2, dl,
        run.strides[1], run.strides[2], tuple(w.stride()), tuple(u.stride()), tuple(dw.stride()),
        tuple(dv2.stride()), tuple(dk1.stride()), tuple(dk_wy.stride()), tuple(dv.stride()),
        T, H, Tp, K, V, NT,
        GATE=gate, BT=CHUNK, BK=wy_BK, BV=wy_BV, PRECISION=run.precision, INV_PRECISION=intermediate_precision(dt),
        num_warps=wy_warps,
    )
    if channel:
        channel_grads(run.k, run.k, g, dl, None, dk_state, None, dk, dg2, pairs=True)
    dlogs = None
    if dg1 is not None:
        # g is the cumulative sum of the log-gates within each chunk: their gradient is the
        # reverse cumulative sum of dg within each chunk
        dg = (dg1.sum(1) + dg2 if gate == GATE_SCALAR else dg1 + dg2).view(B, H, NT, CHUNK, -1)
        dlogs = dg.flip(3).cumsum(3).flip(3).reshape(B, H, Tp, -1)[:, :, :T]
        dlogs = dlogs[..., 0] if gate == GATE_SCALAR else dlogs
    return dq, dk, dv, dbeta, dlogs, dh0


class DeltaRuleFunction(torch.autograd.Function):
    """The chunked delta rule (DeltaNet, Gated DeltaNet, KDA) with its backward in Triton kernels.

    Inputs: q, k [B, H, T, K], v [B, H, T, V], beta [B, H, T], the fp32 log-gates ``logs``
    ([B, H, T] or [B, H, T, K], or None) and the initial state [B, H, V, K] (or None). Outputs (o, final state).

    Stored between forward and backward: the inputs only (q, k, v, beta, logs, initial state), nothing else, so a
    training step holds no extra memory for it. The backward recomputes the WY factors w, u and the state pass
    (every h[c] and v_new) instead of keeping them from the forward. Its own buffers, freed when it returns:
    h[c] and dH per chunk (B*H*NT*V*K elements each, in the inputs' dtype when it is 16-bit, else fp32:
    ``core.chunk_kernels.state_dtype``); w, u, v_new, dv_local and dv2 (B*H*T*K or B*H*T*V elements in the
    inputs' dtype); each chunk's inverse R (B*H*Tp*64*4 bytes); the fp32 partial dk and dw (B*H*T*K*4 bytes
    each); the fp32 dg (B*H*Tp*(K/64 + 1)*4 bytes for scalar gates, 2*B*H*Tp*K*4 for KDA); for KDA also the
    scores Aq, Ak (B*H*Tp*64*4 bytes each). NT = cdiv(T, 64), Tp = 64 NT.

    Works under ``torch.func.grad`` (first order: the backward runs its kernels on the unwrapped
    tensors and is not itself differentiable). Under ``create_graph=True`` outside ``torch.func`` (a
    gradient penalty) the backward differentiates the chunk form instead, keeping the graph. A card whose
    shared memory holds the forward's tiles but not the backward's gets autograd through the chunk form,
    with a warning (``core.dispatch.backward_or_fallback``).
    """

    @staticmethod
    def forward(q, k, v, beta, logs, initial_state):
        return _forward(q, k, v, beta, logs, initial_state)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, do, dht):
        # under torch.func the saved tensors and gradients come wrapped for its transforms; the
        # kernels read raw memory, and the backward is not differentiated again (first order only)
        saved = ctx.saved_tensors                # once: non-reentrant checkpointing unpacks them only once
        refuse_nested_transforms(saved[0], "delta_rule")
        q, k, v, beta, logs, h0, do, dht = map(unwrapped, (*saved, do, dht))
        if do is None:                          # only the final state was used
            do = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
        inputs = (q, k, v, beta, logs, h0)
        if second_order_requested():             # create_graph: differentiable gradients, through the chunk form
            return tuple(chunk_grads(_chunk_form, inputs, ctx.needs_input_grad, (do, dht), create_graph=True))

        def kernels():
            dq, dk, dv, dbeta, dlogs, dh0 = delta_rule_backward(do, dht, *inputs)
            return [dq, dk, dv, dbeta.to(beta.dtype), None if logs is None else dlogs.to(logs.dtype),
                    None if h0 is None else dh0.to(h0.dtype)]
        with torch._C._DisableFuncTorch():       # the buffers it allocates are plain tensors too
            return tuple(backward_or_fallback(kernels, _chunk_form, inputs, ctx.needs_input_grad, (do, dht)))


def _chunk_form(q, k, v, beta, logs, initial_state):
    """``DeltaRuleFunction``'s function as the chunk form computes it (the backward's fallback)."""
    return delta_rule_chunk(q, k, v, beta, None, initial_state, CHUNK, logs)


def delta_rule_triton(q, k, v, beta, alpha=None, initial_state=None, log_alpha=None):
    """Triton forward; same arguments and results as ``delta_rule_recurrent`` (and ``log_alpha``).

    Differentiable through ``DeltaRuleFunction`` (the backward kernels here) in every gate mode.
    """
    logs = gate_logs(alpha, log_alpha, torch.float32)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, beta, logs, initial_state))
    if not needs_grad:
        return _forward(q, k, v, beta, logs, initial_state)
    return DeltaRuleFunction.apply(q, k, v, beta, logs, initial_state)
