"""Chapter 4: polynomial feature maps (monomials, tensor powers, Taylor-weighted) and Prop. 2.

Each map is checked against the kernel value it claims, computed independently on fresh
random inputs: the monomial map against a brute-force enumeration of exponent vectors,
the tensor power against (x.y)^p, the Taylor map against sum_i a_i (x.y)^i. Prop. 2's
capacity thresholds are measured by least squares.
"""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from atlaslib.core import (TaylorFeatures, assert_close, check_degree, elu_plus_one, get_feature_map,
                           identity, monomial_dim, monomial_features, random_qkv, taylor_features, tensor_power)
from atlaslib.linear import linear_attention


def brute_force_monomials(x, p):
    """All x^beta = prod_c x_c^{beta_c} with |beta| <= p, from an enumeration of exponent vectors."""
    d = x.shape[-1]
    betas = [b for b in itertools.product(range(p + 1), repeat=d) if sum(b) <= p]
    return torch.stack([torch.prod(x ** torch.tensor(b, dtype=x.dtype), dim=-1) for b in betas], dim=-1)


@pytest.mark.parametrize("d", [1, 3, 4, 7])
@pytest.mark.parametrize("p", [0, 1, 2, 3])
def test_dimensions(gen, d, p):
    x = torch.randn(2, 5, d, generator=gen)
    assert monomial_features(x, p).shape == (2, 5, math.comb(d + p, p)) == (2, 5, monomial_dim(d, p))
    assert tensor_power(x, p).shape == (2, 5, d ** p)
    for compressed in (False, True):
        phi = TaylorFeatures(p, compressed=compressed)
        D = math.comb(d + p, p) if compressed else sum(d ** i for i in range(p + 1))
        assert phi(x).shape == (2, 5, D) and phi.feature_dim(d) == D


def test_documented_dimensions():
    assert [monomial_dim(4, p) for p in (1, 2, 3)] == [5, 15, 35]
    assert monomial_dim(16, 2) == 153 and monomial_dim(128, 2) == 8385


@pytest.mark.parametrize("d,p", [(1, 3), (3, 2), (4, 3), (5, 1)])
def test_monomials_are_every_monomial_once(gen, d, p):
    """Same multiset of values as the brute-force enumeration, and the same inner products."""
    x = torch.randn(6, d, generator=gen, dtype=torch.float64)
    y = torch.randn(6, d, generator=gen, dtype=torch.float64)
    ours, ref = monomial_features(x, p), brute_force_monomials(x, p)
    assert_close(ours.sort(dim=-1).values, ref.sort(dim=-1).values, tol=1e-12)
    assert_close((ours * monomial_features(y, p)).sum(-1), (ref * brute_force_monomials(y, p)).sum(-1), tol=1e-12)
    assert torch.all(ours[..., 0] == 1), "the constant monomial comes first"


def test_unweighted_monomials_are_not_a_dot_product_kernel():
    """x = e_1 and x = (1, 1)/sqrt 2 both have x.x = 1, yet their unweighted degree-2 kernels differ
    (3 vs 2.75): phi_p(x).phi_p(y) is not a function of x.y, unlike the Taylor-weighted map."""
    e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    diag = torch.tensor([1.0, 1.0], dtype=torch.float64) / math.sqrt(2)
    kernel = lambda x: (monomial_features(x, 2) ** 2).sum().item()        # noqa: E731
    assert kernel(e1) == pytest.approx(3.0) and kernel(diag) == pytest.approx(2.75)
    taylor = TaylorFeatures(2, compressed=True).double()
    assert (taylor(e1) ** 2).sum().item() == pytest.approx((taylor(diag) ** 2).sum().item())


