"""Feature maps phi applied to keys and queries before they enter a linear memory.

Chapter 1 needs the identity and elu+1 (positive features, so that the normaliser
z_t^T phi(q_t) of normalised linear attention stays positive). The polynomial maps of
chapter 4 are added next to these.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def identity(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = x."""
    return x


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al., 2020)."""
    return F.elu(x) + 1.0


FEATURE_MAPS = {"identity": identity, "elu+1": elu_plus_one}


def get_feature_map(name):
    """A feature map by name (``identity``, ``elu+1``) or a callable passed through."""
    if callable(name):
        return name
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; choose one of {sorted(FEATURE_MAPS)} or pass a callable")
    return FEATURE_MAPS[name]
