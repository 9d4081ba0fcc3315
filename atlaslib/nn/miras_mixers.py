"""Chapter 3 mixers: TTT-Linear, TTT-MLP, Titans, Moneta, Yaad and Memora for the tiny LM.

Each is a preset of the MIRAS engine (``atlaslib.miras``) run on l2-normalised q and k
(book ch. 3 §11), with every data-dependent quantity projected from the layer input x_t and
squashed as book/notation.md says:

* alpha_t (retention, one per head; the models whose retention takes it): chapter 1's
  gate sigmoid(w^T x_t + b)^(1/16), so memories start long-lived;
* eta_t (inner learning rate): softplus(w^T x_t + b), started at ``eta_init`` (0.1; a finite number > 0);
* theta_t (Titans' momentum decay): sigmoid(w^T x_t + b), started at 0.5;
* delta_t (Yaad's Huber threshold): softplus(w^T x_t + b), started at the configuration's ``delta``
  (1 by default; ``delta=`` sets it). While |e_t| > delta_t, Yaad's switch loss sees the value only
  through sign(e_t), so no outer gradient reaches the value projection; with the residual memory the
  errors start at a norm of about sqrt(1 + head_k_dim), far above the default start (book ch. 3 §11).

The memory's initial weights W_0 (one set per head, shared by the batch) are parameters
of the layer, trained by the outer loop as in TTT and Titans; they start from the
engine's default initialisation (zeros for the linear memory, N(0, 1/in) for deep ones,
Memora's log-weights N(0, 1)) drawn from torch's global generator, so that
``torch.manual_seed`` fixes them and two layers differ. Momentum starts at zero.

The chunk form runs with gradients frozen at each chunk's start, which **changes the
model** (chunk_size = 1 is the per-token rule); the default chunk_size is
``miras.DEFAULT_CHUNK_SIZE`` (16), the same as ``miras`` itself. The retention gate is handed
over as ``log_alpha`` in fp32 (fp64 for fp64 activations); ``miras`` turns it into alpha in
that dtype, never in the activation dtype. Keyword arguments that are ``MirasConfig`` fields
(memory, expansion, bias, ...) move the preset's axes, e.g. ``make_mixer("titans", 64, 4, memory="linear")``.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..core.chunking import compute_dtype
from ..core.featuremaps import inverse_softplus
from ..miras import DEFAULT_CHUNK_SIZE, Gates, MirasConfig, MirasState, build_parts, init_state, make_config, miras
from ..miras.recurrent import TokenState, miras_step
from ..miras.state import flatten_bh
from ..core.validation import check_positive_number
from .base import gate_dtype, register_mixer
from .linear_mixers import GatedLinear

CONFIG_FIELDS = {f.name for f in dataclasses.fields(MirasConfig)} - {"name"}


def start_token_state(memory: dict, momentum: bool, deltas: bool, q, v) -> TokenState:
    """The engine's state before the first token: W_0 = ``memory`` ({name: [B, H, out, in]}) in q's compute
    dtype, zero momentum (if the optimizer keeps one) and an empty window (with its deltas, if the bias takes them)."""
    B, H, _, D = q.shape
    cd = compute_dtype(q)
    Z = flatten_bh(memory, B, H, cd)
    S = {n: torch.zeros_like(w) for n, w in Z.items()} if momentum else None
    rows = lambda *width: torch.zeros(B * H, 0, *width, dtype=cd, device=q.device)   # noqa: E731
    return TokenState(Z, S, rows(D), rows(v.shape[-1]), rows() if deltas else None)


def engine_step(parts, state: TokenState, q, k, v, G, eta, alpha=None, theta=None, delta=None):
    """One token of chapter 3's engine (``miras_step``) on a mixer's tensors.

    q, k [B, H, 1, D]; v [B, H, 1, V]; G [B, H, c] this token's per-offset window gates
    (G[..., j] = gamma_{t-j}^{(t)}); eta, alpha, theta, delta [B, H, 1] or None. The state is in
    the engine's layout (B * H rows). Returns (o [B, H, 1, V] in q's dtype, the state after the token).
    """
    B, H, _, D = q.shape
    N, V, cd = B * H, v.shape[-1], compute_dtype(q)
    flat = lambda t: None if t is None else t.to(cd).reshape(N)        # noqa: E731  [B, H, 1] -> [N]
    q_t, k_t, v_t = (t.to(cd).reshape(N, -1) for t in (q, k, v))
    eta = parts.retention.effective_eta(flat(eta), k_t)                # proximal: the implicit step, as in miras
    gates_t = Gates(eta=eta, G=G.to(cd).reshape(N, -1), alpha=flat(alpha), theta=flat(theta), delta=flat(delta))
    state, y_t = miras_step(parts, state, q_t, k_t, v_t, gates_t)
    return y_t.reshape(B, H, 1, V).to(q.dtype), state


def learned_start(config: MirasConfig, n_heads: int, in_dim: int, v_dim: int) -> nn.ParameterDict:
    """W_0 as parameters of the layer, one set per head ({name: [H, out, in]}; "M" for the linear memory):
    the engine's default initialisation (``init_state``) drawn from a seed taken from torch's global
    generator, so that ``torch.manual_seed`` fixes it and two layers differ. Drawn on the CPU, then moved
    to the default device, in the default dtype (a model built under ``torch.device("meta")`` gets meta
    parameters, one built under float64 fp64 ones, as nn.Linear does)."""
    device = torch.empty(0).device                       # the ambient default device
    with torch.device("cpu"):
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
        start = init_state(config, 1, n_heads, in_dim, v_dim, generator=torch.Generator().manual_seed(seed),
                           dtype=torch.get_default_dtype()).memory
    start = start if isinstance(start, dict) else {"M": start}
    return nn.ParameterDict({name: nn.Parameter(w[0].clone().to(device)) for name, w in start.items()})


def batch_start(initial: nn.ParameterDict, B: int, dtype) -> dict:
    """``learned_start``'s W_0 broadcast over a batch of B: {name: [B, H, out, in]} in ``dtype``."""
    return {n: w.to(dtype)[None].expand(B, *w.shape) for n, w in initial.items()}