@pytest.mark.parametrize("p", [0, 1, 2, 3, 4])
def test_tensor_power_kernel(gen, p):
    x = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    assert_close((tensor_power(x, p) * tensor_power(y, p)).sum(-1), (x * y).sum(-1) ** p, tol=1e-12)


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("p", [0, 1, 2, 3])
def test_taylor_kernel(gen, compressed, p):
    """phi(x).phi(y) = sum_i a_i (x.y)^i, at the default a_i = 1/i! and at random non-negative a_i."""
    x = torch.randn(4, 7, 6, generator=gen, dtype=torch.float64) / 2
    y = torch.randn(4, 7, 6, generator=gen, dtype=torch.float64) / 2
    s = (x * y).sum(-1)
    phi = TaylorFeatures(p, compressed=compressed).double()
    a = phi.coefficients.detach()
    assert_close(a, torch.tensor([1 / math.factorial(i) for i in range(p + 1)], dtype=torch.float64),
                 tol=1e-6, name="a_i at initialisation")
    assert_close((phi(x) * phi(y)).sum(-1), sum(a[i] * s ** i for i in range(p + 1)), tol=1e-12)
    a_rand = torch.rand(p + 1, generator=gen, dtype=torch.float64) * 2
    phi = TaylorFeatures(p, compressed=compressed, coefficients=a_rand).double()
    a = phi.coefficients.detach()
    assert_close(a, a_rand, tol=1e-6, name="a_i from coefficients=")
    assert_close((phi(x) * phi(y)).sum(-1), sum(a[i] * s ** i for i in range(p + 1)), tol=1e-12)


def test_taylor_coefficients_of_any_size_are_kept():
    """The softplus is inverted without overflow: a_i = 1000 (log(e^1000 - 1) in fp64 is inf) and 1e6 come back
    as given, as do the tiny and the ordinary ones."""
    given = torch.tensor([1e6, 1000.0, 1.0, 1e-9], dtype=torch.float64)
    got = TaylorFeatures(3, coefficients=given).coefficients.detach().double()
    assert torch.isfinite(got).all(), got
    assert_close(got, given, tol=1e-6, name="a_i")


