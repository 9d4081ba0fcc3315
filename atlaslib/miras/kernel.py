"""The GPU kernel: the chunkwise Titans step with a linear memory (TTT-Linear as a special case), in Triton.

The model (book ch. 3 §6, §8 and §9). A linear memory M [V, K]
with momentum S [V, K] learns online on the l2 loss 1/2 ||M k - v||^2; in chunks of b
tokens every gradient is frozen at the chunk-start state M_{t0} (the state after the
previous chunk), which makes everything downstream of the gradients linear:

    e_t = M_{t0} k_t - v_t                      (error at the chunk start)
    S_t = theta_t S_{t-1} - eta_t e_t k_t^T     (momentum: theta its decay, eta the step)
    M_t = alpha_t M_{t-1} + S_t                 (alpha: retention)
    y_t = M_t q_t                               (readout after the token's update)

At b = 1 this is per-token Titans; with theta = 0 (no momentum) and alpha = 1 it is
TTT-Linear, which is the delta rule with beta = eta. For b > 1 it equals the
frozen-gradient sequential oracle for every b, and the per-token model only at b = 1.

Closed form inside one chunk (derived here; local indices t = 1..n, n <= b). Let
A_t = alpha_1 ... alpha_t and B_t = theta_1 ... theta_t (empty products = 1), and
u_i = eta_i e_i k_i^T. The momentum recursion is linear with inputs u_i that no longer
depend on the state, so unrolling it gives

    S_n = B_n S_{t0} - sum_{i<=n} (B_n / B_i) u_i .

The memory recursion M_t = alpha_t M_{t-1} + S_t unrolls to M_t = A_t M_{t0} +
sum_{n<=t} (A_t / A_n) S_n; substituting S_n and swapping the two sums,

    M_t = A_t M_{t0} + s_t S_{t0} - sum_{i<=t} W[t, i] u_i,
    s_t = sum_{n<=t} (A_t / A_n) B_n,
    W   = D_alpha D_theta,  D_alpha[t, n] = A_t / A_n (n <= t),  D_theta[n, i] = B_n / B_i (i <= n),

since sum_{i<=n<=t} (A_t/A_n)(B_n/B_i) is entry (t, i) of the product of the two
lower-triangular ratio matrices. Reading out with q_t turns u_i into a scalar times e_i:

    y_t = A_t M_{t0} q_t + s_t S_{t0} q_t - sum_{i<=t} W[t, i] eta_i (k_i . q_t) e_i,

and the states handed to the next chunk are the rows t = n of the same formulas:

    M_{t0+n} = A_n M_{t0} + s_n S_{t0} - sum_i W[n, i] eta_i e_i k_i^T
    S_{t0+n} = B_n S_{t0} - sum_i (B_n / B_i) eta_i e_i k_i^T .

In matrices, for one chunk with rows Q, K [n, K], V [n, V] and E = K M_{t0}^T - V:

    U      = Diag(eta) E
    Y      = Diag(A) Q M^T + Diag(s) Q S^T - ((Q K^T) * W) U
    M     <- A_n M + s_n S - (Diag(W[n, :]) U)^T K
    S     <- B_n S - (Diag(B_n / B) U)^T K

so a chunk is eight tl.dot's (K M^T, Q M^T, Q S^T, Q K^T, D_alpha D_theta, (QK^T * W) U and
the two state updates); without momentum (theta = None, i.e. theta = 0) B_t = 0 for
t >= 1, D_theta = I, W = D_alpha, s = 0, and the momentum is just the last token's step.

Ratios without division. A_t / A_n is never formed by dividing cumulative products
(A_t underflows in long chunks, and a gate of exactly 0 makes it 0/0). The kernel keeps,
for each gate and each row, l_t = sum of log(gate) over the nonzero gates so far and
z_t = the number of zero gates so far (both from the chunk start). Then

    A_t / A_n = e^{l_t - l_n} if z_t = z_n (no zero gate in (n, t]), else exactly 0,

and the exponent is taken only where the pair is causal and zero-free, masked to -inf
elsewhere, so theta = 0 or alpha = 0 (a full reset) gives exact zeros and never a NaN.
Only differences l_t - l_n <= 0 are exponentiated, so nothing overflows.

Layout. One program owns one (batch*head, value-block) pair and walks the chunks in
order, holding its slices of M and S [BV, BK] in registers in fp32. Value channels never
mix (row r of the error, (M k)_r - v_r, reads only row r of M, and both recursions act
on rows independently), so splitting V across programs is exact; every program needs
all K key channels. Tiles: BT = max(16, next_pow2(b)) token rows, BK = max(16,
next_pow2(K)), BV = min(64, next_pow2(V)) (32 at BK = 128, 16 at BK = 256: ``tile_sizes``), so every tl.dot has sizes
>= 16; rows past the chunk or the sequence load zeros, eta = 0 and gates = 1, so they
write nothing. The chunk size is a runtime argument (any 1 <= b <= 64; b = 1 wastes 15
of 16 rows).

Precision. fp32 inputs: every tl.dot is exact IEEE fp32 (TF32 only when ``ATLASLIB_TF32=1`` asks
for it). bf16/fp16 inputs: q and k are tiles of their own dtype and every other operand of a
tl.dot (the states M and S, the steps U, the weighted scores) is rounded to that dtype first, so all
eight products run on tensor cores with fp32 accumulation; the decay product D_alpha D_theta is TF32
(``core.kernels.intermediate_precision``). The states themselves, the errors and every sum stay fp32
(fp16's range: ``core.chunk_kernels``).
In the interpreter (which rounds as a card does) at T = 4096, K = V = 64, chunks of 16 and 64, this
adds about as much error as rounding the output to bf16 does (relative RMS of o against an fp64 run
on the same bf16 inputs: 2.9e-3, of which 1.7e-3 is o's own rounding; M_T 1.7e-3) and it does not
grow with T.

q, k, v are read through their strides (a [B, T, H, K] tensor transposed to [B, H, T, K]
needs no copy); absent gates and start states are ``None`` pointers, which Triton compiles
away. ``core.kernels`` holds the set-up every chapter's kernels share, ``core.memory_kernels``
the start (head, channels, chunk rows) of the per-head kernels.

Forward only: ``miras(..., backend="triton")`` gets gradients by
``core.with_chunk_backward`` (autograd through the chunk form). Runs under
``TRITON_INTERPRET=1`` on CPU: no autotune, int64 base offsets. Launched as
``core.memory_kernels.per_head_launch`` says: num_stages=1 (software pipelining of the chunk loop
would multiply the shared memory: 330 KB instead of 176 KB at BT = 64, BK = 256, BV = 32 with fp32
inputs), and 16 warps at BT = 64 (8 below), each thread allowed its share of the registers.
The retention reaches the kernel as log alpha (-inf for a gate of 0): a ``log_alpha`` is used as
given, so decays closer to 1 than fp32 resolves (|log alpha| < 6e-8) still count.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..core.kernels import (as_fp32, dot_tile, feature_tile, forward_launch, intermediate_precision, load_block,
                            load_state, load_tile, state_slice, store_tile, value_tile)
from ..core.memory_kernels import chunk_rows, head_value_block, key_channels, per_head_launch, qkvo_at_head
from ..core.validation import check_chunk_size, check_gate, check_one_retention, check_qkv, check_state
from .config import DEFAULT_CHUNK_SIZE

# Tile limits, measured by compiling for sm_90 (H100) on a machine without a GPU
# (triton.compile with GPUTarget("cuda", 90, 32), num_stages=1, BT = 64, all gates and
# both states on). Shared memory per program: fp32 inputs 64 KB at (BK, BV) = (64, 64),
# 96 KB at (128, 32), 176 KB at (256, 32); 16-bit inputs take less (48, 72 and 120 KB), and the
# same tiles. An H100 block may use at most 227 KB; (256, 64) would take 208-224 KB, too close.
# BV = 32 beyond BK = 64 also halves the register-held states: ptxas still spills at these
# tiles (at BT = 64, K = V = 64, 4.1-4.2 KB a thread with ``per_head_launch``'s 16 warps for
# fp32 inputs, 1.3-1.7 KB for bf16; none at BT = 16 on sm_90). Speed has not been measured on
# a GPU. So: chunks of at most 64 tokens, keys of at most 256 channels, any V.
MAX_CHUNK = 64
MAX_KEY = 256


@triton.jit
def chunk_cumsum_of_logs(b_lx, m_causal):
    """For log-gates log x [BT] (padding rows hold 0; -inf is a gate of exactly 0):
    l_t = sum_{j<=t, x_j>0} log x_j and z_t = #{j <= t: x_j = 0}."""
    m_zero = b_lx == float("-inf")
    b_log = tl.where(m_zero, 0.0, b_lx)
    b_flag = tl.where(m_zero, 1.0, 0.0)
    b_l = tl.sum(tl.where(m_causal, b_log[None, :], 0.0), axis=1)
    b_z = tl.sum(tl.where(m_causal, b_flag[None, :], 0.0), axis=1)
    return b_l, b_z, tl.sum(b_log, axis=0), tl.sum(b_flag, axis=0)


