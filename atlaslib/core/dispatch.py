"""Backend choice shared by every model: ``recurrent | chunk | triton | auto``.

One dispatcher serves every chapter. A public function describes its model by a table
``{backend name: function}`` whose functions all take the same positional inputs, plus, when the
table has a "triton" entry, a predicate ``unsupported()`` naming what its kernel refuses; then

    o, state = dispatch(backend, q, table, *inputs, unsupported=..., model="delta_rule")

validates the name, picks the backend (``choose_backend``) and runs it (``call_backend``): the
"triton" entry runs forward only, with gradients by autograd through the table's "chunk" entry
(``with_chunk_backward``), so the two must compute the same function — unless the entry has
backward kernels of its own (``lazy(..., differentiable=True)``; linear attention's and the delta rule's).

``auto`` runs the Triton kernel on CUDA tensors and the chunkwise PyTorch form on CPU.
The Triton kernels run on CPU only under Triton's interpreter, which must be switched on
*before* ``atlaslib`` is imported (``TRITON_INTERPRET=1``), because ``triton.jit``
decides at decoration time whether it builds a GPU kernel or an interpreted one.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import warnings

import torch

BACKENDS = ("recurrent", "chunk", "triton", "auto")
# Every backend name some model has (chapter 3 adds its frozen-gradient oracle): asking a model
# for one of these that it lacks is "not available here", anything else is a misspelling.
KNOWN_BACKENDS = ("recurrent", "frozen_seq", "chunk", "triton", "auto")


# Frames in these folders are the library's own: a warning about the user's call points past them.
# torch is among them because the library calls back into itself through it (an autograd
# Function's apply, nn.Module.__call__ around a mixer).
LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,        # atlaslib/
                os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)                  # torch/


def warn_at_caller(message: str, category=RuntimeWarning):
    """``warnings.warn`` attributed to the user's line: the first frame outside atlaslib (and torch).

    A fixed ``stacklevel`` cannot do it: ``linear_attention`` and ``miras`` reach the warning
    through different numbers of calls, a mixer through ``nn.Module.__call__`` as well, and the
    kernel's fallback through ``ChunkBackward.apply``.
    """
    frame, level = sys._getframe(1), 2                       # stacklevel 2: our caller's frame
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(backend, x: torch.Tensor, unsupported=None) -> str:
    """Turn ``backend`` into one of ``recurrent``, ``chunk`` or ``triton`` for tensor ``x``.

    ``unsupported``: a function of no arguments that says which of these inputs the kernel does
    not take (a phrase such as "fp64 inputs"), or returns None. Every chapter behaves the same:
    ``auto`` on CUDA runs the kernel where it takes the inputs and otherwise the chunk form, with a
    warning saying why; an explicit ``"triton"`` leaves the refusal to the kernel, which raises.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if not (x.is_cuda and triton_importable()):
            return "chunk"
        reason = unsupported() if unsupported is not None else None
        if reason:
            warn_at_caller(f"backend='auto': the Triton kernel does not take {reason}; using the chunk form")
            return "chunk"
        return "triton"
    if backend == "triton":
        if not triton_importable():
            raise RuntimeError("backend='triton' needs the triton package (pip install -r requirements.txt)")
        if not x.is_cuda and not interpreter_on():
            raise RuntimeError(
                "backend='triton' on CPU tensors needs Triton's interpreter: set the environment "
                "variable TRITON_INTERPRET=1 before importing atlaslib (or move the tensors to a GPU)")
    return backend


def choose_backend(backend, x: torch.Tensor, table: dict, *, unsupported=None, model: str = "this model",
                   missing: str | None = None) -> str:
    """The name of the backend of ``table`` that runs for ``backend`` on inputs like ``x``.

    ``table``: the model's backends ``{name: function}`` ("auto" is never an entry; every model has
    "chunk"). ``"auto"`` is the kernel where ``resolve_backend`` allows it (CUDA, and inputs the kernel
    takes by ``unsupported``), else "chunk"; a model with no kernel at all runs "chunk" without a
    warning, since there is nothing to fall back from. An explicit name the model lacks raises a
    ValueError naming ``model``, the reason ``missing`` (if given) and the backends it does have.
    """
    available = tuple(table) + ("auto",)
    if not isinstance(backend, str) or backend not in available:
        if isinstance(backend, str) and backend in KNOWN_BACKENDS:
            why = f": {missing}" if missing else ""
            raise ValueError(f"{model} has no backend {backend!r}{why}; its backends are "
                             f"{', '.join(map(repr, available))}")
        raise ValueError(f"backend must be one of {available}, got {backend!r}")
    if backend == "auto" and "triton" not in table:
        return "chunk"
    if backend in ("auto", "triton"):
        return resolve_backend(backend, x, unsupported=unsupported)
    return backend


