"""The GPU kernel: chunkwise linear attention (plain, scalar-gated, per-channel-gated) in Triton.

One program owns one (batch*head, value-block) pair and walks the chunks in order,
keeping its slice of the state S [BV, BK] in registers (fp32). For each chunk of BT
tokens it does exactly what ``chunk.chunk_step`` does:

    o   = (q * e^g) S^T + (scores * D) v        D[t,i] = e^{g_t - g_i} for i <= t
    S  <- S * e^{g_last} + (v * e^{g_last - g})^T k

where g is the log-gate accumulated from the chunk start (computed on the host).
Scalar gates give a BT x BT decay matrix; per-channel gates need the decay inside the
q.k sum, so that case builds a BT x BT x BK tile and uses a smaller BT = 16.

The kernel is forward only. ``linear_attention(..., backend="triton")`` gets its
gradients from ``core.with_chunk_backward``: autograd through the chunk form,
recomputed from the saved inputs. Runs under ``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.chunking import compute_dtype, gate_logs
from ..core.kernels import GATE_CHANNEL, GATE_NONE, GATE_SCALAR, chunk_local_log_gate, gate_mode, precision
from ..core.testing import empty


@triton.jit
def linear_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, h0_ptr, o_ptr, ht_ptr,
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

    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    causal = offs_t[:, None] >= offs_t[None, :]

    S = tl.zeros([BV, BK], dtype=tl.float32)
    state_offs = i_bh * V * K + offs_v[:, None] * K + offs_k[None, :]
    state_mask = mask_v[:, None] & mask_k[None, :]
    if HAS_H0:
        S += tl.load(h0_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)

    for start in range(0, T, BT):
        t = start + offs_t
        mask_t = t < T
        qc = tl.load(q_ptr + t[:, None] * K + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        kc = tl.load(k_ptr + t[:, None] * K + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        vc = tl.load(v_ptr + t[:, None] * V + offs_v[None, :], mask=mask_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        if GATE == 0:
            scores = tl.where(causal, tl.dot(qc, tl.trans(kc), input_precision=PRECISION), 0.0)
            oc = tl.dot(qc, tl.trans(S), input_precision=PRECISION) + tl.dot(scores, vc, input_precision=PRECISION)
            S += tl.dot(tl.trans(vc), kc, input_precision=PRECISION)
        elif GATE == 1:
            # g is padded to Tp (a multiple of BT) with log-gate 0, so row start+BT-1 exists
            gc = tl.load(g_ptr + i_bh * Tp + start + offs_t).to(tl.float32)
            g_last = tl.load(g_ptr + i_bh * Tp + start + BT - 1).to(tl.float32)
            decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
            scores = tl.dot(qc, tl.trans(kc), input_precision=PRECISION) * decay
            oc = tl.dot(qc, tl.trans(S), input_precision=PRECISION) * tl.exp(gc)[:, None] \
                + tl.dot(scores, vc, input_precision=PRECISION)
            v_decayed = vc * tl.exp(g_last - gc)[:, None]
            S = S * tl.exp(g_last) + tl.dot(tl.trans(v_decayed), kc, input_precision=PRECISION)
        else:
            g_rows = g_ptr + i_bh * Tp * K + (start + offs_t)[:, None] * K + offs_k[None, :]
            gc = tl.load(g_rows, mask=mask_k[None, :], other=0.0).to(tl.float32)
            g_last = tl.load(g_ptr + i_bh * Tp * K + (start + BT - 1) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            diff = tl.where(causal[:, :, None], gc[:, None, :] - gc[None, :, :], float("-inf"))
            scores = tl.sum(qc[:, None, :] * kc[None, :, :] * tl.exp(diff), axis=2)
            oc = tl.dot(qc * tl.exp(gc), tl.trans(S), input_precision=PRECISION) \
                + tl.dot(scores, vc, input_precision=PRECISION)
            k_decayed = kc * tl.exp(g_last[None, :] - gc)
            S = S * tl.exp(g_last)[None, :] + tl.dot(tl.trans(vc), k_decayed, input_precision=PRECISION)
        tl.store(o_ptr + t[:, None] * V + offs_v[None, :], oc.to(o_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & mask_v[None, :])

    if STORE_HT:
        tl.store(ht_ptr + state_offs, S, mask=state_mask)


def linear_attention_triton(q, k, v, alpha=None, initial_state=None, log_alpha=None):
    """Triton forward; same arguments and results as ``linear_attention_recurrent`` (and ``log_alpha``)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    cd = compute_dtype(q)
    if cd == torch.float64:
        raise TypeError("the Triton kernel takes fp32/fp16/bf16 inputs; use backend='chunk' for fp64")
    logs = gate_logs(alpha, log_alpha, torch.float32)
    gate = gate_mode(logs)
    BT = 16 if gate == GATE_CHANNEL else 64
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(64, triton.next_power_of_2(V)))
    if BK > 256:
        raise ValueError(f"the Triton kernel supports K <= 256, got K={K}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if logs is None:
        g, Tp = q, T          # unused pointer
    else:
        g, Tp = chunk_local_log_gate(logs, BT)
    h0 = q if initial_state is None else initial_state.to(torch.float32).contiguous()
    o = empty(B, H, T, V, dtype=q.dtype, device=q.device)
    ht = empty(B, H, V, K, dtype=torch.float32, device=q.device)
    grid = (B * H, triton.cdiv(V, BV))
    linear_attention_fwd_kernel[grid](
        q, k, v, g, h0, o, ht, T, Tp, K, V,
        GATE=gate, HAS_H0=initial_state is not None, STORE_HT=True,
        BT=BT, BK=BK, BV=BV, PRECISION=precision(q.dtype),
    )
    return o, ht
