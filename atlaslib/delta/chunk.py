"""The algorithm: the chunkwise delta rule via the UT (WY) transform, exact for every chunk size.

Take one chunk of n tokens t = 1..n that starts from the memory M_0 (the state after the
previous chunk) and let g_t = sum_{j<=t} log alpha_j be the log-retention accumulated from the chunk
start (a scalar per token, or a K-vector for KDA; g = 0 for DeltaNet). Unrolling the
recurrence inside the chunk, every state is the decayed start memory plus a sum of rank-1
writes u_j k_j^T, where u_j = beta_j (v_j - M'_j k_j) is the *corrected* value that
token j writes:

    M_t = M_0 Diag(e^{g_t}) + sum_{j<=t} u_j (k_j * e^{g_t - g_j})^T .

Reading M'_t = M_{t-1} Diag(alpha_t) off this sum turns the definition of u_t into a
unit lower-triangular linear system for all u's of the chunk at once:

    (I + Diag(beta) L) U = Diag(beta) (V - (K * e^g) M_0^T),
    L[t, j] = sum_c k_tc k_jc e^{g_tc - g_jc}   for j < t   (0 on and above the diagonal),

solved by forward substitution (``torch.linalg.solve_triangular``). Then

    Y   = (Q * e^g) M_0^T + P U,           P[t, j] = sum_c q_tc k_jc e^{g_tc - g_jc}  (j <= t)
    M_n = M_0 Diag(e^{g_n}) + U^T (K * e^{g_n - g}) .

Stability: with scalar gates only differences g_t - g_j with j <= t are exponentiated (and
e^{g_t} itself), so every decay factor lies in [0, 1]; nothing is ever divided by a
cumulative product of gates, which would overflow as soon as the gates are small (book ch. 2 §7
warns about the division in the textbook form). For KDA the per-channel decay sits inside
the k.k and q.k sums; chapter 1's ``decayed_scores`` scores them by halving the chunk, with
every factor <= 1 whatever the gates (scalar gates: the masked [n, n] matrix of e^{g_t - g_j}).

Everything but the start memory is solved ahead, for a group of chunks at once: with
the system matrix I + Diag(beta) L, the UT transform's R = (I + Diag(beta) L)^{-1} (one triangular
solve against I) and Rb = R Diag(beta), the WY pair W = Rb (K e^g), U0 = Rb V gives U = U0 - W M_0^T, so only four
small matrix products per chunk run in sequence:

    U = U0 - W M_0^T,   Y = (Q e^g) M_0^T + P U,   M_n = M_0 e^{g_n} + U^T (K e^{g_n - g}).
"""
from __future__ import annotations

import torch

from ..core.chunking import chunk_run, compute_dtype, cumulative_logs, start_memory, gate_logs, to_chunks
from ..core.validation import check_chunk_size, check_form_shapes
from ..linear.chunk import decayed_scores


def decayed_products(q, k, g):
    """Everything the gates touch, for one chunk or for all chunks at once.

    q, k: [..., n, K]; g: None, [..., n] (scalar) or [..., n, K] (per channel), the log-gates
    accumulated from the chunk start. Returns (P, L, q_dec, k_dec, k_end, m_dec): P [..., n, n]
    the causal decayed q.k scores, L [..., n, n] the strictly lower decayed k.k products,
    q * e^g, k * e^g, k * e^{g_n - g}, and the factor e^{g_n} (None, [..., 1, 1] or [..., 1, K])
    that multiplies the start memory. Queries and keys are scored against the keys together
    by chapter 1's ``decayed_scores``, which computes the gate factors once for both.
    """
    (P, KK), (q_dec, k_dec), k_end, m_dec = decayed_scores((q, k), k, g)
    return P, KK.tril_(-1), q_dec, k_dec, k_end, m_dec


def chunk_step(M, q, k, v, beta, g):
    """One chunk. M: [B,H,V,K], the memory at the chunk's start; q,k: [B,H,n,K]; v: [B,H,n,V];
    beta: [B,H,n]; g: None, [B,H,n] or [B,H,n,K].

    Returns (o [B,H,n,V], the memory at the chunk's end).
    """
    n = q.shape[2]
    P, L, q_dec, k_dec, k_end, m_dec = decayed_products(q, k, g)
    beta = beta[..., None]
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    system = eye + beta * L                                          # I + Diag(beta) L, unit lower-triangular
    rhs = beta * (v - k_dec @ M.mT)                                  # Diag(beta) (V - (K e^g) M_0^T)
    U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = q_dec @ M.mT + P @ U
    M_decayed = M if m_dec is None else M * m_dec
    return o, M_decayed + U.mT @ k_end


# Chunks whose state-independent work is done together: enough to batch the small matrix
# products, few enough that the group's tensors stay in cache (measured on a 2-core CPU).
GROUP = 8