def call_backend(name: str, table: dict, *inputs):
    """Run ``table[name](*inputs)``. A kernel entry marked ``differentiable`` (``lazy(...,
    differentiable=True)``: it has backward kernels of its own) runs as it is (or, where the card
    cannot hold its tiles, the chunk form: ``forward_or_fallback``); any other runs
    forward-only, differentiated through ``table["chunk"]``."""
    if name == "triton":
        if getattr(table["triton"], "differentiable", False):
            return forward_or_fallback(table["triton"], table["chunk"], *inputs)
        return with_chunk_backward(table["triton"], table["chunk"], *inputs)
    return table[name](*inputs)


def dispatch(backend, x: torch.Tensor, table: dict, *inputs, unsupported=None, model: str = "this model",
             missing: str | None = None):
    """``choose_backend`` then ``call_backend``: every chapter's public function ends with this call.

    A kernel runs with ``x``'s GPU as the current device: Triton launches on the current device and its
    stream, not on the device of the tensors it is given (a model on cuda:1 while cuda:0 is current).
    """
    name = choose_backend(backend, x, table, unsupported=unsupported, model=model, missing=missing)
    with without_autocast(x):
        if name == "triton":
            with on_the_inputs_gpu(x):
                return call_backend(name, table, *inputs)
        return call_backend(name, table, *inputs)


def without_autocast(x: torch.Tensor):
    """Autocast off for the library's forms: they choose their own precision (``compute_dtype``: fp32 sums
    and states for 16-bit inputs), and autocast's per-op casts would round the fp32 state to bf16 or mix
    dtypes inside one in-place product. A model run under ``torch.autocast`` hands its bf16 q, k, v over
    as a ``.to(torch.bfloat16)`` model would."""
    kind = x.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def on_the_inputs_gpu(x: torch.Tensor):
    """Where a kernel launches: ``x``'s GPU made the current device (Triton launches on the current device
    and its stream, not on the device of the tensors it is given), or nothing to do off a GPU. Every call
    of a kernel that does not go through ``dispatch`` runs inside it."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def lazy(module: str, name: str, differentiable: bool = False):
    """``module.name``, imported when called: kernel modules import triton, which a CPU-only
    installation may lack, so a backend table names its kernel without importing it.
    ``differentiable``: the function has its own backward (``call_backend`` then runs it as it is)."""
    def call(*args):
        return getattr(importlib.import_module(module), name)(*args)
    call.__name__ = call.__qualname__ = name          # what forward_or_fallback's warning prints
    call.differentiable = differentiable              # type: ignore[attr-defined]
    return call


def matrix_kernel_limits(q: torch.Tensor, max_key: int = 256):
    """What every chapter's kernel refuses: fp64 inputs (they compute in fp32), or keys (features)
    wider than ``max_key``. Kernels with more limits (tile sizes) check those after this."""
    if q.dtype == torch.float64:
        return "fp64 inputs (it computes in fp32)"
    if q.shape[-1] > max_key:
        return f"head size K={q.shape[-1]} (at most {max_key})"
    return None


class ChunkBackward(torch.autograd.Function):
    """Forward with a Triton kernel, backward by autograd through the chunkwise PyTorch form.

    The backward recomputes the chunk form from the saved inputs and differentiates it:
    the gradients are those of the same function (the two forwards agree to rounding),
    with no hand-written Triton backward. Under ``create_graph=True`` the gradients are
    themselves differentiable (``second_order_requested``). ``forward_triton`` and
    ``forward_chunk`` take the same positional tensors (``None`` allowed) and return a
    tuple of tensors.
    """

    @staticmethod
    def forward(ctx, forward_triton, forward_chunk, *inputs):
        ctx.forward_chunk = forward_chunk
        ctx.save_for_backward(*[t if isinstance(t, torch.Tensor) else None for t in inputs])
        ctx.is_tensor = [isinstance(t, torch.Tensor) for t in inputs]
        ctx.others = [None if isinstance(t, torch.Tensor) else t for t in inputs]
        with torch.no_grad():
            outs = forward_or_fallback(forward_triton, forward_chunk, *inputs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        inputs = [s if is_t else o for s, is_t, o in zip(ctx.saved_tensors, ctx.is_tensor, ctx.others)]
        needs = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
        return (None, None, *chunk_grads(ctx.forward_chunk, inputs, needs, grad_outs,
                                         create_graph=second_order_requested()))


def second_order_requested() -> bool:
    """True inside a backward that runs with ``create_graph=True`` (a gradient penalty, a Hessian-vector
    product), outside ``torch.func``, whose transforms take this library's Functions to first order only."""
    return torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()


