"""The exported lower-level forms (``*_recurrent``, ``*_chunk``, ``*_frozen_seq``, steps and helpers) refuse
bad inputs with the entry points' messages, naming the argument.

They check what costs nothing: the shapes and ranks of q, k, v and of every gate, and chunk_size and
window (ints >= 1, not bool). Values are the caller's (the entry points check them before they call a
form), so a gate out of its range passes here: reading it would wait for the device on every call.
Each form is first run on the good inputs, so that a refusal below is the bad argument's alone.
A start memory (``initial_state``) is checked as the entry points check it (type, dtype, shape, device).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import pytest
import torch

from atlaslib.atlas import atlas_chunk, atlas_frozen_seq, atlas_recurrent, atlas_step, start_state
from atlaslib.core import random_gate, random_qkv
from atlaslib.deep import (coefficient_recurrent, deep_mlp_recurrent, dot_chunk, dot_coefficient_recurrent,
                           dot_mlp_recurrent, dot_window_chunk, hebbian_chunk, hebbian_recurrent, masked_chunk)
from atlaslib.delta import delta_rule_chunk, delta_rule_recurrent, longhorn_beta
from atlaslib.linear import linear_attention_chunk, linear_attention_recurrent
from atlaslib.omega import (omega_chunk, omega_deep, omega_frozen_seq, omega_recurrent, swla_chunk, swla_recurrent,
                            window_gates)

B, H, T, K, V, C, CHUNK = 1, 2, 6, 4, 3, 2, 4       # C: the window


def good_inputs() -> dict:
    """Inputs every form takes: q, k, v, one gate for every gate argument, the window C, chunk_size CHUNK."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    g = random_gate(B, H, T, low=0.5, generator=gen)
    return dict(q=q, k=k, v=v, alpha=g, beta=g, eta=0.5 * g, gamma=g, theta=g, log_alpha=None,
                G=window_gates(g, B, H, T, C, torch.float32, "cpu"), W2=0.1 * torch.randn(B, H, V, 8, generator=gen),
                window=C, chunk_size=CHUNK)


class Form(NamedTuple):
    call: Callable[[dict], object]      # the form on a dict of arguments, as its entry point calls it
    gates: tuple[str, ...]
    chunked: bool = False               # takes chunk_size
    windowed: bool = False              # takes window
    per_channel: tuple[str, ...] = ()   # gates that may also be [B, H, T, K], one value per key channel
    needs: tuple[str, ...] = ()         # other tensor arguments it takes (W2: the MLP's second layer)


