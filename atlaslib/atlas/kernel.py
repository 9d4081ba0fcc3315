"""The GPU kernel: Newton–Schulz on a batch of momenta, one program per matrix.

The chunk form (``chunk.py``) materialises a chunk's b momenta S_t [V, D] and orthogonalises
them as one batch; everything else in it is a handful of masked matmuls. NS_J is J rounds of
three small matrix products per matrix plus a normalisation, and as separate PyTorch calls
that is 3J + 3 kernel launches over tensors that fit in one program's registers. Here one
program holds one whole matrix and runs all J steps on it:

    b_x = X / (||X||_F + eps)                       (the matrix, transposed when tall: rows <= cols)
    repeat J times:  b_A = b_x b_x^T,   b_x = p0 b_x + (p1 b_A + p2 b_A b_A) b_x

with (p0, p1, p2) the polynomial's coefficients.

The transpose costs nothing: the host swaps the row and column strides. Tiles are powers of
two of at least 16 (what tl.dot takes), padded with zeros, which change neither the norm nor
the products. The arithmetic is fp32, and so are the products (``ns_precision``): exact
(``input_precision="ieee"``), except where the result ends in bf16 (bf16 matrices, and ATLAS's fp32
momenta when q, k, v are bf16), where they are TF32, on tensor cores.

Limits, from builds for sm_80 and sm_90 (``atlaslib.aot``'s ``build``, ptxas's resource report):
the longer side <= ``MAX_SIDE`` = 128 and the shorter (the Gram matrix's) <= ``MAX_SHORT_SIDE`` = 64,
at most three coefficients (p0, p1, p2). A program holds the matrix, its Gram matrix and the
polynomial in registers: at 64 x 64 and 64 x 128 that takes 16 warps (with 4 warps 64 x 64
spills about 1 KB a thread), while 128 x 128 spills tens of KB a thread at any warp count
(128 KB of shared memory, too): those momenta are left to the chunk form's batched matmuls.
``num_warps``: 4 below 32 x 128, 8 at 32 x 128, 16 from a shorter side of 64 (``warps_for``).
What the builds of ``python -m atlaslib.aot --family atlas`` use (fp32 momenta, as the chunk
form passes them; registers a thread on sm_80 / sm_90):

    momenta S [V, K]      tile     warps   shared   registers   spills
    16 x 16               16x16      4      2 KB     38 / 36     none
    20 x 12 (transposed)  16x32      4      3 KB     44 / 44     none
    32 x 128              32x128     8     20 KB     61 / 64     none
    64 x 64               64x64     16     32 KB     62 / 56     none
    64 x 128              64x128    16     48 KB     76 / 72     none
    128 x 64 (transposed) 64x128    16     48 KB     70 / 76     none

With q, k, v in bf16 the same fp32 momenta take TF32 products (``ns_precision``), on tensor cores:
40-128 registers, and spills where fp32 had none, 16-40 B a thread at 64 x 64, 48-124 B at 64 x 128 and
128 x 64 on sm_90 (none on sm_80). bf16 matrices given to ``newton_schulz_triton`` directly build alike
(64 x 128 on sm_90: 140 B).

``atlas_triton`` is the chunk form with this kernel in place of ``core.newton_schulz``
(forward only; ``core.dispatch`` differentiates ``atlas_chunk`` for the backward): same
arguments, same results to fp32 rounding (to TF32's for bf16 inputs: ``ns_precision``).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..core.kernels import dot_tile, intermediate_precision, precision
from ..core.newton_schulz import NORM_EPS, check_ns_steps, ns_coefficients
from ..core.alloc import empty
from ..miras import DEFAULT_CHUNK_SIZE
from .chunk import atlas_chunk

MAX_SIDE = 128
MAX_SHORT_SIDE = 64


def warps_for(BR: int, BC: int) -> int:
    """Warps per program for a [BR, BC] tile (BR <= BC): enough threads that its tiles fit in registers."""
    if BR >= 64:
        return 16
    return 8 if BR * BC >= 4096 else 4


@triton.jit
def newton_schulz_kernel(x_ptr, o_ptr, s_xn, s_xr, s_xc, s_on, s_or, s_oc, R, C, steps, p0, p1, p2, eps,
                         BR: tl.constexpr, BC: tl.constexpr, PRECISION: tl.constexpr):
    """Program i_n: matrix i_n of the batch, read as [R, C] (R <= C) through the given strides."""
    i_n = tl.program_id(0).to(tl.int64)
    o_r = tl.arange(0, BR)
    o_c = tl.arange(0, BC)
    m_x = (o_r < R)[:, None] & (o_c < C)[None, :]
    p_x = x_ptr + i_n * s_xn + o_r[:, None] * s_xr + o_c[None, :] * s_xc
    b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
    b_norm = tl.sqrt(tl.sum(tl.sum(b_x * b_x, axis=1), axis=0))
    b_x = b_x / (b_norm + eps)
    for _ in range(steps):
        b_A = tl.dot(b_x, tl.trans(b_x), input_precision=PRECISION)                   # [BR, BR] Gram
        b_P = p1 * b_A + p2 * tl.dot(b_A, b_A, input_precision=PRECISION)
        b_x = p0 * b_x + tl.dot(b_P, b_x, input_precision=PRECISION)
    p_o = o_ptr + i_n * s_on + o_r[:, None] * s_or + o_c[None, :] * s_oc
    tl.store(p_o, b_x.to(o_ptr.dtype.element_ty), mask=m_x)


def kernel_supports(rows: int, cols: int, ns_coeffs) -> bool:
    """Whether the kernel takes matrices [rows, cols] with these coefficients."""
    return (max(rows, cols) <= MAX_SIDE and min(rows, cols) <= MAX_SHORT_SIDE
            and len(ns_coefficients(ns_coeffs)) <= 3)


def ns_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the kernel's products for a result that ends in ``dtype``.

    TF32 (tensor cores) for bf16, as ``core.kernels.intermediate_precision``; otherwise ``precision``:
    exact fp32 (CUDA cores) unless ``ATLASLIB_TF32=1``. fp16 stays exact because TF32 would cost it
    accuracy here: the five steps' 15 products feed the fp32 memory, not a rounding to the inputs' dtype.
    Measured in the interpreter (which drops TF32's bits as a card does), ATLAS at T = 512, K = V = 64,
    relative RMS of o against an fp64 run on the same 16-bit inputs: bf16 1.93e-3 with TF32 products,
    1.65e-3 exact (o's own rounding); fp16 1.02e-3 with TF32, 2.07e-4 exact.
    """
    return intermediate_precision(dtype) if dtype == torch.bfloat16 else precision(dtype)


