"""Prompts of mixed lengths built from real text shipped with Python (its own docstrings)."""

import json
import random


def mixed_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts with lengths spread over [lo, hi], cut from real English text."""
    text = " ".join(filter(None, (json.__doc__, random.__doc__, str.__doc__, dict.__doc__,
                                  list.__doc__, int.__doc__, open.__doc__, print.__doc__)))
    ids = tokenizer(text * 4).input_ids
    rng = random.Random(seed)
    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    rng.shuffle(lengths)
    out = []
    for length in lengths:
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out
