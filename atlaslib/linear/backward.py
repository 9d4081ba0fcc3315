"""The GPU backward of linear attention (plain, scalar-gated, per-channel-gated) in Triton.

Chunk c of the forward (``linear.kernel``), with h = h[c] the state at the chunk's start, g the
log-gate accumulated from the chunk's start and g_n its last row, computes

    o    = (q * e^g) h^T + (A * D) v,          A = q k^T,  D[i, j] = e^{g_i - g_j} for j <= i, else 0
    h[c+1] = h Diag(e^{g_n}) + v^T (k * e^{g_n - g})

(per-channel gates: D moves inside the q.k sum, A[i, j] = sum_c q_ic k_jc e^{g_ic - g_jc}).
Differentiating these two lines gives every gradient of chunk c from three things: do, the
state h[c] at its start, and dh[c], the gradient of the loss with respect to the state at its
end. With dA = (do v^T) * D (causal):

    dq = (do h) * e^g            + dA k
    dk = (v dh[c]) * e^{g_n - g} + dA^T q
    dv = (k * e^{g_n - g}) dh[c]^T + (A * D)^T do

(per-channel gates: the decays of dA k and dA^T q act channel by channel again, so they are
computed by sub-chunks as the forward's scores are, below). The backward therefore runs in
three phases, like the forward:

1. the chunk-start states h[c] are recomputed by the forward's state pass (or kept from the
   forward when asked: ``keep_states``), and the chunks' dh[c] come from the reverse state pass
   (``core.chunk_backward.dstate_pass``), the only serial parts, both sequential over chunks
   and parallel over (batch*head, value block, key block);
2. ``linear_dv_kernel`` (parallel over batch*head, chunk, value block) forms dv;
3. ``linear_dqk_kernel`` (parallel over batch*head, chunk, key block) forms dq, dk and each
   token's share of the log-gate gradient. Per-channel gates add ``core.chunk_backward.channel_dqk_kernel``
   (parallel over batch*head, chunk, sub-chunk of 16 tokens, key block) for the intra-chunk
   terms, with the decay folded into q and k against a reference token of each sub-chunk.

The gradient of the log-gates. Write B_t = sum_{s<=t} log alpha_s for the cumulative log-gate
from the sequence's start (the chunk-local g differ from it by a constant per chunk, which
cancels in every difference). Every term of every output o_t, and of the final state, carries
q_t only together with e^{B_t} and k_s only together with e^{-B_s}, except that the final state
h_T (and the initial state's share of every output) carries e^{B_T} (e^{B_t}) with no key. So,
holding B as free variables,

    dL/dB_t = q_t . dq_t - k_t . dk_t  (+ sum(dh_T * h_T) at the last token t = T-1),

channel by channel for per-channel gates (the sum over V only), and since log alpha_s enters
every B_t with t >= s, d log alpha_s = sum_{t>=s} dL/dB_t: a reverse cumulative sum over the
sequence, done on the host. dq and dk here are the complete gradients (state and intra-chunk
terms), which the kernels hold in fp32 before rounding them to the input dtype.

What is stored: the recomputed chunk-start states h [B*H, NT, V, K] (fp32, or the inputs' dtype when it is
16-bit: ``core.chunk_kernels.state_dtype``) and the reverse pass's dh of the same size (NT = cdiv(T, 64)); the
per-channel scores A [B*H, Tp, 64] fp32 and, for per-channel gates, dA [B*H, Tp, 64] and the state terms of
dq, dk [B*H, Tp, K] fp32; the log-gate shares [B*H, Tp(, K)] fp32 (per key block of 64 for scalar gates).
The forward keeps only its inputs and the final state, unless ``keep_states`` keeps h too (then the
backward skips the state pass).

Precision as in the forward: bf16/fp16 tiles go to tl.dot in their dtype with fp32 sums, fp32
intermediates (dh, dA, decayed tiles) are rounded to the input dtype before a product, fp32
inputs use exact products (``core.kernels.precision``).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..core.alloc import empty
from ..core.chunk_backward import channel_grads, dstate_pass, state_grad_terms, state_grad_tiles
from ..core.chunk_kernels import CHUNK, channel_scores, chunk_value_tiles, key_block, num_chunks, state_pass
from ..core.kernels import GATE_CHANNEL, GATE_NONE, GATE_SCALAR, ForwardLaunch, at_head, channel_block, \
    chunk_block_program, chunk_log_gates, chunk_state, decay, load_block, load_state_tile, \
    precision, store_tile, within_head_span


# ---------------------------------------------------------------------------------------
# dv: every (chunk, value block) at once
# ---------------------------------------------------------------------------------------
@triton.jit
def linear_dv_kernel(
    q_ptr, k_ptr, do_ptr, g_ptr, a_ptr, dh_ptr, dv_ptr,
    s_q, s_k, s_do, s_dv,
    T, H, Tp, K, V, NT,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """dv = (k * e^{g_n - g}) dh[c]^T + (A * D)^T do for chunk c, value block i_v. (A * D)^T is
    formed here as k q^T for no gate and scalar gates; read transposed from ``a_ptr`` (the
    forward's ``channel_scores_kernel``) for per-channel gates. h, dh [B*H, NT, V, K] (``state_dtype``)."""
    i_bh, i_c, i_b, i_h, o_i, o_t, m_t, o_v, m_v = chunk_block_program(NT, H, T, BT, BV, V)
    q_ptr, k_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h)
    do_ptr, dv_ptr = at_head(do_ptr, s_do, i_b, i_h), at_head(dv_ptr, s_dv, i_b, i_h)
    dh_ptr = chunk_state(dh_ptr, i_bh, i_c, NT, V, K)
    dt = k_ptr.dtype.element_ty
    m_causal_t = o_i[None, :] >= o_i[:, None]            # row j (key), column i (query): i >= j

    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    b_At = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k, m_k = channel_block(i_k, BK, K)
        b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
        b_dh = load_state_tile(dh_ptr, o_v, o_k, m_v, m_k, K)
        if GATE == GATE_CHANNEL:
            b_g, b_gn = chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT, GATE)
            b_k = (b_k * decay(b_gn[None, :] - b_g)).to(dt)
        else:
            b_q = load_block(q_ptr, s_q, o_t, o_k, m_t, m_k)
            b_At += tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION)
        b_dv += tl.dot(b_k, tl.trans(b_dh).to(dt), input_precision=PRECISION)
    if GATE == GATE_NONE:
        b_At = tl.where(m_causal_t, b_At, 0.0)
    elif GATE == GATE_SCALAR:
        b_g, b_gn = chunk_log_gates(g_ptr, i_bh, i_c, o_t, None, None, Tp, K, BT, GATE)
        b_dv *= decay(b_gn - b_g)[:, None]
        b_At *= decay(tl.where(m_causal_t, b_g[None, :] - b_g[:, None], float("-inf")))
    else:
        b_At = tl.load(a_ptr + i_bh * Tp * BT + o_t[None, :] * BT + o_i[:, None])
    b_do = load_block(do_ptr, s_do, o_t, o_v, m_t, m_v)
    b_dv += tl.dot(b_At.to(dt), b_do, input_precision=PRECISION)
    store_tile(dv_ptr, s_dv, o_t, o_v, m_t, m_v, b_dv)


