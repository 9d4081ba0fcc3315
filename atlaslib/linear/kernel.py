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

The backward kernels are in ``linear.backward``; ``LinearAttentionFunction`` ties the two
together as one ``torch.autograd.Function`` (forward and ``setup_context`` apart, the form
``torch.compile`` and ``torch.func`` ask for; under ``torch.func.grad`` its backward unwraps the
tensors for the kernels, first order only; a backward under ``create_graph=True`` outside
``torch.func`` differentiates the chunk form instead, so that its gradients have a graph), and
``linear_attention(..., backend="triton")`` runs it (``linear_attention_autograd``). Gradients
reach ``alpha`` or ``log_alpha`` through the log-gates the Function takes (their log and clamp
stay in autograd). Runs under ``TRITON_INTERPRET=1`` on CPU.
"""
from __future__ import annotations

import torch

from ..core.chunk_kernels import CHUNK, channel_scores, output_pass, state_pass
from ..core.chunking import gate_logs
from ..core.dispatch import backward_or_fallback, chunk_grads, second_order_requested
from ..core.kernels import GATE_CHANNEL, as_fp32, chunk_gates, chunk_local_log_gate, feature_tile, forward_launch, \
    gate_mode, refuse_nested_transforms, unwrapped
from .chunk import linear_attention_chunk

# The state pass holds the delta rule's whole state; linear attention keeps the same limit.
MAX_KEY = 256


def linear_attention_triton(q, k, v, alpha=None, initial_state=None, log_alpha=None):
    """Triton forward; same arguments and results as ``linear_attention_recurrent`` (and ``log_alpha``)."""
    feature_tile(q.shape[-1], MAX_KEY)
    run = forward_launch(q, k, v, BV=64)
    gate, g, Tp = chunk_gates(alpha, log_alpha, run.T, CHUNK, q.dtype)
    aq = channel_scores(run, g, with_keys=False)[0] if gate == GATE_CHANNEL else None
    h, ht, _ = state_pass(run, gate, g, Tp, as_fp32(initial_state))
    return output_pass(run, gate, g, Tp, h, aq), ht


def _log_gates_forward(q, k, v, logs, initial_state):
    """The forward of the Function: (o, final state, chunk-start states h [B*H, NT, V, K])."""
    feature_tile(q.shape[-1], MAX_KEY)
    run = forward_launch(q, k, v, BV=64)
    gate = gate_mode(logs)
    g, Tp = chunk_local_log_gate(logs, CHUNK, q.dtype) if logs is not None else (None, run.T)
    aq = channel_scores(run, g, with_keys=False)[0] if gate == GATE_CHANNEL else None
    h, ht, _ = state_pass(run, gate, g, Tp, as_fp32(initial_state))
    return output_pass(run, gate, g, Tp, h, aq), ht, h


class LinearAttentionFunction(torch.autograd.Function):
    """Linear attention with Triton kernels both ways: apply(q, k, v, logs, initial_state, keep_states).

    ``logs``: fp32 log-gates [B, H, T] or [B, H, T, K] (<= 0), or None; ``initial_state``: [B, H, V,
    K] or None. Returns (o [B, H, T, V] in q's dtype, final state [B, H, V, K] fp32, h): h the
    chunk-start states when ``keep_states``, else None. The forward
    keeps its inputs and the final state; ``keep_states=True`` also keeps the chunk-start states
    h (B*H*cdiv(T, 64)*V*K in ``core.chunk_kernels.state_dtype``), which the backward otherwise
    recomputes with the forward's state pass. Gradients: q, k, v in their dtype, logs fp32, the
    initial state in its dtype.
    """

    @staticmethod
    def forward(q, k, v, logs, initial_state, keep_states=False):
        o, ht, h = _log_gates_forward(q, k, v, logs, initial_state)
        return o, ht, (h if keep_states else None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, logs, initial_state, keep_states = inputs
        _, ht, h = output
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, logs, initial_state, ht, h)
        if h is not None:
            ctx.mark_non_differentiable(h)

    @staticmethod
    def backward(ctx, do, dht, _dh=None):
        from .backward import linear_attention_backward
        # under torch.func the saved tensors and gradients come wrapped (``core.kernels.unwrapped``)
        saved = ctx.saved_tensors                # once: non-reentrant checkpointing unpacks them only once
        refuse_nested_transforms(saved[0], "linear_attention")
        q, k, v, logs, h0, ht, h, do, dht = map(unwrapped, (*saved, do, dht))
        if do is None:
            do = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
        gate = gate_mode(logs)
        need = ctx.needs_input_grad
        if second_order_requested():             # create_graph: differentiable gradients, through the chunk form
            return (*chunk_grads(_chunk_form, (q, k, v, logs, h0), need[:5], (do, dht), create_graph=True), None)

        def kernels():
            g = chunk_local_log_gate(logs, CHUNK, q.dtype)[0] if logs is not None else None
            grads = linear_attention_backward(q, k, v, gate, g, as_fp32(h0), do, dht, h=h,
                                              ht=ht if h is not None else None)
            return [grads.dq if need[0] else None, grads.dk if need[1] else None, grads.dv if need[2] else None,
                    grads.dlog if need[3] else None, grads.dh0.to(h0.dtype) if need[4] else None]
        with torch._C._DisableFuncTorch():       # the buffers the backward allocates are plain tensors too
            grads = backward_or_fallback(kernels, _chunk_form, (q, k, v, logs, h0), need[:5], (do, dht))
        return (*grads, None)


def _chunk_form(q, k, v, logs, initial_state):
    """``LinearAttentionFunction``'s (o, final state) as the chunk form computes it (the backward's fallback)."""
    return linear_attention_chunk(q, k, v, None, initial_state, CHUNK, logs)


def linear_attention_autograd(q, k, v, alpha=None, initial_state=None, log_alpha=None, keep_states=False):
    """``backend="triton"``: the kernels' forward and backward through ``LinearAttentionFunction``.

    Same arguments and results as ``linear_attention_triton``, plus ``keep_states`` (as in
    ``LinearAttentionFunction``: keep the chunk-start states for the backward instead of recomputing
    them). ``alpha``/``log_alpha`` become fp32 log-gates in autograd (clamped below at
    ``core.chunking.LOG_FLOOR`` as everywhere), so their gradients follow. Without gradients it is the
    plain forward. A card that cannot hold the kernels' tiles gets the chunk form from the caller
    (``core.dispatch.call_backend``), and one that cannot hold the backward's, autograd through it
    (``core.dispatch.backward_or_fallback``).
    """
    logs = gate_logs(alpha, log_alpha, torch.float32)
    tensors = (q, k, v, logs, initial_state)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)):
        return linear_attention_triton(q, k, v, None, initial_state, logs)
    o, ht, _ = LinearAttentionFunction.apply(q, k, v, logs, initial_state, keep_states)
    return o, ht
