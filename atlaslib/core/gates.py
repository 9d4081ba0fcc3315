"""Retention gates given either as ``alpha`` in [0, 1] or as ``log_alpha`` <= 0.

Every model function (``linear_attention`` ... ``memory_caching``, and the mixers) that takes ``alpha``
also takes ``log_alpha``; the per-token loops and DOT's coefficient forms take ``alpha`` only. The log is the form that
survives low precision: the largest bf16 number below 1 is 1 - 2^-8, so every gate above
1 - 2^-9 (1 - 2^-12, say) is exactly 1.0 in bf16 and a memory meant to forget over thousands
of tokens never forgets, while its log, -2.4e-4, is an ordinary number in any float format.
``log_alpha`` must therefore come in fp32 or fp64 and is never rounded to the activation dtype; the chunk
forms and kernels use it as it is (``core.chunking.gate_logs``), the per-token loops get exp(log_alpha) in their compute
dtype (fp32/fp64, which does hold 1 - 2^-12; fp32's spacing below 1 is 6e-8, so there a gate within 3e-8
of 1 is exactly 1 and the ones near it step by 6e-8: use fp64 or a chunk form for such gates).
"""
from __future__ import annotations

import math
import numbers

import torch

from .validation import check_gate, check_one_retention

LOG_GATE_DTYPES = (torch.float32, torch.float64)


def check_retention(alpha, log_alpha, B: int, H: int, T: int, K: int | None = None, *, ref: torch.Tensor):
    """Validate a retention gate given as ``alpha`` (values in [0, 1]) or ``log_alpha`` (values <= 0).

    Both go through ``check_gate`` (shape [B, H, T], or [B, H, T, K] when K is given; device; NaN;
    range). At most one of the two may be given, and ``log_alpha`` must be fp32 or fp64.
    """
    check_one_retention(alpha, log_alpha)
    check_gate("alpha", alpha, B, H, T, K, ref=ref)
    check_gate("log_alpha", log_alpha, B, H, T, K, low=-math.inf, high=0.0, ref=ref)
    if log_alpha is not None and log_alpha.dtype not in LOG_GATE_DTYPES:
        raise TypeError(f"log_alpha must be fp32 or fp64 (a log-gate rounded to {log_alpha.dtype} loses the "
                        f"small decays it exists to keep), got {log_alpha.dtype}")


def alpha_from_log(alpha, log_alpha, cd: torch.dtype) -> torch.Tensor | None:
    """The gate itself, for the forms that multiply by alpha (the per-token loops).

    ``alpha`` is returned unchanged when it was given; otherwise exp(log_alpha) in the compute dtype
    ``cd`` (fp32 or fp64, never the activation dtype), or None when neither was given.
    """
    if log_alpha is None:
        return alpha
    return torch.exp(log_alpha.to(cd))


def retention_gates(alpha, log_alpha, B: int, H: int, T: int, K: int | None = None, *,
                    ref: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``check_retention`` for a gate given as a tensor *or a number*; returns (alpha, log_alpha).

    A number becomes one value per token, a [B, H, T] tensor in the compute dtype (fp32, fp64 for
    fp64 ``ref``) on ``ref``'s device: alpha must lie in [0, 1], log_alpha be <= 0. Tensors pass
    through ``check_retention`` unchanged; None stays None.
    """
    cd = torch.promote_types(ref.dtype, torch.float32)
    if _is_number(alpha):
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
        alpha = torch.full((B, H, T), float(alpha), dtype=cd, device=ref.device)
    if _is_number(log_alpha):
        if not float(log_alpha) <= 0.0:
            raise ValueError(f"log_alpha must be <= 0, got {log_alpha}")
        log_alpha = torch.full((B, H, T), float(log_alpha), dtype=cd, device=ref.device)
    check_retention(alpha, log_alpha, B, H, T, K, ref=ref)
    return alpha, log_alpha


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