# ---------------------------------------------------------------------------------------
# dq, dk and the log-gate shares: every (chunk, key block) at once
# ---------------------------------------------------------------------------------------
@triton.jit
def linear_dqk_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, g_ptr, h_ptr, dh_ptr, dq_ptr, dk_ptr, dg_ptr, da_ptr, dq32_ptr, dk32_ptr,
    s_q, s_k, s_v, s_do, s_dq, s_dk,
    T, H, Tp, K, V, NT, BH,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """Chunk c, key block i_k: the state terms dq = (do h[c]) * e^g, dk = (v dh[c]) * e^{g_n - g}
    and dA = do v^T (summed over value blocks), then

    * no gate, scalar gates: dq += (dA * D) k, dk += (dA * D)^T q, stored in the input dtype, and
      (scalar) the key block's share of dL/dB_t = sum_c q_tc dq_tc - k_tc dk_tc in ``dg_ptr``
      [NK, B*H, Tp] fp32;
    * per-channel gates: the state terms (fp32, [B*H, Tp, K]) and the causal dA (fp32, [B*H, Tp,
      BT], written by key block 0) for ``channel_dqk_kernel``.
    """
    i_bh, i_c, i_b, i_h, o_i, o_t, m_t, o_k, m_k = chunk_block_program(NT, H, T, BT, BK, K)
    q_ptr, k_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h)
    v_ptr, do_ptr = at_head(v_ptr, s_v, i_b, i_h), at_head(do_ptr, s_do, i_b, i_h)
    dq_ptr, dk_ptr = at_head(dq_ptr, s_dq, i_b, i_h), at_head(dk_ptr, s_dk, i_b, i_h)
    h_ptr, dh_ptr = chunk_state(h_ptr, i_bh, i_c, NT, V, K), chunk_state(dh_ptr, i_bh, i_c, NT, V, K)
    dt = q_ptr.dtype.element_ty

    b_dA, b_dq, b_dk, _, _ = state_grad_terms(do_ptr, s_do, v_ptr, s_v, None, s_v, h_ptr, dh_ptr, o_t, m_t, o_k, m_k,
                                              V, K, BT, BK, BV, PRECISION)
    m_causal = o_i[:, None] >= o_i[None, :]
    if GATE != GATE_NONE:
        b_g, b_gn = chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT, GATE)
    if GATE == GATE_CHANNEL:
        b_dq *= decay(b_g)
        b_dk *= decay(b_gn[None, :] - b_g)
        p_x = i_bh * Tp * K + o_t[:, None] * K + o_k[None, :]
        tl.store(dq32_ptr + p_x, b_dq, mask=m_k[None, :])
        tl.store(dk32_ptr + p_x, b_dk, mask=m_k[None, :])
        if tl.program_id(1) == 0:
            tl.store(da_ptr + i_bh * Tp * BT + o_t[:, None] * BT + o_i[None, :], tl.where(m_causal, b_dA, 0.0))
    else:
        b_q = load_block(q_ptr, s_q, o_t, o_k, m_t, m_k)
        b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
        if GATE == GATE_SCALAR:
            b_dq *= decay(b_g)[:, None]
            b_dk *= decay(b_gn - b_g)[:, None]
            b_dA *= decay(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))
        else:
            b_dA = tl.where(m_causal, b_dA, 0.0)
        b_dA = b_dA.to(dt)
        b_dq += tl.dot(b_dA, b_k, input_precision=PRECISION)
        b_dk += tl.dot(tl.trans(b_dA), b_q, input_precision=PRECISION)
        store_tile(dq_ptr, s_dq, o_t, o_k, m_t, m_k, b_dq)
        store_tile(dk_ptr, s_dk, o_t, o_k, m_t, m_k, b_dk)
        if GATE == GATE_SCALAR:
            b_dg = tl.sum(b_q.to(tl.float32) * b_dq - b_k.to(tl.float32) * b_dk, axis=1)
            tl.store(dg_ptr + (tl.program_id(1) * BH + i_bh) * Tp + o_t, b_dg)


