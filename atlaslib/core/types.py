"""Type aliases of the public model functions' signatures (checked by mypy in ``make test``)."""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import torch

# A gate or rate: a per-token tensor ([B, H, T], or wider where the model says so), a number, or
# None for the model's default.
Gate = Union[torch.Tensor, float, None]
# A feature map: None (identity), a name from ``core.FEATURE_MAPS`` or a callable on [..., K] tensors.
FeatureMap = Union[str, Callable[[torch.Tensor], torch.Tensor], None]
# Newton-Schulz coefficients: a name ("muon", "cubic", ...) or explicit (a, b, c) triples.
Coefficients = Union[str, Sequence[Any]]
# What every model returns: the output o [B, H, T, V] and the final state (None unless requested;
# its type is the model's memory: a tensor, a dict of tensors or a state object).
ModelOutput = tuple[torch.Tensor, Any]
