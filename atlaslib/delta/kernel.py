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
    I + Diag(beta) L in registers (``core.chunk_kernels.unit_lower_inverse``: blocked forward
    substitution, the 16 x 16 diagonal blocks inverted together, one row of every block per
    step, then the block rows in order with two small matmuls each) and writes w and u. The
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

The kernels are forward only. ``delta_rule(..., backend="triton")`` gets its gradients from
``core.with_chunk_backward``: autograd through the chunk form, recomputed from the saved
inputs. Runs under ``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..core.chunk_kernels import (CHUNK, channel_scores, key_block, num_chunks, output_pass, state_pass,
                                  unit_lower_inverse)
from ..core.kernels import (GATE_CHANNEL, GATE_SCALAR, as_fp32, at_head, chunk_gates, dot_tile,
                            feature_tile, forward_launch, load_block, store_tile)
from ..core.alloc import empty

# The state pass holds all K key channels of its state slice in registers: K <= 256.
MAX_KEY = 256


@triton.jit
def delta_wy_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr, ak_ptr, w_ptr, u_ptr,
    s_k, s_v, s_w, s_u,
    T, H, Tp, K, V, NT,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """w = R Diag(beta) (K e^g) and u = R Diag(beta) V for chunk i_c, R = (I + Diag(beta) L)^{-1}."""
    i_p = tl.program_id(0).to(tl.int64)
    i_bh, i_c = i_p // NT, i_p % NT
    i_b, i_h = i_bh // H, i_bh % H
    k_ptr, v_ptr = at_head(k_ptr, s_k, i_b, i_h), at_head(v_ptr, s_v, i_b, i_h)
    w_ptr, u_ptr = at_head(w_ptr, s_w, i_b, i_h), at_head(u_ptr, s_u, i_b, i_h)
    dt = k_ptr.dtype.element_ty

    o_i = tl.arange(0, BT)
    o_t = i_c * BT + o_i
    m_t = o_t < T
    m_all = o_t < Tp                        # w and u are written for every padded row too
    m_strict = o_i[:, None] > o_i[None, :]
    b_beta = tl.load(beta_ptr + i_bh * T + o_t, mask=m_t, other=0.0)

    # L: strictly lower decayed k.k products of the chunk
    if GATE == GATE_CHANNEL:
        b_L = tl.load(ak_ptr + i_bh * Tp * BT + o_t[:, None] * BT + o_i[None, :])
    else:
        b_L = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, o_k < K)
            b_L += tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
        if GATE == GATE_SCALAR:
            b_g = tl.load(g_ptr + i_bh * Tp + o_t)
            b_L *= tl.exp(tl.where(m_strict, b_g[:, None] - b_g[None, :], float("-inf")))
        else:
            b_L = tl.where(m_strict, b_L, 0.0)

    # R Diag(beta): the inverse in fp32, cast to the inputs' dtype for its products
    b_R = unit_lower_inverse(b_beta[:, None] * b_L, BT, 16, PRECISION)
    b_Rb = (b_R * b_beta[None, :]).to(dt)

    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
        if GATE == GATE_SCALAR:
            b_k = (b_k * tl.exp(b_g)[:, None]).to(dt)
        elif GATE == GATE_CHANNEL:
            b_gk = tl.load(g_ptr + i_bh * Tp * K + o_t[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
            b_k = (b_k * tl.exp(b_gk)).to(dt)
        store_tile(w_ptr, s_w, o_t, o_k, m_all, m_k, tl.dot(b_Rb, b_k, input_precision=PRECISION))
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_v = load_block(v_ptr, s_v, o_t, o_v, m_t, m_v)
        store_tile(u_ptr, s_u, o_t, o_v, m_all, m_v, tl.dot(b_Rb, b_v, input_precision=PRECISION))


def delta_rule_triton(q, k, v, beta, alpha=None, initial_state=None, log_alpha=None):
    """Triton forward; same arguments and results as ``delta_rule_recurrent`` (and ``log_alpha``)."""
    feature_tile(q.shape[-1], MAX_KEY)
    run = forward_launch(q, k, v, BV=64)
    gate, g, _ = chunk_gates(alpha, log_alpha, run.T, CHUNK)
    NT = num_chunks(run.T)
    Tp = NT * CHUNK                          # w and u cover whole chunks
    aq, ak = channel_scores(run, g, with_keys=True) if gate == GATE_CHANNEL else (None, None)
    # (a) the WY factors, every chunk at once
    w = empty(run.B, run.H, Tp, run.K, dtype=q.dtype, device=q.device)
    u = empty(run.B, run.H, Tp, run.V, dtype=q.dtype, device=q.device)
    delta_wy_kernel[(run.B * run.H * NT,)](
        run.k, run.v, as_fp32(beta), g, ak, w, u,
        run.strides[1], run.strides[2], tuple(w.stride()), tuple(u.stride()),
        run.T, run.H, Tp, run.K, run.V, NT,
        GATE=gate, BT=CHUNK, BK=key_block(run.K), BV=min(dot_tile(run.V), 64), PRECISION=run.precision,
    )
    # (b) the state pass, forming v_new; (c) the outputs
    h, ht, vn = state_pass(run, gate, g, Tp, as_fp32(initial_state), u=u, w=w)
    return output_pass(run, gate, g, Tp, h, aq, vn), ht
