"""The GPU kernel: the chunkwise delta rule (DeltaNet, Gated DeltaNet, KDA) in Triton.

One program owns one (batch*head, value-block) pair and walks the chunks in order,
keeping its slice of the memory M [BV, BK] in registers (fp32). Value columns never mix
in the delta rule (the triangular system acts on tokens, not on value channels), so
splitting V across programs is exact; every program needs all K key channels. For each
chunk of BT tokens it does what ``chunk.chunk_step`` does, with g the log-retention
accumulated from the chunk start (computed on the host, padded with zeros):

    P   = (Q K^T) * e^{g_t - g_j}  (j <= t)         L = (K K^T) * e^{g_t - g_j}  (j < t)
    R   = (I + Diag(beta) L)^{-1}                   in registers, by forward substitution
    U   = R Diag(beta) (V - (K * e^g) M^T)          the corrected values the chunk writes
    o   = (Q * e^g) M^T + P U
    M  <- M Diag(e^{g_n}) + U^T (K * e^{g_n - g})

The triangular solve: the chunk-local inverse R of the unit lower-triangular matrix
I + Diag(beta) L is built inside the kernel (``unit_lower_inverse``), by blocked forward
substitution: the 16 x 16 diagonal blocks are inverted together, one row of every block
per step (row i of R is e_i - sum_{j<i} (beta L)_{ij} R_j, using only finished rows), then
the block rows are filled in order with two small matmuls each. It depends only on the
keys, betas and gates of the chunk, not on the state, and is then applied with one
tl.dot. This is the matrix that fla computes in a separate kernel (WY form; fla calls it T,
which here is the sequence length), done in place to keep everything in one function;
15 + BT/16 - 1 vectorised steps instead of BT - 1 also keep the interpreter fast. Padded tokens (t >= T)
carry beta = 0 and k = v = 0, so they write nothing.

Scalar gates keep BT = 64 and apply their decays by scaling rows of the dot products;
per-channel (KDA) gates need the decay inside the k.k and q.k sums, which builds
BT x BT x BK tiles, so that case uses BT = 16. Gates of exactly 1 give g = 0 and gates of
0 are clamped to log = -60 on the host, so every exponent is a non-positive difference.

q, k, v are read through their strides (a [B, T, H, K] tensor transposed to [B, H, T, K]
needs no copy); absent inputs (no gate, no initial state) are ``None`` pointers, which
Triton compiles away. ``core.kernels`` holds the set-up all four chapters' kernels share.

The kernel is forward only. ``delta_rule(..., backend="triton")`` gets its gradients from
``core.with_chunk_backward``: autograd through the chunk form, recomputed from the saved
inputs. Runs under ``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..core.kernels import (GATE_NONE, GATE_SCALAR, as_fp32, at_head, chunk_gates, feature_tile, forward_launch,
                            load_state, load_tile, state_slice, store_tile, value_tile)


# Every program holds all K key channels of its state slice in registers: K <= 256.
MAX_KEY = 256


@triton.jit
def unit_lower_inverse(b_A, BT: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^{-1} for a strictly lower-triangular [BT, BT] tile A (BT a multiple of SUB).

    Blocked forward substitution. Phase 1 inverts the SUB x SUB diagonal blocks, all of
    them at once: step i finishes row i of every block, R_r = e_r - sum_{j<r} A_rj R_j,
    which reads only rows finished in earlier steps. Phase 2 fills the block rows in order,
    R_j = R_jj (E_j - A_{j,<j} R_{<j}) for block row j, with R_jj the inverted diagonal block.
    """
    o_i = tl.arange(0, BT)
    o_blk = o_i // SUB                                  # the diagonal block of each row
    b_I = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    m_diag = o_blk[:, None] == o_blk[None, :]
    b_R_diag = b_I
    b_A_diag = tl.where(m_diag, b_A, 0.0)
    for i in range(1, SUB):
        b_step = b_I - tl.dot(b_A_diag, b_R_diag, input_precision=PRECISION)
        b_R_diag = tl.where((o_i % SUB == i)[:, None], b_step, b_R_diag)
    b_R = b_R_diag
    b_A_off = tl.where(m_diag, 0.0, b_A)
    for blk in range(1, BT // SUB):
        b_rhs = b_I - tl.dot(b_A_off, b_R, input_precision=PRECISION)
        b_R = tl.where((o_blk == blk)[:, None], tl.dot(b_R_diag, b_rhs, input_precision=PRECISION), b_R)
    return b_R


@triton.jit
def delta_rule_fwd_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, h0_ptr, o_ptr, ht_ptr,
    s_q, s_k, s_v, s_o,
    T, H, Tp, K, V,
    GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)   # int64: offsets of later heads can exceed 2^31
    i_b, i_h, i_v = i_bh // H, i_bh % H, tl.program_id(1)
    # this program's head of q, k, v, o, each read through its own strides (views need no copy)
    q_ptr, k_ptr = at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h)
    v_ptr, o_ptr = at_head(v_ptr, s_v, i_b, i_h), at_head(o_ptr, s_o, i_b, i_h)
    beta_ptr += i_bh * T                    # fp32 [B, H, T], contiguous

    o_i = tl.arange(0, BT)                  # rows of a chunk
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_causal = o_i[:, None] >= o_i[None, :]
    m_strict = o_i[:, None] > o_i[None, :]

    # this program's slice M [BV, BK] of the state, in fp32 (zeros without h0)
    o_s, m_s = state_slice(i_bh, o_v, o_k, V, K)
    b_M = load_state(h0_ptr, o_s, m_s, BV, BK)

    for start in range(0, T, BT):
        o_t = start + o_i                   # the chunk's tokens
        m_t = o_t < T
        b_q = load_tile(q_ptr, s_q, o_t, o_k, m_t, m_k)
        b_k = load_tile(k_ptr, s_k, o_t, o_k, m_t, m_k)
        b_v = load_tile(v_ptr, s_v, o_t, o_v, m_t, m_v)
        b_beta = tl.load(beta_ptr + o_t, mask=m_t, other=0.0)

        # P (causal q.k scores), L (strictly lower k.k), and the start state read by q and k
        if GATE == GATE_NONE:
            b_P = tl.where(m_causal, tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION), 0.0)
            b_L = tl.where(m_strict, tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION), 0.0)
            b_qM = tl.dot(b_q, tl.trans(b_M), input_precision=PRECISION)
            b_kM = tl.dot(b_k, tl.trans(b_M), input_precision=PRECISION)
        elif GATE == GATE_SCALAR:
            b_g = tl.load(g_ptr + i_bh * Tp + o_t)
            b_decay = tl.exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))
            b_P = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * b_decay
            b_L = tl.where(m_strict, tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION) * b_decay, 0.0)
            b_qM = tl.dot(b_q, tl.trans(b_M), input_precision=PRECISION) * tl.exp(b_g)[:, None]
            b_kM = tl.dot(b_k, tl.trans(b_M), input_precision=PRECISION) * tl.exp(b_g)[:, None]
        else:
            p_g = g_ptr + i_bh * Tp * K + o_t[:, None] * K + o_k[None, :]
            b_g = tl.load(p_g, mask=m_k[None, :], other=0.0)
            b_D = tl.exp(tl.where(m_causal[:, :, None], b_g[:, None, :] - b_g[None, :, :], float("-inf")))
            b_P = tl.sum(b_q[:, None, :] * b_k[None, :, :] * b_D, axis=2)
            b_L = tl.where(m_strict, tl.sum(b_k[:, None, :] * b_k[None, :, :] * b_D, axis=2), 0.0)
            b_qM = tl.dot(b_q * tl.exp(b_g), tl.trans(b_M), input_precision=PRECISION)
            b_kM = tl.dot(b_k * tl.exp(b_g), tl.trans(b_M), input_precision=PRECISION)

        # U = (I + Diag(beta) L)^{-1} Diag(beta) (V - (K e^g) M^T): the values the chunk writes
        b_R = unit_lower_inverse(b_beta[:, None] * b_L, BT, 16, PRECISION)
        b_U = tl.dot(b_R, b_beta[:, None] * (b_v - b_kM), input_precision=PRECISION)
        b_o = b_qM + tl.dot(b_P, b_U, input_precision=PRECISION)
        store_tile(o_ptr, s_o, o_t, o_v, m_t, m_v, b_o)

        # M <- M Diag(e^{g_n}) + U^T (K e^{g_n - g}); rows padded up to Tp keep g constant
        if GATE == GATE_NONE:
            b_M += tl.dot(tl.trans(b_U), b_k, input_precision=PRECISION)
        elif GATE == GATE_SCALAR:
            b_g_last = tl.load(g_ptr + i_bh * Tp + start + BT - 1)
            b_U_end = b_U * tl.exp(b_g_last - b_g)[:, None]
            b_M = b_M * tl.exp(b_g_last) + tl.dot(tl.trans(b_U_end), b_k, input_precision=PRECISION)
        else:
            b_g_last = tl.load(g_ptr + i_bh * Tp * K + (start + BT - 1) * K + o_k, mask=m_k, other=0.0)
            b_k_end = b_k * tl.exp(b_g_last[None, :] - b_g)
            b_M = b_M * tl.exp(b_g_last)[None, :] + tl.dot(tl.trans(b_U), b_k_end, input_precision=PRECISION)

    tl.store(ht_ptr + o_s, b_M, mask=m_s)


def delta_rule_triton(q, k, v, beta, alpha=None, initial_state=None, log_alpha=None):
    """Triton forward; same arguments and results as ``delta_rule_recurrent`` (and ``log_alpha``)."""
    run = forward_launch(q, k, v, BV=value_tile(v.shape[-1], 64))
    BK = feature_tile(run.K, MAX_KEY)
    # chunks of 64 tokens; 16 for per-channel gates, whose decays make [BT, BT, BK] tiles
    gate, BT, g, Tp = chunk_gates(alpha, log_alpha, run.T, BT=64, BT_channel=16)
    ht = run.state()
    delta_rule_fwd_kernel[run.grid](
        run.q, run.k, run.v, as_fp32(beta), g, as_fp32(initial_state), run.o, ht, *run.strides,
        run.T, run.H, Tp, run.K, run.V,
        GATE=gate, BT=BT, BK=BK, BV=run.BV, PRECISION=run.precision,
    )
    return run.o, ht