@pytest.mark.parametrize("compressed", [False, True])
def test_taylor_zero_coefficient_drops_its_power(gen, compressed):
    """coefficients=[1, 0, 1/2] is the kernel 1 + (x.y)^2 / 2 (a zero is kept as 1e-12 so that the softplus
    inverts, far below what the kernel shows), not a kernel with some of x.y left in."""
    x = torch.randn(20, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(20, 4, generator=gen, dtype=torch.float64)
    phi = TaylorFeatures(2, compressed=compressed, coefficients=[1.0, 0.0, 0.5]).double()
    s = (x * y).sum(-1)
    torch.testing.assert_close((phi(x) * phi(y)).sum(-1), 1 + 0.5 * s ** 2, rtol=1e-6, atol=1e-9)


def test_taylor_forms_agree_and_train(gen):
    x = torch.randn(5, 4, generator=gen)
    y = torch.randn(5, 4, generator=gen)
    full, small = TaylorFeatures(3), TaylorFeatures(3, compressed=True)
    assert_close((small(x) * small(y)).sum(-1), (full(x) * full(y)).sum(-1), tol=1e-5)
    (small(x) * small(y)).sum().backward()
    s = (x * y).sum(-1)
    # d/d raw_i of sum_n a_i s_n^i = sigmoid(raw_i) * sum_n s_n^i
    expect = torch.sigmoid(small.raw.detach()) * torch.stack([(s ** i).sum() for i in range(4)])
    assert_close(small.raw.grad, expect, tol=1e-5, name="gradient of the coefficients")


def test_taylor_approximates_exp(gen):
    """With unit vectors, the degree-p Taylor kernel approaches exp(x.y) like 1/(p+1)!."""
    x = torch.nn.functional.normalize(torch.randn(50, 3, generator=gen, dtype=torch.float64), dim=-1)
    y = torch.nn.functional.normalize(torch.randn(50, 3, generator=gen, dtype=torch.float64), dim=-1)
    errs = []
    for p in (1, 2, 3, 4, 6):
        phi = TaylorFeatures(p, compressed=True).double()
        errs.append(((phi(x) * phi(y)).sum(-1) - torch.exp((x * y).sum(-1))).abs().max().item())
        assert errs[-1] <= math.e / math.factorial(p + 1) + 1e-9       # Lagrange remainder bound, |x.y| <= 1
    assert all(a > b for a, b in zip(errs, errs[1:]))


@pytest.mark.parametrize("p,expected", [(1, 5), (2, 15), (3, 35)])
def test_prop2_capacity_thresholds(gen, p, expected):
    """[A] Prop. 2 (corrected): a linear memory on phi_p features fits m generic pairs exactly iff
    m <= C(d_k + p, p)."""
    d_k = d_v = 4
    fits = []
    for m in range(1, expected + 6):
        keys = torch.randn(m, d_k, generator=gen, dtype=torch.float64)
        values = torch.randn(m, d_v, generator=gen, dtype=torch.float64)
        features = monomial_features(keys, p)                         # [m, D]
        M_T = torch.linalg.lstsq(features, values, driver="gelsd").solution   # min ||features M^T - values||
        residual = (features @ M_T - values).norm() / values.norm()
        fits.append(residual.item() < 1e-8)
    largest = max(m for m, ok in zip(range(1, expected + 6), fits) if ok)
    assert largest == expected == monomial_dim(d_k, p)
    assert all(fits[:expected]) and not any(fits[expected:])


def test_bad_degrees_and_inputs():
    x = torch.randn(3, 4)
    for fn in (monomial_features, tensor_power):
        with pytest.raises(ValueError, match="degree must be >= 0, got -1"):
            fn(x, -1)
        with pytest.raises(TypeError, match="degree must be a non-negative int, got 2.0"):
            fn(x, 2.0)
        with pytest.raises(TypeError, match="degree must be a non-negative int, got True"):
            fn(x, True)
        with pytest.raises(TypeError, match=r"x must be a floating torch.Tensor"):
            fn([1.0, 2.0], 2)
        with pytest.raises(TypeError, match=r"x must be a floating torch.Tensor"):
            fn(torch.ones(3, 4, dtype=torch.long), 2)
        for empty in (torch.ones(3, 0), torch.ones(())):           # no input width d >= 1
            with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., d\] with d >= 1"):
                fn(empty, 2)
    with pytest.raises(ValueError, match="degree must be >= 0"):
        TaylorFeatures(-2)
    with pytest.raises(ValueError, match="coefficients must be >= 0"):
        taylor_features(x, torch.tensor([-1.0, 1.0]))
    for bad in (torch.ones(2, 2), [1.0, 1.0], torch.ones(2, dtype=torch.long)):
        with pytest.raises(ValueError, match="coefficients must be a 1-D floating tensor"):
            taylor_features(x, bad)
    with pytest.raises(ValueError, match="degree must be >= 0"):
        monomial_dim(4, -1)
    with pytest.raises(TypeError, match="degree must be a non-negative int"):
        TaylorFeatures(1.5)
    with pytest.raises(ValueError, match="coefficients must be >= 0"):
        TaylorFeatures(2, coefficients=[1.0, -0.5, 0.1])
    with pytest.raises(ValueError, match="coefficients must hold degree \\+ 1 = 3 values"):
        TaylorFeatures(2, coefficients=[1.0, 1.0])
    assert check_degree(3) == 3


