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

    M_t = A_t M_{t0} + c_t S_{t0} - sum_{i<=t} W[t, i] u_i,
    c_t = sum_{n<=t} (A_t / A_n) B_n,
    W   = D_A D_B,  D_A[t, n] = A_t / A_n (n <= t),  D_B[n, i] = B_n / B_i (i <= n),

since sum_{i<=n<=t} (A_t/A_n)(B_n/B_i) is entry (t, i) of the product of the two
lower-triangular ratio matrices. Reading out with q_t turns u_i into a scalar times e_i:

    y_t = A_t M_{t0} q_t + c_t S_{t0} q_t - sum_{i<=t} W[t, i] eta_i (k_i . q_t) e_i,

and the states handed to the next chunk are the rows t = n of the same formulas:

    M_{t0+n} = A_n M_{t0} + c_n S_{t0} - sum_i W[n, i] eta_i e_i k_i^T
    S_{t0+n} = B_n S_{t0} - sum_i (B_n / B_i) eta_i e_i k_i^T .

In matrices, for one chunk with rows Q, K [n, K], V [n, V] and E = K M_{t0}^T - V:

    U      = Diag(eta) E
    Y      = Diag(A) Q M^T + Diag(c) Q S^T - ((Q K^T) * W) U
    M     <- A_n M + c_n S - (Diag(W[n, :]) U)^T K
    S     <- B_n S - (Diag(B_n / B) U)^T K

so a chunk is eight tl.dot's (K M^T, Q M^T, Q S^T, Q K^T, D_A D_B, (QK^T * W) U and
the two state updates); without momentum (theta = None, i.e. theta = 0) B_t = 0 for
t >= 1, D_B = I, W = D_A, c = 0, and the momentum is just the last token's step.

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
next_pow2(K)), BV = min(64, next_pow2(V)) (32 when BK > 64), so every tl.dot has sizes
>= 16; rows past the chunk or the sequence load zeros, eta = 0 and gates = 1, so they
write nothing. The chunk size is a runtime argument (any 1 <= b <= 64; b = 1 wastes 15
of 16 rows). fp32/fp16/bf16 inputs, fp32 accumulation (tl.dot in IEEE fp32 for fp32
inputs, TF32 for half-precision inputs, and always IEEE for the decay product D_A D_B).

