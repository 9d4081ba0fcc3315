"""Host-side helpers shared by the Triton kernels of every chapter (imported by the ``kernel.py`` rooms only).

* gate modes: how a kernel is told what kind of retention it gets (a constexpr, so each kind
  is compiled separately and the others cost nothing);
* ``chunk_local_log_gate``: log-gates accumulated within each chunk of the kernel's tile,
  padded to whole chunks with 0 (padding keeps everything, so a chunk's last row is its end);
* ``precision``: IEEE fp32 products for fp32 inputs, TF32 for half-precision inputs.
"""
from __future__ import annotations

import torch
import triton

GATE_NONE, GATE_SCALAR, GATE_CHANNEL = 0, 1, 2


def gate_mode(logs) -> int:
    """GATE_NONE for no gate, GATE_SCALAR for [B, H, T] log-gates, GATE_CHANNEL for [B, H, T, K]."""
    if logs is None:
        return GATE_NONE
    return GATE_SCALAR if logs.dim() == 3 else GATE_CHANNEL


def chunk_local_log_gate(logs: torch.Tensor, BT: int):
    """Log-gates [B, H, T] or [B, H, T, K] accumulated within each chunk of BT tokens, in fp32.

    Returns (g [B, H, Tp(, K)], Tp) with T padded to Tp, a multiple of BT, by log-gate 0: row
    start + BT - 1 of every chunk then exists and holds the chunk's total decay.
    """
    logs = logs.to(torch.float32)
    T = logs.shape[2]
    Tp = triton.cdiv(T, BT) * BT
    pad = [0, 0, 0, Tp - T] if logs.dim() == 4 else [0, Tp - T]
    logs = torch.nn.functional.pad(logs, pad)
    shape = logs.shape
    return logs.view(*shape[:2], Tp // BT, BT, *shape[3:]).cumsum(3).view(shape).contiguous(), Tp


def precision(dtype: torch.dtype) -> str:
    """``input_precision`` of tl.dot: exact fp32 products for fp32 inputs, TF32 for fp16/bf16."""
    return "ieee" if dtype == torch.float32 else "tf32"
