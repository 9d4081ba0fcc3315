"""The backward of an O(T) chunk form costs O(T): the elements all aten ops create during backward() at
T = 512 against T = 128 (fresh random inputs, chunks of 8 tokens) grow about 4x, not 16x.

A chunk loop that slices its inputs (x[:, :, s:e]) or its per-chunk coefficient tables (x[:, j]) gives
each chunk's gradient a zero-filled tensor the size of the whole input: O(T^2 / b) in all, the backward's
largest cost at long T. The forms cut their inputs once (``core.chunking.chunk_windows``, split, unbind);
Memory Caching cuts its segments, batched states and readers' rows once (its checkpoint-mode readout is
O(T^2 / C) by design, but not its backward's slicing).
"""
import pytest
import torch
import torch.nn.functional as F

from atlaslib.atlas import atlas
from atlaslib.caching import log_linear_pp, memory_caching
from atlaslib.core.testing import created_elements
from atlaslib.deep import deep_transformer
from atlaslib.delta import delta_rule
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
    "delta rule, scalar gate": lambda q, k, v, a, e: delta_rule(q, k, v, e, alpha=a, chunk_size=2, backend="chunk"),
    "log-linear++ over linear attention": lambda q, k, v, a, e: log_linear_pp(q, k, v, base=linear_attention,
                                                                              backend="chunk"),
    "memory caching, checkpoint segments": lambda q, k, v, a, e: memory_caching(
        q, k, v, base=linear_attention, segments=B, mode="checkpoint", aggregate="residual", backend="chunk"),
}


def forward_and_backward_elements(form, T, gen):
    q, k = (F.normalize(torch.randn(1, 2, T, 8, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, 2, T, 8, generator=gen)
    a = 0.9 + 0.1 * torch.rand(1, 2, T, generator=gen)
    e = 0.1 * torch.rand(1, 2, T, generator=gen)
    inputs = [x.requires_grad_() for x in (q, k, v, a, e)]
    out = []
    forward = created_elements(lambda: out.append(FORMS[form](*inputs)[0]))
    return forward, created_elements(out[0].square().sum().backward)


@pytest.mark.parametrize("form", FORMS)
def test_the_backward_of_a_chunk_form_grows_as_its_forward(form, gen):
    """At 4x the length: O(T) forms grow 4x, log-linear++ (O(T log T)) about 5x, Memory Caching's checkpoint
    readout (O(T^2 / C)) more; the backward within a quarter of the forward's growth (or of 4x)."""
    (f1, b1), (f2, b2) = (forward_and_backward_elements(form, T, gen) for T in (128, 512))
    allowed = 1.25 * max(4.0, f2 / f1)
    assert b2 / b1 < allowed, (f"{form}: the backward creates {b2 / b1:.1f}x the elements at 4x the length, "
                               f"the forward {f2 / f1:.1f}x")
