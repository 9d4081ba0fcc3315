"""Chapter 1: linear attention and the gated Hebbian family (RetNet, Mamba2, GLA)."""
from __future__ import annotations

import functools

import torch

from ..core import check_chunk_size, check_gate, check_qkv, check_state, resolve_backend, with_chunk_backward
from ..core.dispatch import matrix_kernel_limits
from .chunk import linear_attention_chunk
from .recurrent import linear_attention_recurrent


def linear_attention(q, k, v, *, alpha=None, normalize=False, initial_state=None,
                     output_final_state=False, backend="auto", chunk_size=64):
    """Causal linear attention with optional retention gates.

    M_t = M_{t-1} alpha_t + v_t k_t^T,  y_t = M_t q_t (read after the update).

    Args:
        q, k: [B, H, T, K] queries and keys, already passed through any feature map phi.
        v: [B, H, T, V] values.
        alpha: retention, values in [0, 1]. ``None``: plain linear attention.
            ``[B, H, T]``: one scalar per token (RetNet with a constant, Mamba2-style when
            data-dependent). ``[B, H, T, K]``: per-key-channel decay M Diag(alpha_t) (GLA).
        normalize: divide by z_t^T q_t with z_t = z_{t-1} alpha_t + k_t. Implemented by
            storing z as one extra value row (a value of constant 1), so the state then has
            shape [B, H, V+1, K] with z^T in its last row. Needs features with z^T q > 0
            (e.g. elu+1), otherwise the division is undefined.
        initial_state: optional [B, H, V, K] (or [B, H, V+1, K] when normalize) start state.
        output_final_state: also return the state after the last token.
        backend: "recurrent" (the per-token definition), "chunk" (chunkwise PyTorch, exact
            for every chunk size), "triton" (GPU kernel; CPU under TRITON_INTERPRET=1) or
            "auto" (triton on CUDA, chunk otherwise). The Triton path computes the forward
            pass in the kernel and its backward by autograd through the chunk form.
        chunk_size: chunk length of the "chunk" backend.

    Returns:
        (o [B, H, T, V] in q's dtype, final state in fp32 — or None unless requested).
    """
    B, H, T, K, V = check_qkv(q, k, v)
    check_gate("alpha", alpha, B, H, T, K, ref=q)
    Vs = V + 1 if normalize else V
    check_state("initial_state", initial_state, (B, H, Vs, K), q)
    check_chunk_size(chunk_size)
    backend = resolve_backend(backend, q, unsupported=lambda: matrix_kernel_limits(q))
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    if backend == "recurrent":
        o, state = linear_attention_recurrent(q, k, v, alpha, initial_state)
    elif backend == "chunk":
        o, state = linear_attention_chunk(q, k, v, alpha, initial_state, chunk_size)
    else:
        from .kernel import linear_attention_triton
        chunk = functools.partial(linear_attention_chunk, chunk_size=chunk_size)
        o, state = with_chunk_backward(linear_attention_triton, chunk, q, k, v, alpha, initial_state)
    if normalize:
        o = (o[..., :V].float() / o[..., V:].float()).to(o.dtype)
    return o, (state if output_final_state else None)


__all__ = ["linear_attention", "linear_attention_recurrent", "linear_attention_chunk"]
