"""The algorithm: the chunkwise delta rule via the UT (WY) transform, exact for every chunk size.

Take one chunk of n tokens that starts from state S (the state after the previous chunk)
and let g_t = sum_{j<=t} log alpha_j be the log-retention accumulated from the chunk
start (a scalar per token, or a K-vector for KDA; g = 0 for DeltaNet). Unrolling the
recurrence inside the chunk, every state is the decayed start state plus a sum of rank-1
writes u_j k_j^T, where u_j = beta_j (v_j - M'_j k_j) is the *corrected* value that
token j writes:

    M_t = S Diag(e^{g_t}) + sum_{j<=t} u_j (k_j * e^{g_t - g_j})^T .

Reading M'_t = M_{t-1} Diag(alpha_t) off this sum turns the definition of u_t into a
unit lower-triangular linear system for all u's of the chunk at once:

    (I + Diag(beta) L) U = Diag(beta) (V - (K * e^g) S^T),
    L[t, j] = sum_c k_tc k_jc e^{g_tc - g_jc}   for j < t   (0 on and above the diagonal),

solved here with ``torch.linalg.solve_triangular`` (forward substitution). Then

    Y  = (Q * e^g) S^T + P U,            P[t, j] = sum_c q_tc k_jc e^{g_tc - g_jc}  (j <= t)
    S' = S Diag(e^{g_n}) + U^T (K * e^{g_n - g}) .

Stability: only differences g_t - g_j with j <= t are exponentiated (and e^{g_t} itself),
so every decay factor lies in [0, 1]; nothing is ever divided by a cumulative product of
gates, which would overflow as soon as the gates are small (MATH.md §2 warns about the
division in the textbook form). For KDA the per-channel decay sits inside the k.k and q.k
sums, which builds an [n, n, K] tile as ``atlaslib.linear.chunk`` does for GLA.
"""
from __future__ import annotations

import torch

from ..linear.chunk import causal_decay, log_gate
from ..linear.recurrent import compute_dtype


def decayed_products(q, k, g):
    """Everything the gates touch in one chunk.

    Returns (P, L, q_dec, k_dec, k_end, s_dec): P [B,H,n,n] the causal decayed q.k scores,
    L [B,H,n,n] the strictly lower decayed k.k products, q * e^g, k * e^g, k * e^{g_n - g},
    and the factor e^{g_n} (None, [B,H,1,1] or [B,H,1,K]) that multiplies the start state.
    """
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if g is None:                                                    # DeltaNet: no decay at all
        P = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0.0)
        L = (k @ k.transpose(-1, -2)).tril(-1)
        return P, L, q, k, k, None
    if g.dim() == 3:                                                 # scalar gates [B, H, n]
        D = causal_decay(g, causal)                                  # e^{g_t - g_j}, j <= t
        P = (q @ k.transpose(-1, -2)) * D
        L = ((k @ k.transpose(-1, -2)) * D).tril(-1)
        e_g, e_end = torch.exp(g)[..., None], torch.exp(g[..., -1:, None] - g[..., None])
        return P, L, q * e_g, k * e_g, k * e_end, torch.exp(g[..., -1:, None])
    D = causal_decay(g, causal)                                      # per channel: [B, H, n, n, K]
    P = torch.einsum("bhtc,bhjc,bhtjc->bhtj", q, k, D)
    L = torch.einsum("bhtc,bhjc,bhtjc->bhtj", k, k, D).tril(-1)
    e_g, e_end = torch.exp(g), torch.exp(g[..., -1:, :] - g)
    return P, L, q * e_g, k * e_g, k * e_end, torch.exp(g[..., -1:, :])


def chunk_step(S, q, k, v, beta, g):
    """One chunk. S: [B,H,V,K]; q,k: [B,H,n,K]; v: [B,H,n,V]; beta: [B,H,n]; g: None, [B,H,n] or [B,H,n,K].

    Returns (o [B,H,n,V], S at the chunk's end).
    """
    n = q.shape[2]
    P, L, q_dec, k_dec, k_end, s_dec = decayed_products(q, k, g)
    b = beta[..., None]
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    system = eye + b * L                                             # I + Diag(beta) L, unit lower-triangular
    rhs = b * (v - k_dec @ S.transpose(-1, -2))                      # Diag(beta) (V - (K e^g) S^T)
    U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = q_dec @ S.transpose(-1, -2) + P @ U
    S_start = S if s_dec is None else S * s_dec
    return o, S_start + U.transpose(-1, -2) @ k_end


def delta_rule_chunk(q, k, v, beta, alpha=None, initial_state=None, chunk_size=64):
    """Chunkwise form; same arguments and results as ``delta_rule_recurrent``."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v, beta = q.to(cd), k.to(cd), v.to(cd), beta.to(cd)
    S = torch.zeros(B, H, V, K, dtype=cd, device=q.device) if initial_state is None else initial_state.to(cd)
    logs = None if alpha is None else log_gate(alpha, cd)
    outputs = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        g = None if logs is None else logs[:, :, s:e].cumsum(dim=2)
        o, S = chunk_step(S, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], beta[:, :, s:e], g)
        outputs.append(o)
    return torch.cat(outputs, dim=2).to(out_dtype), S
