"""Chapter 2: the delta rule family (DeltaNet, Gated DeltaNet, KDA, Longhorn)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..core import check_chunk_size, check_flag, check_qkv, check_state, gate_or_number
from ..core.chunking import compute_dtype
from ..core.dispatch import dispatch, lazy, matrix_kernel_limits
from ..core.gates import alpha_from_log, retention_gates
from ..core.types import Gate, ModelOutput
from ..core.validation import check_shape, check_tensor
from .chunk import delta_rule_chunk
from .recurrent import delta_rule_recurrent

# The chunk form (UT transform) is exact for every chunk size: the default trades speed only.
DEFAULT_CHUNK_SIZE = 64

# Largest delta-rule step accepted. For a unit key the transition I - beta k k^T scales the
# k direction by 1 - beta, which is a contraction (|1 - beta| <= 1) exactly for beta in [0, 2];
# beyond 2 the old memory along k is amplified and flips sign every step.
BETA_MAX = 2.0


def longhorn_beta(beta: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Longhorn's implicit step: beta_t / (1 + beta_t ||k_t||^2), ``beta`` the weight of the proximal term
    (eta_R in the book's notation, ch. 2 §4; the result is the delta rule's step beta_t of the book).

    With this step, one delta-rule update lands exactly on the minimiser of
    1/2 ||v_t - M k_t||^2 + 1/(2 beta_t) ||M - M'_t||_F^2 (implicit / proximal GD), where
    M'_t = M_{t-1} Diag(alpha_t) is the decayed previous state (M_{t-1} without gates).
    beta: [B, H, T] with values >= 0; k: [B, H, T, K]. The result satisfies step * ||k||^2 < 1
    (<= 1 after rounding, by one ulp, reached for a very large beta), so the update never overshoots,
    however large beta is, as long as beta ||k||^2 is finite in the compute dtype (above about 3e38 in
    fp32 it is inf and the step 0: the token writes nothing).
    Computed in fp32 (fp64 if either input is fp64). Shapes are checked here; beta >= 0 is the caller's
    (``delta_rule`` checks it).
    """
    check_shape("beta", beta, tuple(check_tensor("k", k, 4, "[B, H, T, K]").shape[:3]))
    cd = torch.promote_types(torch.promote_types(beta.dtype, k.dtype), torch.float32)
    beta = beta.to(cd)
    return beta / (1.0 + beta * k.to(cd).square().sum(-1))


def delta_table(chunk_size: int) -> dict:
    """The three forms, each taking (q, k, v, beta, alpha, initial_state, log_alpha)."""
    def recurrent(q, k, v, beta, alpha, initial_state, log_alpha):
        return delta_rule_recurrent(q, k, v, beta, alpha_from_log(alpha, log_alpha, compute_dtype(q)), initial_state)

    def chunk(q, k, v, beta, alpha, initial_state, log_alpha):
        return delta_rule_chunk(q, k, v, beta, alpha, initial_state, chunk_size, log_alpha)
    return {"recurrent": recurrent, "chunk": chunk,
            "triton": lazy(f"{__name__}.kernel", "delta_rule_triton", differentiable=True)}


def delta_rule(q: Tensor, k: Tensor, v: Tensor, beta: Tensor | float, *, alpha: Gate = None, longhorn: bool = False,
               initial_state: Tensor | None = None, output_final_state: bool = False, backend: str = "auto",
               chunk_size: int | None = None, log_alpha: Gate = None) -> ModelOutput:
    """The delta rule with optional retention gates: DeltaNet, Gated DeltaNet and KDA.

    M_t = M_{t-1} Diag(alpha_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,  y_t = M_t q_t.

    Each token first decays the memory, then takes one gradient step of size beta_t on
    1/2 ||M k_t - v_t||^2: it overwrites what the memory returned for k_t instead of
    adding to it, which is what separates the delta rule from linear attention.

    Args:
        q, k: [B, H, T, K] queries and keys. Keys are used as given; the usual practice
            (and the regime where beta in [0, 2] means "stable") is l2-normalised keys.
        v: [B, H, T, V] values.
        beta: [B, H, T] step sizes (or one number) in [0, 2] (in [0, inf) when ``longhorn=True``). beta = 1
            with a unit key overwrites the value stored under that key exactly; beta = 0
            skips the write. The cap 2 is where I - beta k k^T stops being a contraction
            for unit keys (eigenvalue 1 - beta along k).
        alpha: retention in [0, 1], or a number for every token. ``None``: DeltaNet. ``[B, H, T]``: Gated DeltaNet, a
            scalar decay per token. ``[B, H, T, K]``: KDA, a per-key-channel decay
            M Diag(alpha_t) applied before the update (diagonal-plus-rank-1 transition).
        log_alpha: the same gate as its log (values <= 0, fp32 or fp64, or a number), instead of alpha;
            never rounded to the activation dtype (a bf16 gate 1 - 2^-12 is exactly 1.0). Train a gate
            through it: a gradient with respect to a small alpha (< 1e-3) can lose its digits in fp32, and
            one below e^-60 (0 included) is 0 in the chunk and Triton forms, as ``linear_attention`` says.
        longhorn: read ``beta`` as the weight eta_R of Longhorn's proximal term (book ch. 2 §4) and use
            ``longhorn_beta(beta, k)`` = beta / (1 + beta ||k||^2) as the delta-rule step;
            the update is then the exact minimiser of
            1/2 ||v - M k||^2 + 1/(2 beta) ||M - M_{t-1} Diag(alpha_t)||^2.
        initial_state: optional [B, H, V, K] start state M_0.
        output_final_state: also return the state after the last token.
        backend: "recurrent" (the per-token definition), "chunk" (chunkwise PyTorch via the
            UT transform, exact for every chunk size), "triton" (GPU kernel; CPU under
            TRITON_INTERPRET=1) or "auto" (triton on CUDA, chunk otherwise). The Triton path
            computes the forward pass and the gradients (of q, k, v, beta, the gates and the
            initial state; the final state's gradient is taken) in kernels
            (``delta.kernel.DeltaRuleFunction``).
        chunk_size: chunk length of the "chunk" backend (None: DEFAULT_CHUNK_SIZE = 64; the kernel uses its own).
            The chunk form is exact for every chunk size: it changes the speed, not the output.

    Returns:
        (o [B, H, T, V] in q's dtype, final state [B, H, V, K] in fp32 (fp64 for fp64 inputs) — or None
        unless requested).
    """
    B, H, T, K, V = check_qkv(q, k, v)
    check_flag("longhorn", longhorn)
    check_flag("output_final_state", output_final_state)
    if beta is None:
        raise TypeError("beta is required: the step sizes, a [B, H, T] tensor or one number")
    steps = gate_or_number("beta", beta, B, H, T, torch.promote_types(q.dtype, torch.float32), q, low=0.0,
                           high=None if longhorn else BETA_MAX)
    alpha, log_alpha = retention_gates(alpha, log_alpha, B, H, T, K, ref=q)
    check_state("initial_state", initial_state, (B, H, V, K), q)
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else check_chunk_size(chunk_size)
    if longhorn and steps is not None:
        steps = longhorn_beta(steps, k)
    o, state = dispatch(backend, q, delta_table(chunk_size), q, k, v, steps, alpha, initial_state, log_alpha,
                        unsupported=lambda: matrix_kernel_limits(q), model="delta_rule")
    return o, (state if output_final_state else None)


__all__ = ["delta_rule", "longhorn_beta", "BETA_MAX", "DEFAULT_CHUNK_SIZE", "delta_rule_recurrent", "delta_rule_chunk"]
