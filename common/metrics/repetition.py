"""The output-quality signal: how much of a response repeats itself."""

from __future__ import annotations

from collections.abc import Sequence

from common.metrics.names import REPETITION_NGRAM


def repeated_ngram_share(token_ids: Sequence[int], n: int = REPETITION_NGRAM) -> float | None:
    """Share of the response's ``n``-grams (of token ids) that already occurred earlier in it, in [0, 1).

    0 for a response without repeats; a model stuck in a loop approaches 1. None when the response is too
    short to have two ``n``-grams (nothing to judge).
    """
    total = len(token_ids) - n + 1
    if total < 2:
        return None
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(total):
        gram = tuple(token_ids[i : i + n])
        if gram in seen:
            repeated += 1
        else:
            seen.add(gram)
    return repeated / total
