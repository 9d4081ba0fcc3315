"""The GPU kernel: the chunkwise delta rule (DeltaNet, Gated DeltaNet, KDA) in Triton.

One program owns one (batch*head, value-block) pair and walks the chunks in order,
keeping its slice of the state S [BV, BK] in registers (fp32). Value columns never mix
in the delta rule (the triangular system acts on tokens, not on value channels), so
splitting V across programs is exact; every program needs all K key channels. For each
chunk of BT tokens it does what ``chunk.chunk_step`` does, with g the log-retention
accumulated from the chunk start (computed on the host, padded with zeros):

    P   = (Q K^T) * e^{g_t - g_j}  (j <= t)         L = (K K^T) * e^{g_t - g_j}  (j < t)
    T   = (I + Diag(beta) L)^{-1}                   in registers, by forward substitution
    U   = T Diag(beta) (V - (K * e^g) S^T)          the corrected values the chunk writes
    o   = (Q * e^g) S^T + P U
    S  <- S Diag(e^{g_n}) + U^T (K * e^{g_n - g})

The triangular solve: the chunk-local inverse T of the unit lower-triangular matrix
I + Diag(beta) L is built inside the kernel (``unit_lower_inverse``), by blocked forward
substitution: the 16 x 16 diagonal blocks are inverted together, one row of every block
per step (row i of T is e_i - sum_{j<i} (beta L)_{ij} T_j, using only finished rows), then
the block rows are filled in order with two small matmuls each. It depends only on the
keys, betas and gates of the chunk, not on the state, and is then applied with one
tl.dot. This is the same T that fla computes in a separate kernel (WY form), done in
place to keep everything in one function; 15 + BT/16 - 1 vectorised steps instead of
BT - 1 also keep the interpreter fast. Padded tokens (t >= T) carry beta = 0 and
k = v = 0, so they write nothing.

Scalar gates keep BT = 64 and apply their decays by scaling rows of the dot products;
per-channel (KDA) gates need the decay inside the k.k and q.k sums, which builds
BT x BT x BK tiles, so that case uses BT = 16. Gates of exactly 1 give g = 0 and gates of
0 are clamped to log = -60 on the host, so every exponent is a non-positive difference.

The kernel is forward only. ``delta_rule(..., backend="triton")`` gets its gradients from
``core.with_chunk_backward``: autograd through the chunk form, recomputed from the saved
inputs. Runs under ``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.chunking import compute_dtype, gate_logs
from ..core.kernels import GATE_CHANNEL, GATE_NONE, GATE_SCALAR, chunk_local_log_gate, gate_mode, precision
from ..core.testing import empty


@triton.jit
def unit_lower_inverse(A, BT: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^{-1} for a strictly lower-triangular [BT, BT] tile A (BT a multiple of SUB).

    Blocked forward substitution. Phase 1 inverts the SUB x SUB diagonal blocks, all of
    them at once: step i finishes row i of every block, T_r = e_r - sum_{j<r} A_rj T_j,
    which reads only rows finished in earlier steps. Phase 2 fills the block rows in order,
    T_b = T_bb (E_b - A_{b,<b} T_{<b}) with T_bb the inverted diagonal block.
    """
    rows = tl.arange(0, BT)
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    block = rows // SUB
    same_block = block[:, None] == block[None, :]
    T_diag = eye
    A_diag = tl.where(same_block, A, 0.0)
    for i in range(1, SUB):
        step = eye - tl.dot(A_diag, T_diag, input_precision=PRECISION)
        T_diag = tl.where((rows % SUB == i)[:, None], step, T_diag)
    Tinv = T_diag
    A_off = tl.where(same_block, 0.0, A)
    for b in range(1, BT // SUB):
        rhs = eye - tl.dot(A_off, Tinv, input_precision=PRECISION)
        Tinv = tl.where((block == b)[:, None], tl.dot(T_diag, rhs, input_precision=PRECISION), Tinv)
    return Tinv


@triton.jit
def delta_rule_fwd_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, h0_ptr, o_ptr, ht_ptr,
    T, Tp, K, V,
    GATE: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)   # int64: B*H*T*K can exceed 2^31
    i_v = tl.program_id(1)
    q_ptr += i_bh * T * K
    k_ptr += i_bh * T * K
    v_ptr += i_bh * T * V
    o_ptr += i_bh * T * V
    beta_ptr += i_bh * T

    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    causal = offs_t[:, None] >= offs_t[None, :]
    strict = offs_t[:, None] > offs_t[None, :]

    S = tl.zeros([BV, BK], dtype=tl.float32)
    state_offs = i_bh * V * K + offs_v[:, None] * K + offs_k[None, :]
    state_mask = mask_v[:, None] & mask_k[None, :]
    if HAS_H0:
        S += tl.load(h0_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)

    for start in range(0, T, BT):
        t = start + offs_t
        mask_t = t < T
        qk_mask = mask_t[:, None] & mask_k[None, :]
        qc = tl.load(q_ptr + t[:, None] * K + offs_k[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        kc = tl.load(k_ptr + t[:, None] * K + offs_k[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        vc = tl.load(v_ptr + t[:, None] * V + offs_v[None, :], mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        bc = tl.load(beta_ptr + t, mask=mask_t, other=0.0).to(tl.float32)

        # P (causal q.k scores), L (strictly lower k.k), and the start state read by q and k
        if GATE == 0:
            P = tl.where(causal, tl.dot(qc, tl.trans(kc), input_precision=PRECISION), 0.0)
            L = tl.where(strict, tl.dot(kc, tl.trans(kc), input_precision=PRECISION), 0.0)
            qS = tl.dot(qc, tl.trans(S), input_precision=PRECISION)
            kS = tl.dot(kc, tl.trans(S), input_precision=PRECISION)
        elif GATE == 1:
            gc = tl.load(g_ptr + i_bh * Tp + t).to(tl.float32)
            decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
            P = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * decay
            L = tl.where(strict, tl.dot(kc, tl.trans(kc), input_precision=PRECISION) * decay, 0.0)
            qS = tl.dot(qc, tl.trans(S), input_precision=PRECISION) * tl.exp(gc)[:, None]
            kS = tl.dot(kc, tl.trans(S), input_precision=PRECISION) * tl.exp(gc)[:, None]
        else:
            g_rows = g_ptr + i_bh * Tp * K + t[:, None] * K + offs_k[None, :]
            gc = tl.load(g_rows, mask=mask_k[None, :], other=0.0).to(tl.float32)
            D = tl.exp(tl.where(causal[:, :, None], gc[:, None, :] - gc[None, :, :], float("-inf")))
            P = tl.sum(qc[:, None, :] * kc[None, :, :] * D, axis=2)
            L = tl.where(strict, tl.sum(kc[:, None, :] * kc[None, :, :] * D, axis=2), 0.0)
            qS = tl.dot(qc * tl.exp(gc), tl.trans(S), input_precision=PRECISION)
            kS = tl.dot(kc * tl.exp(gc), tl.trans(S), input_precision=PRECISION)

        # U = (I + Diag(beta) L)^{-1} Diag(beta) (V - (K e^g) S^T): the values the chunk writes
        Tinv = unit_lower_inverse(bc[:, None] * L, BT, 16, PRECISION)
        U = tl.dot(Tinv, bc[:, None] * (vc - kS), input_precision=PRECISION)
        oc = qS + tl.dot(P, U, input_precision=PRECISION)
        tl.store(o_ptr + t[:, None] * V + offs_v[None, :], oc.to(o_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & mask_v[None, :])

        # S <- S Diag(e^{g_n}) + U^T (K e^{g_n - g}); rows padded up to Tp keep g constant
        if GATE == 0:
            S += tl.dot(tl.trans(U), kc, input_precision=PRECISION)
        elif GATE == 1:
            g_last = tl.load(g_ptr + i_bh * Tp + start + BT - 1).to(tl.float32)
            U_end = U * tl.exp(g_last - gc)[:, None]
            S = S * tl.exp(g_last) + tl.dot(tl.trans(U_end), kc, input_precision=PRECISION)
        else:
            g_last = tl.load(g_ptr + i_bh * Tp * K + (start + BT - 1) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            k_end = kc * tl.exp(g_last[None, :] - gc)
            S = S * tl.exp(g_last)[None, :] + tl.dot(tl.trans(U), k_end, input_precision=PRECISION)

    if STORE_HT:
        tl.store(ht_ptr + state_offs, S, mask=state_mask)


def delta_rule_triton(q, k, v, beta, alpha=None, initial_state=None, log_alpha=None):
    """Triton forward; same arguments and results as ``delta_rule_recurrent`` (and ``log_alpha``)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    if compute_dtype(q) == torch.float64:
        raise TypeError("the Triton kernel takes fp32/fp16/bf16 inputs; use backend='chunk' for fp64")
    logs = gate_logs(alpha, log_alpha, torch.float32)
    gate = gate_mode(logs)
    BT = 16 if gate == GATE_CHANNEL else 64
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(64, triton.next_power_of_2(V)))
    if BK > 256:
        raise ValueError(f"the Triton kernel supports K <= 256, got K={K}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    beta = beta.to(torch.float32).contiguous()
    if logs is None:
        g, Tp = q, T          # unused pointer
    else:
        g, Tp = chunk_local_log_gate(logs, BT)
    h0 = q if initial_state is None else initial_state.to(torch.float32).contiguous()
    o = empty(B, H, T, V, dtype=q.dtype, device=q.device)
    ht = empty(B, H, V, K, dtype=torch.float32, device=q.device)
    grid = (B * H, triton.cdiv(V, BV))
    delta_rule_fwd_kernel[grid](
        q, k, v, beta, g, h0, o, ht, T, Tp, K, V,
        GATE=gate, HAS_H0=initial_state is not None, STORE_HT=True,
        BT=BT, BK=BK, BV=BV, PRECISION=precision(q.dtype),
    )
    return o, ht
