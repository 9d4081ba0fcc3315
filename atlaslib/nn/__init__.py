"""Token-mixer layers and the tiny LM used by the experiments.

Chapter 1's mixers (softmax, linear, retnet, mamba2, gla) and chapter 2's (deltanet,
gated_deltanet, kda) are registered on import; later
chapters register theirs with ``register_mixer`` in their own modules (chapter 3: ttt_linear,
ttt_mlp, titans, moneta, yaad, memora; chapter 4: omeganet, swla; chapter 5: atlas,
atlas++; chapter 6: deep_transformer, swdt, dot, dla;
chapter 7: memory_caching over a chapter 1 or 2 base; ``hybrids``: swa and the MAG / MAL backbones over any
memory mixer).
"""
from . import linear_mixers  # noqa: F401  (registers the chapter 1 mixers)
from . import delta_mixers  # noqa: F401  (registers the chapter 2 mixers)
from . import omega_mixers  # noqa: F401  (registers the chapter 4 mixers)
from . import miras_mixers  # noqa: F401  (registers the chapter 3 mixers)
from . import atlas_mixers  # noqa: F401  (registers the chapter 5 mixers)
from . import deep_mixers  # noqa: F401  (registers the chapter 6 mixers)
from . import caching_mixers  # noqa: F401  (registers the chapter 7 mixer)
from . import hybrids  # noqa: F401  (registers swa, mag and mal)
from .lm import TinyLM
from .base import MIXERS, ShortConv, TokenMixer, available_mixers, make_mixer, register_mixer

__all__ = ["TinyLM", "TokenMixer", "ShortConv", "MIXERS", "available_mixers", "make_mixer", "register_mixer"]
