"""Feature maps phi applied to keys and queries before they enter a linear memory.

Chapter 1 needs the identity and elu+1 (positive features, so that the normaliser
z_t^T phi(q_t) of normalised linear attention stays positive). Chapter 4 adds the
polynomial maps of the ATLAS paper, which raise a linear memory's capacity from d_k
pairs to the feature dimension D (book ch. 4 §6, Prop. 2). [A] uses the words
"polynomial features" for three different maps; each has its own function here:

===========================  ================  ======================================
map                          dimension D       inner product phi(x)^T phi(y)
===========================  ================  ======================================
``monomial_features(x, p)``  C(d + p, p)       sum_{|b|<=p} x^b y^b  (not a kernel
                                               of x^T y: the monomials are unweighted)
``tensor_power(x, p)``       d^p               (x^T y)^p
``TaylorFeatures(p)``        sum_i d^i, or     sum_{i<=p} a_i (x^T y)^i, a_i >= 0
                             C(d + p, p) when  learnable, initialised at 1/i! (the
                             ``compressed``    Taylor series of exp(x^T y))
===========================  ================  ======================================

All maps act on the last axis and keep every leading axis: [..., d] -> [..., D].
"""
from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .validation import _value_check, check_int, process_constant, static_int


def identity(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = x."""
    return x


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al., 2020): x + 1 for x > 0, e^x below. e^x itself, not
    (e^x - 1) + 1, which rounds to 0 below about -17 in fp32 (-37 in fp64) and leaves a normalised
    read 0 / 0; e^x stays positive to about -87 (fp32) and -708 (fp64)."""
    return torch.where(x > 0, x + 1.0, torch.exp(x.clamp(max=0.0)))     # clamped: no inf in the branch not taken


FEATURE_MAPS = {"identity": identity, "elu+1": elu_plus_one}


def get_feature_map(name):
    """A feature map by name (``identity``, ``elu+1``) or a callable passed through.

    The polynomial maps take a degree, so pass them as callables, e.g.
    ``functools.partial(monomial_features, degree=2)`` or ``TaylorFeatures(2)``.
    """
    if callable(name):
        return name
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; choose one of {sorted(FEATURE_MAPS)} or pass a callable")
    return FEATURE_MAPS[name]



def apply_feature_map(phi, q: torch.Tensor, k: torch.Tensor):
    """(phi(q), phi(k)) for ``phi`` None (identity), a name or a callable, checked: both must be
    [B, H, T, D] with q's B, H, T and one D."""
    B, H, T = q.shape[:3]
    phi = get_feature_map("identity" if phi is None else phi)
    fq, fk = phi(q), phi(k)
    for name, f in (("phi(q)", fq), ("phi(k)", fk)):
        if not isinstance(f, torch.Tensor) or f.dim() != 4 or tuple(f.shape[:3]) != (B, H, T):
            raise ValueError(f"phi must map [B, H, T, K] to [B, H, T, D] = [{B}, {H}, {T}, D], "
                             f"but {name} has shape {list(getattr(f, 'shape', []))}")
    if fq.shape != fk.shape:
        raise ValueError(f"phi(q) and phi(k) must have the same shape, got {list(fq.shape)} and {list(fk.shape)}")
    return fq, fk

# ----------------------------------------------------------------------------- polynomial maps

def check_degree(degree) -> int:
    """A polynomial degree must be an int >= 0 (``True`` and ``2.0`` are refused)."""
    return check_int("degree", degree, 0)


def _check_input(x) -> int:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating torch.Tensor of shape [..., d], got {type(x).__name__}"
                        + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have shape [..., d] with d >= 1, got {list(x.shape)}")
    return x.shape[-1]


def check_input_dim(d) -> int:
    """An input width d must be an int >= 1, as the feature maps' inputs [..., d] must be. Its value (a traced
    width fixed with a guard, ``static_int``): the monomials' tables and counts are built from it."""
    return static_int(check_int("d (the input width)", d, 1))


def monomial_dim(d: int, degree: int) -> int:
    """Number of monomials of degree <= p in d >= 1 variables: C(d + p, p) (constant included)."""
    return math.comb(check_input_dim(d) + check_degree(degree), check_degree(degree))


def _multisets(d: int, i: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The monomials of degree exactly i in d variables, as sorted index tuples [n_i, i], with their
    multinomial coefficients i! / prod_c (count of c)! (the number of ordered index tuples, i.e. entries of
    x^{(x)i}, that equal this monomial), on ``device``. Kept as tensors for the process, one copy per device
    (a copy from the host on every call waits for the GPU each time); while torch.compile traces, built in the
    graph from the table's numbers (a tensor taken as a constant gets sizes no guard can name under dynamic
    shapes)."""
    if torch.compiler.is_compiling():
        combos, counts = _multiset_numbers(d, i)
        return (torch.tensor(combos, dtype=torch.long, device=device).view(len(combos), i),
                torch.tensor(counts, dtype=torch.float64, device=device))
    return _multiset_table(d, i, str(torch.device(device)))


@torch.compiler.assume_constant_result
def _multiset_numbers(d: int, i: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """The table as Python numbers, which torch.compile takes as a constant (it does not trace itertools)."""
    return _multiset_lists(d, i)


@functools.lru_cache(maxsize=None)
def _multiset_lists(d: int, i: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    combos = tuple(itertools.combinations_with_replacement(range(d), i))
    counts = tuple(math.factorial(i) // math.prod(math.factorial(combo.count(c)) for c in set(combo))
                   for combo in combos)
    return combos, counts


@functools.lru_cache(maxsize=None)
def _multiset_table(d: int, i: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    combos, counts = _multiset_lists(d, i)
    with process_constant():                  # kept for the process: real tensors whatever mode the caller is in
        index = torch.tensor(combos, dtype=torch.long, device=device).view(len(combos), i)
        return index, torch.tensor(counts, dtype=torch.float64, device=device)


def _monomials_of_degree(x: torch.Tensor, i: int) -> torch.Tensor:
    """[..., d] -> [..., C(d+i-1, i)]: every product x_{c_1} ... x_{c_i} with c_1 <= ... <= c_i."""
    index, _ = _multisets(static_int(x.shape[-1]), static_int(i), x.device)
    # degree 0: an empty product, 1; the cast back: autocast runs prod in fp32 for bf16 x
    return x[..., index].prod(dim=-1).to(x.dtype)


def monomial_features(x: torch.Tensor, degree: int) -> torch.Tensor:
    """phi_p(x) = [x^b]_{|b| <= p}: all monomials of degree at most p, constant included.

    This is the map of [A] Prop. 2. Its dimension is C(d + p, p) (d = 4: 5, 15, 35 for
    p = 1, 2, 3; d = 128, p = 2: 8385), and a linear memory on these features can fit
    exactly as many generic key-value pairs as that (book ch. 4 §6). The monomials are
    unweighted, so phi_p(x)^T phi_p(y) is *not* a function of x^T y; use
    ``TaylorFeatures(p, compressed=True)`` for the weighted version whose inner product
    is sum_i a_i (x^T y)^i. Order: by degree, then lexicographic in the variable indices.

    x: [..., d] -> [..., C(d + p, p)].
    """
    _check_input(x)
    degree = check_degree(degree)
    return torch.cat([_monomials_of_degree(x, i) for i in range(degree + 1)], dim=-1)


def tensor_power(x: torch.Tensor, degree: int) -> torch.Tensor:
    """x^{(x)p}: the p-fold Kronecker power, flattened. [..., d] -> [..., d^p].

    Inner product: <x^{(x)p}, y^{(x)p}> = (x^T y)^p, the self-tensoring block of [A]
    eq. 22. Entry (c_1, ..., c_p) is x_{c_1} ... x_{c_p} (row-major). Every monomial of
    degree p appears once per ordering of its indices, so the map is redundant: the
    symmetric form used by ``TaylorFeatures(compressed=True)`` needs only C(d+p-1, p) entries.
    p = 0 gives the constant feature 1.
    """
    _check_input(x)
    degree = check_degree(degree)
    out = torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
    for _ in range(degree):
        out = (out[..., :, None] * x[..., None, :]).flatten(-2)   # one more Kronecker factor
    return out


def taylor_features(x: torch.Tensor, coefficients: torch.Tensor, *, compressed: bool = False) -> torch.Tensor:
    """phi(x) = concat_i sqrt(a_i) x^{(x)i}, i = 0..p, for given a_i >= 0 (p + 1 = len(coefficients)).

    phi(x)^T phi(y) = sum_i a_i (x^T y)^i. ``compressed``: each block x^{(x)i} replaced by its
    distinct monomials x^b, |b| = i, weighted by sqrt(multinomial(i; b)) (same inner product,
    dimension C(d + p, p) instead of sum_i d^i). The function behind ``TaylorFeatures`` (learnable
    a_i) and chapter 6's ``exp_features`` (a_i = 1/i! exactly, in the input's precision).
    """
    d = _check_input(x)
    if not isinstance(coefficients, torch.Tensor) or coefficients.dim() != 1 or not coefficients.is_floating_point():
        got = f"{coefficients.dtype} {list(coefficients.shape)}" if isinstance(coefficients, torch.Tensor) \
            else type(coefficients).__name__
        raise ValueError(f"coefficients must be a 1-D floating tensor a_0..a_p, got {got}")
    how = _value_check(coefficients)
    if how == "host" and not bool((coefficients >= 0).all()):
        raise ValueError(f"coefficients must be >= 0 (phi exists only for non-negative a_i), got "
                         f"{coefficients.tolist()}")
    if how == "device":                 # no host sync: checked on the device, as the other value checks
        torch._assert_async((coefficients >= 0).all(), "coefficients must be >= 0 (phi exists only for "
                             "non-negative a_i)")
    # sqrt(a_i + tiny): the same numbers for every a_i above 1e-30, and at a_i = 0 a finite gradient (phi^T phi
    # depends on a_i linearly; sqrt's infinite slope at 0 times 2 sqrt(a_i) = 0 gave 0 * inf = NaN). In fp32 at
    # least, where tiny's square root is a number (not 0)
    a = coefficients.to(device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))
    scale = (a + torch.finfo(a.dtype).tiny).sqrt().to(x.dtype)
    blocks = []
    for i in range(static_int(scale.shape[0])):
        if compressed:
            _, counts = _multisets(static_int(d), i, x.device)
            weight = counts.to(x.dtype).sqrt()
            blocks.append(scale[i] * weight * _monomials_of_degree(x, i))
        else:
            blocks.append(scale[i] * tensor_power(x, i))
    return torch.cat(blocks, dim=-1)


def inverse_softplus(a: torch.Tensor) -> torch.Tensor:
    """softplus^{-1}(a) = log(e^a - 1) for a > 0, written a + log(1 - e^{-a}) so that a large a does not
    overflow (the start values of learnable positive weights: Taylor coefficients, the mixers' gates)."""
    return a + torch.log(-torch.expm1(-a))


class TaylorFeatures(nn.Module):
    """The Taylor-weighted polynomial map of [A] eq. 5, with learnable non-negative weights.

        phi(x)^T phi(y) = sum_{i=0}^{p} a_i (x^T y)^i,    a_i = softplus(raw_i) >= 0.

    At initialisation a_i = 1/i!, so the kernel is the degree-p Taylor polynomial of
    exp(x^T y) (the softmax numerator). [A] writes eq. 5 with real a_i; a feature map
    (a real phi with this inner product) exists only for a_i >= 0, hence the softplus.

    Realisation: phi(x) = concat_i sqrt(a_i) x^{(x)i}, of dimension sum_i d^i. With
    ``compressed=True`` each block x^{(x)i} is replaced by its distinct monomials x^b,
    |b| = i, weighted by sqrt(a_i * multinomial(i; b)); same inner product, dimension
    C(d + p, p) (the monomial count of Prop. 2) instead of sum_i d^i.

    Args:
        degree: p >= 0.
        compressed: use the symmetric-monomial form.
        coefficients: optional initial a_0..a_p (non-negative; zeros become 1e-12 so that
            the softplus can be inverted). Default 1/i!.
    """

    def __init__(self, degree: int, *, compressed: bool = False, coefficients=None):
        super().__init__()
        self.degree = check_degree(degree)
        self.compressed = bool(compressed)
        # the start values are computed and checked on the CPU, also when the module is built under
        # torch.device("meta"); the parameter then goes to the ambient device, in the default dtype (as
        # nn.Linear's weights: a model built under float64 keeps a_i = 1/i! to fp64)
        cpu = dict(dtype=torch.float64, device="cpu")
        if coefficients is None:
            a = torch.tensor([1.0 / math.factorial(i) for i in range(self.degree + 1)], **cpu)
        else:
            a = torch.as_tensor(coefficients, **cpu).flatten()
            if a.numel() != self.degree + 1:
                raise ValueError(f"coefficients must hold degree + 1 = {self.degree + 1} values a_0..a_p, "
                                 f"got {a.numel()}")
            if torch.isnan(a).any() or (a < 0).any():
                raise ValueError(f"coefficients must be >= 0 (phi exists only for non-negative a_i), got {a.tolist()}")
        ambient = torch.empty(0)
        self.raw = nn.Parameter(inverse_softplus(a.clamp_min(1e-12)).to(ambient.device, ambient.dtype))

    @property
    def coefficients(self) -> torch.Tensor:
        """a_i = softplus(raw_i), shape [p + 1]."""
        return F.softplus(self.raw)

    def feature_dim(self, d: int) -> int:
        """Output dimension for inputs of dimension d."""
        if self.compressed:
            return math.comb(d + self.degree, self.degree)
        return sum(d ** i for i in range(self.degree + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return taylor_features(x, self.coefficients, compressed=self.compressed)

    def extra_repr(self) -> str:
        return f"degree={self.degree}, compressed={self.compressed}"
