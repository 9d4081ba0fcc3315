"""What the Triton kernels of every chapter share (imported by the ``kernel.py`` modules only).

Most chapters' forward kernels have one program per (batch*head, block of BV value channels),
walking the chunks of its sequence in order with its slice of the state in registers; chapters
1 and 2 split theirs into chunk-parallel kernels (``core.chunk_kernels``). Every host wrapper
does the same set-up around its own inputs, and this module holds it once:

* ``forward_launch``: refuses fp64, allocates the output o [B, H, T, V] (and, through
  ``ForwardLaunch.state``, fp32 final states [B, H, V, K]) with ``core.alloc.empty`` so the
  tests can poison them, and gives the grid (B*H, cdiv(V, BV)) of a one-program-per-head kernel,
  the strides of q, k, v, o and the ``tl.dot`` precision. The kernels index q, k, v through their
  strides, so views (the mixers hand in [B, T, H, K] tensors transposed to [B, H, T, K]) are read in place;
* tiles: ``dot_tile`` (the smallest power-of-two tile tl.dot takes), ``feature_tile`` (every
  program holds all K key channels: refuse K past the kernel's limit), ``value_tile`` (BV,
  capped per kernel; wider V is split across programs). Each kernel keeps its own limits, with
  the measurements behind them, in its module;
* the card's shared memory: every tile is sized for the 163 KB a program may use on an A100 (an H100
  allows 227 KB). ``narrow_tiles`` says when the card allows less (99 KB on sm_86 / sm_89 / sm_120 cards:
  RTX 3090, 4090, 5090), where the kernels that would not fit take narrower tiles;
* gate modes: how a kernel is told what kind of retention it gets (a constexpr, so each kind
  is compiled separately and the others cost nothing). The names are ``tl.constexpr`` values,
  the only module globals a kernel may read; on the host they compare equal to the ints 0, 1, 2;
* ``chunk_local_log_gate``: log-gates accumulated within each chunk of the kernel's tile,
  padded to whole chunks with 0 (padding keeps everything, so a chunk's last row is its end), in
  fp64 for fp32 inputs (``gate_sum_dtype``);
  ``chunk_gates`` turns alpha or log_alpha into (gate mode, g, Tp) for the kernels of
  chapters 1 and 2;
* ``precision``: the ``input_precision`` of tl.dot on fp32 operands, exact unless
  ``ATLASLIB_TF32=1`` opts in to TF32;
* ``as_fp32``: optional inputs (gates, start states) as contiguous fp32, ``None`` left as
  ``None``. Kernels take an absent input as a ``None`` pointer: Triton specialises it as a
  constexpr, so ``if h0_ptr is not None:`` is decided when the kernel is compiled.

And, inside the kernels (``@triton.jit`` functions, inlined where they are called):
``head_program``/``chunk_program``/``chunk_block_program`` give a program's head (and chunk, and
block of channels), ``chunk_tokens`` a chunk's rows and tokens, ``channel_block`` a block of
channels, ``chunk_state`` a chunk's stored state h[c], ``chunk_log_gates`` a chunk's log-gates g
and g_n (its last row), ``decay`` the fp32 e^x of a difference x of them, ``at_head`` moves a pointer
to the program's head through the batch and head strides,
``load_block``/``load_tile``/``store_tile`` read and write a masked [rows, channels] block of that
head through the token and channel strides (``load_block`` in the tensor's dtype, ``load_tile``
in fp32), ``state_slice``/``load_state`` give the
program's [BV, BK] slice of a contiguous fp32 state (zeros when none is given).

Names inside the kernels follow fla and the Triton tutorials: ``b_`` a block of values held by
the program (b_q, b_M), ``p_`` a block of pointers, ``o_`` offsets (o_t: token indices,
o_k: key channels), ``m_`` masks, ``s_`` strides, ``i_`` program indices.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from .chunking import gate_logs
from .alloc import empty
from .interpreter import as_a_gpu

as_a_gpu()      # under TRITON_INTERPRET=1 the kernels' products, casts and masked loads as on a card

GATE_NONE = tl.constexpr(0)       # no retention: M <- M + v k^T
GATE_SCALAR = tl.constexpr(1)     # log-gates [B, H, T]: one decay per token
GATE_CHANNEL = tl.constexpr(2)    # log-gates [B, H, T, K]: one decay per token and key channel

# Offsets inside one head are 32-bit in the kernels (the head's own base is 64-bit): a head's
# tokens and channels must span fewer elements than this.
MAX_HEAD_SPAN = 2**31


# ---------------------------------------------------------------------------------------
# Inside the kernels: one program's head, its tiles and its state slice
# ---------------------------------------------------------------------------------------
@triton.jit
def at_head(ptr, strides, i_b, i_h):
    """``ptr`` moved to head (i_b, i_h) of a [B, H, T, C] tensor with these (batch, head, token,
    channel) strides; with i_b, i_h int64 the offset is 64-bit, as later heads need."""
    return ptr + i_b * strides[0] + i_h * strides[1]


@triton.jit
def head_program(H):
    """(i_bh, i_b, i_h) of a program whose axis 0 enumerates batch*head, in int64 (offsets of later
    heads can exceed 2^31)."""
    i_bh = tl.program_id(0).to(tl.int64)
    return i_bh, i_bh // H, i_bh % H


@triton.jit
def chunk_program(NT, H):
    """(i_bh, i_c, i_b, i_h) of a program whose axis 0 enumerates (batch*head, chunk) pairs, in int64
    (offsets of later heads can exceed 2^31)."""
    i_p = tl.program_id(0).to(tl.int64)
    i_bh = i_p // NT
    return i_bh, i_p % NT, i_bh // H, i_bh % H


@triton.jit
def channel_block(i, BN: tl.constexpr, N):
    """Offsets i * BN + [0, BN) of block i of N channels (or tokens), and their mask (< N)."""
    o_n = i * BN + tl.arange(0, BN)
    return o_n, o_n < N


@triton.jit
def chunk_tokens(i_c, BT: tl.constexpr, T):
    """(o_i, o_t, m_t) of chunk i_c: its rows 0..BT-1, their tokens i_c * BT + o_i, and which are < T."""
    o_i = tl.arange(0, BT)
    o_t = i_c * BT + o_i
    return o_i, o_t, o_t < T


@triton.jit
def chunk_block_program(NT, H, T, BT: tl.constexpr, BN: tl.constexpr, N):
    """A program of (batch*head, chunk) on axis 0 and block of BN channels (of N) on axis 1:
    chunk_program's (i_bh, i_c, i_b, i_h), chunk_tokens' (o_i, o_t, m_t) and the block's (o_n, m_n)."""
    i_bh, i_c, i_b, i_h = chunk_program(NT, H)
    o_i, o_t, m_t = chunk_tokens(i_c, BT, T)
    o_n, m_n = channel_block(tl.program_id(1), BN, N)
    return i_bh, i_c, i_b, i_h, o_i, o_t, m_t, o_n, m_n


