"""The GPU kernel: chunkwise linear attention (plain, scalar-gated, per-channel-gated) in Triton.

One program owns one (batch*head, value-block) pair and walks the chunks in order,
keeping its slice of the state S [BV, BK] in registers (fp32). For each chunk of BT
tokens it does exactly what ``chunk.chunk_step`` does:

    o   = (q * e^g) S^T + (scores * D) v        D[t,i] = e^{g_t - g_i} for i <= t
    S  <- S * e^{g_last} + (v * e^{g_last - g})^T k

where g is the log-gate accumulated from the chunk start (computed on the host).
Scalar gates give a BT x BT decay matrix; per-channel gates need the decay inside the
q.k sum, so that case builds a BT x BT x BK tile and uses a smaller BT = 16.

q, k, v are read through their strides (a [B, T, H, K] tensor transposed to [B, H, T, K]
needs no copy); absent inputs (no gate, no initial state) are ``None`` pointers, which
Triton compiles away. ``core.kernels`` holds the set-up all four chapters' kernels share.

The kernel is forward only. ``linear_attention(..., backend="triton")`` gets its
gradients from ``core.with_chunk_backward``: autograd through the chunk form,
recomputed from the saved inputs. Runs under ``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.chunking import gate_logs
from ..core.kernels import (GATE_CHANNEL, GATE_NONE, GATE_SCALAR, as_fp32, chunk_local_log_gate, feature_tile,
                            forward_launch, gate_mode, value_tile)


@triton.jit
def linear_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, h0_ptr, o_ptr, ht_ptr,
    s_q, s_k, s_v, s_o,
    T, H, Tp, K, V,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)   # int64: offsets of later heads can exceed 2^31
    i_b, i_h, i_v = i_bh // H, i_bh % H, tl.program_id(1)
    # strides (batch, head, token, channel): q, k, v may be views, read where they lie
    s_qb, s_qh, s_qt, s_qk = s_q
    s_kb, s_kh, s_kt, s_kk = s_k
    s_vb, s_vh, s_vt, s_vv = s_v
    s_ob, s_oh, s_ot, s_ov = s_o
    q_ptr += i_b * s_qb + i_h * s_qh
    k_ptr += i_b * s_kb + i_h * s_kh
    v_ptr += i_b * s_vb + i_h * s_vh
    o_ptr += i_b * s_ob + i_h * s_oh

    o_i = tl.arange(0, BT)                  # rows of a chunk
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_causal = o_i[:, None] >= o_i[None, :]

    # this program's slice of the state, [BV, BK] of a contiguous fp32 [B, H, V, K]
    o_s = i_bh * V * K + o_v[:, None] * K + o_k[None, :]
    m_s = m_v[:, None] & m_k[None, :]
    b_S = tl.zeros([BV, BK], dtype=tl.float32)
    if h0_ptr is not None:
        b_S += tl.load(h0_ptr + o_s, mask=m_s, other=0.0)

    for start in range(0, T, BT):
        o_t = start + o_i                   # the chunk's tokens
        m_t = o_t < T
        p_q = q_ptr + o_t[:, None] * s_qt + o_k[None, :] * s_qk
        p_k = k_ptr + o_t[:, None] * s_kt + o_k[None, :] * s_kk
        p_v = v_ptr + o_t[:, None] * s_vt + o_v[None, :] * s_vv
        b_q = tl.load(p_q, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        if GATE == GATE_NONE:
            b_scores = tl.where(m_causal, tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION), 0.0)
            b_o = tl.dot(b_q, tl.trans(b_S), input_precision=PRECISION) \
                + tl.dot(b_scores, b_v, input_precision=PRECISION)
            b_S += tl.dot(tl.trans(b_v), b_k, input_precision=PRECISION)
        elif GATE == GATE_SCALAR:
            # g is padded to Tp (a multiple of BT) with log-gate 0, so row start+BT-1 exists
            p_g = g_ptr + i_bh * Tp + o_t
            b_g = tl.load(p_g)
            b_g_last = tl.load(g_ptr + i_bh * Tp + start + BT - 1)
            b_decay = tl.exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))
            b_scores = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * b_decay
            b_o = tl.dot(b_q, tl.trans(b_S), input_precision=PRECISION) * tl.exp(b_g)[:, None] \
                + tl.dot(b_scores, b_v, input_precision=PRECISION)
            b_v_decayed = b_v * tl.exp(b_g_last - b_g)[:, None]
            b_S = b_S * tl.exp(b_g_last) + tl.dot(tl.trans(b_v_decayed), b_k, input_precision=PRECISION)
        else:
            p_g = g_ptr + i_bh * Tp * K + o_t[:, None] * K + o_k[None, :]
            b_g = tl.load(p_g, mask=m_k[None, :], other=0.0)
            b_g_last = tl.load(g_ptr + i_bh * Tp * K + (start + BT - 1) * K + o_k, mask=m_k, other=0.0)
            b_diff = tl.where(m_causal[:, :, None], b_g[:, None, :] - b_g[None, :, :], float("-inf"))
            b_scores = tl.sum(b_q[:, None, :] * b_k[None, :, :] * tl.exp(b_diff), axis=2)
            b_o = tl.dot(b_q * tl.exp(b_g), tl.trans(b_S), input_precision=PRECISION) \
                + tl.dot(b_scores, b_v, input_precision=PRECISION)
            b_k_decayed = b_k * tl.exp(b_g_last[None, :] - b_g)
            b_S = b_S * tl.exp(b_g_last)[None, :] + tl.dot(tl.trans(b_v), b_k_decayed, input_precision=PRECISION)
        p_o = o_ptr + o_t[:, None] * s_ot + o_v[None, :] * s_ov
        tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

    tl.store(ht_ptr + o_s, b_S, mask=m_s)


# Every program holds all K key channels of its state slice: K <= 256 (BK = 256).
MAX_KEY = 256


def linear_attention_triton(q, k, v, alpha=None, initial_state=None, log_alpha=None):
    """Triton forward; same arguments and results as ``linear_attention_recurrent`` (and ``log_alpha``)."""
    run = forward_launch(q, k, v, BV=value_tile(v.shape[-1], 64))
    BK = feature_tile(run.K, MAX_KEY)
    logs = gate_logs(alpha, log_alpha, torch.float32)
    gate = gate_mode(logs)
    BT = 16 if gate == GATE_CHANNEL else 64          # per-channel gates build [BT, BT, BK] tiles
    g, Tp = (None, run.T) if logs is None else chunk_local_log_gate(logs, BT)
    ht = run.state()
    linear_attention_fwd_kernel[run.grid](
        run.q, run.k, run.v, g, as_fp32(initial_state), run.o, ht, *run.strides,
        run.T, run.H, Tp, run.K, run.V,
        GATE=gate, BT=BT, BK=BK, BV=run.BV, PRECISION=run.precision,
    )
    return run.o, ht
