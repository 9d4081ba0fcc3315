"""Multi-query associative recall (MQAR), the synthetic recall task of Zoology.

A sequence of length T starts with ``num_kv_pairs`` key-value pairs laid out
``k1 v1 k2 v2 ...``; the rest of the sequence is filler in which every key is queried
once (its one labelled position), at a slot of the query region drawn from a power law
over the slots (the early slots are likelier, near repeats as with repeated bigrams in
text). With random filler, key tokens can also recur unlabelled among the filler. The
model must emit the key's value as the *next* token after the query, so the label sits at
the query's own position (next-token convention) and every other label is -100 (ignored
by cross-entropy).

    inputs: k1 v1 k2 v2 | .  .  k2 .  .  .  k1 .  ...
    labels: -  -  -  -  | -  -  v2 -  -  -  v1 -  ...

Keys come from the first half of the vocabulary (token 0 excluded, as in Zoology, where
0 marks "filler" before it is replaced by random tokens), values from the second half;
within one example keys are distinct and values are distinct.
"""
from __future__ import annotations

import numbers

import torch

from ..core.validation import check_positive_number


def _check_int(name, x, low):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {x!r}")
    if x < low:
        raise ValueError(f"{name} must be >= {low}, got {x}")


def power_law_gap_probs(space: int, power_a: float) -> torch.Tensor:
    """P(gap = i) proportional to a * (i+1)^(a-1) for i = 0..space-1 (a=1: uniform)."""
    i = torch.arange(1, space + 1, dtype=torch.float64)
    p = power_a * i ** (power_a - 1)
    if not bool(torch.isfinite(p.sum())):          # a term, or only their sum, past 1e308
        raise ValueError(f"power_a={power_a} overflows the gap law over {space} slots (its terms or their sum "
                         "pass 1e308); "
                         "a = 1 is already uniform, larger a favours the last slots")
    return p / p.sum()


def _sample_distinct(n: int, low: int, high: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` distinct integers from [low, high) for each of n rows (uniform, no replacement)."""
    return torch.rand(n, high - low, generator=gen).argsort(dim=1)[:, :count] + low


def mqar(num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, *,
         power_a: float = 0.01, random_non_queries: bool = True, seed: int = 0):
    """Draw an MQAR data set. Returns ``(inputs, labels)``, both ``[num_examples, seq_len]`` long.

    Args:
        num_examples: number of sequences N.
        seq_len: T, even, with room for the pairs and their queries: T >= 4 * num_kv_pairs.
        num_kv_pairs: pairs per sequence (each is queried exactly once).
        vocab_size: must exceed ``seq_len`` (Zoology's rule) and leave at least
            ``num_kv_pairs`` keys in ``[1, vocab_size // 2)`` and values in
            ``[vocab_size // 2, vocab_size)``.
        power_a: exponent a of the gap law p(i) ~ i^(a-1); 0.01 (Zoology's default) puts
            most queries close to the start of the query region, 1.0 is uniform.
        random_non_queries: replace filler tokens by uniform random tokens from the whole
            vocabulary (Zoology's default); otherwise filler is token 0.
        seed: seeds a private generator, so equal seeds give equal data.
    """
    _check_int("num_examples", num_examples, 1)
    _check_int("seq_len", seq_len, 2)
    _check_int("num_kv_pairs", num_kv_pairs, 1)
    _check_int("vocab_size", vocab_size, 2)
    if seq_len % 2:
        raise ValueError(f"seq_len must be even (keys and values come in pairs), got {seq_len}")
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(f"seq_len={seq_len} is too small for num_kv_pairs={num_kv_pairs}: need "
                         f"seq_len >= 4 * num_kv_pairs = {4 * num_kv_pairs} (pairs plus a query slot each)")
    if vocab_size <= seq_len:
        raise ValueError(f"vocab_size must exceed seq_len (as in Zoology), got vocab_size={vocab_size}, "
                         f"seq_len={seq_len}")
    half = vocab_size // 2
    if half - 1 < num_kv_pairs or vocab_size - half < num_kv_pairs:
        raise ValueError(f"vocab_size={vocab_size} is too small for {num_kv_pairs} distinct keys in "
                         f"[1, {half}) and distinct values in [{half}, {vocab_size})")
    check_positive_number("power_a", power_a, "the gap law's exponent a")
    if not isinstance(random_non_queries, bool):
        raise TypeError(f"random_non_queries must be True or False, got {random_non_queries!r}")
    _check_int("seed", seed, 0)

    gen = torch.Generator().manual_seed(seed)
    N, P = num_examples, num_kv_pairs
    context = 2 * P
    keys = _sample_distinct(N, 1, half, P, gen)
    values = _sample_distinct(N, half, vocab_size, P, gen)

    inputs = torch.zeros(N, seq_len, dtype=torch.long)
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values

    # Query slots are the even offsets of the query region; gap j puts key j at slot gap_j.
    space = (seq_len - context) // 2
    probs = power_law_gap_probs(space, power_a).expand(N, space)
    gaps = torch.multinomial(probs, P, replacement=False, generator=gen)   # distinct per row
    query_pos = context + 2 * gaps
    inputs.scatter_(1, query_pos, keys)
    labels = torch.full((N, seq_len), -100, dtype=torch.long)
    labels.scatter_(1, query_pos, values)                 # target of the token after the query

    if random_non_queries:
        filler = inputs == 0
        noise = torch.randint(vocab_size, (N, seq_len), generator=gen)
        inputs[filler] = noise[filler]
    return inputs, labels
