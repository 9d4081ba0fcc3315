"""The suite's stricter interpreter (``tests/interpreter_checks.py``) catches what it claims to catch:
a program that depends on another's output, and a lane outside every tensor argument. Each check is
shown failing on a kernel made to break it, and passing on the same kernel written correctly."""
import pytest
import torch
import triton
import triton.language as tl

import interpreter_checks
from conftest import INTERPRETER_CHECKS

pytestmark = pytest.mark.skipif(not INTERPRETER_CHECKS, reason="the interpreter checks are off")


@triton.jit
def running_copy_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, CHAINED: tl.constexpr):
    """y = cumulative block sums of x; CHAINED reads the previous program's output (a GPU race)."""
    i = tl.program_id(0)
    o = i * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b = tl.sum(tl.load(x_ptr + o, mask=m, other=0.0))
    if CHAINED:
        if i > 0:
            b += tl.load(y_ptr + i - 1)
    else:
        for j in range(0, i):
            b += tl.sum(tl.load(x_ptr + j * BLOCK + tl.arange(0, BLOCK), mask=j * BLOCK + tl.arange(0, BLOCK) < N,
                                other=0.0))
    tl.store(y_ptr + i, b)


@triton.jit
def copy_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if MASKED:
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < N), mask=o < N)
    else:
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < N))


def block_sums(chained: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(100)
    y = torch.zeros(4)
    running_copy_kernel[(4,)](x, y, 100, BLOCK=32, CHAINED=chained)
    return y, torch.stack([x[: 32 * (i + 1)].sum() for i in range(4)])


def test_a_program_reading_another_programs_output_gets_a_wrong_result():
    y, expected = block_sums(chained=True)
    assert not torch.allclose(y, expected)             # the first program ran last: its output came late


def test_independent_programs_pass_in_reversed_order():
    y, expected = block_sums(chained=False)
    torch.testing.assert_close(y, expected)


def test_a_store_past_the_end_is_caught_with_its_program():
    x, y = torch.rand(40), torch.zeros(40)
    outside = r"store outside every tensor argument in program \(1, 0, 0\)"     # program 1 stores y[32:64]
    with pytest.raises(triton.runtime.errors.InterpreterError, match=outside):
        copy_kernel[(2,)](x, y, 40, BLOCK=32, MASKED=False)


def test_a_view_is_bounded_by_its_own_extent_not_its_storage():
    x = torch.rand(64)
    y = torch.zeros(64)
    with pytest.raises(triton.runtime.errors.InterpreterError, match="outside every tensor argument"):
        copy_kernel[(1,)](x[:20], y[:20], 20, BLOCK=32, MASKED=False)  # reads and writes bytes 20..31 of a view
    copy_kernel[(1,)](x[:20], y[:20], 20, BLOCK=32, MASKED=True)
    torch.testing.assert_close(y[:20], x[:20])


def test_masked_lanes_are_not_checked():
    x, y = torch.rand(40), torch.zeros(40)
    copy_kernel[(2,)](x, y, 40, BLOCK=32, MASKED=True)
    torch.testing.assert_close(y, x)


def test_the_checks_can_be_turned_off():
    interpreter_checks.checking(False)
    try:
        y, expected = block_sums(chained=True)
        torch.testing.assert_close(y, expected)        # index order: the chain happens to work
    finally:
        interpreter_checks.checking(True)
