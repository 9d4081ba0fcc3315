"""The algorithm: the linear DeepTransformer as masked matrix products (book ch. 6).

Its update does not depend on the state (dot-product bias), so every form below is exact
for every chunk size, like chapter 1's.

* ``hebbian_chunk``: truncated features phi*_P, no window: chapter 1's chunk form
  (``linear_attention_chunk``) on the features with values eta_t v_t.
* ``masked_chunk``: the kernel trick and the windowed (SWDT) forms, one block of b query rows
  at a time against the keys they can see,

      y_t = sum_{i in window(t)} eta_i e^{g_t - g_i} kappa(k_i, q_t) v_i,    g_t = sum_{j<=t} log alpha_j,

  with kappa(k, q) = exp(k^T q) (exact phi*) or the dot product of features. For exp, the decay
  joins the exponent, exp(k^T q + g_t - g_i), masked to -inf outside the window *before* the
  exponential; the optional shift subtracts each row's max (it cancels in the normalised output).
"""
from __future__ import annotations

import torch

from ..core.chunking import compute_dtype, gate_logs
from ..linear.chunk import linear_attention_chunk


def hebbian_chunk(fq, fk, v, alpha=None, eta=None, initial_state=None, chunk_size=64, log_alpha=None):
    """Chapter 1's chunk form on features; same results as ``hebbian_recurrent``."""
    if eta is not None:
        v = eta[..., None].to(v.dtype) * v                          # the write eta_t v_t
    return linear_attention_chunk(fq, fk, v, alpha, initial_state, chunk_size, log_alpha)


def visible(rows: torch.Tensor, cols: torch.Tensor, window) -> torch.Tensor:
    """[n, m] mask: key i is in query t's memory (i <= t, and i > t - c with a window c)."""
    ok = cols[None, :] <= rows[:, None]
    if window is not None:
        ok &= cols[None, :] > rows[:, None] - window
    return ok


def kernel_weights(x, k, kernel, logdecay, ok, shift=False):
    """W[t, j] = e^{logdecay[t, j]} kappa(k_j, x_t) where ``ok``, else 0 [.., n, m].

    exp kernel: one exponent k_j^T x_t + logdecay, masked to -inf *before* the exponential; ``shift``
    subtracts each row's max (a factor that cancels in a normalised output)."""
    S = x @ k.mT
    if kernel == "exp":
        S = (S if logdecay is None else S + logdecay).masked_fill(~ok, float("-inf"))
        if shift:
            S = S - S.amax(-1, keepdim=True).detach()
        return torch.exp(S)
    return S * (ok.to(S.dtype) if logdecay is None else torch.exp(logdecay.masked_fill(~ok, float("-inf"))))


def masked_chunk(q, k, v, alpha=None, eta=None, window=None, kernel="exp", shift=False, chunk_size=64,
                 log_alpha=None):
    """Same arguments and results as ``coefficient_recurrent`` (plus chunk_size, log_alpha). O(T * span)."""
    B, H, T, _ = q.shape
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    logs = gate_logs(alpha, log_alpha, torch.float64)
    g = None if logs is None else logs.cumsum(-1)        # fp64: differences of a long sum keep their digits
    outputs = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        lo = 0 if window is None else max(0, s - window + 1)      # the oldest key this block sees
        ok = visible(torch.arange(s, e, device=q.device), torch.arange(lo, e, device=q.device), window)
        decay = None if g is None else (g[:, :, s:e, None] - g[:, :, None, lo:e]).to(cd)
        W = kernel_weights(q[:, :, s:e], k[:, :, lo:e], kernel, decay, ok, shift)
        if eta is not None:
            W = W * eta[:, :, None, lo:e].to(cd)
        outputs.append(W @ v[:, :, lo:e])
    return torch.cat(outputs, dim=2).to(out_dtype), None


def dot_chunk(q, k, v, alpha=None, eta=None, kernel="exp", chunk_size=64):
    """DOT (c = 1) in coefficient space, a block of b tokens at a time; same results as
    ``dot_coefficient_recurrent``, exact for every b.

    With g_t = sum_{j<=t} log alpha_j, M_t = sum_{j<=t} e^{g_t - g_j} u_j phi*(k_j)^T, and the coefficients
    solve u_t = eta_t (v_t - sum_{j<t} e^{g_{t-1} - g_j} kappa(k_j, k_t) u_j): a unit lower-triangular
    system, chapter 2's UT transform with the Gram matrix K K^T replaced by the kernel matrix. Blocks
    are solved in order (forward substitution), the earlier blocks entering the right-hand side;
    then y_t = sum_{j<=t} e^{g_t - g_j} kappa(k_j, q_t) u_j as a masked product.
    """
    B, H, T, _ = q.shape
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    logs = gate_logs(alpha, None, torch.float64)
    g = None if logs is None else logs.cumsum(-1)
    eta = torch.ones(B, H, T, dtype=cd, device=q.device) if eta is None else eta.to(cd)
    U = v[:, :, :0]
    outputs = []
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        rows, cols = torch.arange(s, e, device=q.device), torch.arange(0, e, device=q.device)
        # log-decays g_{t-1} - g_j (the state a token corrects) and g_t - g_j (the state it reads)
        gate_prev = None if g is None else ((g - logs)[:, :, s:e, None] - g[:, :, None, :e]).to(cd)
        gate_now = None if g is None else (g[:, :, s:e, None] - g[:, :, None, :e]).to(cd)
        Kmat = kernel_weights(k[:, :, s:e], k[:, :, :e], kernel, gate_prev, cols[None, :] < rows[:, None])
        rhs = eta[:, :, s:e, None] * (v[:, :, s:e] - Kmat[..., :s] @ U)          # earlier blocks: known
        system = torch.eye(e - s, dtype=cd, device=q.device) + eta[:, :, s:e, None] * Kmat[..., s:]
        U = torch.cat([U, torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)], dim=2)
        W = kernel_weights(q[:, :, s:e], k[:, :, :e], kernel, gate_now, cols[None, :] <= rows[:, None])
        outputs.append(W @ U)
    return torch.cat(outputs, dim=2).to(out_dtype), None