def chunk_group(M, q, k, v, beta, g, outputs):
    """A run of G chunks of b tokens from the start memory M [BH,V,K]: q, k [G,BH,b,K];
    v [G,BH,b,V]; beta [G,BH,b,1]; g None, [G,BH,b] or [G,BH,b,K] (chunk-major, as ``chunk_run``
    gives them). Appends each chunk's output [BH,b,V] to ``outputs`` and returns the memory
    after the run.

    P, L, the gated q and k, Rb = (I + Diag(beta) L)^{-1} Diag(beta) and the WY pair W = Rb (K e^g), U0 = Rb V of all
    G chunks come first, in one batch; then only four small matrix products per chunk run in sequence.
    """
    b = q.shape[2]
    P, L, q_dec, k_dec, k_end, m_dec = decayed_products(q, k, g)
    system = torch.eye(b, dtype=q.dtype, device=q.device) + beta * L   # I + Diag(beta) L
    # Its inverse by one triangular solve against I (fewer right-hand sides than [K e^g | V], and
    # then two batched products): the UT transform's R; Rb = R Diag(beta), the kernel's b_Rb
    # (the DeltaNet paper's T, a name kept here for the sequence length).
    Rb = torch.linalg.solve_triangular(system, torch.eye(b, dtype=q.dtype, device=q.device).expand_as(system),
                                       upper=False, unitriangular=True) * beta.mT
    W, U0 = Rb @ k_dec, Rb @ v
    # Chunks taken by unbind, not by indexing: the backward stacks their gradients once instead
    # of zero-filling a copy of the whole group per chunk and tensor.
    decays = [None] * q.shape[0] if m_dec is None else m_dec.unbind(0)
    for U0_c, W_c, P_c, q_c, k_c, d_c in zip(U0.unbind(0), W.unbind(0), P.unbind(0), q_dec.unbind(0),
                                             k_end.unbind(0), decays):
        Mt = M.mT
        U = torch.baddbmm(U0_c, W_c, Mt, alpha=-1)                            # U = U0 - W M^T
        outputs.append((P_c @ U).baddbmm_(q_c, Mt))                           # Y = P U + Q_dec M^T
        # M_next = M e^{g_b} + U^T (K e^{g_b - g}); accumulating in place into the fresh product
        # M e^{g_b} saves a copy and is safe for autograd (the product's backward needs M, not it).
        M = torch.baddbmm(M, U.mT, k_c) if d_c is None else (M * d_c).baddbmm_(U.mT, k_c)
    return M


def delta_rule_chunk(q, k, v, beta, alpha=None, initial_state=None, chunk_size=64, log_alpha=None):
    """Chunkwise form; same arguments and results as ``delta_rule_recurrent``.

    The gates may instead be given as ``log_alpha`` (same shape), used without rounding.
    Shapes and chunk_size are checked here; value ranges are the caller's (``delta_rule`` checks them).

    T is padded to whole chunks with zero rows, beta 0 and log-gates 0, which write nothing.
    Does what a loop of ``chunk_step`` does, with the state-independent work (P, L, the gated
    q, k and the WY pair) hoisted out of the loop and batched over GROUP chunks at a time.
    """
    B, H, T, K, V = check_form_shapes(q, k, v, beta=beta, alpha=alpha, log_alpha=log_alpha,
                                      per_channel=("alpha", "log_alpha"), required=("beta",))
    check_chunk_size(chunk_size)
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v, beta = q.to(cd), k.to(cd), v.to(cd), beta.to(cd)
    M = start_memory(q, v, initial_state)
    if T == 0:
        return v.to(out_dtype), M
    b = min(chunk_size, T)
    rows = [to_chunks(x, b) for x in (q, k, v, beta[..., None])]   # padding: zero rows and beta 0 write nothing,
    logs = gate_logs(alpha, log_alpha, cd)
    gates = None if logs is None else to_chunks(logs, b)            # and log-gates 0 keep everything
    M = M.reshape(B * H, V, K)
    outputs = []
    # The runs are cut once (split): slicing x[:, s:s + GROUP] per run would zero-fill a gradient of the
    # whole input per run and tensor in the backward, O(T^2 / (GROUP b)).
    runs = [x.split(GROUP, dim=1) for x in rows]
    gate_runs = [None] * len(runs[0]) if gates is None else gates.split(GROUP, dim=1)
    for *run, gr in zip(*runs, gate_runs):
        # Each run is copied chunk-major just before it is used: the copies are small, still in
        # cache when read, and recycled by the allocator from run to run.
        qg, kg, vg, betag = (chunk_run(x, 0, GROUP) for x in run)
        g = None if gr is None else cumulative_logs(chunk_run(gr, 0, GROUP), dim=2)   # fp64
        M = chunk_group(M, qg, kg, vg, betag, g, outputs)
    o = torch.stack(outputs, dim=1).reshape(B, H, -1, V)[:, :, :T]                # stacked straight into [B*H, N, b, V]
    return o.to(out_dtype), M.reshape(B, H, V, K)