Forward only: ``miras(..., backend="triton")`` gets gradients by
``core.with_chunk_backward`` (autograd through the chunk form). Runs under
``TRITON_INTERPRET=1`` on CPU: no autotune, int64 base offsets. Launched with
num_stages=1: software pipelining of the chunk loop would multiply the shared memory
(measured: 330 KB instead of 176 KB at BT = 64, BK = 256, BV = 32 with fp32 inputs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.kernels import precision
from ..core.testing import empty
from ..core.validation import check_chunk_size, check_qkv

# Tile limits, measured by compiling for sm_90 (H100) on a machine without a GPU
# (triton.compile with GPUTarget("cuda", 90, 32), num_stages=1, BT = 64, all gates and
# both states on). Shared memory per program: fp32 inputs 64 KB at (BK, BV) = (64, 64),
# 96 KB at (128, 32), 176 KB at (256, 32); bf16/fp16 inputs 80, 72 and 120 KB. An H100
# block may use at most 227 KB; (256, 64) would take 208-224 KB, too close. BV = 32
# beyond BK = 64 also halves the register-held states: ptxas already spills at these
# tiles (about 4 KB of stack per thread with half-precision inputs at (64, 64); the IEEE
# fp32 path, FMA-based, spills far more, as the Omega kernel's does). Speed has not been
# measured on a GPU. So: chunks of at most 64 tokens, keys of at most 256 channels, any V.
MAX_CHUNK = 64
MAX_KEY = 256


@triton.jit
def chunk_log_cumsum(x, causal):
    """For gates x [BT] (padding rows hold 1): l_t = sum_{j<=t, x_j>0} log x_j and z_t = #{j <= t: x_j = 0}."""
    zero = x <= 0.0
    logs = tl.where(zero, 0.0, tl.log(tl.where(zero, 1.0, x)))
    flags = tl.where(zero, 1.0, 0.0)
    l_cum = tl.sum(tl.where(causal, logs[None, :], 0.0), axis=1)
    z_cum = tl.sum(tl.where(causal, flags[None, :], 0.0), axis=1)
    return l_cum, z_cum, tl.sum(logs, axis=0), tl.sum(flags, axis=0)


@triton.jit
def decay_ratios(l_cum, z_cum, causal):
    """D[t, n] = prod_{n < j <= t} x_j for n <= t, else 0: e^{l_t - l_n} when no zero gate lies in (n, t]."""
    keep = causal & (z_cum[:, None] == z_cum[None, :])
    return tl.exp(tl.where(keep, l_cum[:, None] - l_cum[None, :], float("-inf")))


@triton.jit
def titans_linear_fwd_kernel(
    q_ptr, k_ptr, v_ptr, alpha_ptr, eta_ptr, theta_ptr, m0_ptr, s0_ptr, o_ptr, mt_ptr, st_ptr,
    T, K, V, b,
    HAS_ALPHA: tl.constexpr, HAS_ETA: tl.constexpr, HAS_THETA: tl.constexpr,
    HAS_M0: tl.constexpr, HAS_S0: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    i_bh = tl.program_id(0).to(tl.int64)   # int64: B*H*T*K can exceed 2^31
    i_v = tl.program_id(1)
    q_ptr += i_bh * T * K
    k_ptr += i_bh * T * K
    v_ptr += i_bh * T * V
    o_ptr += i_bh * T * V
    alpha_ptr += i_bh * T
    eta_ptr += i_bh * T
    theta_ptr += i_bh * T

    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    causal = offs_t[:, None] >= offs_t[None, :]

    state_offs = i_bh * V * K + offs_v[:, None] * K + offs_k[None, :]
    state_mask = mask_v[:, None] & mask_k[None, :]
    M = tl.zeros([BV, BK], dtype=tl.float32)
    S = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_M0:
        M += tl.load(m0_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    if HAS_S0:
        S += tl.load(s0_ptr + state_offs, mask=state_mask, other=0.0).to(tl.float32)

    for start in range(0, T, b):
        t = start + offs_t
        valid_t = (offs_t < b) & (t < T)                          # token rows of this chunk
        last = tl.minimum(b, T - start) - 1                        # its last row
        qc = tl.load(q_ptr + t[:, None] * K + offs_k[None, :], mask=valid_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        kc = tl.load(k_ptr + t[:, None] * K + offs_k[None, :], mask=valid_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        vc = tl.load(v_ptr + t[:, None] * V + offs_v[None, :], mask=valid_t[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        if HAS_ETA:
            etac = tl.load(eta_ptr + t, mask=valid_t, other=0.0).to(tl.float32)
        else:
            etac = tl.where(valid_t, 1.0, 0.0)

        # retention: D_A[t, n] = A_t / A_n, A_t (from the chunk start), to_end[n] = A_last / A_n
        if HAS_ALPHA:
            ac = tl.load(alpha_ptr + t, mask=valid_t, other=1.0).to(tl.float32)
            lA, zA, lA_end, zA_end = chunk_log_cumsum(ac, causal)
            DA = decay_ratios(lA, zA, causal)
            a_t = tl.where(zA == 0.0, tl.exp(lA), 0.0)
            a_end = tl.where(zA_end == 0.0, tl.exp(lA_end), 0.0)
            to_end = tl.where(valid_t & (zA == zA_end), tl.exp(tl.minimum(lA_end - lA, 0.0)), 0.0)
        else:
            DA = tl.where(causal, 1.0, 0.0)
            a_t = tl.full([BT], 1.0, tl.float32)
            a_end = 1.0
            to_end = tl.where(valid_t, 1.0, 0.0)

        # errors at the chunk-start state and the scaled steps U = Diag(eta) E
        E = tl.dot(kc, tl.trans(M), input_precision=PRECISION) - vc
        U = E * etac[:, None]
        scores = tl.dot(qc, tl.trans(kc), input_precision=PRECISION)
        oc = tl.dot(qc, tl.trans(M), input_precision=PRECISION) * a_t[:, None]

        if HAS_THETA:
            # momentum: D_B[n, i] = B_n / B_i, B_n, mom_end[i] = B_last / B_i
            th = tl.load(theta_ptr + t, mask=valid_t, other=1.0).to(tl.float32)
            lB, zB, lB_end, zB_end = chunk_log_cumsum(th, causal)
            DB = decay_ratios(lB, zB, causal)
            b_n = tl.where(valid_t & (zB == 0.0), tl.exp(lB), 0.0)
            b_end = tl.where(zB_end == 0.0, tl.exp(lB_end), 0.0)
            mom_end = tl.where(valid_t & (zB == zB_end), tl.exp(tl.minimum(lB_end - lB, 0.0)), 0.0)
            W = tl.dot(DA, DB, input_precision="ieee")                  # W[t, i] = sum_n A_t/A_n B_n/B_i
            c_t = tl.sum(DA * b_n[None, :], axis=1)                     # c_t = sum_n A_t/A_n B_n
            w_end = tl.sum(to_end[:, None] * DB, axis=0)                # the last row W[last, :]
            c_end = tl.sum(to_end * b_n, axis=0)
            oc += tl.dot(qc, tl.trans(S), input_precision=PRECISION) * c_t[:, None]
        else:
            # theta = 0: B_n = 0 for n >= 1, D_B = I, so W = D_A and S is the last token's step
            W = DA
            w_end = to_end
            mom_end = tl.where(offs_t == last, 1.0, 0.0)

        oc -= tl.dot(scores * W, U, input_precision=PRECISION)
        tl.store(o_ptr + t[:, None] * V + offs_v[None, :], oc.to(o_ptr.dtype.element_ty),
                 mask=valid_t[:, None] & mask_v[None, :])

        M_step = tl.dot(tl.trans(U * w_end[:, None]), kc, input_precision=PRECISION)
        S_step = tl.dot(tl.trans(U * mom_end[:, None]), kc, input_precision=PRECISION)
        if HAS_THETA:
            M = M * a_end + S * c_end - M_step
            S = S * b_end - S_step
        else:
            M = M * a_end - M_step
            S = -S_step

    tl.store(mt_ptr + state_offs, M, mask=state_mask)
    tl.store(st_ptr + state_offs, S, mask=state_mask)


def tile_sizes(K: int, V: int, chunk_size: int) -> tuple[int, int, int]:
    """(BT, BK, BV): token rows, key channels and value channels of one program's tiles."""
    BT = max(16, triton.next_power_of_2(chunk_size))
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(64 if BK <= 64 else 32, triton.next_power_of_2(V)))   # see the tile limits above
    return BT, BK, BV


def kernel_supports(K: int, V: int, chunk_size: int) -> bool:
    """Whether the kernel's tiles fit (chunk_size <= 64, K <= 256; any V, split across programs).

    A library's ``backend="auto"`` can fall back to the chunk form where this is False.
    """
    return 1 <= chunk_size <= MAX_CHUNK and 1 <= K <= MAX_KEY and V >= 1


def _check_optional(name: str, x, shape: tuple, ref: torch.Tensor):
    """Shape and device of an optional gate or state (value ranges are the entry point's job)."""
    if x is None:
        return None
    want = "[" + ", ".join(str(s) for s in shape) + "]"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {want} or None, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {want}, got [{', '.join(str(s) for s in x.shape)}]")
    if x.device != ref.device:
        raise ValueError(f"{name} must be on {ref.device} like q, got {x.device}")
    return x.to(torch.float32).contiguous()


def titans_linear_triton(q, k, v, alpha=None, eta=None, theta=None, initial_state=None, initial_momentum=None,
                         chunk_size=64):
    """Triton forward of the chunkwise Titans step with a linear memory (gradients frozen per chunk).

    Args:
        q, k: [B, H, T, K]; v: [B, H, T, V] (fp32, fp16 or bf16, one dtype).
        alpha: [B, H, T] retention in [0, 1], or None (alpha = 1: keep everything).
        eta: [B, H, T] inner learning rate >= 0, or None (eta = 1).
        theta: [B, H, T] momentum decay in [0, 1], or None (theta = 0: no momentum, TTT-Linear).
        initial_state: M_0 [B, H, V, K] or None (zeros).
        initial_momentum: S_0 [B, H, V, K] or None (zeros).
        chunk_size: b, 1 <= b <= 64; every gradient of a chunk is taken at the chunk-start state.

    Returns:
        (o [B, H, T, V] in q's dtype, M_T [B, H, V, K] fp32, S_T [B, H, V, K] fp32).
        Equal to the frozen-gradient sequential loop for every chunk size, and to per-token
        Titans (momentum + decay, l2 loss 1/2 ||M k - v||^2) at chunk_size = 1.
    """
    B, H, T, K, V = check_qkv(q, k, v)
    if q.dtype == torch.float64:
        raise TypeError("titans_linear_triton takes fp32/fp16/bf16 inputs (it accumulates in fp32); "
                        "got float64: use the chunk form (backend='chunk') for fp64")
    chunk_size = check_chunk_size(chunk_size)
    if chunk_size > MAX_CHUNK:
        raise ValueError(f"titans_linear_triton supports chunk_size <= {MAX_CHUNK} (a chunk is one [BT, BT] "
                         f"tile), got {chunk_size}; use a smaller chunk_size or backend='chunk'")
    if K > MAX_KEY:
        raise ValueError(f"titans_linear_triton supports key dimensions K <= {MAX_KEY} (every program holds "
                         f"all K channels of M and S), got K={K}; use backend='chunk'")
    alpha = _check_optional("alpha", alpha, (B, H, T), q)
    eta = _check_optional("eta", eta, (B, H, T), q)
    theta = _check_optional("theta", theta, (B, H, T), q)
    m0 = _check_optional("initial_state", initial_state, (B, H, V, K), q)
    s0 = _check_optional("initial_momentum", initial_momentum, (B, H, V, K), q)

    BT, BK, BV = tile_sizes(K, V, chunk_size)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = empty(B, H, T, V, dtype=q.dtype, device=q.device)
    M_T = empty(B, H, V, K, dtype=torch.float32, device=q.device)
    S_T = empty(B, H, V, K, dtype=torch.float32, device=q.device)
    unused = M_T                                                   # a pointer the kernel never reads
    grid = (B * H, triton.cdiv(V, BV))
    titans_linear_fwd_kernel[grid](
        q, k, v,
        unused if alpha is None else alpha, unused if eta is None else eta, unused if theta is None else theta,
        unused if m0 is None else m0, unused if s0 is None else s0,
        o, M_T, S_T, T, K, V, chunk_size,
        HAS_ALPHA=alpha is not None, HAS_ETA=eta is not None, HAS_THETA=theta is not None,
        HAS_M0=m0 is not None, HAS_S0=s0 is not None,
        BT=BT, BK=BK, BV=BV, PRECISION=precision(q.dtype), num_stages=1,
    )
    return o, M_T, S_T


__all__ = ["titans_linear_triton", "kernel_supports", "tile_sizes", "MAX_CHUNK", "MAX_KEY"]