FORMS = {
    "linear_attention_recurrent": Form(lambda a: linear_attention_recurrent(a["q"], a["k"], a["v"], a["alpha"]),
                                       ("alpha",), per_channel=("alpha",)),
    "linear_attention_chunk": Form(lambda a: linear_attention_chunk(a["q"], a["k"], a["v"], a["alpha"], None,
                                                                    a["chunk_size"], a["log_alpha"]),
                                   ("alpha", "log_alpha"), chunked=True, per_channel=("alpha", "log_alpha")),
    "delta_rule_recurrent": Form(lambda a: delta_rule_recurrent(a["q"], a["k"], a["v"], a["beta"], a["alpha"]),
                                 ("beta", "alpha"), per_channel=("alpha",)),
    "delta_rule_chunk": Form(lambda a: delta_rule_chunk(a["q"], a["k"], a["v"], a["beta"], a["alpha"], None,
                                                        a["chunk_size"], a["log_alpha"]),
                             ("beta", "alpha", "log_alpha"), chunked=True, per_channel=("alpha", "log_alpha")),
    "omega_recurrent": Form(lambda a: omega_recurrent(a["q"], a["k"], a["v"], a["window"], a["gamma"], a["alpha"],
                                                      a["eta"]),
                            ("gamma", "alpha", "eta"), windowed=True),
    "omega_frozen_seq": Form(lambda a: omega_frozen_seq(a["q"], a["k"], a["v"], a["window"], a["gamma"], a["alpha"],
                                                        a["eta"], None, a["chunk_size"]),
                             ("gamma", "alpha", "eta"), chunked=True, windowed=True),
    "omega_chunk": Form(lambda a: omega_chunk(a["q"], a["k"], a["v"], a["window"], a["gamma"], a["alpha"], a["eta"],
                                              None, a["chunk_size"], a["log_alpha"]),
                        ("gamma", "alpha", "eta", "log_alpha"), chunked=True, windowed=True),
    "swla_recurrent": Form(lambda a: swla_recurrent(a["q"], a["k"], a["v"], a["window"], a["gamma"], a["alpha"],
                                                    a["eta"]),
                           ("gamma", "alpha", "eta"), windowed=True),
    "swla_chunk": Form(lambda a: swla_chunk(a["q"], a["k"], a["v"], a["window"], a["gamma"], a["alpha"], a["eta"],
                                            None, a["chunk_size"], a["log_alpha"]),
                       ("gamma", "alpha", "eta", "log_alpha"), chunked=True, windowed=True),
    "omega_deep": Form(lambda a: omega_deep(a["q"], a["k"], a["v"], a["window"], a["gamma"], a["alpha"], a["eta"],
                                            "mlp", None, False, "chunk", a["chunk_size"], a["log_alpha"]),
                       ("gamma", "alpha", "eta"), chunked=True, windowed=True),
    "atlas_recurrent": Form(lambda a: atlas_recurrent(a["q"], a["k"], a["v"], a["window"], a["G"], a["alpha"],
                                                      a["eta"], a["theta"]),
                            ("G", "alpha", "eta", "theta"), windowed=True),
    "atlas_frozen_seq": Form(lambda a: atlas_frozen_seq(a["q"], a["k"], a["v"], a["window"], a["G"], a["alpha"],
                                                        a["eta"], a["theta"], chunk_size=a["chunk_size"]),
                             ("G", "alpha", "eta", "theta"), chunked=True, windowed=True),
    "atlas_chunk": Form(lambda a: atlas_chunk(a["q"], a["k"], a["v"], a["window"], a["G"], a["alpha"], a["eta"],
                                              a["theta"], chunk_size=a["chunk_size"], log_alpha=a["log_alpha"]),
                        ("G", "alpha", "eta", "theta", "log_alpha"), chunked=True, windowed=True),
    "dot_coefficient_recurrent": Form(lambda a: dot_coefficient_recurrent(a["q"], a["k"], a["v"], a["alpha"],
                                                                          a["eta"], "exp", a["window"], a["gamma"],
                                                                          a["chunk_size"]),
                                      ("gamma", "alpha", "eta"), chunked=True, windowed=True),
    "dot_chunk": Form(lambda a: dot_chunk(a["q"], a["k"], a["v"], a["alpha"], a["eta"], "exp", a["chunk_size"]),
                      ("alpha", "eta"), chunked=True),
    "dot_window_chunk": Form(lambda a: dot_window_chunk(a["q"], a["k"], a["v"], a["alpha"], a["eta"], "exp",
                                                        a["window"], a["gamma"], a["chunk_size"]),
                             ("gamma", "alpha", "eta"), chunked=True, windowed=True),
    "hebbian_recurrent": Form(lambda a: hebbian_recurrent(a["q"], a["k"], a["v"], a["alpha"], a["eta"]),
                              ("alpha", "eta")),
    "coefficient_recurrent": Form(lambda a: coefficient_recurrent(a["q"], a["k"], a["v"], a["alpha"], a["eta"],
                                                                  a["window"]),
                                  ("alpha", "eta"), windowed=True),
    "hebbian_chunk": Form(lambda a: hebbian_chunk(a["q"], a["k"], a["v"], a["alpha"], a["eta"], None,
                                                  a["chunk_size"], a["log_alpha"]),
                          ("alpha", "eta", "log_alpha"), chunked=True),
    "masked_chunk": Form(lambda a: masked_chunk(a["q"], a["k"], a["v"], a["alpha"], a["eta"], a["window"], "exp",
                                                False, a["chunk_size"], a["log_alpha"]),
                         ("alpha", "eta", "log_alpha"), chunked=True, windowed=True),
    "deep_mlp_recurrent": Form(lambda a: deep_mlp_recurrent(a["q"], a["k"], a["v"], a["W2"], a["alpha"], a["eta"]),
                               ("alpha", "eta"), needs=("W2",)),
    "dot_mlp_recurrent": Form(lambda a: dot_mlp_recurrent(a["q"], a["k"], a["v"], a["W2"], a["alpha"], a["eta"],
                                                          window=a["window"], gamma=a["gamma"]),
                              ("gamma", "alpha", "eta"), windowed=True, needs=("W2",)),
}


