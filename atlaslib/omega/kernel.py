"""The GPU kernel: the chunkwise Omega rule (and SWLA) with a linear memory, in Triton.

One program owns one (batch*head, value-block) pair and walks the chunks in order,
keeping its slice of the memory M [BV, BD] in registers (fp32). Value columns never mix
(the error of value channel r, (M phi(k))_r - v_r, reads only row r of M), so splitting
V across programs is exact; every program needs all D feature channels.

For each chunk of b tokens starting at t0 it computes exactly what ``chunk.window_chunk_step``
computes, the *frozen-gradient* chunk form (so it matches ``omega_chunk`` and
``omega_frozen_seq`` with the same chunk size, not the per-token rule unless b = 1):

    window rows  idx = t0 - c + 1 + [0, b + c - 1)    (reaches c - 1 rows back; rows < 0 are 0)
    Gamma[t, w]  = G[t0 + t, t + c - 1 - w]           the band, gathered from per-offset gates G
    D[t, n]      = e^{g_t - g_n} (n <= t)             g: log-retention accumulated in the chunk
    C            = (D * eta[None, :]) Gamma           [BT, BW]: one tl.dot
    E            = K_idx M^T - V_idx                  errors at the chunk-start memory (SWLA: -V_idx)
    o            = e^{g} * (Q M^T) - ((Q K_idx^T) * C) E
    M           <- e^{g_b} M - (E * C[b, :])^T K_idx

Tiles: BT = max(16, next_pow2(b)) token rows, BW = max(16, next_pow2(b + c - 1)) window
rows, so every tl.dot has sizes >= 16; rows past the chunk or the sequence are masked
to zero (zero gates, eta = 0), so they write nothing. The chunk size is a runtime
argument: any 1 <= b <= 64 (b = 1 wastes 15 of 16 rows; SWLA, exact at every chunk length,
runs chunks of 32 when 64 would not fit an A100's shared memory: wide fp32 features). The host prepares the
per-offset gates G [B, H, T, c] (both gamma parametrisations, zeros for tokens before
the start), eta, and the chunk-local cumulative log-gates g (fp64 for fp32 inputs: each g_t - g_n is
rounded after it is taken, ``core.kernels.gate_sum_dtype``). q, k, v are read through
their strides (a [B, T, H, D] tensor transposed to [B, H, T, D] needs no copy); absent
inputs (no alpha, no eta, no initial state) are ``None`` pointers, which Triton compiles
away. ``core.kernels`` holds the set-up every chapter's kernels share, ``core.memory_kernels``
the start (head, channels, chunk rows) of the per-head kernels.

Precision. fp32 inputs: every tl.dot is exact IEEE fp32 (TF32 only under ``ATLASLIB_TF32=1``). bf16/fp16
inputs: q and the window's keys are tiles of their own dtype, and the memory, the weighted scores and the
errors are rounded to that dtype before their products, so all six run on tensor cores with fp32 sums;
C = D Diag(eta) Gamma is TF32 (``core.kernels.intermediate_precision``). The memory and the errors stay
fp32 (fp16's range: ``core.chunk_kernels``). In the interpreter (which rounds as a card does) at T = 512,
D = V = 64, c = 8, o is off an fp64 run on the same bf16 inputs by 1.7x what rounding o to bf16 costs
(2.9e-3 against 1.7e-3; fp16 2.8x-3.2x), SWLA's by 1.5x (fp16 2.6x-3.3x).

Forward only: ``omega_rule(..., backend="triton")`` gets its gradients from
``core.with_chunk_backward`` (autograd through the chunk form, recomputed from the saved
inputs). Runs under ``TRITON_INTERPRET=1`` on CPU: no autotune, int64 base offsets.
Launched as ``core.memory_kernels.per_head_launch`` says: num_stages=1 (software pipelining of
the chunk loop would multiply the shared memory: 297 KB instead of 115 KB at BT=64, BW=128, BD=64,
over an H100's limit), and 16 warps at BT = 64 (8 below), each thread allowed its share of the
registers (sm_90, c = 8, b = 64, D = V = 64: 2.3 KB spilled a thread, 33 KB at 4 warps).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.chunking import gate_logs
from ..core.kernels import (MAX_HEAD_SPAN, as_fp32, chunk_local_log_gate, decay, dot_tile, feature_tile, forward_launch,
                            intermediate_precision, load_block, load_state, load_tile, narrow_tiles, state_slice,
                            store_tile, value_tile)
from ..core.memory_kernels import chunk_rows, head_value_block, key_channels, per_head_launch, qkvo_at_head
from ..core.windows import window_gates
from ..miras.config import DEFAULT_CHUNK_SIZE  # the Omega rule is a MIRAS model: one default chunk length

# Tile limits. Measured by compiling for sm_90 (H100) with fp32 inputs: the kernel's
# shared memory is 114 KB at BT=64, BW=128, BD=64 with BV = 64 (98 KB with the BV = 32 the
# wrapper picks for BW > 64); 147 KB at (64, 128, 128); 180 KB at (64, 256, 64); but
# 262 KB, over the 227 KB an H100 block may use, at (64, 256, 128) and at BT = BD = 128.
# So: chunks of at most 64 tokens and a window tile of at most 128 x 128 elements
# (BW * BD), e.g. D = 128 with chunk_size + window - 1 <= 128.
MAX_CHUNK = 64
MAX_WINDOW_TILE = 128 * 128
MAX_FEATURES = 256


@triton.jit
def omega_fwd_kernel(
    q_ptr, k_ptr, v_ptr, G_ptr, eta_ptr, g_ptr, h0_ptr, o_ptr, ht_ptr,
    s_q, s_k, s_v, s_o,
    T, H, Tp, D, V, b, c,
    HEBBIAN: tl.constexpr,
    BT: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
    GATE_PRECISION: tl.constexpr,
):
    i_bh, i_b, i_h, o_v, m_v = head_value_block(H, V, BV)        # this program's head and value channels
    q_ptr, k_ptr, v_ptr, o_ptr = qkvo_at_head(q_ptr, k_ptr, v_ptr, o_ptr, s_q, s_k, s_v, s_o, i_b, i_h)
    G_ptr += i_bh * T * c                   # the host's gates, fp32 and contiguous
    o_d, m_d = key_channels(BD, D)
    o_i, m_causal = chunk_rows(BT)                                 # rows of a chunk, n <= t
    o_j = tl.arange(0, BW)                  # rows of its window
    dt = q_ptr.dtype.element_ty             # tl.dot's operand dtype: the inputs' (see the docstring)

    # this program's slice M [BV, BD] of the state, in fp32 (zeros without h0)
    o_s, m_s = state_slice(i_bh, o_v, o_d, V, D)
    b_M = load_state(h0_ptr, o_s, m_s, BV, BD)

    for start in range(0, T, b):
        o_t = start + o_i                                       # the chunk's tokens
        m_t = (o_i < b) & (o_t < T)
        o_w = start - (c - 1) + o_j                             # its window's tokens, may be < 0
        m_w = (o_j < b + c - 1) & (o_w >= 0) & (o_w < T)

        b_q = load_block(q_ptr, s_q, o_t, o_d, m_t, m_d)
        b_kw = load_block(k_ptr, s_k, o_w, o_d, m_w, m_d)       # keys and values of the window
        b_vw = load_tile(v_ptr, s_v, o_w, o_v, m_w, m_v)
        if eta_ptr is not None:
            b_eta = tl.load(eta_ptr + i_bh * T + o_t, mask=m_t, other=0.0)
        else:
            b_eta = tl.where(m_t, 1.0, 0.0)

        # the band Gamma[t, w] = gamma^{(t0+t)} at offset j = t + c - 1 - w
        o_off = o_i[:, None] + (c - 1) - o_j[None, :]
        m_band = m_t[:, None] & m_w[None, :] & (o_off >= 0) & (o_off < c)
        b_gam = tl.load(G_ptr + o_t[:, None] * c + o_off, mask=m_band, other=0.0)

        # decays inside the chunk: D[t, n] = e^{g_t - g_n} (n <= t), A_t = e^{g_t}, A_b / A_n
        if g_ptr is not None:
            b_g = tl.load(g_ptr + i_bh * Tp + o_t, mask=m_t, other=0.0)
            b_g_last = tl.load(g_ptr + i_bh * Tp + start + b - 1)       # padding rows repeat the last
            # rows past the chunk read g = 0: masked, or e^{0 - g_n} overflows there (never stored, but inf * 0)
            b_decay = decay(tl.where(m_causal & m_t[:, None], b_g[:, None] - b_g[None, :], float("-inf")))
            b_A = decay(b_g)
            b_A_end = decay(b_g_last)
            b_to_end = decay(b_g_last - b_g)
        else:
            b_decay = tl.where(m_causal, 1.0, 0.0)
            b_A = tl.full([BT], 1.0, tl.float32)
            b_A_end = 1.0
            b_to_end = tl.full([BT], 1.0, tl.float32)

        b_C = tl.dot(b_decay * b_eta[None, :], b_gam, input_precision=GATE_PRECISION)  # D diag(eta) Gamma
        b_c_end = tl.sum((b_to_end * b_eta)[:, None] * b_gam, axis=0)                  # its last row C[b, :]
        b_Mt = tl.trans(b_M).to(dt)
        if HEBBIAN:
            b_E = -b_vw
        else:
            b_E = tl.dot(b_kw, b_Mt, input_precision=PRECISION) - b_vw                # errors at M_{t0}
        b_scores = tl.dot(b_q, tl.trans(b_kw), input_precision=PRECISION) * b_C
        b_o = tl.dot(b_q, b_Mt, input_precision=PRECISION) * b_A[:, None] \
            - tl.dot(b_scores.to(dt), b_E.to(dt), input_precision=PRECISION)
        store_tile(o_ptr, s_o, o_t, o_v, m_t, m_v, b_o)
        b_step = tl.dot(tl.trans(b_E * b_c_end[:, None]).to(dt), b_kw, input_precision=PRECISION)
        b_M = b_M * b_A_end - b_step

    tl.store(ht_ptr + o_s, b_M, mask=m_s)


def kernel_supports(D: int, window: int, chunk_size: int) -> bool:
    """Whether the kernel's tiles fit (see the limits above); ``backend="auto"`` falls back to chunk otherwise."""
    BW, BD = dot_tile(chunk_size + window - 1), dot_tile(D)
    return chunk_size <= MAX_CHUNK and D <= MAX_FEATURES and BW * BD <= MAX_WINDOW_TILE


