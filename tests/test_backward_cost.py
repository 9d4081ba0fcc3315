"""The backward of an O(T) chunk form costs O(T): the elements all aten ops create during backward() at
T = 512 against T = 128 (fresh random inputs, chunks of 8 tokens) grow about 4x, not 16x.

A chunk loop that slices its inputs (x[:, :, s:e]) or its per-chunk coefficient tables (x[:, j]) gives
each chunk's gradient a zero-filled tensor the size of the whole input: O(T^2 / b) in all, the backward's
largest cost at long T. The forms cut their inputs once (``core.chunking.chunk_windows``, split, unbind).
"""
import pytest
import torch
import torch.nn.functional as F

from atlaslib.atlas import atlas
from atlaslib.core.testing import created_elements
from atlaslib.deep import deep_transformer
from atlaslib.linear import linear_attention
from atlaslib.miras import miras
from atlaslib.omega import omega_rule, swla

B = 8
FORMS = {
    "linear attention": lambda q, k, v, a, e: linear_attention(q, k, v, alpha=a, chunk_size=B, backend="chunk"),
    "omega, c = 4": lambda q, k, v, a, e: omega_rule(q, k, v, window=4, alpha=a, eta=e, chunk_size=B,
                                                     backend="chunk"),
    "swla, c = 3": lambda q, k, v, a, e: swla(q, k, v, window=3, alpha=a, eta=e, chunk_size=B, backend="chunk"),
    "atlas, c = 2": lambda q, k, v, a, e: atlas(q, k, v, window=2, alpha=a, eta=e, chunk_size=B, backend="chunk"),
    "titans, linear memory": lambda q, k, v, a, e: miras(q, k, v, preset="titans", memory="linear", alpha=a, eta=e,
                                                         theta=a, chunk_size=B, backend="chunk"),
    "titans, mlp memory, c = 3": lambda q, k, v, a, e: miras(q, k, v, preset="titans", window=3, alpha=a, eta=e,
                                                             theta=a, chunk_size=B, backend="chunk"),
    "deep transformer, window 6": lambda q, k, v, a, e: deep_transformer(q, k, v, alpha=a, eta=e, window=6,
                                                                         chunk_size=B, backend="chunk"),
}


def backward_elements(form, T, gen):
    q, k = (F.normalize(torch.randn(1, 2, T, 8, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, 2, T, 8, generator=gen)
    a = 0.9 + 0.1 * torch.rand(1, 2, T, generator=gen)
    e = 0.1 * torch.rand(1, 2, T, generator=gen)
    inputs = [x.requires_grad_() for x in (q, k, v, a, e)]
    loss = FORMS[form](*inputs)[0].square().sum()
    return created_elements(loss.backward)


@pytest.mark.parametrize("form", FORMS)
def test_the_backward_of_a_chunk_form_grows_linearly_with_the_length(form, gen):
    growth = backward_elements(form, 512, gen) / backward_elements(form, 128, gen)
    assert growth < 5, f"{form}: the backward creates {growth:.1f}x the elements at 4x the length"
