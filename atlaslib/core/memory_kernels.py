"""The set-up the per-head forward kernels of chapters 3, 4 and 6 (and chapter 7's readout) share.

Those kernels have one program per (batch*head, block of BV value channels), the grid
``core.kernels.forward_launch`` gives, and each starts the same way: find its head and its value
channels, move q, k, v, o to that head, and lay out the offsets and masks of its key channels and
of the rows of a chunk. These ``@triton.jit`` helpers (inlined where they are called) do that once;
the arithmetic of each chapter's rule stays in its own kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .kernels import at_head, channel_block, head_program, register_share


@triton.jit
def head_value_block(H, V, BV: tl.constexpr):
    """A program of the grid (B*H, cdiv(V, BV)): its head (i_bh, i_b, i_h, int64, from ``head_program``)
    and its block of BV value channels, axis 1 (offsets o_v and mask m_v: value channels never mix)."""
    i_bh, i_b, i_h = head_program(H)
    o_v, m_v = channel_block(tl.program_id(1), BV, V)
    return i_bh, i_b, i_h, o_v, m_v


@triton.jit
def key_channels(BK: tl.constexpr, K):
    """Offsets 0 .. BK - 1 of all key (feature) channels, and their mask (< K): every program holds whole keys."""
    return channel_block(0, BK, K)


@triton.jit
def qkvo_at_head(q_ptr, k_ptr, v_ptr, o_ptr, s_q, s_k, s_v, s_o, i_b, i_h):
    """q, k, v and o moved to head (i_b, i_h), each through its own strides (views need no copy)."""
    return at_head(q_ptr, s_q, i_b, i_h), at_head(k_ptr, s_k, i_b, i_h), \
        at_head(v_ptr, s_v, i_b, i_h), at_head(o_ptr, s_o, i_b, i_h)


@triton.jit
def chunk_rows(BT: tl.constexpr):
    """Rows 0 .. BT - 1 of a chunk (o_i) and the causal mask [BT, BT] of the chunk: row t sees n <= t."""
    o_i = tl.arange(0, BT)
    return o_i, o_i[:, None] >= o_i[None, :]


def per_head_launch(BT: int) -> dict:
    """Launch options of chapters 3 and 4's per-head kernels (Titans, the Omega rule, SWLA) for chunk tiles
    of BT rows. One pipeline stage: pipelining the chunk loop would multiply the shared memory. Warps:
    the program holds its state slices and several [BT, BT] fp32 tiles, so at BT = 64 it takes 16 warps,
    else 8, each with its ``register_share`` (sm_90 builds, K = V = 64: Titans at BT = 64 spilled 59 KB a
    thread at 4 warps, 4.2 KB now; at BT = 16, 1.1 KB and none; the Omega rule at BT = 64, c = 8,
    33 KB and 2.3 KB)."""
    warps = 16 if BT >= 64 else 8
    return dict(num_stages=1, num_warps=warps, maxnreg=register_share(warps))
