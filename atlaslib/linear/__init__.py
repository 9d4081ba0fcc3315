"""Chapter 1: linear attention and the gated Hebbian family (RetNet, Mamba2, GLA)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..core import check_chunk_size, check_flag, check_qkv, check_state
from ..core.chunking import compute_dtype
from ..core.dispatch import choose_backend, dispatch, lazy, matrix_kernel_limits
from ..core.gates import alpha_from_log, retention_gates
from ..core.types import Gate, ModelOutput
from .chunk import linear_attention_chunk
from .recurrent import linear_attention_recurrent

# The chunk form is exact for every chunk size, so this default only trades speed, never the output.
DEFAULT_CHUNK_SIZE = 64


def linear_table(chunk_size: int) -> dict:
    """The three forms, each taking (q, k, v, alpha, initial_state, log_alpha)."""
    def recurrent(q, k, v, alpha, initial_state, log_alpha):
        return linear_attention_recurrent(q, k, v, alpha_from_log(alpha, log_alpha, compute_dtype(q)), initial_state)

    def chunk(q, k, v, alpha, initial_state, log_alpha):
        return linear_attention_chunk(q, k, v, alpha, initial_state, chunk_size, log_alpha)
    return {"recurrent": recurrent, "chunk": chunk,
            "triton": lazy(f"{__name__}.kernel", "linear_attention_autograd", differentiable=True)}


def linear_attention(q: Tensor, k: Tensor, v: Tensor, *, alpha: Gate = None, normalize: bool = False,
                     initial_state: Tensor | None = None, output_final_state: bool = False, backend: str = "auto",
                     chunk_size: int | None = None, log_alpha: Gate = None) -> ModelOutput:
    """Causal linear attention with optional retention gates.

    M_t = M_{t-1} alpha_t + v_t k_t^T,  y_t = M_t q_t (read after the update).

    Args:
        q, k: [B, H, T, K] queries and keys, already passed through any feature map phi.
        v: [B, H, T, V] values.
        alpha: retention, values in [0, 1]. ``None``: plain linear attention. A number: that gate at every token.
            ``[B, H, T]``: one scalar per token (RetNet with a constant, Mamba2-style when
            data-dependent). ``[B, H, T, K]``: per-key-channel decay M Diag(alpha_t) (GLA).
        normalize: divide by z_t^T q_t with z_t = z_{t-1} alpha_t + k_t. Implemented by
            storing z as one extra value row (a value of constant 1), so the state then has
            shape [B, H, V+1, K] with z^T in its last row. Needs features with z^T q > 0
            (e.g. elu+1), otherwise the division is undefined. For 16-bit inputs the PyTorch forms
            divide in fp32 and round the quotient once; the Triton kernel returns numerator and
            denominator in its input dtype, so its quotient is rounded twice (about 2x the error).
        log_alpha: the same gate as its log (values <= 0, fp32 or fp64, same shapes as alpha, or a number),
            instead of alpha. It is never rounded to the activation dtype: in a bf16 model a gate
            1 - 2^-12 is exactly 1.0 as bf16 alpha but still decays as log_alpha. Train a gate through
            log_alpha: the chunk forms and kernel work with log-gates, so a gradient with respect to alpha
            itself is d/dlog(alpha) / alpha and, in fp32, can lose its digits for small gates (alpha < 1e-3).
            Every form but the loop floors the log-gate at -60 (``core.chunking.LOG_FLOOR``): a gate below
            e^-60, 0 included, is a full reset there and gets a gradient of 0 (the loop: the one-sided
            derivative). The same holds for the gates of chapters 2-6 (alpha, and theta of MIRAS/ATLAS).
        initial_state: optional [B, H, V, K] (or [B, H, V+1, K] when normalize) start state.
        output_final_state: also return the state after the last token.
        backend: "recurrent" (the per-token definition), "chunk" (chunkwise PyTorch, exact
            for every chunk size), "triton" (GPU kernel; CPU under TRITON_INTERPRET=1) or
            "auto" (triton on CUDA, chunk otherwise). The Triton path runs kernels both ways
            (``linear.kernel.LinearAttentionFunction``: the forward's kernels, and the backward
            kernels of ``linear.backward``).
        chunk_size: chunk length of the "chunk" backend (None: DEFAULT_CHUNK_SIZE = 64). The chunk form is exact
            for every chunk size: it changes the speed, not the output.

    Returns:
        (o [B, H, T, V] in q's dtype, final state in fp32 (fp64 for fp64 inputs) — or None unless requested).
    """
    B, H, T, K, V = check_qkv(q, k, v)
    check_flag("normalize", normalize)
    check_flag("output_final_state", output_final_state)
    alpha, log_alpha = retention_gates(alpha, log_alpha, B, H, T, K, ref=q)
    Vs = V + 1 if normalize else V
    check_state("initial_state", initial_state, (B, H, Vs, K), q)
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else check_chunk_size(chunk_size)
    table, out_dtype = linear_table(chunk_size), q.dtype
    unsupported = lambda: matrix_kernel_limits(q)                                 # noqa: E731
    backend = choose_backend(backend, q, table, unsupported=unsupported, model="linear_attention")
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        if backend != "triton":
            # the PyTorch forms compute in fp32 anyway: numerator and denominator stay fp32 until the
            # quotient is rounded once (the kernel returns them in its input dtype)
            q, k, v = (x.to(compute_dtype(q)) for x in (q, k, v))
    o, state = dispatch(backend, q, table, q, k, v, alpha, initial_state, log_alpha, unsupported=unsupported,
                        model="linear_attention")
    if normalize:
        cd = compute_dtype(o)
        o = o[..., :V].to(cd) / o[..., V:].to(cd)
    return o.to(out_dtype), (state if output_final_state else None)


__all__ = ["linear_attention", "linear_attention_recurrent", "linear_attention_chunk", "DEFAULT_CHUNK_SIZE"]
