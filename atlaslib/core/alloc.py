"""Where the kernels' host wrappers allocate their outputs: one hook, ``torch.empty`` by default.

The kernels allocate through ``empty`` below, which calls the module attribute ``allocate``. Tests
replace that attribute (``core.testing.poisoned_outputs``, or the ``poisoned`` fixture in the
test suite) with an allocator that fills new floating-point buffers with NaN, so that an output a
kernel never writes shows up; the library itself never changes it.
"""
from __future__ import annotations

from typing import Any

import torch

allocate = torch.empty


def empty(*shape: Any, **kw: Any) -> torch.Tensor:
    """``allocate(*shape, **kw)``: ``torch.empty`` unless a test has swapped the hook."""
    return allocate(*shape, **kw)
