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
        S = q[:, :, s:e] @ k[:, :, lo:e].mT                          # k_i^T q_t [B,H,n,m]
        decay = None if g is None else (g[:, :, s:e, None] - g[:, :, None, lo:e]).to(cd)
        if kernel == "exp":
            S = S if decay is None else S + decay
            S = S.masked_fill(~ok, float("-inf"))
            if shift:
                S = S - S.amax(-1, keepdim=True).detach()
            W = torch.exp(S)
        else:
            W = S * (ok.to(cd) if decay is None else torch.exp(decay.masked_fill(~ok, float("-inf"))))
        if eta is not None:
            W = W * eta[:, :, None, lo:e].to(cd)
        outputs.append(W @ v[:, :, lo:e])
    return torch.cat(outputs, dim=2).to(out_dtype), None
