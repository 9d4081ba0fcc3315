"""Contracts of the public calls that no model test sees: what they refuse at the edges of their ranges,
the dtypes they return, and the inputs they must read as given (views, gates of another dtype, autocast).
Each test compares against an independent reference or a documented rule."""
from __future__ import annotations

import pytest
import torch

from atlaslib.core import TaylorFeatures, elu_plus_one, random_gate, random_qkv, rel_rmse, softmax_attention
from atlaslib.delta import delta_rule
from atlaslib.linear import linear_attention
from atlaslib.atlas import atlas
from atlaslib.miras import miras
from atlaslib.omega import omega_rule

F64 = torch.float64


# ---- ranges: numbers at and past their bounds -----------------------------------------------------------

@pytest.mark.parametrize("call", ["linear", "delta"])
def test_a_number_gate_is_checked_against_both_bounds(gen, call):
    """alpha as one number must lie in [0, 1]: 1.0 (no decay) and 0.0 (reset) are allowed, 1.5 is refused."""
    q, k, v = random_qkv(1, 2, 6, 4, 4, generator=gen)
    run = (lambda a: linear_attention(q, k, v, alpha=a)) if call == "linear" else \
        (lambda a: delta_rule(q, k, v, 0.5, alpha=a))
    plain = run(None)[0]
    assert torch.equal(run(1.0)[0], plain)                 # alpha = 1 keeps everything
    run(0.0)
    with pytest.raises(ValueError, match=r"alpha must lie in \[0, 1\], got 1.5"):
        run(1.5)


@pytest.mark.parametrize("name, call", [
    ("beta", lambda q, k, v: delta_rule(q, k, v, float("nan"))),
    ("alpha", lambda q, k, v: linear_attention(q, k, v, alpha=float("nan"))),
])
def test_a_nan_number_is_refused(gen, name, call):
    q, k, v = random_qkv(1, 2, 6, 4, 4, generator=gen)
    with pytest.raises(ValueError, match=f"{name} must lie in .*got nan"):
        call(q, k, v)


def _with_one_inf(x):
    x = x.clone()
    x.view(-1)[3] = float("inf")
    return x


@pytest.mark.parametrize("name, call", [
    ("eta", lambda q, k, v, g: omega_rule(q, k, v, window=2, eta=g, backend="chunk")),
    ("eta", lambda q, k, v, g: atlas(q, k, v, eta=g, backend="chunk", chunk_size=2)),
    ("eta", lambda q, k, v, g: miras(q, k, v, preset="titans", eta=g, backend="chunk", chunk_size=2)),
    ("eta", lambda q, k, v, g: miras(q, k, v, preset="titans", eta=g, backend="recurrent")),
    ("delta", lambda q, k, v, g: miras(q, k, v, preset="yaad", delta=g, backend="chunk", chunk_size=2)),
    ("beta", lambda q, k, v, g: delta_rule(q, k, v, g, longhorn=True)),
])
def test_an_unbounded_gate_must_still_be_finite(gen, name, call):
    # eta, Yaad's delta and Longhorn's beta have no upper bound, but +inf in one entry is refused by name (it would
    # make every later output inf or NaN)
    q, k, v = random_qkv(1, 2, 6, 4, 4, generator=gen)
    gate = 0.1 + torch.rand(1, 2, 6, generator=gen)
    call(q, k, v, gate)
    with pytest.raises(ValueError, match=f"{name} must lie in .*inf"):
        call(q, k, v, _with_one_inf(gate))


@pytest.mark.parametrize("call", [lambda q, k, v: linear_attention(q, k, v), lambda q, k, v: delta_rule(q, k, v, 0.5)])
def test_no_value_channels_is_refused(gen, call):
    q, k, _ = random_qkv(1, 2, 6, 4, 4, generator=gen)
    with pytest.raises(ValueError, match="must not be empty|at least 1|empty"):
        call(q, k, torch.zeros(1, 2, 6, 0))


def test_taylor_coefficients_must_be_numbers_at_least_zero():
    for bad in ([1.0, float("nan"), 0.5], [1.0, -1.0, 0.5]):
        with pytest.raises(ValueError, match="coefficients"):
            TaylorFeatures(2, coefficients=bad)


# ---- dtypes -----------------------------------------------------------------------------------------

