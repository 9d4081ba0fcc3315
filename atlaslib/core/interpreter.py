"""Triton's interpreter made to compute as a GPU does, where the two differ in ways a test can see.

``as_a_gpu`` swaps three methods of the interpreter's builder (Triton 3.7): ``tl.dot``, casts to bf16 and
masked loads, and gives ``tl.dot`` a card's smallest inner dimension. The library's kernels install it
when ``core.kernels`` is imported, the exercises when ``atlaslib.exercises`` is (a learner's kernel meets
the same interpreter); it changes nothing for compiled kernels, and nothing when called twice. The
library imports ``core.kernels`` at its first kernel launch, not at ``import atlaslib``; from then on, for
the rest of the process, every interpreted kernel computes this way, a reader's own too. Call ``as_a_gpu()``
first where a kernel of your own must not give other numbers after the library's first launch.
"""
from __future__ import annotations

import numpy as np


# NaNs that say where they came from: a 6-bit payload just below the quiet bit (the top of the mantissa, so
# casts between float widths keep it, as bf16's 7 mantissa bits leave room for 6 of them). Copies keep it,
# and so does arithmetic with one NaN operand (x86); an invalid operation (0/0, inf - inf, inf * 0) makes
# the default NaN, payload 0. The exercises' checks read it to name a NaN's likely cause.
QUIET_NAN = {"float16": (0x7E00, 10), "bfloat16": (0x7FC0, 7), "float32": (0x7FC0_0000, 23),
             "float64": (0x7FF8_0000_0000_0000, 52)}          # the quiet NaN's bits, the mantissa's width
UNDEFINED_LANE = 0b010101     # a masked-off lane of a load without other=
NEVER_STORED = 0b101010       # an output entry no store reached (the exercises' output buffers)


def nan_bits(dtype: str, payload: int) -> int:
    """The bits of the quiet NaN of ``dtype`` ("float32", "bfloat16", ...) carrying ``payload`` (< 64)."""
    quiet, mantissa = QUIET_NAN[dtype]
    return quiet | payload << (mantissa - 7)


def as_a_gpu() -> None:
    """Make Triton's interpreter treat bf16 tiles, TF32 products and masked-off lanes as a GPU does, in
    ``tl.dot``, in casts and in masked loads.

    The interpreter (triton 3.7) stores bf16 tiles as their raw 16 bits (uint16 arrays): its ``tl.dot``
    multiplies those integers, and it truncates fp32 to bf16 where a GPU rounds to the nearest. So
    ``tl.dot`` here converts both operands to fp32 first (exact: a bf16 value is an fp32 value with a
    shorter mantissa, and so is the product of two; this is what bf16 tensor cores compute, with fp32
    accumulation), and fp32 -> bf16 casts round to nearest even. It also ignores ``input_precision``: a
    "tf32" product of fp32 tiles comes out exact. Here its operands lose the low 13 of their 23 mantissa
    bits first, as a compiled Triton kernel's do (its TF32 tensor-core instructions read fp32 registers and
    drop those bits: a truncation, not a rounding), so a test in the interpreter sees the TF32 error a card
    makes. A "tf32x3" product (on a card, three TF32 products of each operand split into its TF32 part and
    the rest, about 2^-21 relative) is exact here, as an "ieee" one. And a masked load without ``other``
    fills its masked-off lanes with 0, where a card leaves them undefined (whatever the register held): a
    kernel that sums over them is right here and wrong on a card. Here those lanes hold NaN (floats, with
    the payload ``UNDEFINED_LANE``; the largest value for integers), so every result they reach shows it.
    And ``tl.dot`` needs an inner dimension of at least 16 (32 for 8-bit operands), as a card's compiler
    does (the interpreter takes 1: a product of a column by a row ran here and did not compile for a GPU).
    Compiled kernels are untouched.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
        builder, convert, handle = interpreter.InterpreterBuilder, interpreter._convert_float, interpreter.TensorHandle
    except (ImportError, AttributeError):        # another Triton: leave it as it is
        return
    if getattr(builder.create_dot, "as_a_gpu", False):
        return
    dot, cast, masked_load = builder.create_dot, builder.cast_impl, builder.create_masked_load

    def as_fp32(x):
        if x.dtype == tl.bfloat16:
            return handle(convert(x.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)
        return x

    def as_tf32(x):
        if x.dtype != tl.float32:
            return x
        bits = np.ascontiguousarray(x.data, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
        return handle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if getattr(input_precision, "name", str(input_precision)).upper() == "TF32":
            a, b = as_tf32(a), as_tf32(b)
        return dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)   # to nearest, ties to even
            nan = np.isnan(src.data)
            return handle(np.where(nan, np.uint16(0x7FC0), rounded).astype(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    def undefined_lanes(ptrs):
        dtype = ptrs.get_element_ty()
        np_dtype = interpreter._get_np_dtype(dtype)
        if dtype == tl.bfloat16:                    # bf16 is held as its 16 bits: NaN's
            fill = np.uint16(nan_bits("bfloat16", UNDEFINED_LANE))
        elif np_dtype.kind == "f":
            fill = np.array(nan_bits(np_dtype.name, UNDEFINED_LANE), dtype=f"u{np_dtype.itemsize}").view(np_dtype)
        elif np_dtype.kind in "iu":
            fill = np.iinfo(np_dtype).max
        else:                                       # booleans: any value is a value
            return None
        return handle(np.full(ptrs.data.shape, fill, dtype=np_dtype), dtype)

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):   # tensor descriptors pass keywords
        return masked_load(self, ptrs, mask, undefined_lanes(ptrs) if other is None else other, *args, **kwargs)

    def min_dot_size(lhs, rhs):                 # a card's: an inner dimension of at least 16 (32 for 8-bit)
        return 1, 1, 32 if lhs.scalar.primitive_bitwidth == 8 else 16

    create_dot.as_a_gpu = True
    builder.create_dot, builder.cast_impl, builder.create_masked_load = create_dot, cast_impl, create_masked_load
    # the builder the interpreter made at import, which every launch uses (not the class: its __init__ ran)
    shared = getattr(interpreter, "interpreter_builder", None)
    if shared is not None and "min_dot_size" in getattr(shared, "codegen_fns", {}):
        shared.codegen_fns["min_dot_size"] = min_dot_size
