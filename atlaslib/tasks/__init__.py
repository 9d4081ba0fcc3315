"""Synthetic tasks: multi-query associative recall (MQAR) and capacity probes."""
from .capacity import (capacity_sweep, gd_memory, hebbian_memory, least_squares_memory,
                       random_pairs, recall_error)
from .mqar import mqar

__all__ = ["mqar", "capacity_sweep", "gd_memory", "hebbian_memory", "least_squares_memory",
           "random_pairs", "recall_error"]