def test_softmax_attention_returns_the_inputs_dtype(gen):
    q, k, v = (x.bfloat16() for x in random_qkv(1, 2, 7, 4, 3, generator=gen))
    o = softmax_attention(q, k, v)
    ref = softmax_attention(q.double(), k.double(), v.double())
    assert o.dtype == torch.bfloat16
    assert rel_rmse(o.double(), ref) <= 1.5 * rel_rmse(ref.bfloat16().double(), ref)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_normalized_bf16_rounds_the_quotient_once(gen, backend):
    """normalize=True on bf16 inputs: numerator and denominator stay fp32 until the quotient, which is rounded
    once to bf16 (the output's dtype): as close to the fp64 quotient as that one rounding."""
    q, k, v = random_qkv(2, 2, 64, 16, 16, generator=gen)
    q, k, v = (x.bfloat16() for x in (elu_plus_one(q), elu_plus_one(k), v))
    alpha = 0.9 + 0.1 * torch.rand(2, 2, 64, generator=gen)
    ref, _ = linear_attention(q.double(), k.double(), v.double(), alpha=alpha.double(), normalize=True,
                              backend="recurrent")
    o, _ = linear_attention(q, k, v, alpha=alpha, normalize=True, backend=backend)
    assert o.dtype == torch.bfloat16
    assert rel_rmse(o.double(), ref) <= 1.2 * rel_rmse(ref.bfloat16().double(), ref)


def test_bf16_delta_rule_keeps_an_fp32_beta(gen):
    """beta is a step size, not an activation: with bf16 q, k, v an fp32 beta is used as given (not rounded
    to bf16). Seen in the final state, which stays fp32: as close to the fp64 run on the same inputs as fp32
    arithmetic allows, where rounding beta to bf16 moves it by 1e-3."""
    q, k, v = (x.bfloat16() for x in random_qkv(1, 2, 64, 16, 16, generator=gen))
    k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
    beta = 0.3 + 0.6 * torch.rand(1, 2, 64, generator=gen)
    run = lambda b, dtype, backend: delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), b,  # noqa: E731
                                               backend=backend, output_final_state=True)[1]
    ref = run(beta.double(), F64, "recurrent")
    rounded_beta = run(beta.bfloat16().double(), F64, "recurrent")
    assert rel_rmse(rounded_beta, ref) > 1e-4                     # rounding beta would show
    for backend in ("recurrent", "chunk"):
        assert rel_rmse(run(beta, torch.bfloat16, backend).double(), ref) < 1e-5, backend
        # and beta as one number is that number, not its bf16 rounding (0.3 -> 0.30078125)
        assert torch.equal(run(0.3, torch.bfloat16, backend), run(torch.full_like(beta, 0.3), torch.bfloat16, backend))


def test_beta_as_a_number_is_checked_against_both_bounds(gen):
    """beta in [0, 2] (BETA_MAX): both ends allowed as numbers, and a number is the constant tensor."""
    from atlaslib.delta import BETA_MAX
    q, k, v = random_qkv(1, 2, 6, 4, 4, generator=gen)
    for x in (0.0, BETA_MAX):
        assert torch.equal(delta_rule(q, k, v, x)[0], delta_rule(q, k, v, torch.full((1, 2, 6), x))[0])
    for x in (-0.5, BETA_MAX + 0.5):
        for beta in (x, torch.full((1, 2, 6), x)):
            with pytest.raises(ValueError, match="beta must lie in"):
                delta_rule(q, k, v, beta)


# ---- inputs read as given -------------------------------------------------------------------------------

def _autocast_call(call, q, k, v, alpha, backend):
    from atlaslib.caching import memory_caching
    from atlaslib.deep import deep_transformer, dla
    calls = {
        "linear": lambda: linear_attention(q, k, v, alpha=alpha, backend=backend),
        "delta": lambda: delta_rule(q, k, v, 0.5, alpha=alpha, backend=backend),
        "titans": lambda: miras(q, k, v, preset="titans", alpha=alpha, eta=0.1, theta=0.5, backend=backend),
        "dla": lambda: dla(q, k, v, memory="mlp", alpha=alpha, backend=backend, chunk_size=1),
        "atlas": lambda: atlas(q, k, v, alpha=alpha, eta=0.1, backend=backend),
        "omega": lambda: omega_rule(q, k, v, window=3, alpha=alpha, eta=0.1, backend=backend),
        "deep_transformer": lambda: deep_transformer(q, k, v, alpha=alpha, phi_star=("taylor", 2), normalize=True,
                                                     backend=backend),
        "memory_caching": lambda: memory_caching(q, k, v, base=linear_attention, base_kwargs=dict(alpha=alpha),
                                                 segments=16, aggregate="grm", backend=backend)}
    return calls[call]()[0]


