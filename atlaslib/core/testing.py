"""Helpers for tests, exercises and notebooks: relative error, NaN poisoning, random inputs."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from . import alloc

# Relative-RMSE thresholds by dtype: fp32 references agree to rounding; low precision
# kernels accumulate in fp32 but round their inputs and outputs.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero); a and b of one shape (no broadcasting)."""
    if a.shape != b.shape:
        raise ValueError(f"rel_rmse compares tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.detach().double(), b.detach().double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def assert_close(actual, expected, tol: float | None = None, name: str = "output", scale=None):
    """Assert ``rel_rmse(actual, expected) <= tol`` with a message that says where they differ.

    ``scale``: measure the error against ||scale|| instead of ||expected||. Rounding errors of a
    sum are bounded relative to the sum of the terms' magnitudes, not to the sum itself, so a
    result that cancels (a dot product close to zero) should be judged against the same
    computation on absolute values.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if tol is None:
        tol = TOLERANCE.get(actual.dtype, 1e-5)
    if torch.isnan(actual).any() and not torch.isnan(expected).any():
        idx = torch.nonzero(torch.isnan(actual))[0].tolist()
        raise AssertionError(f"{name}: NaN at index {idx} (an output the code never wrote?)")
    if not torch.isfinite(expected).all():
        idx = torch.nonzero(~torch.isfinite(expected))[0].tolist()
        raise AssertionError(f"{name}: the reference is not finite at index {idx} (inputs outside the stable regime?)")
    err = rel_rmse(actual, expected)
    if scale is not None:
        err *= expected.detach().double().norm().item() / scale.detach().double().norm().item()
    if not err <= tol:
        diff = (actual.double() - expected.double()).abs()
        idx = torch.nonzero(diff == diff.max())[0].tolist()
        raise AssertionError(
            f"{name}: relative RMSE {err:.3g} > {tol:.3g}{'' if scale is None else ' (against the scale)'}; "
            f"largest difference {diff.max().item():.3g} "
            f"at index {idx} (got {actual[tuple(idx)].item():.6g}, expected {expected[tuple(idx)].item():.6g})")
    return err


def assert_within_rounding(actual, expected, dtype: torch.dtype, times: float, name: str = "output"):
    """Assert that ``actual``, computed from ``dtype`` inputs, is within ``times`` the error that rounding
    ``expected`` (fp64, from the same inputs) to ``dtype`` makes: what a kernel's 16-bit products cost,
    measured against what storing its result in that dtype costs anyway."""
    own = rel_rmse(expected.to(dtype), expected)
    if own == 0:
        raise ValueError(f"{name}: the reference is exact in {dtype}, so its rounding is no yardstick; "
                         "draw inputs whose result is not")
    err = rel_rmse(actual, expected)
    if not err <= times * own:
        raise AssertionError(f"{name}: relative error {err:.2e} is {err / own:.2f} times the {dtype} rounding of the "
                             f"result ({own:.2e}); at most {times} allowed")


def nan_filled(allocate):
    """An allocator like ``allocate`` whose floating-point buffers come back filled with NaN."""
    def nan_empty(*shape, **kw) -> torch.Tensor:
        x = allocate(*shape, **kw)
        if x.is_floating_point():
            x.fill_(float("nan"))
        return x
    return nan_empty


@contextlib.contextmanager
def poisoned_outputs():
    """Inside this block, the kernels' buffers (``core.alloc.empty``) are NaN-filled, so unwritten
    outputs show up. It swaps the allocation hook ``core.alloc.allocate`` and restores it after."""
    old = alloc.allocate
    alloc.allocate = nan_filled(old)
    try:
        yield
    finally:
        alloc.allocate = old


def random_qkv(B=2, H=2, T=37, K=12, V=10, *, dtype=torch.float32, device="cpu", seed=None,
               normalize_keys=True, generator=None):
    """Fresh random q, k, v of shapes [B,H,T,K], [B,H,T,K], [B,H,T,V]; q and k l2-normalised by default
    (``normalize_keys``). Drawn on the CPU (``generator``: a CPU generator) and moved to ``device``, so a
    draw is the same on every device."""
    gen = generator if generator is not None else torch.Generator().manual_seed(
        int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed)
    q = torch.randn(B, H, T, K, generator=gen)
    k = torch.randn(B, H, T, K, generator=gen)
    v = torch.randn(B, H, T, V, generator=gen)
    if normalize_keys:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def random_gate(B, H, T, K=None, *, low=0.8, high=1.0, dtype=torch.float32, device="cpu", generator=None):
    """Retention gates uniform in [low, high]: [B,H,T] if K is None, else [B,H,T,K]; drawn on the CPU (a CPU
    ``generator``) and moved to ``device``, as ``random_qkv``."""
    shape = (B, H, T) if K is None else (B, H, T, K)
    u = torch.rand(*shape, generator=generator)
    return (low + (high - low) * u).to(device=device, dtype=dtype)


def window_gate(gamma, t: int, i: int):
    """gamma_i^{(t)} [B, H], the weight of pair i in token t's window loss, for the oracles: per source
    token (gamma [B, H, T]) gamma[i], per offset (gamma [B, H, T, c]) gamma[t, t - i]; 1 without gates."""
    if gamma is None:
        return 1.0
    return gamma[:, :, i] if gamma.dim() == 3 else gamma[:, :, t, t - i]


def assert_causal_mixer(mixer, x, t: int, generator=None):
    """A token mixer on x [B, T, d] (requires_grad): the output has x's shape and is finite, changing token t
    leaves every earlier output alone and changes the later ones, and a loss on the output gives x and every
    parameter a finite gradient."""
    y = mixer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    x2 = x.detach().clone()
    x2[:, t] += torch.randn(x.shape[0], x.shape[-1], generator=generator).to(x.device, x.dtype)   # CPU draw
    y2 = mixer(x2)
    assert torch.allclose(y[:, :t], y2[:, :t], atol=1e-5), f"token {t} changed an earlier output"
    assert not torch.allclose(y[:, t:], y2[:, t:], atol=1e-5), f"token {t} changed no output"
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    missing = [n for n, p in mixer.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"no (finite) gradient for {missing}"


def window_l2_grad(W, k, v, t: int, window: int, gamma=None):
    """By autograd, for the oracles: the gradient at W [B, H, V, D] of token t's window loss
    sum_{t - c < i <= t} gamma_i^{(t)} 1/2 ||W k_i - v_i||^2, with k [B, H, T, D] and v [B, H, T, V]."""
    W = W.detach().clone().requires_grad_(True)
    loss = 0.0
    for i in range(max(0, t - window + 1), t + 1):
        err = torch.einsum("bhvd,bhd->bhv", W, k[:, :, i]) - v[:, :, i]
        loss = loss + (window_gate(gamma, t, i) * 0.5 * err.square().sum(-1)).sum()
    (grad,) = torch.autograd.grad(loss, W)
    return grad


def created_elements(fn, *args) -> int:
    """The elements of all tensors the aten ops create while fn(*args) runs: the work and memory traffic
    of a call (or of a backward pass: fn = loss.backward), up to a constant."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Created(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(x, torch.Tensor) and not x._is_view():
                    Created.total += x.numel()
            return out

    with Created():
        fn(*args)
    return Created.total


def largest_tensor(fn, *args):
    """The most elements of any tensor an aten op creates while fn(*args) runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(x, torch.Tensor):
                    Largest.most = max(Largest.most, x.numel())
            return out

    with Largest():
        fn(*args)
    return Largest.most
