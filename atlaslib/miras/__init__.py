"""Chapter 3: the four MIRAS axes as one composable engine.

A model is a choice of memory architecture (``memory.py``), attentional bias
(``bias.py``), retention (``retention.py``) and optimizer (``optimizer.py``); the named
models are presets (``config.PRESETS``): linear_attention, deltanet, gated_deltanet,
ttt_linear, ttt_mlp, titans, moneta, yaad, memora, chapter 5's atlas and chapter 6's dla
(deep linear attention). One function runs any of them:

    o, state = miras(q, k, v, preset="titans", alpha=a, eta=lr, theta=mom, output_final_state=True)
    o, _ = miras(q, k, v, preset="titans", memory="linear", alpha=a, eta=lr, theta=mom)   # one axis moved
    o, _ = miras(q, k, v, memory="mlp", bias="huber_switch", retention="kl", delta=d)

The three rooms: ``recurrent.py`` (the per-token definition, the frozen-gradient oracle
``miras_frozen_seq``, backend "frozen_seq", and ``memory_gradient``, grad_W l for any configuration by autograd),
``chunk.py`` (chunkwise, gradients frozen at the chunk start; ``titans_linear_chunk``, the
kernel's contract in PyTorch) and ``kernel.py`` (Triton, Titans/TTT with a linear memory).
``config.py`` has the presets and the four-axis table (``axes_table``, ``axes_markdown``),
``state.py`` the state (``MirasState``, ``init_state``), and ``backends.py`` splits ``miras``
into validation and execution (``prepare`` + ``run``) and chooses the backend.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from ..core.dispatch import without_autocast
from ..core.types import FeatureMap, Gate, ModelOutput
from ..core.validation import check_flag
from .bias import BIASES, Bias, build_bias
from .chunk import miras_chunk, titans_linear_chunk
from .config import (AXES, DEFAULT_CHUNK_SIZE, EXACT_CHUNK, PRESETS, MirasConfig, axes_markdown, axes_table,
                     describe, make_config, validate_config)
from .memory import ACTIVATIONS, MEMORIES, Memory, build_memory
from .optimizer import OPTIMIZERS, Optimizer, build_optimizer
from .backends import BACKENDS, KERNEL_CONFIGS, Problem, has_kernel, prepare, run
from .recurrent import Gates, Parts, build_parts, loss_gradient, memory_gradient, miras_frozen_seq, miras_recurrent
from .retention import RETENTIONS, Retention, build_retention, soft_threshold
from .state import MirasState, init_state


def miras(q: Tensor, k: Tensor, v: Tensor, *, preset: str | MirasConfig | None = None,
          config: MirasConfig | None = None, alpha: Gate = None, eta: Gate = None, theta: Gate = None,
          delta: Gate = None, gamma: Gate = None, phi: FeatureMap = None, initial_state: Any = None,
          output_final_state: bool = False, backend: str = "auto", chunk_size: int | None = None,
          log_alpha: Gate = None, **overrides: Any) -> ModelOutput:
    """Run any MIRAS configuration: memory, attentional bias, retention, optimizer.

    The per-token rule (book/notation.md, book ch. 3 §1), with W_{t-1} the memory's weights before token t:

        grad_t = sum_{i=t-c+1}^{t} gamma_i^{(t)} grad_W l(W_{t-1}; phi(k_i), v_i)   (c = window, usually 1)
        u_t = -eta_t grad_t                              (optimizer="gd")
            = S_t = theta_t S_{t-1} - eta_t grad_t       (optimizer="momentum", Titans)
        Z_t = alpha_t Z_{t-1} + u_t,  W_t = R(Z_t)       (retention: see retention.py for all seven)
        y_t = M_{W_t}(phi(q_t))                          (read out after the update)

    Args:
        q, k: [B, H, T, K] queries and keys (phi is applied here; l2-normalised keys are
            the usual regime). v: [B, H, T, V] values.
        preset: a name from ``PRESETS`` (or a MirasConfig); ``config``: a MirasConfig (give
            one of the two, or neither for the default linear/l2/none/gd = DeltaNet).
        **overrides: MirasConfig fields that move axes or set options, e.g. memory="linear",
            bias="lp", p=3, retention="kl", scale=2.0, optimizer="momentum", window=4,
            expansion=2, layer_norm=True (see ``MirasConfig``). Unknown names: TypeError;
            options of an axis choice the config does not make, or incompatible axes
            (residual memory with K != V, proximal with a deep memory, ...): ValueError.
        alpha: retention gate in [0, 1], [B, H, T] or a number (None: 1). Only for
            retentions that take it (all but "none"); it is Memora's beta_t and Moneta's
            beta_t, and the lambda of the elastic net.
        log_alpha: the retention gate as its log (values <= 0; a tensor in fp32/fp64 or a
            number) instead of alpha. The forms that combine with alpha itself get exp(log_alpha)
            in the compute dtype (fp32, fp64 for fp64 inputs), never in the activation dtype;
            the chunk form's decays use the log itself (no log(exp(.)) round trip).
        eta: inner learning rate >= 0, [B, H, T] or a number (None: 1). The delta rule's beta.
            The default suits the linear memory on unit-norm keys (per token, stable while eta ||k||^2 < 2;
            with gradients frozen over a chunk, eta * lambda_max(the chunk's K K^T) < 2 is sufficient, and
            lambda_max is about 2.5 for 16 random unit keys of K = 32; measured there, ttt_linear at
            chunk_size=16 stayed bounded up to eta = 1.3 and grew from 1.4);
            the plain MLP memories (ttt_mlp, titans) diverge per token at it: on random unit keys
            at T = 512 they blew up at eta >= 0.4 (K = 16) and >= 0.3 (K = 64), not at 0.2.
        theta: momentum decay in [0, 1], [B, H, T] or a number, optimizer="momentum" or "muon" only
            (None: 0, no momentum carried).
        delta: Huber threshold / value-shift radius >= 0 for the biases that take one,
            [B, H, T] (data-dependent, as in Yaad) or a number (None: the config's delta).
        gamma: window gates in [0, 1]: [B, H, T] per source token or [B, H, T, window] per
            offset, as in ``atlaslib.omega.omega_rule``, or a number (None: all ones).
        phi: feature map for q and k (None, a name from ``core.FEATURE_MAPS`` or a callable).
        initial_state: None (the default start: zeros for the linear memory, seeded random
            weights for deep ones, see ``init_state``), a memory state (tensor [B, H, V, D]
            for the linear memory, dict {name: [B, H, out, in]} for deep ones) or a
            ``MirasState(memory, momentum)``. The memory state is the *raw* state: log-weights
            for retention="kl", the accumulator Z ([M]'s A) for "lq" (see ``state.py``).
        output_final_state: also return the final ``MirasState``.
        backend: "recurrent" (the per-token definition, gradients at W_{t-1}),
            "frozen_seq" (per-token, gradients frozen at each chunk start: the chunk form's
            oracle), "chunk" (chunkwise PyTorch), "triton" (kernel; only for
            ``KERNEL_CONFIGS``, chunk_size <= 64, K <= 256, fp32/fp16/bf16; CPU under
            TRITON_INTERPRET=1; backward through the chunk form) or "auto" (triton on CUDA
            where a kernel exists and its tiles fit, chunk otherwise).
        chunk_size: b for "chunk", "frozen_seq" and "triton" (None: ``DEFAULT_CHUNK_SIZE`` =
            16, shared with ``omega_rule`` and the mixers). **It changes the model** for every
            configuration whose gradient depends on the state.

    Which equalities hold (book ch. 3 §8; all tested):

    ==========================================================  ========================
    chunk(b) vs frozen_seq(b), every configuration and b        exact
    chunk(1) vs recurrent                                       exact
    chunk(b > 1) vs recurrent                                   differ (frozen gradients),
                                                                except linear_attention
                                                                (state-free gradient): exact
    triton(b) vs chunk(b)                                       exact (fp32 rounding)
    recurrent, preset linear_attention vs linear_attention      exact (alpha with
                                                                retention="decay")
    recurrent, deltanet / gated_deltanet vs delta_rule          exact (eta = beta)
    recurrent, retention="proximal" vs delta_rule(longhorn)     exact
    chunk(b > 1), deltanet / gated_deltanet vs delta_rule       differ: the frozen-gradient
                                                                delta family is approximate
    ==========================================================  ========================

    Some configurations are chaotic in the model itself, whatever the form computes them, so an fp32 run
    and an fp64 run of the same inputs part over long sequences: Yaad (its Huber switch and sign make each
    update jump when an error crosses 0 or delta; at eta = 0.1 on unit keys, a 1e-9 change of the keys
    moved the fp64 output by 5% at T = 1024), and the residual memory's LayerNorm under strong decay
    (book ch. 3 §8). Compare forms in fp64 there, or over a few hundred tokens.

    Returns:
        (o [B, H, T, V] in q's dtype, ``MirasState`` in fp32 (fp64 for fp64 inputs) or None).
    """
    problem = prepare(q, k, v, preset=preset, config=config, alpha=alpha, eta=eta, theta=theta, delta=delta,
                      gamma=gamma, phi=phi, initial_state=initial_state, backend=backend, chunk_size=chunk_size,
                      log_alpha=log_alpha, **overrides)
    check_flag("output_final_state", output_final_state)
    with without_autocast(q):             # as ``dispatch``: the engine keeps its own precision (fp32 states)
        o, state = run(problem)
    return o.to(q.dtype), (state if output_final_state else None)


__all__ = [
    # the public function, its configurations and its state
    "miras", "MirasConfig", "MirasState", "make_config", "validate_config", "PRESETS", "AXES", "EXACT_CHUNK",
    "axes_table", "axes_markdown", "describe", "init_state", "DEFAULT_CHUNK_SIZE", "BACKENDS",
    "KERNEL_CONFIGS", "has_kernel",
    # the four axes: registries, base classes and builders
    "MEMORIES", "BIASES", "RETENTIONS", "OPTIMIZERS", "ACTIVATIONS", "Memory", "Bias", "Retention", "Optimizer",
    "build_memory", "build_bias", "build_retention", "build_optimizer",
    # the forms, and what they take
    "miras_recurrent", "miras_frozen_seq", "miras_chunk", "titans_linear_chunk", "Parts", "Gates",
    "build_parts", "Problem", "prepare", "run",
    # building blocks the chapter shows
    "memory_gradient", "loss_gradient", "soft_threshold",
]
