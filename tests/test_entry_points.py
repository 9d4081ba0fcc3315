"""One model, one default, whichever door it is reached by.

* The Omega rule's chunk form freezes gradients, so its chunk size is part of the model; it is a
  MIRAS model, and omega_rule, miras and the mixers must agree on its default.
* Mixers hand the library the chunk_size they were given, and their retention as an fp32 log.
* The mixer registry names the module behind every name.
"""
import inspect
import re
import sys

import pytest
import torch
from torch import nn

import atlaslib.miras as miras_pkg
from atlaslib.core import assert_close, random_gate, random_qkv, rel_rmse
from atlaslib.miras import miras
from atlaslib.nn import MIXERS, TokenMixer, available_mixers, make_mixer, register_mixer
from atlaslib.omega import OMEGA_CHUNK_SIZE, SWLA_CHUNK_SIZE, omega_rule, swla

F64 = torch.float64


def _window_inputs(gen, T=45, K=6, V=6, c=3):
    q, k, v = random_qkv(1, 2, T, K, V, dtype=F64, generator=gen)
    return q, k, v, dict(window=c, alpha=random_gate(1, 2, T, low=0.7, dtype=F64, generator=gen),
                         eta=random_gate(1, 2, T, low=0.1, high=0.3, dtype=F64, generator=gen))


def test_omega_rule_with_a_linear_memory_defaults_like_miras(gen):
    """omega_rule(memory="linear") is miras' deltanet with a window and decay: same default b."""
    q, k, v, kw = _window_inputs(gen)
    o_omega, _ = omega_rule(q, k, v, backend="chunk", **kw)
    o_miras, _ = miras(q, k, v, preset="deltanet", retention="decay", backend="chunk", **kw)
    assert_close(o_omega, o_miras, tol=1e-12, name="omega_rule vs miras, default chunk sizes")
    other, _ = omega_rule(q, k, v, backend="chunk", chunk_size=64, **kw)
    assert rel_rmse(other, o_omega) > 1e-4, "the chunk size must change this model, or the test proves nothing"


def test_omega_rule_with_a_deep_memory_defaults_like_the_engine_it_runs_on(gen):
    q, k, v, kw = _window_inputs(gen)
    o_omega, _ = omega_rule(q, k, v, memory="mlp", backend="chunk", **kw)
    o_miras, _ = miras(q, k, v, memory="mlp", bias="l2", optimizer="gd", retention="decay", backend="chunk", **kw)
    assert_close(o_omega, o_miras, tol=1e-12, name="omega_rule(memory='mlp') vs miras, default chunk sizes")
    other, _ = omega_rule(q, k, v, memory="mlp", backend="chunk", chunk_size=64, **kw)
    assert rel_rmse(other, o_omega) > 1e-4


def test_the_defaults_are_declared_once():
    default = lambda fn: inspect.signature(fn).parameters["chunk_size"].default     # noqa: E731
    assert default(omega_rule) is None and default(miras) is None and default(swla) is None   # the model's own:
    assert default(miras_pkg.titans_linear_chunk) == OMEGA_CHUNK_SIZE == miras_pkg.DEFAULT_CHUNK_SIZE
    assert make_mixer("omeganet", 16, 2).chunk_size == OMEGA_CHUNK_SIZE
    assert make_mixer("swla", 16, 2).chunk_size == SWLA_CHUNK_SIZE
    for name in ("ttt_linear", "ttt_mlp", "titans", "moneta", "yaad", "memora"):
        assert make_mixer(name, 16, 2).chunk_size == miras_pkg.DEFAULT_CHUNK_SIZE, name


LIBRARY_CALLS = ("linear_attention", "delta_rule", "miras", "omega_rule", "swla", "atlas", "deep_transformer", "dot",
                 "dla", "memory_caching")
GATED = ("retnet", "mamba2", "gla", "gated_deltanet", "kda", "omeganet", "swla", "titans", "moneta", "yaad", "memora",
         "atlas", "atlas++", "mag", "mal", "deep_transformer", "swdt", "dla", "memory_caching", "dot")
