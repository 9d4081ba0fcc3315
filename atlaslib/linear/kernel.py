"""The GPU kernels: chunkwise linear attention (plain, scalar-gated, per-channel-gated) in Triton.

The forward runs as the chunk-parallel decomposition of ``core.chunk_kernels``, with v itself as
the values every chunk writes. With g the log-gate accumulated from each chunk's start
(computed on the host, padded with zeros), chunk c of BT = 64 tokens does what
``chunk.chunk_step`` does:

    o    = (q * e^g) h[c]^T + (scores * D) v        D[t,i] = e^{g_t - g_i} for i <= t
    h[c+1] = h[c] * e^{g_last} + (v * e^{g_last - g})^T k

Only the second line depends on the previous chunk. So the state pass
(``chunk_state_kernel``) runs it alone, sequential over chunks and parallel over
(batch*head, value block, key block) — key blocks are independent here, since no term mixes
key channels — and stores every h[c]; the output kernel (``chunk_output_kernel``) then runs
the first line for every (batch*head, chunk, value block) at once. Per-channel gates need the
decay inside the q.k sum: ``channel_scores_kernel`` computes those scores first, parallel over
(batch*head, chunk, sub-chunk of 16 tokens), with the decay folded into q and k against a
reference token of each sub-chunk so that every exponent is <= 0.

q, k, v are read through their strides (a [B, T, H, K] tensor transposed to [B, H, T, K]
needs no copy) and in their own dtype: bf16/fp16 tiles meet on bf16/fp16 tensor cores, fp32
tiles multiply exactly. Absent inputs (no gate, no initial state) are ``None`` pointers, which
Triton compiles away. ``core.kernels`` holds the set-up all chapters' kernels share.

The kernels are forward only. ``linear_attention(..., backend="triton")`` gets its
gradients from ``core.with_chunk_backward``: autograd through the chunk form,
recomputed from the saved inputs. Runs under ``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

from ..core.chunk_kernels import CHUNK, channel_scores, output_pass, state_pass
from ..core.kernels import GATE_CHANNEL, as_fp32, chunk_gates, feature_tile, forward_launch

# The state pass holds the delta rule's whole state; linear attention keeps the same limit.
MAX_KEY = 256


def linear_attention_triton(q, k, v, alpha=None, initial_state=None, log_alpha=None):
    """Triton forward; same arguments and results as ``linear_attention_recurrent`` (and ``log_alpha``)."""
    feature_tile(q.shape[-1], MAX_KEY)
    run = forward_launch(q, k, v, BV=64)
    gate, g, Tp = chunk_gates(alpha, log_alpha, run.T, CHUNK)
    aq = channel_scores(run, g, with_keys=False)[0] if gate == GATE_CHANNEL else None
    h, ht, _ = state_pass(run, gate, g, Tp, as_fp32(initial_state))
    return output_pass(run, gate, g, Tp, h, aq), ht