class ScalarGate(nn.Module):
    """One value per head and token from x [B, T, D]: squash(w_h^T x_t + b_h) as [B, H, T], in
    ``gate_dtype(x)`` (a bf16 sigmoid rounds every value above 1 - 2^-9 to exactly 1)."""

    def __init__(self, d_model: int, n_heads: int, squash: str, start: float):
        super().__init__()
        self.proj = nn.Linear(d_model, n_heads)
        self.squash = squash
        # a number computed on the CPU, also when the mixer is built under torch.device("meta")
        start64 = torch.tensor(float(start), dtype=torch.float64, device="cpu")
        nn.init.constant_(self.proj.bias, inverse_softplus(start64).item() if squash == "softplus" else
                          math.log(start / (1 - start)))

    def forward(self, x):
        z = self.proj(x).transpose(1, 2).to(gate_dtype(x))            # squashed in fp32, not x's dtype
        return F.softplus(z) if self.squash == "softplus" else torch.sigmoid(z)


class MirasMixer(GatedLinear):
    """A MIRAS preset as a token mixer (see the module docstring)."""

    preset = "ttt_linear"
    per_channel = False

    def __init__(self, d_model, n_heads, *, eta_init: float = 0.1, **kw):
        # eta starts at softplus(b) = eta_init: b = softplus^-1(eta_init) needs a finite eta_init > 0
        check_positive_number("eta_init", eta_init, "the inner learning rate eta_t starts there")
        options = {name: kw.pop(name) for name in list(kw) if name in CONFIG_FIELDS}
        kw.setdefault("qk_norm", True)
        kw.setdefault("chunk_size", DEFAULT_CHUNK_SIZE)
        super().__init__(d_model, n_heads, **kw)
        self.config = make_config(self.preset, **options)
        parts = build_parts(self.config, self.memory_in_dim(), self.head_v_dim)
        self.memory_shapes = parts.memory.shapes
        if not parts.retention.uses_alpha:
            self.gate_proj = None
        self.eta_gate = ScalarGate(d_model, n_heads, "softplus", eta_init)
        self.theta_gate = ScalarGate(d_model, n_heads, "sigmoid", 0.5) if parts.optimizer.uses_theta else None
        self.delta_gate = (ScalarGate(d_model, n_heads, "softplus", check_positive_number(
            "delta", self.config.delta, "the Huber threshold delta_t starts there")) if parts.bias.uses_delta else None)
        self.has_momentum = parts.optimizer.has_state
        self.initial = learned_start(self.config, n_heads, self.memory_in_dim(), self.head_v_dim)

    def memory_in_dim(self) -> int:
        """The width of what the memory reads: the width of phi(k) (``feature_dim``)."""
        return self.feature_dim()

    def initial_state(self, B: int, dtype) -> MirasState:
        """W_0 broadcast over the batch: a tensor [B, H, V, K] (linear memory) or a dict of them."""
        mem = batch_start(self.initial, B, dtype)
        return MirasState(mem["M"] if set(mem) == {"M"} else mem, None)

    def gates(self, x, dtype, log_alpha: bool = False):
        """The data-dependent gates in ``dtype`` (None where the model has none): eta, theta,
        delta and the retention, as ``alpha`` or, with ``log_alpha=True``, as ``log_alpha``
        (computed as a log, see ``GatedLinear.log_gate``)."""
        cast = lambda g: None if g is None else g.to(dtype)             # noqa: E731
        out = dict(eta=cast(self.eta_gate(x)),
                   theta=cast(self.theta_gate(x)) if self.theta_gate is not None else None,
                   delta=cast(self.delta_gate(x)) if self.delta_gate is not None else None)
        if self.gate_proj is None:
            out["alpha"] = None
        elif log_alpha:
            out["log_alpha"] = cast(self.log_gate(x))
        else:
            out["alpha"] = cast(self.gate(x))
        return out

    def mix(self, q, k, v, x):
        gates = {n: g for n, g in self.gates(x, gate_dtype(q), log_alpha=True).items() if g is not None}
        return miras(q, k, v, config=self.config, initial_state=self.initial_state(q.shape[0], q.dtype),
                     backend=self.backend, chunk_size=self.chunk_size, **gates)[0]

    def mix_step(self, q, k, v, x, state):
        """One token of the per-token engine (the model of ``chunk_size=1`` / ``backend="recurrent"``).

        The state is the engine's ``TokenState`` in its internal layout (B * H rows): the raw memory
        state, the momentum and the window's last c - 1 rows; it starts from W_0 (``initial``) and
        zero momentum, as ``forward`` does.
        """
        B, H, _, D = q.shape
        parts = build_parts(self.config, D, v.shape[-1])
        if state is None:
            start = self.initial_state(B, q.dtype).memory              # q's dtype, as ``mix`` hands it over
            state = start_token_state(start if isinstance(start, dict) else {"M": start}, self.has_momentum,
                                      self.delta_gate is not None, q, v)
        g = self.gates(x, gate_dtype(q))
        G = torch.ones(B, H, self.config.window, dtype=gate_dtype(q), device=q.device)   # no window gates here
        return engine_step(parts, state, q, k, v, G, g["eta"], g["alpha"], g["theta"], g["delta"])

    @property
    def state_size(self) -> int:
        """The memory's weights (plus the momentum buffer, for Titans), summed over heads."""
        per_head = sum(o * i for o, i in self.memory_shapes.values())
        return self.n_heads * per_head * (2 if self.has_momentum else 1)

    def extra_repr(self) -> str:
        c = self.config
        return (f"{super().extra_repr()}, memory={c.memory!r}, bias={c.bias!r}, retention={c.retention!r}, "
                f"optimizer={c.optimizer!r}, chunk_size={self.chunk_size}")