def test_named_maps_still_work(gen):
    x = torch.randn(2, 3, generator=gen)
    assert get_feature_map("identity") is identity and get_feature_map("elu+1") is elu_plus_one
    phi = TaylorFeatures(2)
    assert get_feature_map(phi) is phi
    with pytest.raises(ValueError, match="unknown feature map"):
        get_feature_map("poly2")
    assert (elu_plus_one(x) > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_elu_plus_one_stays_positive(gen, dtype):
    """elu + 1 is e^x for x <= 0: positive where (e^x - 1) + 1 rounds to 0 (x = -20 in fp32, -40 in fp64),
    so a normalised read of queries that far out is finite. Values and gradients are elu's (fp64 reference)."""
    x = torch.cat([torch.randn(50, generator=gen, dtype=torch.float64) * 5, torch.tensor([0.0, -20.0, -40.0, 30.0],
                                                                                          dtype=torch.float64)])
    got = x.to(dtype, copy=True).requires_grad_(True)
    want = x.clone().requires_grad_(True)
    elu_plus_one(got).sum().backward()
    (F.elu(want) + 1).sum().backward()
    assert (elu_plus_one(x.to(dtype)) > 0).all()
    assert_close(elu_plus_one(x.to(dtype)).double(), torch.exp(x).where(x <= 0, x + 1), tol=1e-6)
    assert torch.allclose(got.grad.double(), want.grad, rtol=1e-6, atol=0)
    q, k, v = random_qkv(1, 1, 4, 3, 2, dtype=dtype, generator=gen)
    q[..., 2, :] = -20.0 if dtype == torch.float32 else -40.0
    for backend in ("recurrent", "chunk"):
        o, _ = linear_attention(elu_plus_one(q), elu_plus_one(k), v, normalize=True, backend=backend)
        assert torch.isfinite(o).all(), backend


def test_features_first_built_in_inference_mode_still_train(gen):
    """The monomials' index tables are kept for the process; built by a first call under
    torch.inference_mode (an evaluation pass), they were inference tensors, and a later training call
    failed ("Inference tensors cannot be saved for backward")."""
    from atlaslib.core import featuremaps
    featuremaps._multiset_table.cache_clear()
    x = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        evaluated = featuremaps.monomial_features(x, 2)
    leaf = x.clone().requires_grad_(True)
    features = featuremaps.monomial_features(leaf, 2)
    features.sum().backward()
    assert torch.equal(features.detach(), evaluated)
    # d/dx_c of sum_{|b|<=2} x^b = 1 + sum_{e} d(x_c x_e)/dx_c = 1 + (sum_e x_e) + x_c
    assert_close(leaf.grad, 1 + x.sum(-1, keepdim=True) + x, tol=1e-12, name="gradient of the summed monomials")


def test_taylor_features_gradient_at_a_zero_coefficient(gen):
    """phi(x)^T phi(y) = sum_i a_i (x^T y)^i is linear in each a_i, so its gradient in a_i is (x^T y)^i, also
    at a_i = 0 (sqrt's infinite slope there gave NaN); the features' values are unchanged by the fix."""
    x, y = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    for a0 in ([1.0, 0.0, 0.5], [0.0, 0.0, 0.0], [0.3, 1e-30, 2.0]):
        a = torch.tensor(a0, dtype=torch.float64, requires_grad=True)
        for compressed in (False, True):
            kernel = (taylor_features(x, a, compressed=compressed) * taylor_features(y, a, compressed=compressed))
            (grad,) = torch.autograd.grad(kernel.sum(), a)
            s = (x * y).sum(-1)
            assert_close(grad, torch.stack([(s ** i).sum() for i in range(3)]), tol=1e-12, name=f"{a0}")
    a = torch.tensor([1.0, 0.5, 1 / 6], dtype=torch.float64)
    assert torch.equal(taylor_features(x, a), torch.cat([a[0].sqrt() * torch.ones(5, 1, dtype=torch.float64),
                                                         a[1].sqrt() * x, a[2].sqrt() * tensor_power(x, 2)], -1))


def test_taylor_features_refuse_a_negative_coefficient_on_a_device(monkeypatch):
    """On an accelerator the value check runs on the device (no host sync), as every other value check."""
    from atlaslib.core import featuremaps
    monkeypatch.setattr(featuremaps, "_value_check", lambda t: "device")
    x = torch.randn(3, 4)
    featuremaps.taylor_features(x, torch.tensor([1.0, 0.5]))
    with pytest.raises(RuntimeError, match="coefficients must be >= 0"):
        featuremaps.taylor_features(x, torch.tensor([1.0, -0.5]))
