"""A MIRAS model is one choice on each of four axes; the named models are presets.

    cfg = make_config("titans")                        # a preset
    cfg = make_config("titans", memory="linear")       # a preset with one axis moved
    cfg = make_config(memory="mlp", bias="huber_switch", retention="kl", optimizer="momentum")
    print(axes_markdown())                             # the four-axis table, built from PRESETS

``MirasConfig`` holds the four axes and the few static hyper-parameters they need;
data-dependent quantities (alpha, eta, theta, delta, gamma) are tensors passed to
``miras`` at call time. ``make_config`` checks names, values, and axis combinations
that cannot work, and raises ValueError saying what to change. ``DEFAULT_CHUNK_SIZE`` is
the chapter's one chunk length b (a static choice that is part of the model, see below).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from ..core.newton_schulz import check_ns_steps, ns_coefficients
from .bias import BIASES
from .memory import ACTIVATIONS, MEMORIES, MEMORY_CLASSES
from .optimizer import OPTIMIZERS
from .retention import RETENTIONS

# The options of the memory axis that the other chapters' model functions pass on to this engine for a
# deep memory (dla, omega_rule, atlas): the hidden width, the nonlinearity, the residual branch's LayerNorm.
MEMORY_OPTIONS = ("expansion", "activation", "layer_norm")


def check_memory_options(model: str, memory: str, options: dict) -> dict:
    """``options`` if they are deep-memory options (``MEMORY_OPTIONS``) and ``memory`` is deep; the engine then
    checks their values. An unknown name is a TypeError, an option for the linear memory a ValueError."""
    unknown = sorted(set(options) - set(MEMORY_OPTIONS))
    if unknown:
        raise TypeError(f"{model}: unknown option(s) {unknown}; it takes {list(MEMORY_OPTIONS)} for a deep memory")
    if options and memory == "linear":
        raise ValueError(f"{model}: {sorted(options)} shape a deep memory; memory='linear' has none")
    return options

AXES = ("memory", "bias", "retention", "optimizer")

# The chunk length b of "chunk", "frozen_seq" and "triton" for every MIRAS model, and for every
# entry point that reaches one: the OmegaNet rule (atlaslib.omega.omega_rule, linear or deep memory,
# which is this engine's l2 bias with a window) and the token mixers. For all but the
# state-free linear_attention preset b changes the output (gradients are frozen at each chunk's
# start), so one model must not get two defaults from two doors. 16 is TTT's inner mini-batch size
# and what this chapter always used: short enough that the frozen gradient stays close to the
# per-token one, long enough to give the chunk form matrix products to batch.
DEFAULT_CHUNK_SIZE = 16


@dataclass(frozen=True)
class MirasConfig:
    """The four axes plus their static hyper-parameters.

    memory:     "linear" | "mlp" | "residual" | "gated"                        (axis 1)
    bias:       "dot" | "l2" | "lp" | "huber" | "huber_norm" | "huber_switch" | "value_shift"   (axis 2)
    retention:  "none" | "decay" | "decay_first" | "proximal" | "kl" | "lq" | "elastic"        (axis 3)
    optimizer:  "gd" | "momentum" | "muon"                                       (axis 4)
    window:     c >= 1 past pairs in each update (Omega rule, l2-family biases; 1: one pair)
    expansion, activation: hidden width expansion * K and nonlinearity of deep memories
    layer_norm: LN on the residual memory's branch, x + LN(W1 act(W2 x)) (MIRAS, [M] §4.2)
    p:          exponent of the lp bias; sign_sharpness a (sign ~ tanh(a x), None: exact
                sign) and abs_eps (|x| ~ sqrt(x^2 + eps), 0: exact) smooth its gradient
    delta:      default Huber threshold / value-shift radius when no per-token tensor is given
    lq:         exponent q of Moneta's normalisation W = Z / ||Z||_q^(q-2)
    scale:      c, the mass of Memora's simplex {W >= 0, sum W = c} (per weight matrix; not the score
                scale of ``softmax_attention``)
    threshold:  gamma >= 0 of the elastic-net soft threshold
    ns_steps, ns_coeffs: Muon's Newton–Schulz, J >= 0 steps (0: NS off, the identity) with
                coefficients "muon" | "cubic" | "quintic" or a tuple (p0, p1[, p2, ...]; make_config and atlas
                take a list too), see
                ``atlaslib.core.newton_schulz``
    name:       the preset this came from (or "custom")
    """

    memory: str = "linear"
    bias: str = "l2"
    retention: str = "none"
    optimizer: str = "gd"
    window: int = 1
    expansion: int = 4
    activation: str = "gelu"
    layer_norm: bool = False
    p: float = 3.0
    sign_sharpness: float | None = 10.0
    abs_eps: float = 1e-6
    delta: float = 1.0
    lq: float = 4.0
    scale: float = 1.0
    threshold: float = 0.0
    ns_steps: int = 5
    ns_coeffs: str | tuple = "muon"
    name: str = "custom"

    def replace(self, **changes) -> "MirasConfig":
        return make_config(self, **changes)


# Which option belongs to which axis value: passing it with another choice is an error.
# The field names, once: torch.compile cannot trace dataclasses.fields on the class (a mixer's forward
# calls make_config).
FIELDS = frozenset(f.name for f in dataclasses.fields(MirasConfig))

OPTION_OWNERS = {
    "p": ("bias", ("lp",)), "sign_sharpness": ("bias", ("lp",)), "abs_eps": ("bias", ("lp",)),
    "delta": ("bias", ("huber", "huber_norm", "huber_switch", "value_shift")),
    "lq": ("retention", ("lq",)), "scale": ("retention", ("kl",)), "threshold": ("retention", ("elastic",)),
    "expansion": ("memory", ("mlp", "residual", "gated")), "activation": ("memory", ("mlp", "residual", "gated")),
    "layer_norm": ("memory", ("residual",)),
    "ns_steps": ("optimizer", ("muon",)), "ns_coeffs": ("optimizer", ("muon",)),
}

PRESETS: dict[str, MirasConfig] = {
    # chapter 1-2 models as presets of the same engine
    "linear_attention": MirasConfig(memory="linear", bias="dot", retention="none", optimizer="gd"),
    "deltanet": MirasConfig(memory="linear", bias="l2", retention="none", optimizer="gd"),
    "gated_deltanet": MirasConfig(memory="linear", bias="l2", retention="decay_first", optimizer="gd"),
    # test-time training and Titans
    "ttt_linear": MirasConfig(memory="linear", bias="l2", retention="none", optimizer="gd"),
    "ttt_mlp": MirasConfig(memory="mlp", bias="l2", retention="none", optimizer="gd"),
    "titans": MirasConfig(memory="mlp", bias="l2", retention="decay", optimizer="momentum"),
    # the three MIRAS models ([M] Table 1, book ch. 3 §3): residual-MLP memory with LN, expansion 4, GELU
    "moneta": MirasConfig(memory="residual", layer_norm=True, bias="lp", p=3.0, retention="lq", lq=4.0,
                          optimizer="gd"),
    "yaad": MirasConfig(memory="residual", layer_norm=True, bias="huber_switch", retention="decay", optimizer="gd"),
    "memora": MirasConfig(memory="residual", layer_norm=True, bias="l2", retention="kl", scale=1.0, optimizer="gd"),
    # chapter 5: ATLAS ([A] §5) is one more optimizer, Muon (NS_5 of the momentum); its Omega window is
    # the `window` field, which [A] sweeps rather than fixes (atlaslib.atlas.atlas_config builds others)
    "atlas": MirasConfig(memory="residual", bias="l2", retention="decay", optimizer="muon"),
    # chapter 6: deep linear attention ([A] eq 19) is linear attention's dot-product bias on a deep memory,
    # M_t = alpha_t M_{t-1} - eta_t grad l_dot(M_{t-1}); with memory="linear" it is gated linear attention
    # (atlaslib.deep.dla; with phi = phi*_P it is the DeepTransformer on Taylor features)
    "dla": MirasConfig(memory="mlp", bias="dot", retention="decay", optimizer="gd"),
}
PRESETS = {name: dataclasses.replace(cfg, name=name) for name, cfg in PRESETS.items()}

# Presets whose chunk form is exact for every chunk size (the gradient of the dot-product
# bias with a linear memory does not depend on the state, book ch. 3 §8).
EXACT_CHUNK = ("linear_attention",)


def _check_choice(axis, value, table):
    if value not in table:
        raise ValueError(f"{axis} must be one of {sorted(table)}, got {value!r}")


def _check_number(name, x, low, *, strict=False, integer=False, allow_none=False):
    if x is None and allow_none:
        return
    kind = numbers.Integral if integer else numbers.Real                # numpy scalars too, as check_int takes
    if isinstance(x, bool) or not isinstance(x, kind):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got {x!r}")
    if not (x == x and abs(x) != math.inf):          # comparisons, not math.isfinite: a traced number takes them
        raise ValueError(f"{name} must be a finite number, got {x}")
    if x < low or (strict and x == low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {x}")


def validate_config(cfg: MirasConfig) -> MirasConfig:
    """Check names, ranges and the combinations of axes that have no meaning here."""
    if not isinstance(cfg, MirasConfig):
        raise TypeError(f"config must be a MirasConfig (see make_config), got {type(cfg).__name__}")
    _check_choice("memory", cfg.memory, MEMORIES)
    _check_choice("bias", cfg.bias, BIASES)
    _check_choice("retention", cfg.retention, RETENTIONS)
    _check_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    _check_choice("activation", cfg.activation, ACTIVATIONS)
    _check_number("window", cfg.window, 1, integer=True)
    _check_number("expansion", cfg.expansion, 1, integer=True)
    _check_number("p", cfg.p, 1)
    _check_number("sign_sharpness", cfg.sign_sharpness, 0, strict=True, allow_none=True)
    _check_number("abs_eps", cfg.abs_eps, 0)
    _check_number("delta", cfg.delta, 0)
    _check_number("lq", cfg.lq, 1)
    _check_number("scale", cfg.scale, 0, strict=True)
    _check_number("threshold", cfg.threshold, 0)
    check_ns_steps(cfg.ns_steps)
    if isinstance(cfg.ns_coeffs, list):
        raise TypeError(f"ns_coeffs must be a name or a tuple, got the list {cfg.ns_coeffs!r}")
    ns_coefficients(cfg.ns_coeffs)
    if not isinstance(cfg.layer_norm, bool):
        raise TypeError(f"layer_norm must be True or False, got {cfg.layer_norm!r}")
    if cfg.layer_norm and cfg.memory != "residual":
        raise ValueError(f"layer_norm applies to memory='residual' (x + LN(W1 act(W2 x))), not {cfg.memory!r}")
    if cfg.retention == "proximal" and (cfg.memory, cfg.bias, cfg.optimizer, cfg.window) != ("linear", "l2", "gd", 1):
        raise ValueError("retention='proximal' (the exact implicit step, Longhorn) has a closed form only for "
                         "memory='linear', bias='l2', optimizer='gd', window=1; got "
                         f"memory={cfg.memory!r}, bias={cfg.bias!r}, optimizer={cfg.optimizer!r}, window={cfg.window}")
    if cfg.window > 1:
        if cfg.bias not in ("l2", "lp", "huber", "huber_norm", "huber_switch", "value_shift"):
            raise ValueError(f"window={cfg.window} (Omega rule) takes a bias of the l2 family, not bias={cfg.bias!r}; "
                             "the dot-product window exists only on a linear memory, as atlaslib.omega.swla "
                             "(where the gradient does not depend on the memory, so the window is a sum of writes)")
        if RETENTIONS[cfg.retention].grad_at_decayed:
            raise ValueError(f"window={cfg.window} cannot be combined with retention={cfg.retention!r}: the window's "
                             "gradients are taken at M_{t-1}; use retention='decay' (decay after the gradient)")
    return cfg


def make_config(preset: str | MirasConfig | None = None, **overrides) -> MirasConfig:
    """A validated config: ``preset`` (a name from ``PRESETS`` or a MirasConfig) with ``overrides``.

    Overrides are MirasConfig fields (memory, bias, retention, optimizer, window, p, lq,
    ...). An option that belongs to an axis choice the config does not make (e.g. ``p``
    without ``bias="lp"``, ``delta`` with ``bias="dot"``) is a ValueError.
    """
    if preset is None:
        base = MirasConfig()
    elif isinstance(preset, MirasConfig):
        base = preset
    elif isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {sorted(PRESETS)}")
        base = PRESETS[preset]
    else:
        raise TypeError(f"preset must be a preset name or a MirasConfig, got {type(preset).__name__}")
    unknown = sorted(set(overrides) - FIELDS)
    if unknown:
        raise TypeError(f"unknown config option(s) {unknown}; options: {sorted(FIELDS - {'name'})}")
    if "memory" in overrides and "layer_norm" not in overrides and overrides["memory"] != "residual":
        overrides = {**overrides, "layer_norm": False}        # a preset's LN belongs to its residual memory
    if isinstance(overrides.get("ns_coeffs"), list):
        overrides = {**overrides, "ns_coeffs": tuple(overrides["ns_coeffs"])}
    # numpy scalars (a sweep's grid) as Python numbers, so that equal configs compare and print equal
    overrides = {k: (int(v) if isinstance(v, numbers.Integral) else float(v))
                 if type(v).__module__ == "numpy" and isinstance(v, numbers.Real) else v
                 for k, v in overrides.items()}
    changed = {k: v for k, v in overrides.items() if getattr(base, k) != v}
    name = overrides.get("name", base.name if not changed else
                         f"{base.name}({', '.join(f'{k}={v!r}' for k, v in changed.items())})")
    cfg = dataclasses.replace(base, **{**overrides, "name": name})
    for option in overrides:
        if option in OPTION_OWNERS and not (option == "layer_norm" and overrides[option] is False):
            axis, owners = OPTION_OWNERS[option]
            if getattr(cfg, axis) not in owners:
                raise ValueError(f"option {option}={overrides[option]!r} applies to {axis} in {list(owners)}, "
                                 f"but this config has {axis}={getattr(cfg, axis)!r}")
    return validate_config(cfg)


# ---------------------------------------------------------------------------- the four-axis table

def describe(cfg: MirasConfig) -> dict:
    """One row of the four-axis table: model, memory, bias, retention, optimizer (in words). ``cfg``: a
    MirasConfig or a preset's name."""
    cfg = make_config(cfg) if isinstance(cfg, str) else cfg
    row = {"model": cfg.name,
           "memory": MEMORY_CLASSES[cfg.memory].describe(cfg),
           "bias": BIASES[cfg.bias].describe(cfg),
           "retention": RETENTIONS[cfg.retention].describe(cfg),
           "optimizer": OPTIMIZERS[cfg.optimizer].describe(cfg)}
    if cfg.window > 1:
        row["bias"] += f", window of c={cfg.window} pairs"
    return row


def axes_table(presets=None) -> list[dict]:
    """The blog's four-axis table, one row per preset, generated from ``PRESETS``."""
    names = list(PRESETS) if presets is None else list(presets)
    return [describe(make_config(n) if isinstance(n, str) else n) for n in names]


def axes_markdown(presets=None) -> str:
    """``axes_table`` as a Markdown table."""
    rows = axes_table(presets)
    cols = ["model", "memory", "bias", "retention", "optimizer"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |" for r in rows]
    return "\n".join(lines)
