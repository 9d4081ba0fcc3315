"""Chunking machinery shared by every chapter's chunkwise form.

Book ch. 1 §7 derives it for linear attention; chapters 2-4 reuse it unchanged:

* ``compute_dtype``: states accumulate in fp32 (fp64 for fp64 inputs), whatever the activations;
  ``start_memory``: the memory before the first token, in that dtype;
* ``log_gate`` / ``gate_logs``: retention gates enter every chunk form as log-gates, accumulated
  from each chunk's start (``cumulative_logs``, in fp64), so only differences g_t - g_i <= 0 are ever
  exponentiated, and they keep their digits;
* ``causal_decay``: D[t, i] = e^{g_t - g_i} for i <= t, masked *before* the exponential, and
  ``chunk_decay``: the same from per-token log-gates, with the cumulative gate e^{g_t};
* ``to_chunks`` / ``chunk_run`` / ``from_chunks``: [B, H, T, ...] <-> chunk-major blocks, and
  ``chunk_spans``: the token ranges of the chunk loops that slice [B, H, T, ...] directly.
"""
from __future__ import annotations

import math

import torch

from .validation import check_state

# alpha is clamped to e^LOG_FLOOR before the log so that a gate of exactly 0 (a full reset)
# gives a finite log-gate and a zero, not NaN, gradient (clamping after the log would give 0 * inf).
LOG_FLOOR = -60.0


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """States accumulate in fp32 (fp64 when the inputs are fp64)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def start_memory(q: torch.Tensor, v: torch.Tensor, initial_state) -> torch.Tensor:
    """The memory before the first token, [B, H, V, D] in ``compute_dtype(q)``: zeros, or ``initial_state``
    (checked here too, as the entry points check it: the forms are exported, they reshape it, and a transposed
    [B, H, D, V] would pass silently, an integer state or one on another device fail deep inside)."""
    cd = compute_dtype(q)
    B, H, _, D = q.shape
    shape = (B, H, v.shape[-1], D)
    if initial_state is not None:
        return check_state("initial_state [B, H, V, K]", initial_state, shape, q).to(cd)
    return torch.zeros(shape, dtype=cd, device=q.device)


def log_gate(alpha: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """log(alpha) in dtype ``cd``, with alpha clamped to e^LOG_FLOOR (a gate of 0 is a full reset)."""
    return torch.log(alpha.to(cd).clamp_min(math.exp(LOG_FLOOR)))


def gate_logs(alpha, log_alpha, cd: torch.dtype):
    """The log-gate of a retention given either as ``alpha`` or as ``log_alpha`` (None if neither).

    ``log_alpha`` is used as given (clamped below at LOG_FLOOR), never exponentiated and logged
    again: a gate close to 1 survives in its log even where the activation dtype would round
    alpha itself to exactly 1.0 (bf16: any alpha > 1 - 2^-9).
    """
    if log_alpha is not None:
        return log_alpha.to(cd).clamp_min(LOG_FLOOR)
    return None if alpha is None else log_gate(alpha, cd)


def cumulative_logs(log_gates: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """g_t = log alpha_1 + ... + log alpha_t along ``dim``, in fp64 whatever the gates' dtype.

    The chunk forms exponentiate differences g_t - g_i. After a reset (a log-gate at the floor, -60)
    or a run of strong decays every later g_t sits far below 0, and an fp32 difference of two such
    sums keeps only the digits their size leaves (spacing 4e-6 near -60, 6e-5 near -1000): about
    100x the error of the per-token loop with 20% resets. In fp64 the differences are exact to
    fp32's precision; they are rounded to the compute dtype only then (``causal_decay``'s dtype).
    """
    return log_gates.to(torch.float64).cumsum(dim)


def causal_decay(g: torch.Tensor, causal: torch.Tensor | None = None, dtype: torch.dtype | None = None
                 ) -> torch.Tensor:
    """D[t, i] = exp(g_t - g_i) for i <= t, else 0, for scalar log-gates g [..., n] (any leading dims).

    ``causal``: the [n, n] lower-triangular boolean mask (built when None). The entries above
    the diagonal are masked to -inf *before* the exponential, so they become exact zeros
    instead of overflowing, and only differences g_t - g_i <= 0 are exponentiated, never
    quotients of cumulative products. (Per-channel gates: ``linear.chunk.decayed_scores``.)
    ``dtype``: that of D (default g's); the differences are taken in g's dtype first, so an fp64 g
    (``cumulative_logs``) gives an fp32 D without the digits fp32 sums would lose.
    """
    if causal is None:
        n = g.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
    diff = (g[..., :, None] - g[..., None, :]).to(dtype or g.dtype)
    return torch.exp(diff.masked_fill(~causal, float("-inf")))


def chunk_decay(log_gates: torch.Tensor, causal: torch.Tensor | None = None):
    """(D [..., n, n], A [..., n]) of one chunk from its per-token log-gates [..., n], in their dtype.

    With g_t the log-gates accumulated from the chunk's start (``cumulative_logs``), D =
    ``causal_decay(g)`` (the ratio A_t / A_i of cumulative gates for i <= t) and A_t = e^{g_t},
    what is left at token t of the chunk-start state.
    """
    g, dtype = cumulative_logs(log_gates), log_gates.dtype
    return causal_decay(g, causal, dtype), torch.exp(g).to(dtype)


def chunk_spans(T: int, b: int):
    """The chunks of a loop over T tokens, b at a time: (s, e) for tokens [s, e), the last one maybe shorter."""
    return [(s, min(s + b, T)) for s in range(0, T, b)]


def chunk_windows(x, b: int, extra: int = 0, dim: int = 2) -> list:
    """The chunks of ``chunk_spans(T, b)`` cut from x once, as views: chunk [s, e) gets the rows
    [s, e + extra) of x along ``dim``, where x holds T + extra rows (``extra`` rows of left padding, e.g.
    the c - 1 of a window; then chunk windows overlap). None stays None.

    Slicing x[s:e] inside the chunk loop instead gives each chunk's gradient, in the backward, a
    zero-filled tensor the size of the whole x: O(T^2 / b) work and memory traffic for an O(T) form."""
    if x is None:
        return None
    dim = dim % x.dim()                           # movedim below counts from the front
    T = x.shape[dim] - extra
    if extra == 0:
        return list(x.split(b, dim))
    full = T // b
    views = []
    if full:                                      # [..., full, b + extra, ...] -> full windows
        windows = x.narrow(dim, 0, full * b + extra).unfold(dim, b + extra, b).movedim(-1, dim + 1)
        views = list(windows.unbind(dim))
    if T % b:
        views.append(x.narrow(dim, full * b, T - full * b + extra))
    return views


def to_chunks(x, b, fill=0.0):
    """[B, H, T, ...] -> [B*H, N, b, ...]: T cut into N chunks of b tokens, a view of a contiguous x
    whose T needs no padding, else a copy.

    Padding rows get ``fill``: 0 for q, k, v, beta and log-gates (they write nothing and keep
    everything), 1 for gates given as alpha.
    """
    B, H, T = x.shape[:3]
    if T % b:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, -T % b), value=fill)
    return x.reshape(B * H, -1, b, *x.shape[3:])


def chunk_run(x, s, n):
    """Chunks s, ..., s+n-1 of x [B*H, N, b, ...] as one contiguous chunk-major block [n, B*H, b, ...].

    Batched matrix products then take a chunk, or the whole run, without copying it again; a
    run copied just before it is used is also still in cache.
    """
    return x[:, s:s + n].transpose(0, 1).contiguous()


def from_chunks(o, B, H, T):
    """Chunk-major outputs [N, B*H, b, V] back to [B, H, T, V] (dropping the padding)."""
    N, _, b, V = o.shape
    return o.transpose(0, 1).reshape(B, H, N * b, V)[:, :, :T]
