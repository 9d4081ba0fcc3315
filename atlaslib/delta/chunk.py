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
sums. ``decayed_products`` builds the exact [n, n, K] tile as ``atlaslib.linear.chunk`` does
for GLA; ``delta_rule_chunk`` instead splits the sums at sub-chunk boundaries (only the
diagonal sub-blocks need the tile, see ``batched_decayed_products``) and batches a few
chunks at a time: with A = I + Diag(beta) L, everything but the start state is solved
ahead, W = A^{-1} Diag(beta) (K e^g) and U0 = A^{-1} Diag(beta) V, so U = U0 - W S^T and
only the state recurrence runs chunk by chunk.
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


# Sub-chunk length for the per-channel (KDA) products: only the diagonal SUB x SUB blocks
# of a chunk need the exact [SUB, SUB, K] decay tile.
SUB = 16


def batched_decayed_products(q, k, g):
    """``decayed_products`` for all chunks at once: q, k [B,H,N,C,K]; g None, [B,H,N,C] or [B,H,N,C,K].

    Same six results with the chunk axis N in front of the chunk's rows. For per-channel
    gates the sums over c of x_tc y_jc e^{g_tc - g_jc} are split at sub-chunk boundaries:
    for sub-chunks I > J they equal (X_I e^{g_I - r_I}) (Y_J e^{r_I - g_J})^T with r_I the
    log-gate just before sub-chunk I (both exponents <= 0); only the diagonal sub-blocks
    build the exact [SUB, SUB, K] tile.
    """
    C = q.shape[3]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if g is None:                                                    # DeltaNet: no decay at all
        P = (q @ k.mT).masked_fill(~causal, 0.0)
        L = (k @ k.mT).tril(-1)
        return P, L, q, k, k, None
    if g.dim() == 4:                                                 # scalar gates [B, H, N, C]
        D = torch.exp((g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")))
        P = (q @ k.mT) * D
        L = ((k @ k.mT) * D).tril(-1)
        e_g, e_end = torch.exp(g)[..., None], torch.exp(g[..., -1:, None] - g[..., None])
        return P, L, q * e_g, k * e_g, k * e_end, torch.exp(g[..., -1:, None])
    P, L = per_channel_products(q, k, g)
    e_g, e_end = torch.exp(g), torch.exp(g[..., -1:, :] - g)
    return P, L, q * e_g, k * e_g, k * e_end, torch.exp(g[..., -1:, :])


def per_channel_products(q, k, g):
    """P and L for per-channel log-gates g [B,H,N,C,K] via sub-chunks (see above)."""
    *lead, C, K = q.shape
    sub = SUB if C % SUB == 0 else C                                 # odd chunk sizes: one exact tile
    ns = C // sub
    gs = g.unflatten(-2, (ns, sub))                                  # [B, H, N, ns, sub, K]
    # r_I: log-gate just before sub-chunk I (0 at the chunk start)
    r = torch.cat([torch.zeros_like(gs[..., :1, -1, :]), gs[..., :-1, -1, :]], dim=-2)[..., None, :]
    row_scale = torch.exp(gs - r)                                    # e^{g_t - r_I}, t in I
    # column factor e^{r_I - g_j} for j before sub-chunk I, 0 elsewhere (masked before exp)
    before = torch.arange(C, device=q.device)[None, :] < (torch.arange(ns, device=q.device) * sub)[:, None]
    col = torch.exp((r - g[..., None, :, :]).masked_fill(~before[..., None], float("-inf")))
    k_col = k[..., None, :, :] * col                                 # [B, H, N, ns, C, K]
    qs, ks = q.unflatten(-2, (ns, sub)), k.unflatten(-2, (ns, sub))
    P_off = ((qs * row_scale) @ k_col.mT).flatten(-3, -2)            # [B, H, N, C, C]
    L_off = ((ks * row_scale) @ k_col.mT).flatten(-3, -2)
    tri = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()
    D = torch.exp((gs[..., :, None, :] - gs[..., None, :, :]).masked_fill(~tri[..., None], float("-inf")))
    kD = ks[..., None, :, :] * D                                     # [B, H, N, ns, sub, sub, K]
    P_diag = (qs[..., :, None, :] * kD).sum(-1)
    L_diag = (ks[..., :, None, :] * kD).sum(-1).tril(-1)
    # place the diagonal blocks: [.., ns, sub, sub] -> [.., ns, sub, ns, sub]
    place = torch.eye(ns, dtype=q.dtype, device=q.device)[:, None, :, None]
    P = P_off + (P_diag[..., :, None, :] * place).flatten(-2, -1).flatten(-3, -2)
    L = L_off + (L_diag[..., :, None, :] * place).flatten(-2, -1).flatten(-3, -2)
    return P, L


# Chunks processed per batched step: large enough to batch, small enough to stay in cache.
GROUP = 2


def chunk_group(S, q, k, v, b, g):
    """A group of G chunks from start state S [B,H,V,K]: q, k [B,H,G,C,K]; v [B,H,G,C,V];
    b = beta [B,H,G,C,1]; g None, [B,H,G,C] or [B,H,G,C,K]. Returns (o [B,H,G,C,V], end state)."""
    B, H, G, C, K = q.shape
    V = v.shape[-1]
    P, L, q_dec, k_dec, k_end, s_dec = batched_decayed_products(q, k, g)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([b * k_dec, b * v], dim=-1)                      # Diag(beta) [K e^g | V]
    # flattened to one batch axis: much faster than the 5-d broadcasting path
    sol = torch.linalg.solve_triangular((eye + b * L).flatten(0, 2), rhs.flatten(0, 2), upper=False,
                                        unitriangular=True).view(B, H, G, C, K + V)
    W, U0 = sol[..., :K], sol[..., K:]
    starts, Us = [], []
    for c in range(G):                                               # the only sequential part
        U = U0[:, :, c] - W[:, :, c] @ S.mT
        starts.append(S)
        Us.append(U)
        S = (S if s_dec is None else S * s_dec[:, :, c]) + U.mT @ k_end[:, :, c]
    S_c, U = torch.stack(starts, dim=2), torch.stack(Us, dim=2)      # [B,H,G,V,K], [B,H,G,C,V]
    return q_dec @ S_c.mT + P @ U, S


def delta_rule_chunk(q, k, v, beta, alpha=None, initial_state=None, chunk_size=64):
    """Chunkwise form; same arguments and results as ``delta_rule_recurrent``.

    T is padded to whole chunks with zero rows, beta 0 and gates 1, which write nothing.
    Without gates or with scalar gates each chunk is one ``chunk_step`` (fastest on CPU);
    with per-channel gates ``chunk_group`` handles GROUP chunks per batched step.
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v, beta = q.to(cd), k.to(cd), v.to(cd), beta.to(cd)
    S = torch.zeros(B, H, V, K, dtype=cd, device=q.device) if initial_state is None else initial_state.to(cd)
    if T == 0:
        return v.to(out_dtype), S
    C = min(chunk_size, T)
    N, pad = -(-T // C), -T % C
    logs = None if alpha is None else log_gate(alpha, cd)
    if pad:                                                          # zero rows, beta 0, log-gate 0
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta = torch.nn.functional.pad(beta, (0, pad))
        if logs is not None:
            logs = torch.nn.functional.pad(logs, (0, 0, 0, pad) if logs.dim() == 4 else (0, pad))
    q, k, v = (x.unflatten(2, (N, C)) for x in (q, k, v))            # [B, H, N, C, .]
    b = beta.unflatten(2, (N, C))[..., None]
    g = None if logs is None else logs.unflatten(2, (N, C)).cumsum(dim=3)
    outputs = []
    if g is None or g.dim() == 4:
        # no or scalar gates: per-chunk steps measured fastest on CPU (everything stays in cache)
        for c in range(N):
            o, S = chunk_step(S, q[:, :, c], k[:, :, c], v[:, :, c], b[:, :, c, :, 0], None if g is None else g[:, :, c])
            outputs.append(o[:, :, None])
    else:
        for s in range(0, N, GROUP):                                 # small groups of chunks stay in cache
            sl = slice(s, min(s + GROUP, N))
            o, S = chunk_group(S, q[:, :, sl], k[:, :, sl], v[:, :, sl], b[:, :, sl], g[:, :, sl])
            outputs.append(o)
    o = torch.cat(outputs, dim=2)
    return o.flatten(2, 3)[:, :, :T].to(out_dtype), S
