"""Kernel tests on a real GPU (skipped without CUDA; CI has none, the device machine does).

The same comparisons as the interpreter tests, but compiled for the card, in fp32 and in
bf16/fp16, and at lengths the interpreter would take too long for.
"""
import pytest
import torch

from atlaslib.core import assert_close, poisoned_outputs, random_gate, random_qkv
from atlaslib.linear import linear_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU kernel tests skipped")

MODES = [None, "scalar", "channel"]
SHAPES = [(1, 1, 1, 16, 16), (2, 3, 63, 60, 100), (2, 2, 75, 64, 64), (1, 4, 1000, 128, 128)]


def inputs(gen, B, H, T, K, V, mode, low=0.5):
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    alpha = None if mode is None else random_gate(B, H, T, K if mode == "channel" else None, low=low, generator=gen)
    h0 = torch.randn(B, H, V, K, generator=gen)
    return [None if x is None else x.cuda() for x in (q, k, v, alpha, h0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_attention_kernel_on_gpu(gen, shape, mode, dtype):
    q, k, v, alpha, h0 = inputs(gen, *shape, mode)
    ref, ref_s = linear_attention(q, k, v, alpha=alpha, initial_state=h0, output_final_state=True, backend="chunk")
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    with poisoned_outputs():
        o, s = linear_attention(cast(q), cast(k), cast(v), alpha=cast(alpha), initial_state=h0,
                                output_final_state=True, backend="triton")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close(o.float(), ref, tol=tol)
    assert_close(s, ref_s, tol=tol, name="final state")


def test_linear_attention_long_bf16(gen):
    q, k, v, alpha, h0 = inputs(gen, 1, 2, 16384, 64, 64, "scalar", low=0.9)
    ref, _ = linear_attention(q, k, v, alpha=alpha, initial_state=h0, backend="chunk")
    o, _ = linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), alpha=alpha, initial_state=h0,
                            backend="triton")
    assert torch.isfinite(o.float()).all()
    assert_close(o.float(), ref, tol=3e-2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_delta_rule_kernel_on_gpu(gen, shape, mode, dtype):
    from atlaslib.delta import delta_rule
    q, k, v, alpha, h0 = inputs(gen, *shape, mode)
    beta = torch.rand(*shape[:3], generator=gen).cuda()
    ref, ref_s = delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, output_final_state=True, backend="chunk")
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    with poisoned_outputs():
        o, s = delta_rule(cast(q), cast(k), cast(v), beta, alpha=cast(alpha), initial_state=h0,
                          output_final_state=True, backend="triton")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close(o.float(), ref, tol=tol)
    assert_close(s, ref_s, tol=tol, name="final state")


@pytest.mark.parametrize("mode", [None, "scalar"])
def test_delta_rule_long_bf16(gen, mode):
    """T = 16K in bf16: the kernel stays finite and close to the fp32 chunk form."""
    from atlaslib.delta import delta_rule
    q, k, v, alpha, h0 = inputs(gen, 1, 2, 16384, 64, 64, mode, low=0.9)
    beta = torch.rand(1, 2, 16384, generator=gen).cuda()
    ref, _ = delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, backend="chunk")
    o, _ = delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta, alpha=alpha, initial_state=h0,
                      backend="triton")
    assert torch.isfinite(o.float()).all()
    assert_close(o.float(), ref, tol=3e-2)


@pytest.mark.parametrize("T, K, V", [(1, 16, 16), (63, 60, 100), (1000, 128, 128), (300, 256, 64)])
@pytest.mark.parametrize("normalize, window", [(True, None), (False, None), (True, 70), (False, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_deep_transformer_kernel_on_gpu(gen, T, K, V, normalize, window, dtype):
    from atlaslib.deep import deep_transformer
    q, k, v = random_qkv(2, 2, T, K, V, generator=gen)
    q = q / K ** 0.5                                               # attention's scale, so exp stays in range
    alpha, eta = random_gate(2, 2, T, low=0.9, generator=gen), 0.2 + torch.rand(2, 2, T, generator=gen)
    q, k, v, alpha, eta = (x.cuda() for x in (q, k, v, alpha, eta))
    ref, _ = deep_transformer(q, k, v, alpha=alpha, eta=eta, normalize=normalize, window=window, backend="chunk")
    with poisoned_outputs():
        o, _ = deep_transformer(q.to(dtype), k.to(dtype), v.to(dtype), alpha=alpha, eta=eta, normalize=normalize,
                                window=window, backend="triton")
    assert o.dtype == dtype
    assert_close(o.float(), ref, tol=1e-4 if dtype == torch.float32 else 3e-2)