# ---------------------------------------------------------------------------------------
# On the host
# ---------------------------------------------------------------------------------------
def _launch(q, k, v) -> ForwardLaunch:
    """What the forward's state pass reads, without allocating an output (the backward has none)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    strides = tuple(tuple(x.stride()) for x in (q, k, v)) + ((0, 0, 0, 0),)
    return ForwardLaunch(q, k, v, None, strides, (B * H, 1), 64, precision(q.dtype), B, H, T, K, V)  # type: ignore[arg-type]


@dataclasses.dataclass
class LinearGrads:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dlog: torch.Tensor | None     # fp32, [B, H, T] or [B, H, T, K]; None without a gate
    dh0: torch.Tensor             # fp32 [B, H, V, K]


def linear_attention_backward(q, k, v, gate, g, h0, do, dht=None, h=None, ht=None) -> LinearGrads:
    """All gradients of linear attention's chunk-parallel forward (module docstring).

    q, k [B, H, T, K], v, do [B, H, T, V] (any strides, ``within_head_span``; q, k, v in one dtype); ``gate``, ``g``:
    the forward's gate mode and chunk-local log-gates (``core.kernels.chunk_gates(..., CHUNK, q.dtype)``);
    h0: the initial state (fp32 contiguous) or None; dht: the final state's gradient or None;
    h, ht: the chunk-start states and the final state kept by the forward, else recomputed.
    """
    q, k, v, do = within_head_span(q, k, v, do.to(q.dtype))
    run = _launch(q, k, v)
    B, H, T, K, V = run.B, run.H, run.T, run.K, run.V
    NT = num_chunks(T)
    Tp = NT * CHUNK
    gate = int(gate)
    if g is not None and g.shape[2] != Tp:
        raise ValueError(f"log-gates padded to {g.shape[2]} tokens, expected {Tp}")
    if h is None:
        h, ht, _ = state_pass(run, gate, g, Tp, h0)
    dh, dh0, _ = dstate_pass(q, do, gate, g, dht)
    dev = q.device
    BK = key_block(K, q)
    NK = triton.cdiv(K, BK)
    BV, dv_warps = chunk_value_tiles(V, q.element_size())
    prec = run.precision
    dq, dk, dv = (empty(*x.shape, dtype=q.dtype, device=dev) for x in (q, k, v))
    channel = gate == GATE_CHANNEL.value
    aq = channel_scores(run, g, with_keys=False)[0] if channel else None
    linear_dv_kernel[(B * H * NT, triton.cdiv(V, BV))](
        q, k, do, g, aq, dh, dv,
        run.strides[0], run.strides[1], tuple(do.stride()), tuple(dv.stride()),
        T, H, Tp, K, V, NT,
        GATE=gate, BT=CHUNK, BK=BK, BV=BV, PRECISION=prec, num_warps=dv_warps,
    )
    dg = da = dq32 = dk32 = None
    if gate == GATE_SCALAR.value:
        dg = empty(NK, B * H, Tp, dtype=torch.float32, device=dev)
    elif channel:
        da = empty(B * H, Tp, CHUNK, dtype=torch.float32, device=dev)
        dq32 = empty(B * H, Tp, K, dtype=torch.float32, device=dev)
        dk32 = empty(B * H, Tp, K, dtype=torch.float32, device=dev)
    BV_step, dqk_warps = state_grad_tiles(V, q.element_size())
    linear_dqk_kernel[(B * H * NT, NK)](
        q, k, v, do, g, h, dh, dq, dk, dg, da, dq32, dk32,
        run.strides[0], run.strides[1], run.strides[2], tuple(do.stride()), tuple(dq.stride()), tuple(dk.stride()),
        T, H, Tp, K, V, NT, B * H,
        GATE=gate, BT=CHUNK, BK=BK, BV=BV_step, PRECISION=prec, num_warps=dqk_warps,
    )
    dlog = None
    if channel:
        dg = empty(B * H, Tp, K, dtype=torch.float32, device=dev)
        channel_grads(q, k, g, da, dq32, dk32, dq, dk, dg)
    if gate != GATE_NONE.value:
        dlog = log_gate_grads(dg if channel else dg.sum(0), dh, h, ht, channel).view(B, H, Tp, -1)[:, :, :T]
        dlog = dlog if channel else dlog[..., 0]
    return LinearGrads(dq, dk, dv, dlog, dh0)


def log_gate_grads(dB, dh, h, ht, channel: bool):
    """d log alpha_s from dB_t = dL/dB_t, the gradients of the cumulative log-gates as the chunk terms see
    them ([B*H, Tp] or, per channel, [B*H, Tp, K]), and the states: [B*H, Tp, 1 or K].

    d log alpha_s = sum_{t >= s in s's chunk c} dB_t + <dh[c], h[c+1]>: raising every later B_t by d scales
    the state after chunk c by e^d (the terms of later tokens of chunk c come back through their own dB_t), so
    the later chunks' whole share is that product (for the last chunk <dht, ht>; dh is 0 without dht). A
    reverse sum of at most 64 terms per token, as the delta rule's: a sum over the whole sequence carried
    every token's rounding error to every earlier token (2e-2 of a bf16 gradient's norm at T = 1000)."""
    BH, NT = h.shape[0], h.shape[1]
    after = torch.cat([h[:, 1:].float(), ht.reshape(BH, 1, *ht.shape[-2:]).float()], 1)      # h[c + 1]
    share = (dh.float() * after).sum(-2)                                                       # [B*H, NT, K]
    share = share[:, :, None, :] if channel else share.sum(-1)[:, :, None, None]
    dB = dB.view(BH, NT, CHUNK, -1)
    return (dB.flip(2).cumsum(2).flip(2) + share).view(BH, NT * CHUNK, -1)