@triton.jit
def chunk_log_cumsum(b_x, m_causal):
    """``chunk_cumsum_of_logs`` for gates x [BT] (padding rows hold 1)."""
    m_zero = b_x <= 0.0
    return chunk_cumsum_of_logs(tl.where(m_zero, float("-inf"), tl.log(tl.where(m_zero, 1.0, b_x))), m_causal)


@triton.jit
def decay_ratios(b_l, b_z, m_causal):
    """D[t, n] = prod_{n < j <= t} x_j for n <= t, else 0: e^{l_t - l_n} when no zero gate lies in (n, t]."""
    m_keep = m_causal & (b_z[:, None] == b_z[None, :])
    return tl.exp(tl.where(m_keep, b_l[:, None] - b_l[None, :], float("-inf")))


@triton.jit
def titans_linear_fwd_kernel(
    q_ptr, k_ptr, v_ptr, log_alpha_ptr, eta_ptr, theta_ptr, m0_ptr, s0_ptr, o_ptr, mt_ptr, st_ptr,
    s_q, s_k, s_v, s_o,
    T, H, K, V, b,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
    DECAY_PRECISION: tl.constexpr,
):
    i_bh, i_b, i_h, o_v, m_v = head_value_block(H, V, BV)        # this program's head and value channels
    q_ptr, k_ptr, v_ptr, o_ptr = qkvo_at_head(q_ptr, k_ptr, v_ptr, o_ptr, s_q, s_k, s_v, s_o, i_b, i_h)
    o_k, m_k = key_channels(BK, K)
    o_i, m_causal = chunk_rows(BT)                                 # rows of a chunk, n <= t
    dt = q_ptr.dtype.element_ty             # tl.dot's operand dtype: the inputs' (see the docstring)

    # this program's slices of the memory M and the momentum S, [BV, BK] each, in fp32
    o_s, m_s = state_slice(i_bh, o_v, o_k, V, K)
    b_M = load_state(m0_ptr, o_s, m_s, BV, BK)            # zeros without M_0
    b_S = load_state(s0_ptr, o_s, m_s, BV, BK)            # zeros without S_0

    for start in range(0, T, b):
        o_t = start + o_i                                          # the chunk's tokens
        m_t = (o_i < b) & (o_t < T)
        o_last = tl.minimum(b, T - start) - 1                      # its last row
        b_q = load_block(q_ptr, s_q, o_t, o_k, m_t, m_k)
        b_k = load_block(k_ptr, s_k, o_t, o_k, m_t, m_k)
        b_v = load_tile(v_ptr, s_v, o_t, o_v, m_t, m_v)
        if eta_ptr is not None:
            b_eta = tl.load(eta_ptr + i_bh * T + o_t, mask=m_t, other=0.0)
        else:
            b_eta = tl.where(m_t, 1.0, 0.0)

        # retention: D_alpha[t, n] = A_t / A_n, A_t (from the chunk start), to_end[n] = A_last / A_n
        if log_alpha_ptr is not None:
            # the retention as a log (-inf: a gate of 0), never rounded through exp in fp32
            b_log_alpha = tl.load(log_alpha_ptr + i_bh * T + o_t, mask=m_t, other=0.0)
            b_lA, b_zA, b_lA_end, b_zA_end = chunk_cumsum_of_logs(b_log_alpha, m_causal)
            b_DA = decay_ratios(b_lA, b_zA, m_causal)
            b_A = tl.where(b_zA == 0.0, tl.exp(b_lA), 0.0)
            b_A_end = tl.where(b_zA_end == 0.0, tl.exp(b_lA_end), 0.0)
            b_to_end = tl.where(m_t & (b_zA == b_zA_end), tl.exp(tl.minimum(b_lA_end - b_lA, 0.0)), 0.0)
        else:
            b_DA = tl.where(m_causal, 1.0, 0.0)
            b_A = tl.full([BT], 1.0, tl.float32)
            b_A_end = 1.0
            b_to_end = tl.where(m_t, 1.0, 0.0)

        # errors at the chunk-start state and the scaled steps U = Diag(eta) E
        b_Mt = tl.trans(b_M).to(dt)
        b_E = tl.dot(b_k, b_Mt, input_precision=PRECISION) - b_v
        b_U = b_E * b_eta[:, None]
        b_scores = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
        b_o = tl.dot(b_q, b_Mt, input_precision=PRECISION) * b_A[:, None]

        if theta_ptr is not None:
            # momentum: D_theta[n, i] = B_n / B_i, B_n, mom_end[i] = B_last / B_i
            b_theta = tl.load(theta_ptr + i_bh * T + o_t, mask=m_t, other=1.0)
            b_lB, b_zB, b_lB_end, b_zB_end = chunk_log_cumsum(b_theta, m_causal)
            b_DB = decay_ratios(b_lB, b_zB, m_causal)
            b_B = tl.where(m_t & (b_zB == 0.0), tl.exp(b_lB), 0.0)
            b_B_end = tl.where(b_zB_end == 0.0, tl.exp(b_lB_end), 0.0)
            b_mom_end = tl.where(m_t & (b_zB == b_zB_end), tl.exp(tl.minimum(b_lB_end - b_lB, 0.0)), 0.0)
            b_W = tl.dot(b_DA, b_DB, input_precision=DECAY_PRECISION)   # W[t, i] = sum_n A_t/A_n B_n/B_i
            b_c = tl.sum(b_DA * b_B[None, :], axis=1)                   # s_t = sum_n A_t/A_n B_n
            b_w_end = tl.sum(b_to_end[:, None] * b_DB, axis=0)          # the last row W[last, :]
            b_c_end = tl.sum(b_to_end * b_B, axis=0)
            b_o += tl.dot(b_q, tl.trans(b_S).to(dt), input_precision=PRECISION) * b_c[:, None]
        else:
            # theta = 0: B_n = 0 for n >= 1, D_theta = I, so W = D_alpha and S is the last token's step
            b_W = b_DA
            b_w_end = b_to_end
            b_mom_end = tl.where(o_i == o_last, 1.0, 0.0)

        b_o -= tl.dot((b_scores * b_W).to(dt), b_U.to(dt), input_precision=PRECISION)
        store_tile(o_ptr, s_o, o_t, o_v, m_t, m_v, b_o)

        b_M_step = tl.dot(tl.trans(b_U * b_w_end[:, None]).to(dt), b_k, input_precision=PRECISION)
        b_S_step = tl.dot(tl.trans(b_U * b_mom_end[:, None]).to(dt), b_k, input_precision=PRECISION)
        if theta_ptr is not None:
            b_M = b_M * b_A_end + b_S * b_c_end - b_M_step
            b_S = b_S * b_B_end - b_S_step
        else:
            b_M = b_M * b_A_end - b_M_step
            b_S = -b_S_step

    tl.store(mt_ptr + o_s, b_M, mask=m_s)
    tl.store(st_ptr + o_s, b_S, mask=m_s)


