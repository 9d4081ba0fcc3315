"""The algorithm: the linear DeepTransformer (and DOT) as masked matrix products (book ch. 6).

The DeepTransformer's update does not depend on the state (dot-product bias), so its forms below
are exact for every chunk size, like chapter 1's; so is ``dot_chunk`` (c = 1, a triangular solve).
``dot_window_chunk`` (c > 1) freezes the errors per chunk: exact at b = 1 only.

* ``hebbian_chunk``: truncated features phi*_P, no window: chapter 1's chunk form
  (``linear_attention_chunk``) on the features with values eta_t v_t.
* ``masked_chunk``: the kernel trick and the windowed (SWDT) forms, one block of b query rows
  at a time against the keys they can see,

      y_t = sum_{i in window(t)} eta_i e^{g_t - g_i} kappa(k_i, q_t) v_i,    g_t = sum_{j<=t} log alpha_j,

  with kappa(k, q) = exp(k^T q) (exact phi*) or the dot product of features. For exp, the decay
  joins the exponent, exp(k^T q + g_t - g_i), masked to -inf outside the window *before* the
  exponential; the optional shift subtracts each row's max (it cancels in the normalised output).
  The decay enters as a row part plus a column part (``split_decay``), and with a decay weights
  below e times the smallest normal number become 0 (``exp_flushed``: exp is slow down there).
* ``dot_chunk`` (DOT, c = 1: exact, a triangular solve per block) and ``dot_window_chunk`` (DOT with a
  window c: the errors frozen at each chunk's start, chapter 4's approximation).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core.chunking import chunk_decay, chunk_spans, chunk_windows, compute_dtype, gate_logs
from ..core.validation import check_chunk_size, check_form_shapes, check_window
from ..core.windows import window_gates
from ..linear.chunk import linear_attention_chunk
from .validation import check_kernel


def hebbian_chunk(fq, fk, v, alpha=None, eta=None, initial_state=None, chunk_size=64, log_alpha=None):
    """Chapter 1's chunk form on features; same results as ``hebbian_recurrent``.
    Shapes and chunk_size are checked here; value ranges are the caller's (``deep_transformer`` checks them)."""
    check_form_shapes(fq, fk, v, alpha=alpha, eta=eta, log_alpha=log_alpha)
    check_chunk_size(chunk_size)
    if eta is not None:
        v = eta[..., None].to(v.dtype) * v                          # the write eta_t v_t
    return linear_attention_chunk(fq, fk, v, alpha, initial_state, chunk_size, log_alpha)


def visible(rows: torch.Tensor, cols: torch.Tensor, window) -> torch.Tensor:
    """[n, m] mask: key i is in query t's memory (i <= t, and i > t - c with a window c)."""
    ok = cols[None, :] <= rows[:, None]
    if window is not None:
        ok &= cols[None, :] > rows[:, None] - window
    return ok


def mask_invisible_(S: torch.Tensor, top: int, lo: int, window, value: float) -> torch.Tensor:
    """In place: S[..., r, j] = value where key lo + j is not in the memory of position top + r.

    Only the ragged columns are written: with n rows, the keys [top + n - c, top] (every key up to
    top without a window) are in every row's memory, so a long block of keys costs no mask."""
    n, m = S.shape[-2:]
    rows, cols = torch.arange(top, top + n, device=S.device), torch.arange(lo, lo + m, device=S.device)
    shared = lo if window is None else max(lo, top + n - window)      # first key every row sees
    if shared > top:                                                  # no key seen by all: mask it all
        return S.masked_fill_(~visible(rows, cols, window), value)
    head, tail = shared - lo, top + 1 - lo                            # ragged: [0, head) and [tail, m)
    if head > 0:
        S[..., :head].masked_fill_(~visible(rows, cols[:head], window), value)
    if tail < m:
        S[..., tail:].masked_fill_(~visible(rows, cols[tail:], window), value)
    return S