def chunk_grads(forward_chunk, inputs, needs, grad_outs, create_graph: bool = False) -> list:
    """The gradients of ``forward_chunk(*inputs)`` (outputs met by ``grad_outs``) for the inputs whose
    ``needs`` is true, by autograd through the recomputed chunk form; None for the others.

    ``create_graph``: differentiate through views of the inputs (not detached copies) and keep the graph,
    so that the gradients can be differentiated again (second order through the chunk form). Views, not
    the inputs themselves: an input made from another (k and beta = f(k), q is k) would otherwise get the
    gradient of both paths here, and the outer graph adds the other path again."""
    if create_graph:
        xs = [x.view_as(x) if need and isinstance(x, torch.Tensor) else x for x, need in zip(inputs, needs)]
    else:
        xs = [x.detach().requires_grad_(need) if isinstance(x, torch.Tensor) else x for x, need in zip(inputs, needs)]
    wrt = [x for x, need in zip(xs, needs) if need and isinstance(x, torch.Tensor)]
    with torch.enable_grad():
        outs = forward_chunk(*xs)
        pairs = [(o, g) for o, g in zip(outs, grad_outs) if o is not None and g is not None and o.requires_grad]
        grads = (torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True,
                                     create_graph=create_graph)
                 if pairs and wrt else [None] * len(wrt))
    it = iter(grads)
    return [next(it) if need and isinstance(x, torch.Tensor) else None for x, need in zip(xs, needs)]


def forward_or_fallback(forward_triton, forward_chunk, *inputs):
    """``forward_triton(*inputs)``, or the chunk form with a warning if the card cannot run it.

    Every tile configuration is built ahead of time for sm_80 and sm_90 (``python -m
    atlaslib.aot``) and fits there. On a card with less shared memory per block (consumer GPUs
    allow 99 KB) the kernels take narrower tiles (``core.kernels.narrow_tiles``), and the builds
    for sm_86 show a few fp32 configurations that still do not fit (``aot.CHUNK_FORM_ON``): a
    card refuses those at launch, and the same function is computed by the chunk form instead
    of failing.
    """
    from triton.runtime.errors import OutOfResources

    try:
        return forward_triton(*inputs)
    except OutOfResources as exc:
        warn_at_caller(f"{getattr(forward_triton, '__name__', 'the Triton kernel')} does not fit this GPU "
                       f"({exc}); using the chunk form instead")
        return forward_chunk(*inputs)


def backward_or_fallback(backward_triton, forward_chunk, inputs, needs, grad_outs) -> list:
    """``backward_triton()`` (the gradients of ``inputs``), or, if the card cannot hold the backward
    kernels' tiles, ``chunk_grads`` with a warning: ``forward_or_fallback`` for a Function whose forward
    fitted the card and whose backward kernels, which hold more tiles at once, do not."""
    from triton.runtime.errors import OutOfResources

    try:
        return backward_triton()
    except OutOfResources as exc:
        warn_at_caller(f"the backward kernels do not fit this GPU ({exc}); gradients by autograd through "
                       f"the chunk form instead")
        return chunk_grads(forward_chunk, inputs, needs, grad_outs)


def with_chunk_backward(forward_triton, forward_chunk, *inputs):
    """Run ``forward_triton`` and attach the chunk-form backward when gradients are needed. Under a
    ``torch.func`` transform (``grad``, ``vjp``, ``vmap``), which takes an autograd Function only in the form
    with ``setup_context``, the chunk form runs itself: the same function, which the transform differentiates."""
    if torch._C._are_functorch_transforms_active():
        return forward_chunk(*inputs)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return ChunkBackward.apply(forward_triton, forward_chunk, *inputs)
    return forward_or_fallback(forward_triton, forward_chunk, *inputs)
