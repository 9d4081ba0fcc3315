"""The contract every public model function of the book keeps (``atlaslib.core.types``).

The models are found, not listed: every function in a chapter package's ``__all__`` whose parameters
start with (q, k, v) and that has keyword-only options is a model (the forms, ``*_recurrent``,
``*_chunk``, ..., take positional arguments). A new chapter's model is therefore checked as soon as it
is exported, and the explicit ``EXPECTED`` set makes a lost export fail too.

For every model:

* arguments: ``alpha`` and ``log_alpha`` (the retention gate; the wrappers of chapter 7 take the base's
  gates in ``base_kwargs``), ``initial_state``, ``output_final_state=False``, ``backend="auto"`` and
  ``chunk_size=None`` (the model's own default), all keyword-only; the step is ``beta`` for the delta
  rule and ``eta`` everywhere else; Newton–Schulz options are ``ns_steps`` / ``ns_coeffs``; a ``memory``
  option defaults to "linear" (DLA, a deep memory by definition, is the one documented exception);
* gates given as numbers (the window gates gamma included) equal the same gates given as tensors (and
  log_alpha as a number equals alpha);
* the return value is a pair (o, state), state None without ``output_final_state``, and otherwise of
  one type per function whatever the memory or other options, accepted back as ``initial_state``
  (for a per-token backend and one pair per step, two calls chained through it are one call on the
  whole sequence; a window c > 1 would also need the last c - 1 pairs);
* ``chunk_size=None`` equals the documented default (and, where the chunk length is part of the model,
  another chunk length gives another output, so the comparison can fail).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import pkgutil
import sys

import pytest
import torch
from torch import Tensor

import atlaslib
from atlaslib.core.testing import rel_rmse
from atlaslib.miras import MirasState

# Subpackages of atlaslib that are tools, not chapters.
TOOLS = {"core", "nn", "exercises", "tasks"}
CHAPTERS = sorted(m.name for m in pkgutil.iter_modules(atlaslib.__path__) if m.ispkg and m.name not in TOOLS)
EXPECTED = {"linear_attention", "delta_rule", "miras", "omega_rule", "swla", "atlas", "deep_transformer", "dot",
            "dla", "memory_caching", "log_linear_pp"}
# Functions of a chapter's __all__ that start with (q, k, v) and take keyword options but are not models.
NOT_MODELS = {"prepare"}          # atlaslib.miras.prepare: miras' validation step, returns a Problem
WRAPPERS = {"memory_caching", "log_linear_pp"}          # a model over a base model: the gates are the base's
MEMORY_DEFAULT = {"dla": "mlp"}   # the documented exception to memory="linear"
NO_STEP = {"linear_attention"}    # writes v k^T as it is: no step size

B, H, K, V = 1, 2, 4, 4
F64 = torch.float64


def discover() -> dict:
    found = {}
    for chapter in CHAPTERS:
        module = importlib.import_module(f"atlaslib.{chapter}")
        for name in getattr(module, "__all__", ()):
            fn = getattr(module, name)
            if not inspect.isfunction(fn) or name in NOT_MODELS:
                continue
            params = list(inspect.signature(fn).parameters.values())
            if [p.name for p in params[:3]] == ["q", "k", "v"] and any(p.kind is p.KEYWORD_ONLY for p in params):
                found.setdefault(name, fn)
    return found


MODELS = discover()


def test_every_model_is_found():
    assert CHAPTERS, "no chapter packages found"
    assert set(MODELS) == EXPECTED, (f"missing: {sorted(EXPECTED - set(MODELS))}, new (add them to EXPECTED and "
                                     f"to CASES below): {sorted(set(MODELS) - EXPECTED)}")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_arguments(name):
    fn = MODELS[name]
    sig = inspect.signature(fn)
    params = sig.parameters

    def kw(p, default):
        assert p in params, f"{name} lacks {p}"
        assert params[p].kind is inspect.Parameter.KEYWORD_ONLY, f"{name}: {p} must be keyword-only"
        assert params[p].default == default if default is not None else params[p].default is None, \
            f"{name}: {p} defaults to {params[p].default!r}, want {default!r}"
    kw("initial_state", None)
    kw("output_final_state", False)
    kw("backend", "auto")
    kw("chunk_size", None)
    if name in WRAPPERS:
        kw("base_kwargs", None)
        assert "base" in params
    else:
        kw("alpha", None)
        kw("log_alpha", None)
        step = "beta" if name == "delta_rule" else "eta"
        other = {"beta", "eta"} - {step}
        assert (step in params or name in NO_STEP) and not other & set(params), f"{name}: the step is {step!r}"
    assert not {"coeffs", "steps"} & set(params), f"{name}: Newton-Schulz options are ns_steps / ns_coeffs"
    if "memory" in params:
        assert params["memory"].default == MEMORY_DEFAULT.get(name, "linear"), name
    assert sig.return_annotation in ("ModelOutput", tuple[Tensor, object]) or "ModelOutput" in str(
        sig.return_annotation), f"{name} must be annotated -> ModelOutput"


# ---- calls -------------------------------------------------------------------------------------------

def _inputs(gen, T):
    q = torch.randn(B, H, T, K, generator=gen, dtype=F64) / 2
    k = torch.nn.functional.normalize(torch.randn(B, H, T, K, generator=gen, dtype=F64), dim=-1) / 2
    v = torch.randn(B, H, T, V, generator=gen, dtype=F64)
    return q, k, v


# name -> (state type, configurations). A configuration: (label, fixed kwargs, gates as numbers). Every
# configuration of one model must give the same state type.
TAYLOR = ("taylor", 2)
CASES = {
    "linear_attention": (Tensor, [("plain", {}, {}), ("normalize", {"normalize": True}, {})]),
    "delta_rule": (Tensor, [("deltanet", {}, {"beta": 0.5}), ("longhorn", {"longhorn": True}, {"beta": 0.5})]),
    "swla": (Tensor, [("c=2", {"window": 2}, {"eta": 0.5, "gamma": 0.7})]),
    "miras": (MirasState, [("gated_deltanet", {"preset": "gated_deltanet"}, {"eta": 0.5}),
                           ("titans linear", {"preset": "titans", "memory": "linear"}, {"eta": 0.5, "theta": 0.5}),
                           ("titans mlp", {"preset": "titans"}, {"eta": 0.5, "theta": 0.5, "gamma": 0.7})]),
    "omega_rule": (MirasState, [("linear", {"window": 2}, {"eta": 0.5, "gamma": 0.7}),
                                ("mlp", {"window": 2, "memory": "mlp"}, {"eta": 0.5, "gamma": 0.7})]),
    "atlas": (MirasState, [("linear", {}, {"eta": 0.1, "theta": 0.5, "gamma": 0.7}),
                           ("mlp", {"memory": "mlp"}, {"eta": 0.1, "theta": 0.5})]),
    "dla": (MirasState, [("mlp", {}, {"eta": 0.5}), ("linear", {"memory": "linear"}, {"eta": 0.5})]),
    "deep_transformer": (MirasState, [("linear", {"phi_star": TAYLOR}, {"eta": 0.5}),
                                      ("mlp", {"phi_star": TAYLOR, "memory": "mlp"}, {"eta": 0.5})]),
    "dot": (MirasState, [("c=1", {"phi_star": TAYLOR}, {"eta": 0.2}),
                         ("c=2", {"phi_star": TAYLOR, "window": 2}, {"eta": 0.1, "gamma": 0.7}),
                         ("mlp", {"phi_star": TAYLOR, "memory": "mlp"}, {"eta": 0.2})]),
}
# The wrappers return their base's state: (base, base_kwargs with number gates, its state type).
from atlaslib.linear import linear_attention  # noqa: E402
from atlaslib.omega import omega_rule  # noqa: E402

WRAPPED = [("linear_attention", linear_attention, {}, Tensor),
           ("omega_rule", omega_rule, {"window": 2, "eta": 0.5}, MirasState)]
PER_TOKEN = {"dot": "recurrent"}


def _call(name, q, k, v, fixed, gates, **kw):
    fn = MODELS[name]
    if name == "delta_rule":
        gates = dict(gates)
        return fn(q, k, v, gates.pop("beta"), **fixed, **gates, **kw)
    return fn(q, k, v, **fixed, **gates, **kw)


def _tensor_gates(gates, T):
    """Gates given as numbers (floats) as the same gates given as [B, H, T] tensors; other options as they are."""
    return {n: torch.full((B, H, T), x, dtype=F64) if isinstance(x, float) else x for n, x in gates.items()}


def _leaves(state):
    if isinstance(state, Tensor):
        return [state]
    if isinstance(state, dict):
        return [x for n in sorted(state) for x in _leaves(state[n])]
    if isinstance(state, tuple):
        return [x for part in state if part is not None for x in _leaves(part)]
    raise TypeError(type(state).__name__)


def _close(a, b, tol=1e-9):
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(x.shape == y.shape and rel_rmse(x, y) < tol for x, y in zip(la, lb))


CALLS = [(name, label, fixed, gates) for name, (_, cfgs) in CASES.items() for label, fixed, gates in cfgs]


def test_cases_cover_every_model():
    assert set(CASES) | WRAPPERS == EXPECTED


@pytest.mark.parametrize("name, label, fixed, gates", CALLS, ids=[f"{n}-{lab}" for n, lab, _, _ in CALLS])
def test_gates_state_and_continuation(gen, name, label, fixed, gates):
    T, T1 = 10, 6
    q, k, v = _inputs(gen, T)
    state_type = CASES[name][0]
    alpha = 0.9
    # number gates == tensor gates; log_alpha as a number == alpha as a number
    o, s = _call(name, q, k, v, fixed, gates, alpha=alpha, backend="chunk", output_final_state=True)
    o_t, s_t = _call(name, q, k, v, fixed, _tensor_gates(gates, T), alpha=torch.full((B, H, T), alpha, dtype=F64),
                     backend="chunk", output_final_state=True)
    o_l, s_l = _call(name, q, k, v, fixed, gates, log_alpha=math.log(alpha), backend="chunk", output_final_state=True)
    assert rel_rmse(o, o_t) < 1e-12 and rel_rmse(o_l, o) < 1e-9
    assert o.shape == (B, H, T, V) and o.dtype == q.dtype
    # one state type, whatever the configuration
    for st in (s, s_t, s_l):
        assert type(st) is state_type, f"{name}({label}) returned a {type(st).__name__}, want {state_type.__name__}"
    assert _close(s, s_t) and _close(s_l, s, 1e-9)
    out = _call(name, q, k, v, fixed, gates, alpha=alpha, backend="chunk")
    assert isinstance(out, tuple) and len(out) == 2 and out[1] is None
    # the returned state is accepted as initial_state: per token, two calls chained are one call
    backend = PER_TOKEN.get(name, "recurrent")
    whole, s_whole = _call(name, q, k, v, fixed, gates, alpha=alpha, backend=backend, output_final_state=True)
    _, s1 = _call(name, q[:, :, :T1], k[:, :, :T1], v[:, :, :T1], fixed, gates, alpha=alpha, backend=backend,
                  output_final_state=True)
    o2, s2 = _call(name, q[:, :, T1:], k[:, :, T1:], v[:, :, T1:], fixed, gates, alpha=alpha, backend=backend,
                   initial_state=s1, output_final_state=True)
    assert type(s1) is state_type and type(s2) is state_type
    if fixed.get("window", 1) == 1:                 # a window would also need the last c - 1 pairs
        assert rel_rmse(o2, whole[:, :, T1:]) < 1e-9 and _close(s2, s_whole)


@pytest.mark.parametrize("name, label, fixed, gates", CALLS, ids=[f"{n}-{lab}" for n, lab, _, _ in CALLS])
def test_switches_must_be_bools(gen, name, label, fixed, gates):
    """A string such as "no" is truthy: every model refuses it for output_final_state (and, where it has
    them, normalize and longhorn) instead of reading it as True."""
    q, k, v = _inputs(gen, 5)
    params = inspect.signature(MODELS[name]).parameters
    for switch in ("output_final_state", "normalize", "longhorn"):
        if switch in params and switch not in fixed:
            with pytest.raises(TypeError, match=f"{switch} must be True or False"):
                _call(name, q, k, v, fixed, gates, backend="chunk", **{switch: "no"})


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("base_name, base, base_kwargs, state_type", WRAPPED, ids=[w[0] for w in WRAPPED])
def test_wrappers(gen, wrapper, base_name, base, base_kwargs, state_type):
    T = 12
    q, k, v = _inputs(gen, T)
    fn = MODELS[wrapper]
    extra = {"segments": 4} if wrapper == "memory_caching" else {}
    o, s = fn(q, k, v, base=base, base_kwargs=dict(base_kwargs, alpha=0.9), output_final_state=True, backend="chunk",
              **extra)
    o_t, s_t = fn(q, k, v, base=base, base_kwargs=_tensor_gates(dict(base_kwargs, alpha=0.9), T),
                  output_final_state=True, backend="chunk", **extra)
    assert rel_rmse(o, o_t) < 1e-12 and type(s) is state_type and type(s_t) is state_type and _close(s, s_t)
    o_zero, none = fn(q, k, v, base=base, base_kwargs=base_kwargs, backend="chunk", **extra)
    assert none is None
    o2, _ = fn(q, k, v, base=base, base_kwargs=base_kwargs, initial_state=s, backend="chunk", **extra)
    assert o2.shape == o.shape and rel_rmse(o2, o_zero) > 1e-3      # the state is read, not dropped


# ---- chunk_size=None is the documented default ------------------------------------------------------

def _defaults():
    from atlaslib import atlas, deep, delta, linear, miras, omega
    return [  # (name, fixed kwargs incl. gates, the documented default, whether b is part of the model)
        ("linear_attention", {"alpha": 0.9}, linear.DEFAULT_CHUNK_SIZE, False),
        ("delta_rule", {"beta": 0.5}, delta.DEFAULT_CHUNK_SIZE, False),
        ("swla", {"window": 2, "eta": 0.5}, omega.SWLA_CHUNK_SIZE, False),
        ("miras", {"preset": "titans", "eta": 0.5, "theta": 0.5}, miras.DEFAULT_CHUNK_SIZE, True),
        ("omega_rule", {"window": 2, "eta": 0.5}, omega.OMEGA_CHUNK_SIZE, True),
        ("atlas", {"eta": 0.1, "theta": 0.5}, atlas.ATLAS_CHUNK_SIZE, True),
        ("dla", {"eta": 0.5}, miras.DEFAULT_CHUNK_SIZE, True),
        ("deep_transformer", {"phi_star": TAYLOR, "eta": 0.5}, deep.DEFAULT_CHUNK_SIZE, False),
        ("deep_transformer", {"phi_star": TAYLOR, "eta": 0.5, "memory": "mlp"}, deep.FROZEN_CHUNK_SIZE, True),
        ("dot", {"phi_star": TAYLOR, "eta": 0.2}, deep.DEFAULT_CHUNK_SIZE, False),
        ("dot", {"phi_star": TAYLOR, "eta": 0.1, "window": 2}, deep.FROZEN_CHUNK_SIZE, True),
        ("memory_caching", {"base": omega_rule, "segments": 36, "base_kwargs": {"window": 2, "eta": 0.5}},
         omega.OMEGA_CHUNK_SIZE, True),
        ("log_linear_pp", {"base": omega_rule, "base_kwargs": {"window": 2, "eta": 0.5}}, omega.OMEGA_CHUNK_SIZE,
         True),
    ]


DEFAULTS = _defaults()


def test_defaults_cover_every_model():
    assert {d[0] for d in DEFAULTS} == EXPECTED


@pytest.mark.parametrize("name, fixed, default, frozen", DEFAULTS, ids=[f"{d[0]}-{i}" for i, d in enumerate(DEFAULTS)])
def test_chunk_size_none_is_the_default(gen, monkeypatch, name, fixed, default, frozen):
    T = 36                                          # more than 2 chunks of 16, less than one of 64
    q, k, v = _inputs(gen, T)
    fixed = dict(fixed)

    def fn(q=q, k=k, v=v, **kw):
        if name == "delta_rule":
            return MODELS[name](q, k, v, fixed["beta"], backend="chunk", **kw)
        return MODELS[name](q, k, v, backend="chunk", **fixed, **kw)
    o_none, _ = fn()
    o_default, _ = fn(chunk_size=default)
    assert rel_rmse(o_none, o_default) < 1e-12
    if frozen:                                      # b is part of the model: another b is another output
        other, _ = fn(chunk_size=max(1, default // 4))
        assert rel_rmse(other, o_default) > 1e-8
    else:                       # every b gives the same output: watch the chunking, on T > b (b is cut to T)
        with chunk_lengths_seen(monkeypatch) as seen:
            fn(*_inputs(gen, 2 * default + 5))
        assert seen == {default}, (name, seen)


@contextlib.contextmanager
def chunk_lengths_seen(monkeypatch):
    """The chunk lengths b that the chunk forms cut T into (``to_chunks``, ``chunk_spans``, ``chunk_windows``)
    during the block."""
    from atlaslib.core import chunking
    seen = set()
    for helper in (chunking.to_chunks, chunking.chunk_spans, chunking.chunk_windows):
        def spy(x, b, *args, _real=helper, **kwargs):
            seen.add(b)
            return _real(x, b, *args, **kwargs)
        for module in [m for n, m in sys.modules.items() if n.startswith("atlaslib")]:
            for attr, value in list(vars(module).items()):
                if value is helper:
                    monkeypatch.setattr(module, attr, spy)
    yield seen
    monkeypatch.undo()


# ---- frozen gradients: the per-token oracle is a backend ---------------------------------------------

FROZEN = [(name, fixed) for name, fixed, _, frozen in DEFAULTS if frozen and name not in WRAPPERS] + [
    ("dot", {"eta": 0.1, "window": 2}),                                   # phi_star="kernel": coefficient space
    ("omega_rule", {"window": 2, "eta": 0.5, "memory": "mlp"}),           # the deep memory on chapter 3's engine
]


@pytest.mark.parametrize("name, fixed", FROZEN, ids=[f"{f[0]}-{i}" for i, f in enumerate(FROZEN)])
def test_frozen_gradient_models_offer_their_oracle(gen, name, fixed):
    """Where the chunk form freezes the gradients at each chunk start, backend="frozen_seq" runs the per-token
    loop with the same frozen gradients (the chunk form's oracle) and equals the chunk form at the same b; the
    definition ("recurrent") differs, so the comparison can fail."""
    q, k, v = _inputs(gen, 11)
    def run(backend):
        return MODELS[name](q, k, v, backend=backend, chunk_size=4, **fixed)[0]
    chunk = run("chunk")
    assert rel_rmse(run("frozen_seq"), chunk) < 1e-10
    assert rel_rmse(run("recurrent"), chunk) > 1e-8