def exp_flushed(S: torch.Tensor) -> torch.Tensor:
    """exp(S) in place, with 0 wherever it would be below e times the dtype's smallest normal number
    (3.2e-38 in fp32, 6e-308 in fp64).

    Decays push the exponents of old keys far below exp's range (-200 and less); there, and at the
    edge of the range itself, the CPU's vectorised exp takes a slow path, some 20-70x slower, and it
    hands the products after it subnormal numbers. So the exponent is clamped one unit inside the
    range and the entries that were below it are zeroed: the same weights down to 3.2e-38, 0 below."""
    floor = math.log(torch.finfo(S.dtype).tiny) + 1
    kept = torch.gt(S, floor, out=torch.empty_like(S))      # 1.0 / 0.0, not a bool mask:
    W = S.clamp_min_(floor).exp_()                                  # a bool factor costs a conversion
    return W * kept if W.requires_grad else W.mul_(kept)           # exp's backward keeps its output


def split_decay(row_logs, col_logs, ref, cd):
    """The log-decays row_logs[t] - g[j] of a block (row_logs: its rows' [.., n], col_logs: g at its
    columns [.., m]) as a row part and a column part about ref = g[t0] [.., 1], t0 the block's first
    row: (row_logs[t] - g[t0], g[t0] - g[j]), each an fp64 difference of
    the long sums, then in cd. Added to the scores one broadcast at a time, they spare building (and
    rounding) an [n, m] matrix of fp64 differences per block. The price: the two parts are rounded
    apart, so in fp32 a pair of tokens that a strong decay D inside the block separates from t0 loses
    about D * 3e-8 of relative accuracy (measured: 1e-6 at D = 44, 3e-5 at D = 1320); the length of the
    sequence costs nothing."""
    return (row_logs - ref).to(cd), (ref - col_logs).to(cd)


def kernel_weights(x, k, kernel, decay, top, lo, window=None, shift=False):
    """W[r, j] = e^{row[r] + col[j]} kappa(k_j, x_r) where key lo + j is in the memory of position
    top + r (``visible``), else 0 [.., n, m]; ``decay`` is None or the log-decay's (row, col) parts.

    exp kernel: one exponent k_j^T x_r + row[r] + col[j], masked to -inf *before* the exponential,
    all in place on the score block; ``shift`` subtracts each row's max (a factor that cancels in a
    normalised output)."""
    S = x @ k.mT
    logdecay = None if decay is None else (decay[0][..., :, None], decay[1][..., None, :])
    if kernel == "exp":
        if logdecay is not None:
            S.add_(logdecay[0]).add_(logdecay[1])
        mask_invisible_(S, top, lo, window, float("-inf"))
        if shift:
            S.sub_(S.detach().amax(-1, keepdim=True))
        return S.exp_() if logdecay is None else exp_flushed(S)
    if logdecay is None:
        return mask_invisible_(S, top, lo, window, 0.0)
    return S * torch.exp(mask_invisible_(logdecay[0] + logdecay[1], top, lo, window, float("-inf")))


