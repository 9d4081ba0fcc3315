"""The GPU kernel: the chunkwise Omega rule (and SWLA) with a linear memory, in Triton.

One program owns one (batch*head, value-block) pair and walks the chunks in order,
keeping its slice of the state S [BV, BD] in registers (fp32). Value columns never mix
(the error of value channel r, (S phi(k))_r - v_r, reads only row r of S), so splitting
V across programs is exact; every program needs all D feature channels.

For each chunk of b tokens starting at t0 it computes exactly what ``chunk.chunk_step``
computes, the *frozen-gradient* chunk form (so it matches ``omega_chunk`` and
``omega_frozen_seq`` with the same chunk size, not the per-token rule unless b = 1):

    window rows  idx = t0 - c + 1 + [0, b + c - 1)    (reaches c - 1 rows back; rows < 0 are 0)
    Gamma[t, w]  = G[t0 + t, t + c - 1 - w]           the band, gathered from per-offset gates G
    D[t, n]      = e^{g_t - g_n} (n <= t)             g: log-retention accumulated in the chunk
    C            = (D * eta[None, :]) Gamma           [BT, BW]: one tl.dot
    E            = K_idx S^T - V_idx                  errors at the chunk-start state (SWLA: -V_idx)
    o            = e^{g} * (Q S^T) - ((Q K_idx^T) * C) E
    S           <- e^{g_b} S - (E * C[b, :])^T K_idx

Tiles: BT = max(16, next_pow2(b)) token rows, BW = max(16, next_pow2(b + c - 1)) window
rows, so every tl.dot has sizes >= 16; rows past the chunk or the sequence are masked
to zero (zero gates, eta = 0), so they write nothing. The chunk size is a runtime
argument: any b >= 1 works (b = 1 wastes 15 of 16 rows). The host prepares the
per-offset gates G [B, H, T, c] (both gamma parametrisations, zeros for tokens before
the start), eta, and the chunk-local cumulative log-gates g.

Forward only: ``omega_rule(..., backend="triton")`` gets its gradients from
``core.with_chunk_backward`` (autograd through the chunk form, recomputed from the saved
inputs). Runs under ``TRITON_INTERPRET=1`` on CPU: no autotune, int64 base offsets.
Launched with num_stages=1: software pipelining of the chunk loop would multiply the
shared memory (297 KB instead of 115 KB at BT=64, BW=128, BD=64, over an H100's limit).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.chunking import compute_dtype, gate_logs
from ..core.kernels import chunk_local_log_gate, precision
from ..core.testing import empty
from ..core.windows import window_gates

# Tile limits. Measured by compiling for sm_90 (H100) with fp32 inputs: the kernel's
# shared memory is 114 KB at BT=64, BW=128, BD=64; 147 KB at (64, 128, 128); 180 KB at
# (64, 256, 64); but 262 KB, over the 227 KB an H100 block may use, at (64, 256, 128) and
# at BT = BD = 128. So: chunks of at most 64 tokens and a window tile of at most
# 128 x 128 elements (BW * BD), e.g. D = 128 with chunk_size + window - 1 <= 128.
MAX_CHUNK = 64
MAX_WINDOW_TILE = 128 * 128
MAX_FEATURES = 256


@triton.jit
def omega_fwd_kernel(
    q_ptr, k_ptr, v_ptr, G_ptr, eta_ptr, g_ptr, h0_ptr, o_ptr, ht_ptr,
    T, Tp, D, V, b, c,
    HAS_ALPHA: tl.constexpr, HAS_H0: tl.constexpr, HEBBIAN: tl.constexpr,
    BT: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)   # int64: B*H*T*D can exceed 2^31
    i_v = tl.program_id(1)
    q_ptr += i_bh * T * D
    k_ptr += i_bh * T * D
    v_ptr += i_bh * T * V
    o_ptr += i_bh * T * V
    G_ptr += i_bh * T * c
    eta_ptr += i_bh * T
    g_ptr += i_bh * Tp                     # chunk-local log-gates, padded to Tp rows

    offs_t = tl.arange(0, BT)
    offs_w = tl.arange(0, BW)
    offs_d = tl.arange(0, BD)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_d = offs_d < D
    mask_v = offs_v < V
    causal = offs_t[:, None] >= offs_t[None, :]

    S = tl.zeros([BV, BD], dtype=tl.float32)
    state_offs = i_bh * V * D + offs_v[:, None] * D + offs_d[None, :]
    state_mask = mask_v[:, None] & mask_d[None, :]
    if HAS_H0:
        S += tl.load(h0_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)

    for start in range(0, T, b):
        t = start + offs_t
        valid_t = (offs_t < b) & (t < T)                       # token rows of this chunk
        w = start - (c - 1) + offs_w                            # window rows, may be < 0
        valid_w = (offs_w < b + c - 1) & (w >= 0) & (w < T)

        qc = tl.load(q_ptr + t[:, None] * D + offs_d[None, :], mask=valid_t[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        kw = tl.load(k_ptr + w[:, None] * D + offs_d[None, :], mask=valid_w[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        vw = tl.load(v_ptr + w[:, None] * V + offs_v[None, :], mask=valid_w[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        etac = tl.load(eta_ptr + t, mask=valid_t, other=0.0).to(tl.float32)

        # the band Gamma[t, w] = gamma^{(t0+t)} at offset j = t + c - 1 - w
        j = offs_t[:, None] + (c - 1) - offs_w[None, :]
        band = valid_t[:, None] & valid_w[None, :] & (j >= 0) & (j < c)
        gam = tl.load(G_ptr + t[:, None] * c + j, mask=band, other=0.0).to(tl.float32)

        # decays inside the chunk: D[t, n] = e^{g_t - g_n} (n <= t), A_t = e^{g_t}, A_b / A_n
        if HAS_ALPHA:
            gc = tl.load(g_ptr + t, mask=valid_t, other=0.0).to(tl.float32)
            g_last = tl.load(g_ptr + start + b - 1).to(tl.float32)       # padding rows repeat the last
            decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
            a_t = tl.exp(gc)
            a_end = tl.exp(g_last)
            to_end = tl.exp(g_last - gc)
        else:
            decay = tl.where(causal, 1.0, 0.0)
            a_t = tl.full([BT], 1.0, tl.float32)
            a_end = 1.0
            to_end = tl.full([BT], 1.0, tl.float32)

        C = tl.dot(decay * etac[None, :], gam, input_precision=PRECISION)           # D diag(eta) Gamma
        c_end = tl.sum((to_end * etac)[:, None] * gam, axis=0)                      # its last row C[b, :]
        if HEBBIAN:
            E = -vw
        else:
            E = tl.dot(kw, tl.trans(S), input_precision=PRECISION) - vw              # errors at M_{t0}
        scores = tl.dot(qc, tl.trans(kw), input_precision=PRECISION) * C
        oc = tl.dot(qc, tl.trans(S), input_precision=PRECISION) * a_t[:, None] \
            - tl.dot(scores, E, input_precision=PRECISION)
        tl.store(o_ptr + t[:, None] * V + offs_v[None, :], oc.to(o_ptr.dtype.element_ty),
                 mask=valid_t[:, None] & mask_v[None, :])
        S = S * a_end - tl.dot(tl.trans(E * c_end[:, None]), kw, input_precision=PRECISION)

    tl.store(ht_ptr + state_offs, S, mask=state_mask)


def kernel_supports(D: int, window: int, chunk_size: int) -> bool:
    """Whether the kernel's tiles fit (see the limits above); ``backend="auto"`` falls back to chunk otherwise."""
    BW = max(16, triton.next_power_of_2(chunk_size + window - 1))
    BD = max(16, triton.next_power_of_2(D))
    return chunk_size <= MAX_CHUNK and D <= MAX_FEATURES and BW * BD <= MAX_WINDOW_TILE


