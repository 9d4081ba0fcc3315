"""The GPU kernel: chunkwise linear attention (plain, scalar-gated, per-channel-gated) in Triton.

One program owns one (batch*head, value-block) pair and walks the chunks in order,
keeping its slice of the memory M [BV, BK] in registers (fp32). For each chunk of BT
tokens it does exactly what ``chunk.chunk_step`` does:

    o   = (q * e^g) M^T + (scores * D) v        D[t,i] = e^{g_t - g_i} for i <= t
    M  <- M * e^{g_last} + (v * e^{g_last - g})^T k

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

import triton
import triton.language as tl

from ..core.kernels import (GATE_NONE, GATE_SCALAR, as_fp32, at_head, chunk_gates, feature_tile, forward_launch,
                            load_state, load_tile, rows_within_shared, state_slice, store_tile, value_tile)


# Every program holds all K key channels of its state slice in registers: K <= 256.
MAX_KEY = 256


@triton.jit
def linear_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, h0_ptr, o_ptr, ht_ptr,
    s_q, s_k, s_v, s_o,
    T, H, Tp, K, V,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)   # int64: offsets of later heads can exceed 2^31
    i_b, i_h, i_v = i_bh // H, i_bh % H, tl.program_id(1)
    # this program's head of q, k, v, o, each read through its own strides (views need no copy)
    q_ptr, k_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h)
    v_ptr, o_ptr = at_head(v_ptr, s_v, i_b, i_h), at_head(o_ptr, s_o, i_b, i_h)

    o_i = tl.arange(0, BT)                  # rows of a chunk
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_causal = o_i[:, None] >= o_i[None, :]

    # this program's slice M [BV, BK] of the state, in fp32 (zeros without h0)
    o_s, m_s = state_slice(i_bh, o_v, o_k, V, K)
    b_M = load_state(h0_ptr, o_s, m_s, BV, BK)

    for start in range(0, T, BT):
        o_t = start + o_i                   # the chunk's tokens
        m_t = o_t < T
        b_q = load_tile(q_ptr, s_q, o_t, o_k, m_t, m_k)
        b_k = load_tile(k_ptr, s_k, o_t, o_k, m_t, m_k)
        b_v = load_tile(v_ptr, s_v, o_t, o_v, m_t, m_v)
        if GATE == GATE_NONE:
            b_scores = tl.where(m_causal, tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION), 0.0)
            b_o = tl.dot(b_q, tl.trans(b_M), input_precision=PRECISION) \
                + tl.dot(b_scores, b_v, input_precision=PRECISION)
            b_M += tl.dot(tl.trans(b_v), b_k, input_precision=PRECISION)
        elif GATE == GATE_SCALAR:
            # g is padded to Tp (a multiple of BT) with log-gate 0, so row start+BT-1 exists
            p_g = g_ptr + i_bh * Tp + o_t
            b_g = tl.load(p_g)
            b_g_last = tl.load(g_ptr + i_bh * Tp + start + BT - 1)
            b_decay = tl.exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))
            b_scores = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * b_decay
            b_o = tl.dot(b_q, tl.trans(b_M), input_precision=PRECISION) * tl.exp(b_g)[:, None] \
                + tl.dot(b_scores, b_v, input_precision=PRECISION)
            b_v_decayed = b_v * tl.exp(b_g_last - b_g)[:, None]
            b_M = b_M * tl.exp(b_g_last) + tl.dot(tl.trans(b_v_decayed), b_k, input_precision=PRECISION)
        else:
            p_g = g_ptr + i_bh * Tp * K + o_t[:, None] * K + o_k[None, :]
            b_g = tl.load(p_g, mask=m_k[None, :], other=0.0)
            b_g_last = tl.load(g_ptr + i_bh * Tp * K + (start + BT - 1) * K + o_k, mask=m_k, other=0.0)
            b_diff = tl.where(m_causal[:, :, None], b_g[:, None, :] - b_g[None, :, :], float("-inf"))
            b_scores = tl.sum(b_q[:, None, :] * b_k[None, :, :] * tl.exp(b_diff), axis=2)
            b_o = tl.dot(b_q * tl.exp(b_g), tl.trans(b_M), input_precision=PRECISION) \
                + tl.dot(b_scores, b_v, input_precision=PRECISION)
            b_k_decayed = b_k * tl.exp(b_g_last[None, :] - b_g)
            b_M = b_M * tl.exp(b_g_last)[None, :] + tl.dot(tl.trans(b_v), b_k_decayed, input_precision=PRECISION)
        store_tile(o_ptr, s_o, o_t, o_v, m_t, m_v, b_o)

    tl.store(ht_ptr + o_s, b_M, mask=m_s)


def linear_attention_triton(q, k, v, alpha=None, initial_state=None, log_alpha=None):
    """Triton forward; same arguments and results as ``linear_attention_recurrent`` (and ``log_alpha``)."""
    BK = feature_tile(q.shape[-1], MAX_KEY)
    row_bytes = BK * q.element_size()
    # fp32 rows of 256 keys: 187 KB with per-channel gates at BV = 64, 131 KB at 32 (sm_80 AOT builds)
    run = forward_launch(q, k, v, BV=value_tile(v.shape[-1], 64 if row_bytes <= 512 else 32))
    # chunks of up to 64 tokens, fewer for wide fp32 keys (shared memory); 16 for per-channel
    # gates, whose decays make [BT, BT, BK] tiles
    BT = rows_within_shared(BK, q.element_size(), 64)
    gate, BT, g, Tp = chunk_gates(alpha, log_alpha, run.T, BT=BT, BT_channel=16)
    ht = run.state()
    linear_attention_fwd_kernel[run.grid](
        run.q, run.k, run.v, g, as_fp32(initial_state), run.o, ht, *run.strides,
        run.T, run.H, Tp, run.K, run.V,
        GATE=gate, BT=BT, BK=BK, BV=run.BV, PRECISION=run.precision,
    )
    return run.o, ht