def masked_chunk(q, k, v, alpha=None, eta=None, window=None, kernel="exp", shift=False, chunk_size=64,
                 log_alpha=None, normalize=False):
    """Same arguments and results as ``coefficient_recurrent`` (plus chunk_size, log_alpha). O(T * span).

    ``normalize``: return y_t / z_t instead, z_t the same sum with v = 1 (eta_i included), divided per
    block in fp32/fp64. Without eta, z is the row sum of the block's weights, cheaper than the extra
    column of ones a caller would add to v (a 65th column slows every product); with eta, eta_i rides
    along as that last column. Shapes, window and chunk_size are checked here; value ranges are the
    caller's (``deep_transformer`` checks them)."""
    B, H, T, _, _ = check_form_shapes(q, k, v, alpha=alpha, eta=eta, log_alpha=log_alpha)
    check_chunk_size(chunk_size)
    if window is not None:                                        # None: no window (the DeepTransformer)
        check_window(window)
    check_kernel(kernel)
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    if eta is not None:
        v = eta[..., None].to(cd) * v                             # the written values eta_i v_i, once
        if normalize:
            v = torch.cat([v, eta[..., None].to(cd)], dim=-1)     # and z's weights eta_i
    logs = gate_logs(alpha, log_alpha, torch.float64)
    g = None if logs is None else logs.cumsum(-1)        # fp64: differences of a long sum keep their digits
    outputs = []
    # each block's queries (and, with a window, keys and values) cut once, as views: slices in the loop cost
    # the backward a zero-filled copy of the whole input per block
    q_blocks, g_blocks = q.split(chunk_size, 2), None if g is None else g.split(chunk_size, -1)
    if window is not None:
        padded = (F.pad(k, (0, 0, window - 1, 0)), F.pad(v, (0, 0, window - 1, 0)),
                  None if g is None else F.pad(g, (window - 1, 0)))
        windows = [chunk_windows(x, chunk_size, window - 1) for x in padded]
    for i, (s, e) in enumerate(chunk_spans(T, chunk_size)):
        lo = 0 if window is None else max(0, s - window + 1)      # the oldest key this block sees
        if window is None:                                        # the whole prefix: O(T^2) as the model is
            k_i, v_i, g_i = k[:, :, :e], v[:, :, :e], None if g is None else g[..., :e]
        else:                                                     # padded rows from lo on
            k_i, v_i, g_i = (None if w is None else w[i].narrow(2, lo - (s - window + 1), e - lo) for w in windows)
        decay = None if g is None else split_decay(g_blocks[i], g_i, g_blocks[i][..., :1], cd)
        W = kernel_weights(q_blocks[i], k_i, kernel, decay, s, lo, window, shift)
        o = W @ v_i
        if normalize:
            o = o / W.sum(-1, keepdim=True) if eta is None else o[..., :-1] / o[..., -1:]
        outputs.append(o)
    return torch.cat(outputs, dim=2).to(out_dtype), None


def dot_chunk(q, k, v, alpha=None, eta=None, kernel="exp", chunk_size=64):
    """DOT (c = 1) in coefficient space, a block of b tokens at a time; same results as
    ``dot_coefficient_recurrent``, exact for every b.

    With g_t = sum_{j<=t} log alpha_j, M_t = sum_{j<=t} e^{g_t - g_j} u_j phi*(k_j)^T, and the coefficients
    solve u_t = eta_t (v_t - sum_{j<t} e^{g_{t-1} - g_j} kappa(k_j, k_t) u_j): a unit lower-triangular
    system, chapter 2's UT transform with the Gram matrix K K^T replaced by the kernel matrix. Blocks
    are solved in order (forward substitution), the earlier blocks entering the right-hand side;
    then y_t = sum_{j<=t} e^{g_t - g_j} kappa(k_j, q_t) u_j as a masked product.
    Shapes and chunk_size are checked here; value ranges are the caller's (``dot`` checks them).
    """
    B, H, T, _, _ = check_form_shapes(q, k, v, alpha=alpha, eta=eta)
    check_chunk_size(chunk_size)
    check_kernel(kernel)
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    logs = gate_logs(alpha, None, torch.float64)
    g = None if logs is None else logs.cumsum(-1)
    g_prev = None if logs is None else g - logs                          # g_{t-1}
    eta = torch.ones(B, H, T, dtype=cd, device=q.device) if eta is None else eta.to(cd)
    U = v[:, :, :0]
    outputs = []
    for s, e in chunk_spans(T, chunk_size):
        # log-decays g_{t-1} - g_j (the state a token corrects) and g_t - g_j (the state it reads)
        ref = None if g is None else g[..., s:s + 1]
        gate_prev = None if g is None else split_decay(g_prev[..., s:e], g[..., :e], ref, cd)
        gate_now = None if g is None else split_decay(g[..., s:e], g[..., :e], ref, cd)
        Kmat = kernel_weights(k[:, :, s:e], k[:, :, :e], kernel, gate_prev, s - 1, 0)   # j < t: one row up
        rhs = eta[:, :, s:e, None] * (v[:, :, s:e] - Kmat[..., :s] @ U)          # earlier blocks: known
        system = torch.eye(e - s, dtype=cd, device=q.device) + eta[:, :, s:e, None] * Kmat[..., s:]
        U = torch.cat([U, torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)], dim=2)
        W = kernel_weights(q[:, :, s:e], k[:, :, :e], kernel, gate_now, s, 0)
        outputs.append(W @ U)
    return torch.cat(outputs, dim=2).to(out_dtype), None


