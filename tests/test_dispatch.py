"""backend="auto" behaves the same in every chapter: the kernel on CUDA where it takes the inputs,
otherwise the chunk form with a warning saying why. CI has no GPU, so the CUDA side of the choice
is exercised with a stand-in tensor that reports being on CUDA."""
import warnings

import pytest
import torch

import atlaslib.core.dispatch as dispatch
from atlaslib.core import random_gate, random_qkv


class OnCuda:
    """All that resolve_backend asks of a tensor: whether it is on CUDA."""
    is_cuda = True


def test_auto_on_cuda_runs_the_kernel_where_it_takes_the_inputs():
    assert dispatch.resolve_backend("auto", OnCuda(), unsupported=lambda: None) == "triton"


def test_auto_on_cuda_falls_back_with_a_warning_saying_why():
    with pytest.warns(RuntimeWarning, match="does not take fp64 inputs; using the chunk form"):
        assert dispatch.resolve_backend("auto", OnCuda(), unsupported=lambda: "fp64 inputs") == "chunk"


def test_auto_on_cpu_is_the_chunk_form_without_asking():
    asked = []
    assert dispatch.resolve_backend("auto", torch.zeros(1), unsupported=lambda: asked.append(1)) == "chunk"
    assert not asked


def _call(chapter, dtype, K=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (x.to(dtype) for x in random_qkv(1, 2, 12, K, 4, generator=g))
    alpha = random_gate(1, 2, 12, generator=g, dtype=dtype)
    if chapter == "linear":
        from atlaslib.linear import linear_attention
        return linear_attention(q, k, v, alpha=alpha)
    if chapter == "delta":
        from atlaslib.delta import delta_rule
        return delta_rule(q, k, v, torch.full_like(alpha, 0.5), alpha=alpha)
    if chapter == "omega":
        from atlaslib.omega import omega_rule
        return omega_rule(q, k, v, window=4, alpha=alpha)
    from atlaslib.miras import miras
    return miras(q, k, v, preset="ttt_linear")


@pytest.mark.parametrize("chapter, module", [("linear", "atlaslib.linear"), ("delta", "atlaslib.delta"),
                                             ("omega", "atlaslib.omega"), ("miras", "atlaslib.miras")])
def test_every_chapter_applies_its_kernel_limits_the_same_way(monkeypatch, chapter, module):
    import importlib
    mod = importlib.import_module(module)
    choices = []

    real = dispatch.resolve_backend

    def as_if_on_cuda(backend, x, unsupported=None):
        choices.append(real(backend, OnCuda(), unsupported))
        return "chunk"                            # then compute on the CPU as usual
    monkeypatch.setattr(dispatch, "resolve_backend", as_if_on_cuda)   # every chapter reaches it via dispatch
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # inputs the kernel takes: no warning
        _call(chapter, torch.float32)
    assert choices == ["triton"]
    with pytest.warns(RuntimeWarning, match="does not take fp64 inputs"):
        _call(chapter, torch.float64)
    assert choices[-1] == "chunk"