def windowed_triton(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None,
                    chunk_size=64, hebbian=False, log_alpha=None):
    """Triton forward of the chunk form; same arguments and results as ``chunk.windowed_chunk``."""
    b, c = chunk_size, window
    if q.shape[2] * c >= MAX_HEAD_SPAN:                  # the gates [B*H, T, c] are read with 32-bit offsets
        raise ValueError(f"the Triton kernel indexes a head's window gates with 32-bit offsets: T * window must be "
                         f"below 2^31, got T={q.shape[2]}, window={c}; use backend='chunk'")
    BW = dot_tile(b + c - 1)
    # wide windows hold two [BW, BD] and two [BW, BV] tiles per chunk, and so do wide fp32 features:
    # narrower value blocks (more programs) keep them within shared memory on the GPU (sm_80 AOT
    # builds at BW = 64, D = 256, fp32: 192 KB at BV = 64, 160 KB at 32)
    # (budgets for fp32 tiles, whatever the inputs' dtype: 16-bit inputs take less)
    wide_rows = dot_tile(q.shape[-1]) * 4 > 512
    if hebbian and wide_rows and b > 32:
        # SWLA's chunk form is exact for every chunk length, so the kernel may use shorter chunks:
        # at b = 64, c = 1, D = 256 fp32 it needs 184 KB (164 KB at BV = 16), over an A100's 163 KB
        b = 32
        BW = dot_tile(b + c - 1)
    if hebbian and b > 16 and narrow_tiles(q) and (BW > 64 or dot_tile(q.shape[-1]) >= 128):
        # a card with less shared memory than an A100 (``core.kernels.narrow_tiles``; 99 KB): sm_86 fp32
        # builds need 104 KB at b = 64, c = 8, D = 64 and 112 KB at b = 64, c = 1, D = 128, and 29-84 KB at
        # b = 16 up to D = 256, c = 8. The Omega rule's chunk length is part of the model: it cannot shorten
        # its chunks, and where its tiles do not fit, the chunk form runs instead (``core.dispatch``)
        b = 16
        BW = dot_tile(b + c - 1)
    run = forward_launch(q, k, v, BV=value_tile(v.shape[-1], 32 if BW > 64 or wide_rows else 64))
    B, H, T, D = run.B, run.H, run.T, run.K
    if b > MAX_CHUNK:
        raise ValueError(f"the Triton kernel supports chunk_size <= {MAX_CHUNK}, got {b}; use backend='chunk'")
    BD = dot_tile(D)
    if D <= MAX_FEATURES and BW * BD > MAX_WINDOW_TILE:
        raise ValueError(f"the Triton kernel holds a [{BW}, {BD}] window tile (chunk_size + window - 1 = "
                         f"{b + c - 1} rows, D = {D}), more than {MAX_WINDOW_TILE} elements; use a smaller "
                         f"chunk_size (or window), or backend='chunk'")
    feature_tile(D, MAX_FEATURES, "D")        # refuses D > MAX_FEATURES
    G = window_gates(gamma, B, H, T, c, torch.float32, q.device).contiguous()
    logs = gate_logs(alpha, log_alpha, torch.float32)
    g, Tp = (None, T) if logs is None else chunk_local_log_gate(logs, b, q.dtype)
    ht = run.state()
    omega_fwd_kernel[run.grid](
        run.q, run.k, run.v, G, as_fp32(eta), g, as_fp32(initial_state), run.o, ht, *run.strides,
        T, H, Tp, D, run.V, b, c,
        HEBBIAN=hebbian, BT=dot_tile(b), BW=BW, BD=BD, BV=run.BV, PRECISION=run.precision,
        GATE_PRECISION=intermediate_precision(q.dtype),
        **per_head_launch(dot_tile(b)),
    )
    return run.o, ht


def omega_triton(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None,
                 chunk_size=DEFAULT_CHUNK_SIZE, log_alpha=None):
    """Triton forward of the frozen-gradient Omega chunk form (matches ``chunk.omega_chunk``)."""
    return windowed_triton(q, k, v, window, gamma, alpha, eta, initial_state, chunk_size, False, log_alpha)


def swla_triton(q, k, v, window, gamma=None, alpha=None, eta=None, initial_state=None, chunk_size=64,
                log_alpha=None):
    """Triton forward of SWLA (matches ``chunk.swla_chunk`` and ``recurrent.swla_recurrent``)."""
    return windowed_triton(q, k, v, window, gamma, alpha, eta, initial_state, chunk_size, True, log_alpha)