def preset_mixer(preset: str, name: str, doc: str) -> type:
    """Register the mixer ``make_mixer(preset, ...)``: a ``MirasMixer`` of chapter 3's preset ``preset``."""
    return register_mixer(preset)(type(name, (MirasMixer,), {"preset": preset, "__doc__": doc, "__module__": __name__}))


PRESET_MIXERS = {preset: preset_mixer(preset, name, doc) for preset, name, doc in (
    ("ttt_linear", "TTTLinear", "TTT-Linear: a linear memory, one GD step on the l2 loss per token (mini-batched "
                                "by chunks)."),
    ("ttt_mlp", "TTTMLP", "TTT-MLP: a 2-layer MLP memory W2 gelu(W1 k), GD on the l2 loss."),
    ("titans", "Titans", "Titans: an MLP memory, l2 loss, GD with momentum theta_t and retention alpha_t."),
    ("moneta", "Moneta", "Moneta: residual-MLP memory, l3 loss, l4 normalisation of a linear accumulator."),
    ("yaad", "Yaad", "Yaad: residual-MLP memory, Huber switch loss with threshold delta_t, retention alpha_t."),
    ("memora", "Memora", "Memora: residual-MLP memory on the scaled simplex (softmax in the log domain), l2 loss."))}
# module globals under their own names, so that pickle (torch.save of a model) finds the classes
globals().update({cls.__name__: cls for cls in PRESET_MIXERS.values()})