def windowed_triton(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None,
                    chunk_size=64, hebbian=False, log_alpha=None):
    """Triton forward of the chunk form; same arguments and results as ``chunk.windowed_chunk``."""
    B, H, T, D = q.shape
    V = v.shape[-1]
    if compute_dtype(q) == torch.float64:
        raise TypeError("the Triton kernel takes fp32/fp16/bf16 inputs; use backend='chunk' for fp64")
    b, c = chunk_size, window
    BT = max(16, triton.next_power_of_2(b))
    BW = max(16, triton.next_power_of_2(b + c - 1))
    BD = max(16, triton.next_power_of_2(D))
    # wide windows hold two [BW, BD] and two [BW, BV] tiles per chunk: narrower value blocks
    # (more programs) keep them within shared memory on the GPU
    BV = max(16, min(64 if BW <= 64 else 32, triton.next_power_of_2(V)))
    if b > MAX_CHUNK:
        raise ValueError(f"the Triton kernel supports chunk_size <= {MAX_CHUNK}, got {b}; use backend='chunk'")
    if D <= MAX_FEATURES and BW * BD > MAX_WINDOW_TILE:
        raise ValueError(f"the Triton kernel holds a [{BW}, {BD}] window tile (chunk_size + window - 1 = "
                         f"{b + c - 1} rows, D = {D}), more than {MAX_WINDOW_TILE} elements; use a smaller "
                         f"chunk_size (or window), or backend='chunk'")
    if D > MAX_FEATURES:
        raise ValueError(f"the Triton kernel supports feature dimensions D <= {MAX_FEATURES}, got D={D}; "
                         f"use backend='chunk'")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    G = window_gates(gamma, B, H, T, c, torch.float32, q.device).contiguous()
    eta = torch.ones(B, H, T, dtype=torch.float32, device=q.device) if eta is None else eta.to(torch.float32).contiguous()
    logs = gate_logs(alpha, log_alpha, torch.float32)
    g, Tp = (eta, T) if logs is None else chunk_local_log_gate(logs, b)   # unused pointer without alpha
    h0 = q if initial_state is None else initial_state.to(torch.float32).contiguous()
    o = empty(B, H, T, V, dtype=q.dtype, device=q.device)
    ht = empty(B, H, V, D, dtype=torch.float32, device=q.device)
    grid = (B * H, triton.cdiv(V, BV))
    omega_fwd_kernel[grid](
        q, k, v, G, eta, g, h0, o, ht, T, Tp, D, V, b, c,
        HAS_ALPHA=logs is not None, HAS_H0=initial_state is not None, HEBBIAN=hebbian,
        BT=BT, BW=BW, BD=BD, BV=BV, PRECISION=precision(q.dtype), num_stages=1,
    )
    return o, ht


def omega_triton(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None, chunk_size=64,
                 log_alpha=None):
    """Triton forward of the frozen-gradient Omega chunk form (matches ``chunk.omega_chunk``)."""
    return windowed_triton(q, k, v, window, gamma, alpha, eta, initial_state, chunk_size, False, log_alpha)


def swla_triton(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None, chunk_size=64,
                log_alpha=None):
    """Triton forward of SWLA (matches ``chunk.swla_chunk`` and ``recurrent.swla_recurrent``)."""
    return windowed_triton(q, k, v, window, gamma, alpha, eta, initial_state, chunk_size, True, log_alpha)
