"""The prompts of the SGLang end-to-end tests (token ids of the tiny model's vocabulary):
two that fill two chunks each and leave a tail, one under a chunk (LMCache #4007: never
stored), and one that shares 300 tokens (one whole chunk) with the first."""

from __future__ import annotations

import random

CHUNK = 256
VOCAB = 420  # within the tiny model's tokenizer (427 entries)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


PROMPT_A = tokens(1, 700)  # two chunks and a tail of 188 tokens
PROMPT_B = tokens(2, 600)  # two chunks and a tail of 88 tokens
SHORT = tokens(3, 200)  # under one chunk
SHARED = PROMPT_A[:300] + tokens(4, 400)  # shares A's first chunk, not its second