@triton.jit
def chunk_state(ptr, i_bh, i_c, NT, V, K):
    """``ptr`` moved to h[c] (or dh[c]) of head i_bh in a contiguous [B*H, NT, V, K] buffer of chunk states."""
    return ptr + (i_bh * NT + i_c) * V * K


@triton.jit
def chunk_log_gates(g_ptr, i_bh, i_c, o_t, o_k, m_k, Tp, K, BT: tl.constexpr, GATE: tl.constexpr):
    """(g, g_n): chunk-local log-gates at tokens o_t and at the chunk's last row; [BT] and a scalar
    (GATE_SCALAR, g [B*H, Tp]), or [BT, BK] and [BK] on key channels o_k (GATE_CHANNEL, g [B*H, Tp, K])."""
    # g is padded to Tp (whole chunks) with log-gate 0, so the last row i_c*BT+BT-1 always exists
    t_n = i_c * BT + BT - 1
    if GATE == GATE_SCALAR:
        b_g = tl.load(g_ptr + i_bh * Tp + o_t)
        b_gn = tl.load(g_ptr + i_bh * Tp + t_n)
    else:
        g_ptr += i_bh * Tp * K
        b_g = tl.load(g_ptr + o_t[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_gn = tl.load(g_ptr + t_n * K + o_k, mask=m_k, other=0.0)
    return b_g, b_gn


@triton.jit
def decay(b_log):
    """e^x in fp32 for a log-decay x made of chunk-local log-gate sums: for fp32 inputs the sums are fp64
    (``gate_sum_dtype``), and x, a difference g_t - g_i, is rounded only here, after it is taken."""
    return tl.exp(b_log.to(tl.float32))


@triton.jit
def load_state_tile(ptr, o_v, o_k, m_v, m_k, K):
    """The [BV, BK] slice (rows o_v, columns o_k) of one stored [V, K] state, h[c] or dh[c]; 0 where masked."""
    return tl.load(ptr + o_v[:, None] * K + o_k[None, :], mask=m_v[:, None] & m_k[None, :], other=0.0)


@triton.jit
def load_block(ptr, strides, o_rows, o_cols, m_rows, m_cols):
    """The block (rows o_rows, channels o_cols) of the head ``ptr`` points at, in its own dtype; 0 where masked."""
    p_x = ptr + o_rows[:, None] * strides[2] + o_cols[None, :] * strides[3]
    return tl.load(p_x, mask=m_rows[:, None] & m_cols[None, :], other=0.0)


@triton.jit
def load_tile(ptr, strides, o_rows, o_cols, m_rows, m_cols):
    """The block (rows o_rows, channels o_cols) of the head ``ptr`` points at, in fp32; 0 where masked."""
    return load_block(ptr, strides, o_rows, o_cols, m_rows, m_cols).to(tl.float32)


@triton.jit
def store_tile(ptr, strides, o_rows, o_cols, m_rows, m_cols, b_x):
    """Write block b_x (rows o_rows, channels o_cols) of the head ``ptr`` points at, in its dtype."""
    p_x = ptr + o_rows[:, None] * strides[2] + o_cols[None, :] * strides[3]
    tl.store(p_x, b_x.to(ptr.dtype.element_ty), mask=m_rows[:, None] & m_cols[None, :])


@triton.jit
def state_slice(i_bh, o_v, o_k, V, K):
    """Offsets and mask of one program's [BV, BK] slice of a contiguous [B, H, V, K] state."""
    return i_bh * V * K + o_v[:, None] * K + o_k[None, :], (o_v < V)[:, None] & (o_k < K)[None, :]


@triton.jit
def load_state(ptr, o_s, m_s, BV: tl.constexpr, BK: tl.constexpr):
    """A program's fp32 state slice from ``ptr``, or zeros when there is none (``ptr`` None)."""
    b_M = tl.zeros([BV, BK], dtype=tl.float32)
    if ptr is not None:
        b_M += tl.load(ptr + o_s, mask=m_s, other=0.0)
    return b_M



# ---------------------------------------------------------------------------------------
# On the host
# ---------------------------------------------------------------------------------------
def gate_mode(logs) -> int:
    """GATE_NONE for no gate, GATE_SCALAR for [B, H, T] log-gates, GATE_CHANNEL for [B, H, T, K] (as an int)."""
    if logs is None:
        return GATE_NONE.value
    return (GATE_SCALAR if logs.dim() == 3 else GATE_CHANNEL).value


def gate_sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the chunk-local log-gate sums a kernel with inputs of ``dtype`` gets: fp64 for fp32.

    After resets (log-gates at the floor, -60) or strong decays the sums g_t lie far below 0, and an
    fp32 difference g_t - g_i keeps only the digits their size leaves (a quarter of the gates at 0,
    T = 96: outputs 1e-5 relative from the fp64 definition, 100x the fp32 loop's error). From fp64
    sums the kernels take each difference before rounding it (``decay``), as the PyTorch chunk forms
    do (``chunking.cumulative_logs``). 16-bit inputs get fp32 sums: their own rounding (4e-3 for
    bf16) dwarfs 1e-5, and the gate tiles of their kernels stay half the size. The cost for fp32, in sm_90
    builds (``python -m atlaslib.aot``): most kernels spill 0-30 B a thread more, the per-channel state
    passes up to twice as much (linear attention at K = 100: 224 -> 560 B; the delta rule at K = 256:
    0.65 -> 1.3 KB), and the per-channel output, dv and WY kernels take 32 KB more shared memory (up
    to 145 KB, within an A100's 163 KB); no time measured on a card yet.
    """
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else torch.float64


def chunk_local_log_gate(logs: torch.Tensor, BT: int, dtype: torch.dtype):
    """Log-gates [B, H, T] or [B, H, T, K] accumulated within each chunk of BT tokens, for inputs of ``dtype``.

    Returns (g [B, H, Tp(, K)], Tp) with T padded to Tp, a multiple of BT, by log-gate 0: row
    start + BT - 1 of every chunk then exists and holds the chunk's total decay. The sums are taken
    in fp64 and stored in ``gate_sum_dtype(dtype)``: fp64 for fp32 inputs, fp32 for 16-bit ones.
    """
    logs = logs.to(torch.float64)
    T = logs.shape[2]
    Tp = triton.cdiv(T, BT) * BT
    pad = [0, 0, 0, Tp - T] if logs.dim() == 4 else [0, Tp - T]
    logs = torch.nn.functional.pad(logs, pad)
    shape = logs.shape
    g = logs.view(*shape[:2], Tp // BT, BT, *shape[3:]).cumsum(3).view(shape)
    return g.to(gate_sum_dtype(dtype)).contiguous(), Tp


def chunk_gates(alpha, log_alpha, T: int, BT: int, dtype: torch.dtype):
    """A retention (``alpha`` or ``log_alpha``, or neither) as kernels with chunks of BT tokens and inputs of
    ``dtype`` take it.

    Returns (GATE, g, Tp): the gate mode; the chunk-local log-gates g [B, H, Tp(, K)]
    (``chunk_local_log_gate``), or None without a gate; T padded to whole chunks (Tp = T without a gate).
    """
    logs = gate_logs(alpha, log_alpha, torch.float32)
    gate = gate_mode(logs)
    if logs is None:
        return gate, None, T
    return (gate, *chunk_local_log_gate(logs, BT, dtype))


# Set ATLASLIB_TF32=1 to let tl.dot round fp32 operands to TF32 (faster on tensor cores, about
# 3 decimal digits per product): an explicit opt-in, read at each launch.
TF32_ENV = "ATLASLIB_TF32"


def precision(dtype: torch.dtype) -> str:
    """``input_precision`` of tl.dot for a kernel whose inputs have this dtype.

    It applies only to products of fp32 operands: "ieee" ("exact fp32 products" in this library: the
    operands keep all 24 bits of their fp32 mantissa, where TF32 keeps 11, and every product and sum is
    rounded to fp32 as on a CPU), for fp32 inputs and the fp32 intermediates of half-precision kernels
    (one exception: the products of ``intermediate_precision``); "tf32" only when ``ATLASLIB_TF32=1``
    is set. bf16/fp16 tiles given to tl.dot as they are run on bf16/fp16 tensor cores with fp32
    accumulation whatever this says. (``dtype`` is kept so a kernel's choice reads as a function
    of its inputs.)
    """
    return "tf32" if os.environ.get(TF32_ENV) == "1" else "ieee"


def intermediate_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of products between fp32 intermediates whose result is rounded to the inputs'
    dtype right after: the delta rule's triangular inverse R (and its gradient), Titans' decay product
    D_alpha D_theta, the Omega rule's gate matrix C (and, for bf16 only, Newton-Schulz: ``atlas.kernel``).
    The deep kernel's read, whose fp32 weights are not rounded next, has its own rule
    (``deep.kernel.weights_precision``).

    For fp32 inputs these products are exact like the rest ("ieee", or TF32 under ``ATLASLIB_TF32=1``:
    ``precision``). For bf16/fp16 inputs they are TF32, on tensor cores: exact fp32 products run on the
    CUDA cores, at about 1/15 of an H100's bf16 tensor-core rate (the delta rule's inverse, 2.6 MFLOP per
    chunk, would cost more than the forward's 11.5 MFLOP of bf16 products at K = V = 128), while the
    result is rounded to the inputs' dtype next (a bf16 mantissa is 3 bits shorter than TF32's, fp16's
    as long), so the TF32 error stays below the rounding that follows it. For fp16 it is about as large:
    with decays, Titans' and the Omega rule's fp16 outputs are 2.4x-2.8x their own rounding (bf16's 1.7x);
    three TF32 products ("tf32x3") brought them to 1.7x but doubled the spills of 64-token chunks
    (``tests/test_miras_kernel.py``, ``tests/test_omega.py``), so fp16 keeps one.
    """
    return "tf32" if dtype in (torch.bfloat16, torch.float16) else precision(dtype)


def as_fp32(x):
    """An optional gate or state as a contiguous fp32 tensor (the kernels index it densely), or None."""
    return None if x is None else x.to(torch.float32).contiguous()


def unwrapped(x):
    """``x`` without torch.func's wrappers (``None`` stays ``None``).

    An autograd Function's backward under ``torch.func.grad`` receives its saved tensors and
    gradients wrapped for the transform; a kernel reads raw memory, so the backward of a kernel
    Function unwraps them and runs under ``torch._C._DisableFuncTorch()`` (first order only: the
    backward is not itself differentiated).
    """
    return _unwrap_levels(x)[0]


def _unwrap_levels(x):
    """(``x`` without torch.func's wrappers, how many there were)."""
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor
    levels = 0
    while x is not None and is_functorch_wrapped_tensor(x):
        x, levels = get_unwrapped(x), levels + 1
    return x, levels


def refuse_nested_transforms(x, name: str) -> None:
    """Raise if ``x`` (a tensor a kernel Function's backward saved) is wrapped by more than one torch.func
    level: the backward unwraps them all for its kernels, so an outer grad (grad of grad, jacrev of jacrev)
    would see the gradient as a constant and return 0 instead of failing."""
    levels = _unwrap_levels(x)[1]
    if levels > 1:
        raise RuntimeError(f"{name}: the Triton backward is first order under torch.func ({levels} nested "
                           "transforms here); for higher derivatives use backend='chunk', or plain autograd "
                           "with create_graph=True")


def dot_tile(n: int) -> int:
    """A tile covering n rows or channels: a power of two, and at least 16, the least tl.dot takes."""
    return max(16, triton.next_power_of_2(n))


def feature_tile(K: int, limit: int, what: str = "K") -> int:
    """BK = dot_tile(K), after refusing K > limit (every program holds all K channels of its state)."""
    if K > limit:
        raise ValueError(f"the Triton kernel supports {what} <= {limit}, got {what}={K}; use backend='chunk'")
    return dot_tile(K)


def register_share(num_warps: int) -> int:
    """``maxnreg`` for the serial kernels (state passes, per-head chunk loops): a program's share of an
    SM's 64K 32-bit registers at ``num_warps`` warps, at most 255 a thread.

    Left to itself, ptxas sometimes settles on 32 registers a thread for these programs and spills
    kilobytes (sm_90 builds: Titans' kernel at chunks of 64, 59 KB a thread; the fp32 state pass at
    K = 60, V = 100, 9.6 KB). At this share two programs fit an SM at 4 warps and one at 8 or more,
    and their grids (one program per head and block of the state) are no larger than that at the book's
    and the benchmark's sizes: on an H100 (132 SMs) at B = 4, H = 16, K = V = 128 in bf16, the linear
    state pass launches 256 programs of 4 warps, the delta rule's 128 of 8. So a program gives up no
    occupancy by taking every register it may have (Titans: 3.8-4.2 KB spilled at 16 warps; the state
    pass: 1.3-1.5 KB at 8). The interpreter ignores it.
    """
    return min(255, 65536 // (32 * num_warps))


# The shared memory one program may use on an A100, which every default tile configuration fits
# (``atlaslib.aot`` builds each one for sm_80 and sm_90). A card that allows less gets narrower tiles
# where a kernel needs them (``narrow_tiles``); a kernel that still does not fit raises OutOfResources
# at launch, and ``core.dispatch`` runs the chunk form instead, with a warning.
FULL_SHARED_MEMORY = 163 * 1024
_ASSUMED_SHARED_MEMORY = contextvars.ContextVar("assumed_shared_memory", default=None)


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device``: the card's opt-in maximum per block
    (the number Triton checks at launch), ``FULL_SHARED_MEMORY`` off a GPU (the interpreter has no
    limit), or what ``assume_shared_memory`` set."""
    assumed = _ASSUMED_SHARED_MEMORY.get()
    if assumed is not None:
        return assumed
    if device.type != "cuda":
        return FULL_SHARED_MEMORY
    return _card_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _card_shared_memory(index: int) -> int:
    from triton.compiler import max_shared_mem
    return max_shared_mem(index)


def narrow_tiles(x: torch.Tensor) -> bool:
    """Whether the kernels launched on ``x``'s device take their narrower tiles: the card lets a
    program use less shared memory than an A100 (99 KB on RTX 3090 / 4090 / 5090 cards)."""
    return shared_memory(x.device) < FULL_SHARED_MEMORY


@contextlib.contextmanager
def assume_shared_memory(nbytes: int):
    """Choose tiles as for a card that lets a program use ``nbytes`` of shared memory, whatever the
    device: ``atlaslib.aot`` builds each target's tiles this way, and the tests run the narrow ones
    in the interpreter."""
    token = _ASSUMED_SHARED_MEMORY.set(nbytes)
    try:
        yield
    finally:
        _ASSUMED_SHARED_MEMORY.reset(token)


def value_tile(V: int, widest: int) -> int:
    """BV: value channels per program, dot_tile(V) but at most ``widest``; more programs share a wider V."""
    return max(16, min(widest, triton.next_power_of_2(V)))


@dataclasses.dataclass(frozen=True)
class ForwardLaunch:
    """What a forward kernel's launch needs besides its own inputs (see ``forward_launch``).

    ``q, k, v``: the inputs as the kernel reads them (views kept as they are); ``o``: the output
    [B, H, T, V] in q's dtype; ``strides``: four (batch, head, token, channel) tuples, for
    q, k, v and o, each passed as one kernel argument; ``grid``: (B*H, cdiv(V, BV)); ``B, H, T, K, V``:
    the sizes (K is q's feature width, D in chapter 4).
    """
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    strides: tuple
    grid: tuple
    BV: int
    precision: str
    B: int
    H: int
    T: int
    K: int
    V: int

    def state(self) -> torch.Tensor:
        """A new final state [B, H, V, K] in fp32, for the kernel to write."""
        return empty(self.B, self.H, self.V, self.K, dtype=torch.float32, device=self.q.device)


def forward_launch(q, k, v, BV: int, name: str = "the Triton kernel") -> ForwardLaunch:
    """The set-up every forward wrapper shares, for q, k [B, H, T, K] and v [B, H, T, V].

    Refuses fp64 (the kernels accumulate in fp32), allocates o, and takes the strides of q, k,
    v, o: any layout is read in place. Only a view whose one head spans 2^31 elements or more
    (e.g. a [B, T, H, K] tensor with T * H * K >= 2^31) is copied to a contiguous one first,
    since offsets inside a head are 32-bit; for the same reason T, padded to whole chunks of 64,
    times K and times V must stay below 2^31.
    """
    if q.dtype == torch.float64:
        raise TypeError(f"{name} takes fp32/fp16/bf16 inputs (it accumulates in fp32), got float64: "
                        f"use backend='chunk' for fp64")
    B, H, T, K = q.shape
    V = v.shape[-1]
    q, k, v = within_head_span(q, k, v)
    # the kernels pad T to whole chunks (at most 64 tokens) in their per-head buffers (gates, w, u, ...)
    Tp = triton.cdiv(T, 64) * 64
    if max(Tp * K, Tp * V) >= MAX_HEAD_SPAN:
        raise ValueError(f"{name} indexes a head with 32-bit offsets: T (padded to a multiple of 64) * K "
                         f"and * V must be below 2^31, got T={T}, K={K}, V={V}")
    o = empty(B, H, T, V, dtype=q.dtype, device=q.device)
    return ForwardLaunch(q, k, v, o, tuple(tuple(x.stride()) for x in (q, k, v, o)),
                         (B * H, triton.cdiv(V, BV)), BV, precision(q.dtype), B, H, T, K, V)


def within_head_span(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each x [B, H, T, C] as it is, or as a contiguous copy if one head spans 2^31 elements or more in
    memory (a [B, T, H, C] view with T * H * C >= 2^31): the kernels index inside a head with 32-bit
    offsets. Forward and backward launchers pass every [B, H, T, C] input through it."""
    return tuple(x if _head_span(x) < MAX_HEAD_SPAN else x.contiguous() for x in xs)


def _head_span(x: torch.Tensor) -> int:
    """How many elements one head of x [B, H, T, C] spans in memory (its last element's offset + 1)."""
    return 1 + sum((n - 1) * s for n, s in zip(x.shape[2:], x.stride()[2:]))