def dot_window_chunk(q, k, v, alpha=None, eta=None, kernel="exp", window=1, gamma=None, chunk_size=16):
    """DOT with a window c in coefficient space, a chunk of b tokens at a time, every error of the chunk
    frozen at its start state (chapter 4's chunk form, book ch. 4 §8): the same results as
    ``dot_coefficient_recurrent(..., chunk_size=b)`` for every b and c, and so an *approximation* of the
    per-token rule for b > 1 (b = 1 is exact), as OmegaNet's chunk form is.

    For the chunk [s, e) with start coefficients U (tokens j < s), the negated errors of its window pairs
    i in [s - c + 1, e) are N_i = v_i - sum_{j<s} u_j kappa(k_j, k_i), all at once. Token t adds
    eta_t gamma_i^{(t)} N_i to u_i, which decays by A_{t'}/A_t later, so with C[t, t'] = eta_{t'} A_t / A_{t'}
    (t' <= t in the chunk) and the band Gamma[t', i] = gamma_i^{(t')}, W = C Gamma weighs N_i in the
    coefficients at t, and

        y_t = (A_t / A_{s-1}) sum_{j<s} u_j kappa(k_j, q_t) + sum_i W[t, i] kappa(k_i, q_t) N_i.

    Shapes, window and chunk_size are checked here; value ranges are the caller's (``dot`` checks them).
    """
    B, H, T, _, _ = check_form_shapes(q, k, v, window=check_window(window), gamma=gamma, alpha=alpha, eta=eta)
    check_chunk_size(chunk_size)
    check_kernel(kernel)
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    dev = q.device
    kappa = (lambda x, y: torch.exp(x @ y.mT)) if kernel == "exp" else (lambda x, y: x @ y.mT)
    G = window_gates(gamma, B, H, T, window, cd, dev)                    # G[t, j] = gamma_{t-j}^{(t)}
    logs = gate_logs(alpha, None, torch.float64)
    eta = torch.ones(B, H, T, dtype=cd, device=dev) if eta is None else eta.to(cd)
    U = v[:, :, :0]                                                       # coefficients of the tokens < s
    outputs = []
    for s, e in chunk_spans(T, chunk_size):
        n, lo = e - s, max(0, s - window + 1)                             # the chunk's oldest window pair
        N = v[:, :, lo:e] - kappa(k[:, :, lo:e], k[:, :, :s]) @ U           # -errors at the start state
        rows, cols = torch.arange(s, e, device=dev), torch.arange(lo, e, device=dev)
        offset = rows[:, None] - cols[None, :]                            # t - i
        inside = (offset >= 0) & (offset < window)
        Gam = G[:, :, s:e].gather(-1, offset.clamp(0, window - 1).expand(B, H, n, e - lo)) * inside
        tril = rows[None, :] <= rows[:, None]
        if logs is None:
            C = tril.to(cd) * eta[:, :, None, s:e]
            start = torch.ones(B, H, n, 1, dtype=cd, device=dev)
        else:
            C, A = chunk_decay(logs[:, :, s:e], tril)                     # A_t / A_i and A_t / A_{s-1}, fp64
            C = C.to(cd) * eta[:, :, None, s:e]
            start = A.to(cd)[..., None]
        W = C @ Gam                                                       # [B,H,n,e-lo]
        outputs.append(start * (kappa(q[:, :, s:e], k[:, :, :s]) @ U) + (W * kappa(q[:, :, s:e], k[:, :, lo:e])) @ N)
        U = torch.cat([U * start[:, :, -1:], torch.zeros_like(v[:, :, s:e])], dim=2)
        U = torch.cat([U[:, :, :lo], U[:, :, lo:] + W[:, :, -1, :, None] * N], dim=2)
    return torch.cat(outputs, dim=2).to(out_dtype), None