@pytest.mark.parametrize("call", ["linear", "delta", "titans", "dla", "atlas", "omega", "deep_transformer",
                                  "memory_caching"])
def test_forms_compute_as_without_autocast(gen, call):
    """Under torch.autocast (bf16 on the CPU) the library's forms choose their own precision: fp32 inputs give
    the fp32 result, not autocast's bf16 products (the MIRAS engine and Memory Caching, which do not go
    through ``dispatch``, once ran their states' products in bf16)."""
    T = 50 if call in ("linear", "delta") else 20
    q, k, v = random_qkv(1, 2, T, 8, 8, generator=gen)
    k = torch.nn.functional.normalize(k, dim=-1)
    alpha = random_gate(1, 2, T, low=0.8, generator=gen)
    for backend in ("recurrent", "chunk"):
        plain = _autocast_call(call, q, k, v, alpha, backend)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = _autocast_call(call, q, k, v, alpha, backend)
        assert auto.dtype == torch.float32 and torch.equal(auto, plain), backend


def test_triton_reads_gate_views_as_given(gen):
    """beta and alpha handed to the kernels as [B, T, H] projections transposed to [B, H, T] (as the mixers
    do): non-contiguous fp32 views, read through their own layout."""
    B, H, T = 2, 3, 20
    q, k, v = random_qkv(B, H, T, 8, 8, generator=gen)
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(B, T, H, generator=gen).transpose(1, 2)
    alpha = random_gate(B, T, H, low=0.7, generator=gen).transpose(1, 2)
    assert not beta.is_contiguous() and not alpha.is_contiguous()
    ref, _ = delta_rule(q.double(), k.double(), v.double(), beta.double(), alpha=alpha.double(), backend="recurrent")
    o, _ = delta_rule(q, k, v, beta, alpha=alpha, backend="triton")
    assert rel_rmse(o.double(), ref) < 1e-5
    h0 = torch.randn(B, H, 8, 8, generator=gen).transpose(-1, -2)           # a view too
    ref, _ = linear_attention(q.double(), k.double(), v.double(), alpha=alpha.double(), initial_state=h0.double(),
                              backend="recurrent")
    o, _ = linear_attention(q, k, v, alpha=alpha, initial_state=h0, backend="triton")
    assert rel_rmse(o.double(), ref) < 1e-5


# ---- gradients at the edges of the gates ---------------------------------------------------------------

@pytest.mark.parametrize("call", ["linear", "delta"])
def test_zero_gates_leave_finite_gradients(gen, call):
    """alpha exactly 0 (a reset) on some tokens: every gradient is finite (the log-gate is floored at
    log e^-60 before the log is taken, so d log(alpha) / d alpha never meets 1 / 0)."""
    q, k, v = random_qkv(1, 2, 12, 4, 4, generator=gen)
    alpha = random_gate(1, 2, 12, low=0.5, generator=gen)
    alpha[:, :, 3] = 0.0
    for backend in ("recurrent", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, alpha)]
        o = linear_attention(*xs[:3], alpha=xs[3], backend=backend)[0] if call == "linear" else \
            delta_rule(*xs[:3], 0.5, alpha=xs[3], backend=backend)[0]
        o.square().sum().backward()
        assert all(torch.isfinite(x.grad).all() for x in xs), backend


@pytest.mark.parametrize("call", ["linear", "delta"])
def test_strong_decays_inside_a_chunk_leave_finite_gradients(gen, call):
    """Two log-gates of -46 in one chunk of 16: g_t - g_i reaches +92 above the diagonal, past fp32's exp
    range (88.7). The decay matrix is masked before the exponential, so the chunk form's fp32 gradients stay
    finite and match the fp64 per-token loop's."""
    q, k, v = random_qkv(1, 1, 16, 4, 3, generator=gen)
    log_alpha = (0.5 + 0.5 * torch.rand(1, 1, 16, generator=gen)).log()
    log_alpha[..., 3] = log_alpha[..., 9] = -46.0

    def grads(dtype, backend):
        xs = [x.to(dtype).clone().requires_grad_() for x in (q, k, v, log_alpha)]
        if call == "linear":
            o = linear_attention(*xs[:3], log_alpha=xs[3], backend=backend, chunk_size=16)[0]
        else:
            o = delta_rule(*xs[:3], 0.5, log_alpha=xs[3], backend=backend, chunk_size=16)[0]
        o.sum().backward()
        return [x.grad for x in xs]
    for got, want in zip(grads(torch.float32, "chunk"), grads(F64, "recurrent")):
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max() < 1e-5 * max(1.0, want.abs().max().item())
