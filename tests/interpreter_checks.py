"""Two things a GPU does that Triton's interpreter does not, checked while the tests run in it.

* **Programs run in any order, at once.** The interpreter runs the grid's programs one after another in
  index order, so a kernel whose program reads what an earlier program of the same launch wrote passes
  there and fails (or races) on a card. ``install`` makes the interpreter run every grid backwards,
  which reverses the order of every pair of programs: such a dependency then shows as a wrong result,
  and two programs that write one address leave the other value behind.
* **An address outside every tensor is a fault, or someone else's data.** The interpreter loads and
  stores through raw host pointers, so an unmasked lane past the end of a buffer reads whatever lies
  there. ``install`` checks every active lane of every load and store against the extents of the
  launch's tensor arguments and raises ``OutOfBounds`` (with the program and the address) otherwise.

``tests/conftest.py`` installs both for the whole suite when ``TRITON_INTERPRET=1``, except for the
exercise tests, whose deliberately wrong kernels must meet the interpreter as a learner's notebook
does (``checking(False)``). The hooks replace methods of Triton's interpreter (the pinned version's
``GridExecutor`` and ``InterpreterBuilder``); ``install`` fails loudly if they are gone.
"""
import numpy as np
import torch
from triton.runtime import interpreter

ENABLED = [True]
EXTENTS: list[tuple[int, int]] = []      # [first byte, one past the last byte] of each tensor argument


class OutOfBounds(RuntimeError):
    """A load or store lane outside every tensor argument of the launch."""


def checking(on: bool) -> None:
    """Turn the reversed order and the bounds check on or off (both are installed once)."""
    ENABLED[0] = on


def extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a (possibly strided) tensor spans: from its first element to the end of its last."""
    if t.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from tensors(y)


def check_lanes(ptrs, mask, what: str) -> None:
    if not ENABLED[0]:
        return
    addresses = np.asarray(ptrs.data).astype(np.uint64)
    active = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
    addresses = addresses[active]
    if addresses.size == 0:
        return
    size = ptrs.get_element_ty().primitive_bitwidth // 8
    inside = np.zeros(addresses.shape, dtype=bool)
    for lo, hi in EXTENTS:
        inside |= (addresses >= lo) & (addresses + size <= hi)
    if not inside.all():
        outside = [hex(int(a)) for a in addresses[~inside][:4]]
        raise OutOfBounds(f"{what} outside every tensor argument in program "
                          f"{interpreter.interpreter_builder.grid_idx}: {outside} (tensors at "
                          f"{[(hex(lo), hi - lo) for lo, hi in EXTENTS]}, start and bytes)")


def install() -> None:
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    for cls, name in ((executor, "_init_args_hst"), (builder, "set_grid_idx"),
                      (builder, "create_masked_load"), (builder, "create_masked_store")):
        assert hasattr(cls, name), f"Triton's interpreter has no {cls.__name__}.{name}: update {__file__}"
    init_args, set_grid_idx = executor._init_args_hst, builder.set_grid_idx
    load, store = builder.create_masked_load, builder.create_masked_store

    def init_args_recording_extents(self, args, kwargs):
        host_args, host_kwargs = init_args(self, args, kwargs)
        EXTENTS[:] = [e for t in tensors([host_args, list(host_kwargs.values())]) if (e := extent(t))]
        return host_args, host_kwargs

    def set_grid_idx_backwards(self, x, y, z):
        if ENABLED[0]:
            x, y, z = (n - 1 - i for n, i in zip(self.grid_dim, (x, y, z)))
        set_grid_idx(self, x, y, z)

    def checked_load(self, ptrs, mask, *args, **kwargs):          # tensor descriptors pass keywords
        check_lanes(ptrs, mask, "load")
        return load(self, ptrs, mask, *args, **kwargs)

    def checked_store(self, ptrs, value, mask, *args, **kwargs):
        check_lanes(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args, **kwargs)

    executor._init_args_hst = init_args_recording_extents
    builder.set_grid_idx = set_grid_idx_backwards
    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
