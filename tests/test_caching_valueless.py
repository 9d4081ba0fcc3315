"""Chapter 7 §3: memory caching with segments of one token over a value-less vector memory is gated
global softmax attention ([MC] §4.1, eqs. 18-20, the softmax summed over the visible tokens).

The references are written here on fresh random inputs: causal softmax attention as a masked score
matrix and a row softmax, and PyTorch's ``scaled_dot_product_attention`` (an implementation that shares
no code with the library), gated element-wise by q; the memory itself against its token loop.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from atlaslib.caching import memory_caching
from atlaslib.caching.valueless import valueless_memory
from atlaslib.core import random_qkv

F64 = torch.float64


def masked_softmax_attention(u, k, v):
    T = u.shape[2]
    scores = (u @ k.mT).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def inputs(gen, B=2, H=3, T=19, V=5):
    # the memory is read element-wise, so the query (the gate) has the width of v, and k the width of q
    u, k, v = random_qkv(B, H, T, V, V, generator=gen, dtype=F64)
    gate = torch.sigmoid(torch.randn(B, H, T, V, generator=gen, dtype=F64))     # sigma(x_t W_Q), eq. 20
    bias = torch.randn(B, H, V, generator=gen, dtype=F64)                        # b_K, eq. 18
    return u, k, v, gate, bias


def test_the_memory_is_its_token_loop(gen):
    """M_t = M_{t-1} + Diag(v_t), y_t = M_t q_t, from a full (not diagonal) start state."""
    B, H, T, V = 2, 2, 9, 4
    q, _, v = random_qkv(B, H, T, V, V, generator=gen, dtype=F64)
    M = torch.randn(B, H, V, V, generator=gen, dtype=F64)
    M0 = M.clone()
    want = []
    for t in range(T):
        M = M + torch.diag_embed(v[:, :, t])
        want.append((M @ q[:, :, t, :, None])[..., 0])
    o, final = valueless_memory(q, q, v, initial_state=M0, output_final_state=True)
    torch.testing.assert_close(o, torch.stack(want, 2), rtol=0, atol=1e-12)
    torch.testing.assert_close(final, M, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_segments_of_one_token_are_gated_softmax_attention(gen, backend):
    """GRM, segment length 1, independent mode from Diag(b): y_t = (b + softmax-attention(u, k, v)_t) * q_t."""
    u, k, v, gate, bias = inputs(gen)
    attention = masked_softmax_attention(u, k, v)
    sdpa = F.scaled_dot_product_attention(u, k, v, is_causal=True, scale=1.0)
    torch.testing.assert_close(attention, sdpa, rtol=0, atol=1e-12)        # the two references agree
    y, _ = memory_caching(gate, k, v, base=valueless_memory, segments=1, mode="independent", aggregate="grm", u=u,
                          initial_state=torch.diag_embed(bias), backend=backend)
    torch.testing.assert_close(y, (bias[:, :, None] + sdpa) * gate, rtol=0, atol=1e-12)
    # without the bias: gated attention itself
    y0, _ = memory_caching(gate, k, v, base=valueless_memory, segments=1, mode="independent", aggregate="grm", u=u,
                           backend=backend)
    torch.testing.assert_close(y0, sdpa * gate, rtol=0, atol=1e-12)


def test_equation_19_stores_the_key(gen):
    """Eq. 19 before the re-parametrisation: the memory stores the routed key itself (v = k)."""
    u, k, _, _, _ = inputs(gen)
    q = torch.randn(k.shape, generator=gen, dtype=F64)
    y, _ = memory_caching(q, k, k, base=valueless_memory, segments=1, mode="independent", aggregate="grm", u=u)
    torch.testing.assert_close(y, masked_softmax_attention(u, k, k) * q, rtol=0, atol=1e-12)


def test_other_aggregators_are_not_attention(gen):
    """Residual (gamma = 1) sums the cached vectors instead: y_t = (t b + v_1 + ... + v_t) * q_t; and a
    segment longer than one token pools its keys, which is no longer attention."""
    u, k, v, gate, bias = inputs(gen)
    T = u.shape[2]
    y, _ = memory_caching(gate, k, v, base=valueless_memory, segments=1, mode="independent", aggregate="residual",
                          initial_state=torch.diag_embed(bias))
    count = torch.arange(1, T + 1, dtype=F64)[:, None]
    torch.testing.assert_close(y, (count * bias[:, :, None] + v.cumsum(2)) * gate, rtol=0, atol=1e-12)
    y2, _ = memory_caching(gate, k, v, base=valueless_memory, segments=2, mode="independent", aggregate="grm", u=u)
    assert (y2 - masked_softmax_attention(u, k, v) * gate).abs().max() > 1e-3


@pytest.mark.parametrize("K", [1, 3])
def test_the_read_must_have_the_values_width(K):
    # the read is element-wise: a q of width 1 would otherwise broadcast as one number per token
    q = k = torch.randn(1, 2, 5, K)
    with pytest.raises(ValueError, match="width of v"):
        valueless_memory(q, k, torch.randn(1, 2, 5, 4))