def bad_inputs(form: Form, good: dict):
    """(label, the one argument changed, the error, a pattern its message must match) for every bad input."""
    if form.chunked:
        yield from ((f"chunk_size={b!r}", {"chunk_size": b}, err, r"^chunk_size must be")
                    for b, err in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)))
    if form.windowed:
        yield from ((f"window={w!r}", {"window": w}, err, r"^window must be")
                    for w, err in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)))
    for name in form.gates:
        g = good[name] if good[name] is not None else torch.log(good["alpha"])     # log_alpha: off by default
        drop = {"alpha": None} if name == "log_alpha" else {}                      # in place of alpha
        yield f"{name} of T/2 tokens", {name: g[:, :, :T // 2], **drop}, ValueError, rf"^{name} must have shape"
        yield f"{name} one rank short", {name: g[:, :, 0], **drop}, ValueError, rf"^{name} must have shape"
        if name not in form.per_channel and name != "G":                          # G is [B, H, T, c] anyway
            yield (f"{name} per key channel", {name: g[..., None].expand(B, H, T, K), **drop}, ValueError,
                   rf"^{name} must have shape \[{B}, {H}, {T}\]")
    q, k, v = good["q"], good["k"], good["v"]
    yield "k of T-1 tokens", {"k": k[:, :, 1:]}, ValueError, r"^q and k must have the same shape"
    yield "v of T-1 tokens", {"v": v[:, :, 1:]}, ValueError, r"^v must have shape"
    yield "q of rank 3", {"q": q[0]}, ValueError, r"^q must have shape"
    yield "v in float64", {"v": v.double()}, TypeError, r"^q, k, v must share a dtype"
    yield "k on another device", {"k": k.to("meta")}, ValueError, r"^q, k, v must be on one device"
    for name in form.gates:
        if good[name] is not None:
            yield (f"{name} on another device", {name: good[name].to("meta")}, ValueError,
                   rf"^{name} must be on cpu like q")
    if "W2" in form.needs:
        W2 = good["W2"]
        yield "W2 for another V", {"W2": W2[:, :, 1:]}, ValueError, r"^W2 must have shape \[1, 2, 3, 8\]"
        yield "W2 of rank 3", {"W2": W2[0]}, ValueError, r"^W2 must have shape \[B, H, V, h\]"
        yield "W2 of width 0", {"W2": W2[..., :0]}, ValueError, r"^W2 must have a hidden width h >= 1"
        yield "W2 on another device", {"W2": W2.to("meta")}, ValueError, r"^W2 must be on cpu like q"
    # no token: the loops met an empty torch.stack, some chunk forms returned an empty output
    empty = {name: good[name][:, :, :0] for name in ("q", "k", "v", *form.gates) if good[name] is not None}
    yield "T = 0", empty, ValueError, r"^q, k, v must be non-empty"


GOOD = good_inputs()
CASES = [(name, *case) for name, form in FORMS.items() for case in bad_inputs(form, GOOD)]


@pytest.mark.parametrize("name", sorted(FORMS))
def test_good_inputs_pass(name):
    FORMS[name].call(GOOD)


@pytest.mark.parametrize("name, label, change, error, pattern", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_input_is_refused(name, label, change, error, pattern):
    with pytest.raises(error, match=pattern):
        FORMS[name].call({**GOOD, **change})


@pytest.mark.parametrize("name", sorted(n for n, f in FORMS.items() if f.per_channel))
def test_per_channel_gates_pass(name):
    """Where a form takes a retention gate per key channel, [B, H, T, K] runs (and is refused elsewhere, above)."""
    wide = GOOD["alpha"][..., None].expand(B, H, T, K).contiguous()
    FORMS[name].call({**GOOD, "alpha": wide})
    if "log_alpha" in FORMS[name].per_channel:
        FORMS[name].call({**GOOD, "alpha": None, "log_alpha": torch.log(wide)})


@pytest.mark.parametrize("name", sorted(set(FORMS) - {"omega_deep"}))        # omega_deep: the checked miras
def test_values_are_the_callers(name):
    """Gates out of their ranges (-0.5; log_alpha +0.5) still run: the forms read no value (the entry points do)."""
    form = FORMS[name]
    bad = {g: torch.full_like(GOOD[g], -0.5) for g in form.gates if g != "log_alpha"}
    form.call({**GOOD, **bad})
    if "log_alpha" in form.gates:                                  # the retention as its log instead
        form.call({**GOOD, **bad, "alpha": None, "log_alpha": torch.full_like(GOOD["alpha"], 0.5)})


def _step(**change):
    """One ``atlas_step`` from the zero state, on token 0 of the good inputs (gates per token: [B, H])."""
    a = {"q_t": GOOD["q"][:, :, 0], "k_t": GOOD["k"][:, :, 0], "v_t": GOOD["v"][:, :, 0], "window": C,
         "G_t": GOOD["G"][:, :, 0], **{g: GOOD[g[:-2]][:, :, 0] for g in ("alpha_t", "eta_t", "theta_t")}, **change}
    state = start_state(torch.zeros(B, H, V, K))
    return atlas_step(state, a.pop("q_t"), a.pop("k_t"), a.pop("v_t"), **a)


STEP_CASES = [("window", 0, ValueError), ("window", -1, ValueError), ("window", 2.5, TypeError),
              ("window", True, TypeError), ("k_t", torch.ones(B, H, K + 1), ValueError),
              ("v_t", torch.ones(B, H, V + 1), ValueError), ("q_t", torch.ones(B, H, 1, K), ValueError),
              ("G_t", torch.ones(B, H, C + 1), ValueError), ("alpha_t", torch.ones(B, H, T), ValueError),
              ("eta_t", torch.ones(B), ValueError), ("theta_t", torch.ones(B, H, 1), ValueError)]


def test_atlas_step_good_inputs_pass():
    _step()                                              # G_t per offset [B, H, c]
    _step(G_t=GOOD["gamma"][:, :, 0])                    # and per source [B, H]


@pytest.mark.parametrize("arg, value, error", STEP_CASES,
                         ids=[f"{a}={list(getattr(v, 'shape', [v]))}" for a, v, _ in STEP_CASES])
def test_atlas_step_refuses(arg, value, error):
    with pytest.raises(error, match=rf"^{arg} must"):
        _step(**{arg: value})


@pytest.mark.parametrize("beta, k, pattern", [
    (GOOD["beta"][:, :, :T // 2], GOOD["k"], r"^beta must have shape"),
    (GOOD["beta"][:, :, 0], GOOD["k"], r"^beta must have shape"),
    (GOOD["beta"], GOOD["k"][0], r"^k must have shape"),
], ids=["beta of T/2 tokens", "beta one rank short", "k of rank 3"])
def test_longhorn_beta_refuses(beta, k, pattern):
    longhorn_beta(GOOD["beta"], GOOD["k"])
    with pytest.raises(ValueError, match=pattern):
        longhorn_beta(beta, k)


@pytest.mark.parametrize("window, gamma, error, pattern", [
    (0, GOOD["gamma"], ValueError, r"^window must be"), (-1, GOOD["gamma"], ValueError, r"^window must be"),
    (2.5, GOOD["gamma"], TypeError, r"^window must be"), (True, GOOD["gamma"], TypeError, r"^window must be"),
    (C, GOOD["gamma"][:, :, :T // 2], ValueError, r"^gamma must have shape"),
    (C, GOOD["gamma"][:, :, 0], ValueError, r"^gamma must have shape"),
    (C, GOOD["G"][..., :1], ValueError, r"^gamma must have shape"),
], ids=["window=0", "window=-1", "window=2.5", "window=True", "gamma of T/2 tokens", "gamma [B, H]",
        "gamma of 1 offset for window 2"])
def test_window_gates_refuses(window, gamma, error, pattern):
    window_gates(GOOD["gamma"], B, H, T, C, torch.float32, "cpu")
    with pytest.raises(error, match=pattern):
        window_gates(gamma, B, H, T, window, torch.float32, "cpu")


@pytest.mark.parametrize("name", ["delta_rule_recurrent", "delta_rule_chunk"])
def test_delta_forms_need_beta(name):
    with pytest.raises(TypeError, match="^beta is required"):
        FORMS[name].call({**GOOD, "beta": None})


@pytest.mark.parametrize("name", sorted(n for n, f in FORMS.items() if "log_alpha" in f.gates))
def test_alpha_and_log_alpha_not_both(name):
    """Given both, the forms used log_alpha and dropped alpha without a word."""
    with pytest.raises(ValueError, match="either as alpha or as log_alpha, not both"):
        FORMS[name].call({**GOOD, "log_alpha": torch.log(GOOD["alpha"])})


STATE_FORMS = {   # forms that take initial_state [B, H, V, K], called with it
    "linear_attention_recurrent": lambda a, s: linear_attention_recurrent(a["q"], a["k"], a["v"], a["alpha"], s),
    "linear_attention_chunk": lambda a, s: linear_attention_chunk(a["q"], a["k"], a["v"], a["alpha"], s, CHUNK),
    "delta_rule_recurrent": lambda a, s: delta_rule_recurrent(a["q"], a["k"], a["v"], a["beta"], a["alpha"], s),
    "delta_rule_chunk": lambda a, s: delta_rule_chunk(a["q"], a["k"], a["v"], a["beta"], a["alpha"], s, CHUNK),
    "omega_recurrent": lambda a, s: omega_recurrent(a["q"], a["k"], a["v"], C, a["gamma"], a["alpha"], a["eta"], s),
    "omega_chunk": lambda a, s: omega_chunk(a["q"], a["k"], a["v"], C, a["gamma"], a["alpha"], a["eta"], s, CHUNK),
    "swla_chunk": lambda a, s: swla_chunk(a["q"], a["k"], a["v"], C, a["gamma"], a["alpha"], a["eta"], s, CHUNK),
    "atlas_chunk": lambda a, s: atlas_chunk(a["q"], a["k"], a["v"], C, a["G"], a["alpha"], a["eta"], a["theta"],
                                            initial_state=s, chunk_size=CHUNK),
    "hebbian_chunk": lambda a, s: hebbian_chunk(a["q"], a["k"], a["v"], a["alpha"], a["eta"], s, CHUNK),
}
BAD_STATES = [("a list", [[0.0]], TypeError, "must be a torch.Tensor"),
              ("int32", torch.zeros(B, H, V, K, dtype=torch.int32), TypeError, "must be a floating tensor"),
              ("[B, H, K, V]", torch.zeros(B, H, K, V), ValueError, r"must have shape \[1, 2, 3, 4\]"),
              ("on meta", torch.zeros(B, H, V, K, device="meta"), ValueError, "must be on cpu like q")]


@pytest.mark.parametrize("name", sorted(STATE_FORMS))
@pytest.mark.parametrize("label, state, error, pattern", BAD_STATES, ids=[b[0] for b in BAD_STATES])
def test_initial_state_is_checked(name, label, state, error, pattern):
    """The start memory's type, dtype, shape and device, as the entry points check it (a state on another
    device used to give uninitialised outputs, an integer one an error naming another tensor)."""
    STATE_FORMS[name](GOOD, torch.zeros(B, H, V, K))
    with pytest.raises(error, match=r"^initial_state \[B, H, V, K\] " + pattern):
        STATE_FORMS[name](GOOD, state)