def tile_sizes(K: int, V: int, chunk_size: int, element_size: int = 4) -> tuple[int, int, int]:
    """(BT, BK, BV): token rows, key channels and value channels of one program's tiles."""
    BK = dot_tile(K)
    # see the tile limits above; fp32 rows of 256 keys at BT = 64 need BV = 16 on an A100
    # (sm_80 AOT builds: 176 KB at BV = 32, 160 KB at 16)
    widest = 64 if BK <= 64 else 32 if BK * element_size <= 512 else 16
    return dot_tile(chunk_size), BK, value_tile(V, widest)


def kernel_supports(K: int, V: int, chunk_size: int) -> bool:
    """Whether the kernel's tiles fit (chunk_size <= 64, K <= 256; any V, split across programs).

    A library's ``backend="auto"`` can fall back to the chunk form where this is False.
    """
    return 1 <= chunk_size <= MAX_CHUNK and 1 <= K <= MAX_KEY and V >= 1


def titans_linear_triton(q, k, v, alpha=None, eta=None, theta=None, initial_state=None, initial_momentum=None,
                         chunk_size=DEFAULT_CHUNK_SIZE, log_alpha=None):
    """Triton forward of the chunkwise Titans step with a linear memory (gradients frozen per chunk).

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V] (fp32, fp16 or bf16, one dtype; views are read in place).
        alpha: [B, H, T] retention in [0, 1], or None (alpha = 1: keep everything).
        eta: [B, H, T] inner learning rate >= 0, or None (eta = 1).
        theta: [B, H, T] momentum decay in [0, 1], or None (theta = 0: no momentum, TTT-Linear).
        initial_state: M_0 [B, H, V, K] or None (zeros).
        initial_momentum: S_0 [B, H, V, K] or None (zeros).
        chunk_size: b, 1 <= b <= 64; every gradient of a chunk is taken at the chunk-start state
            (default: the chapter's ``DEFAULT_CHUNK_SIZE``, as ``titans_linear_chunk`` and ``miras``).
        log_alpha: [B, H, T] fp32/fp64 log of the retention (<= 0; -inf: a gate of 0) in place of
            alpha: the kernel takes the retention as a log, so a log given is used as it is (an alpha
            is turned into its log first; decays within fp32's resolution of 1 survive only as logs).

    Returns:
        (o [B, H, T, V] in q's dtype, M_T [B, H, V, K] fp32, S_T [B, H, V, K] fp32).
        Equal to the frozen-gradient sequential loop for every chunk size, and to per-token
        Titans (momentum + decay, l2 loss 1/2 ||M k - v||^2) at chunk_size = 1.
    """
    B, H, T, K, V = check_qkv(q, k, v)
    chunk_size = check_chunk_size(chunk_size)
    BT, BK, BV = tile_sizes(K, V, chunk_size)          # the fp32 budget, for every input dtype
    run = forward_launch(q, k, v, BV, name="titans_linear_triton")
    if chunk_size > MAX_CHUNK:
        raise ValueError(f"titans_linear_triton supports chunk_size <= {MAX_CHUNK} (a chunk is one [BT, BT] "
                         f"tile), got {chunk_size}; use a smaller chunk_size or backend='chunk'")
    feature_tile(K, MAX_KEY)                  # refuses K > MAX_KEY
    # shapes, devices and NaN here (and log_alpha's range, since -inf is valid there); other value
    # ranges are the entry point's job
    check_one_retention(alpha, log_alpha)
    alpha, eta, theta = (as_fp32(check_state(name, x, (B, H, T), q))
                         for name, x in (("alpha", alpha), ("eta", eta), ("theta", theta)))
    # -inf (a gate of 0) is a valid log
    log_alpha = as_fp32(check_gate("log_alpha", log_alpha, B, H, T, low=-math.inf, high=0.0, ref=q))
    if alpha is not None:
        log_alpha = torch.log(alpha)                      # a gate of 0 becomes -inf: a reset
    m0 = as_fp32(check_state("initial_state", initial_state, (B, H, V, K), q))
    s0 = as_fp32(check_state("initial_momentum", initial_momentum, (B, H, V, K), q))
    M_T, S_T = run.state(), run.state()
    titans_linear_fwd_kernel[run.grid](
        run.q, run.k, run.v, log_alpha, eta, theta, m0, s0, run.o, M_T, S_T, *run.strides,
        T, H, K, V, chunk_size,
        BT=BT, BK=BK, BV=BV, PRECISION=run.precision, DECAY_PRECISION=intermediate_precision(q.dtype),
        **per_head_launch(BT),
    )
    return run.o, M_T, S_T


__all__ = ["titans_linear_triton", "kernel_supports", "tile_sizes", "MAX_CHUNK", "MAX_KEY"]