ATTENTION = ("softmax", "swa")                       # no chunk form, no retention gate
HYBRIDS = ("mag", "mal")                             # their memory branch (atlas by default) makes the call


def spy(seen, real):
    """``real`` that records its keywords (a base's gates in base_kwargs among them) in ``seen``."""
    def call(*args, **kw):
        seen.append({**kw, **(kw.get("base_kwargs") or {})})
        return real(*args, **kw)
    return call


@pytest.mark.parametrize("name", [n for n in sorted(MIXERS) if n not in ATTENTION])
def test_every_mixer_passes_its_chunk_size_and_a_log_gate(monkeypatch, gen, name):
    """Spy on the library function the mixer's module calls: chunk_size is the mixer's (5 is nobody's
    default), and a retention gate arrives as fp32 log_alpha from a bf16 model, never as alpha.
    A hybrid passes its keywords to its memory mixer, whose module is spied on; memory_caching hands the
    gates to its base in base_kwargs, which are checked as if passed directly."""
    module = sys.modules[MIXERS["atlas" if name in HYBRIDS else name].__module__]
    seen = []
    for fn in LIBRARY_CALLS:
        if hasattr(module, fn):
            real = getattr(module, fn)
            monkeypatch.setattr(module, fn, spy(seen, real))
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    mixer = make_mixer(name, 16, 2, backend="chunk", chunk_size=5).to(torch.bfloat16)
    with torch.no_grad():
        mixer(torch.randn(1, 11, 16, generator=gen).to(torch.bfloat16))
    assert len(seen) == 1 and seen[0]["chunk_size"] == 5
    assert seen[0].get("alpha") is None, "retention must travel as log_alpha"
    if any(m.__dict__.get("_modules", {}).get("gate_proj") is not None for m in mixer.modules()):
        assert name in GATED, f"{name} projects a retention gate: list it in GATED"
    if name in GATED:
        assert seen[0]["log_alpha"].dtype == torch.float32
        assert (seen[0]["log_alpha"] < 0).all()


def test_unknown_mixer_names_every_module():
    with pytest.raises(ValueError) as err:
        make_mixer("foo", 8, 2)
    msg = str(err.value)
    assert msg.startswith("unknown mixer 'foo'; available: ")
    for name in available_mixers():
        assert f"{name} ({MIXERS[name].__module__})" in msg
    assert "deltanet (atlaslib.nn.delta_mixers)" in msg and "titans (atlaslib.nn.miras_mixers)" in msg


def test_registering_a_name_twice_names_both_modules():
    first = type("First", (TokenMixer,), {"mix": lambda self, q, k, v, x: v, "__module__": "somewhere.first"})
    second = type("Second", (TokenMixer,), {"mix": lambda self, q, k, v, x: v, "__module__": "elsewhere.second"})
    register_mixer("_twice")(first)
    try:
        with pytest.raises(ValueError, match=r"'_twice' is already registered by somewhere\.first\.First; "
                                             r"elsewhere\.second\.Second cannot"):
            register_mixer("_twice")(second)
        assert register_mixer("_twice")(first) is first          # the same class again is harmless
    finally:
        MIXERS.pop("_twice")
    with pytest.raises(TypeError, match="TokenMixer subclass"):
        register_mixer("_bad")(nn.Linear)


def test_the_readme_examples_run_as_written():
    # the README's Python blocks, in a fresh interpreter as a reader pastes them (CPU: the chunk forms)
    import subprocess
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", readme, flags=re.S | re.M)
    assert blocks, "the README shows no Python example"
    # and every floating-point tensor the example leaves behind is finite (theta = 0.9 with eta = 0.1 drove
    # the Titans example's MLP memory to NaN while the block still ran)
    finite = ("\nimport torch\nbad = [n for n, x in dict(globals()).items() if isinstance(x, torch.Tensor)"
              " and x.is_floating_point() and not torch.isfinite(x).all()]\nassert not bad, bad\n")
    for code in blocks:
        proc = subprocess.run([sys.executable, "-c", code + finite], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{code}\n{proc.stderr[-3000:]}"
