"""The algorithm: chunkwise ATLAS with a linear memory ([A] §5.1, book ch. 5).

Split the sequence into chunks of b tokens. In a chunk that starts from M_{t0} and S_{t0},
take every gradient at M_{t0} instead of M_{t-1} (as Titans, TTT and the Omega rule do).
Then a window row r (token i, with the c - 1 rows before the chunk included) contributes
the *fixed* rank-one gradient e_r phi(k_r)^T with e_r = M_{t0} phi(k_r) - v_r, and the
chunk is four steps:

1. **Frozen errors.** E = Phi_K,win M_{t0}^T - V_win for all b + c - 1 window rows at once.
2. **All b momenta by one masked matmul.** The momentum recursion no longer depends on
   the memory, so it unrolls:
       S_t = Theta_t S_{t0} + sum_{i <= t} (Theta_t / Theta_i) sum_r Gamma[i, r] e_r phi(k_r)^T,
   with Theta_t = theta_{t0+1} ... theta_t and Gamma the chunk's b x (b + c - 1) band of window
   gates. W = D_theta Gamma (D_theta[t, i] = Theta_t / Theta_i for i <= t) weighs row r in S_t.
3. **Newton–Schulz on the batch.** NS_J(S_t) for the b matrices as one batched call: the
   step that is not linear, and the reason the b momenta are materialised.
4. **A linear scan for M.** M_t = A_t M_{t0} - sum_{i <= t} (A_t / A_i) eta_i NS_J(S_i),
   with A_t = alpha_{t0+1} ... alpha_t, one more masked matmul; y_t = M_t phi(q_t).

Decay ratios are exp(g_t - g_i) of log-gates accumulated from the chunk start, masked
before the exponential (``core.chunking.chunk_decay``); theta = 0 becomes the log-floor,
a factor of e^-60. [A] §5.1 writes the cumulative product of the thetas as beta_t and
drops alpha and eta from its eqs 40-41 (book/errata.md).

Exactness (book ch. 5, tested): ``atlas_chunk(b) == atlas_frozen_seq(b)`` for every b,
and at b = 1 both are ``atlas_recurrent``; for b > 1 the frozen gradient makes it a
different model. Deep memories run the same steps inside chapter 3's engine
(``atlaslib.miras``, optimizer "muon": ``Muon.updates`` is step 2 and 3 per weight matrix).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.chunking import chunk_decay, chunk_windows, compute_dtype, gate_logs, log_gate, start_memory
from ..core.newton_schulz import newton_schulz
from ..core.validation import check_chunk_size, check_form_shapes, check_shape, check_window
from ..core.windows import band_gates
from ..miras import DEFAULT_CHUNK_SIZE


def atlas_chunk(q, k, v, window=1, G=None, alpha=None, eta=None, theta=None, ns_steps=5, ns_coeffs="muon",
                initial_state=None, initial_momentum=None, chunk_size=DEFAULT_CHUNK_SIZE, log_alpha=None,
                orthogonalise=None):
    """Chunkwise ATLAS with a linear memory (see the module docstring).

    Arguments as ``atlas_recurrent`` plus ``chunk_size`` (b) and ``log_alpha`` (the retention as
    its log, instead of alpha). ``orthogonalise(S, steps, ns_coeffs)`` replaces ``newton_schulz`` in
    step 3 (the Triton kernel's, ``kernel.atlas_triton``). Returns (o [B, H, T, V] in q's dtype,
    M_T, S_T [B, H, V, D]). Shapes, window and chunk_size are checked here; value ranges are the
    caller's (``atlas`` checks them).
    """
    ns = newton_schulz if orthogonalise is None else orthogonalise
    B, H, T, D, V = check_form_shapes(q, k, v, alpha=alpha, eta=eta, theta=theta, log_alpha=log_alpha)
    c, b = check_window(window), check_chunk_size(chunk_size)
    check_shape("G", G, (B, H, T, c), ref=q)
    check_shape("initial_momentum", initial_momentum, (B, H, V, D))
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    M = start_memory(q, v, initial_state)
    S = torch.zeros_like(M) if initial_momentum is None else initial_momentum.to(cd)
    G = torch.ones(B, H, T, c, dtype=cd, device=q.device) if G is None else G.to(cd)
    eta = torch.ones(B, H, T, dtype=cd, device=q.device) if eta is None else eta.to(cd)
    ga = gate_logs(alpha, log_alpha, cd)                                       # log alpha_t (None: 1)
    h = None if theta is None else log_gate(theta, cd)                         # log theta_t (None: theta = 0)
    k_win_all = F.pad(k, (0, 0, c - 1, 0))                                     # row s + j is token s - c + 1 + j
    v_win_all = F.pad(v, (0, 0, c - 1, 0))
    outputs = []
    none = [None] * -(-T // b)
    # chunk [s, e) of every input, cut once (slices in the loop cost the backward O(T^2 / b))
    chunks = zip(*(chunk_windows(x, b) for x in (q, G, eta)), chunk_windows(h, b) or none,
                 chunk_windows(ga, b) or none, chunk_windows(k_win_all, b, c - 1), chunk_windows(v_win_all, b, c - 1))
    for q_c, G_c, eta_c, h_c, ga_c, K_win, V_win in chunks:                  # K_win, V_win: [B, H, n + c - 1, .]
        n = q_c.shape[2]
        # 1. errors of every window row at the chunk-start memory
        E = K_win @ M.transpose(-1, -2) - V_win                                # [B, H, R, V]
        # 2. all n momenta: S_t = Theta_t S_{t0} + sum_r W[t, r] e_r phi(k_r)^T, W = D_theta Gamma
        Gamma = band_gates(G_c, c)                                              # [B, H, n, R]
        if h is None:                                                          # theta = 0: nothing carried
            S_all = torch.einsum("btr,brv,brd->btvd", Gamma.flatten(0, 1), E.flatten(0, 1),
                                 K_win.flatten(0, 1)).view(B, H, n, V, D)
        else:
            D_theta, Theta = chunk_decay(h_c)
            W = D_theta @ Gamma
            S_all = torch.einsum("btr,brv,brd->btvd", W.flatten(0, 1), E.flatten(0, 1),
                                 K_win.flatten(0, 1)).view(B, H, n, V, D)
            S_all = S_all + Theta[..., None, None] * S[:, :, None]
        # 3. Newton-Schulz on the batch of n momenta (each [V, D] matrix on its own)
        U = ns(S_all, ns_steps, ns_coeffs)
        # 4. M_t = A_t M_{t0} - sum_{i <= t} (A_t / A_i) eta_i NS_J(S_i)
        if ga is None:
            D_alpha, A = torch.ones(n, n, dtype=cd, device=q.device).tril(), None
        else:
            D_alpha, A = chunk_decay(ga_c)
        C = D_alpha * eta_c[:, :, None]                                        # C[t, i] = (A_t / A_i) eta_i
        M_all = -torch.einsum("bti,bivd->btvd", C.flatten(0, 1), U.flatten(0, 1))
        M_all = M_all.view(B, H, n, V, D) + (M[:, :, None] if A is None else A[..., None, None] * M[:, :, None])
        outputs.append(torch.einsum("bhtvd,bhtd->bhtv", M_all, q_c))          # y_t = M_t phi(q_t)
        M, S = M_all[:, :, -1], S_all[:, :, -1]
    return torch.cat(outputs, dim=2).to(out_dtype), M, S


__all__ = ["atlas_chunk"]