def newton_schulz_triton(G: torch.Tensor, ns_steps: int = 5, ns_coeffs="muon",
                         rounded_to: torch.dtype | None = None) -> torch.Tensor:
    """``core.newton_schulz.newton_schulz(G, ns_steps, ns_coeffs)`` for fp32/fp16/bf16 G [..., m, n] on the
    kernel (fp32 arithmetic; result in G's dtype); max(m, n) <= 128, min(m, n) <= 64, at most three
    coefficients. ``rounded_to``: the dtype the result ends in downstream (default G's), which sets the
    products' precision (``ns_precision``)."""
    ns_steps = check_ns_steps(ns_steps)
    poly = ns_coefficients(ns_coeffs)
    if len(poly) > 3:
        raise ValueError(f"the Newton-Schulz kernel takes at most three coefficients (p0, p1, p2), got {len(poly)}")
    p0, p1, p2 = poly + (0.0,) * (3 - len(poly))
    m, n = G.shape[-2:]
    if max(m, n) > MAX_SIDE or min(m, n) > MAX_SHORT_SIDE:
        raise ValueError(f"the Newton-Schulz kernel takes matrices up to {MAX_SHORT_SIDE} x {MAX_SIDE} (either "
                         f"way round), got {m} x {n}; use backend='chunk'")
    if G.dtype == torch.float64:
        raise ValueError("the Newton-Schulz kernel computes in fp32; use backend='chunk' for fp64")
    if ns_steps == 0:
        return G
    x = G.reshape(-1, m, n)
    out = empty(x.shape, dtype=G.dtype, device=G.device)
    if x.shape[0] == 0:
        return out.view(G.shape)
    s_x, s_o = list(x.stride()), list(out.stride())
    R, C = m, n
    if m > n:                                            # tall: iterate on the transpose (swap the strides)
        R, C = n, m
        s_x[1], s_x[2] = s_x[2], s_x[1]
        s_o[1], s_o[2] = s_o[2], s_o[1]
    BR, BC = dot_tile(R), dot_tile(C)
    newton_schulz_kernel[(x.shape[0],)](x, out, *s_x, *s_o, R, C, ns_steps, p0, p1, p2, NORM_EPS,
                                        BR=BR, BC=BC, PRECISION=ns_precision(rounded_to or G.dtype),
                                        num_warps=warps_for(BR, BC), num_stages=1)
    return out.view(G.shape)


def atlas_triton(q, k, v, window=1, G=None, alpha=None, eta=None, theta=None, ns_steps=5, ns_coeffs="muon",
                 initial_state=None, initial_momentum=None, chunk_size=DEFAULT_CHUNK_SIZE, log_alpha=None):
    """The chunk form with Newton–Schulz on the kernel (see the module docstring); as ``atlas_chunk``."""
    orthogonalise = functools.partial(newton_schulz_triton, rounded_to=q.dtype)    # TF32 for a bf16 model
    return atlas_chunk(q, k, v, window, G, alpha, eta, theta, ns_steps, ns_coeffs, initial_state, initial_momentum,
                       chunk_size, log_alpha, orthogonalise=orthogonalise)


__all__ = ["newton_schulz_triton", "atlas_triton", "kernel_supports", "MAX_SIDE"]
