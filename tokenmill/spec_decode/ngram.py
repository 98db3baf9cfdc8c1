"""N-gram prompt lookup: find the sequence's last n tokens earlier in the sequence (prompt and output) and
propose the tokens that followed them there. Free to compute, and right whenever the answer copies its input
(edits, quotes, code, extraction)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` proposed tokens: the longest n (max_n down to min_n) whose suffix occurs earlier wins,
    and of its occurrences the latest one (the nearest context is the likeliest to repeat)."""
    length = len(token_ids)
    if length < min_n + 1 or num_tokens < 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Candidates: earlier positions holding the last token (an n-gram match must end on one); then each longer
    # n only filters these, so a step costs one vectorized pass over the sequence.
    ends = np.flatnonzero(tokens[:length - 1] == tokens[-1])
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        matches = ends[ends >= n - 1]
        for back in range(1, n):
            if not matches.size:
                break
            matches = matches[tokens[matches - back] == tokens[length - 1 - back]]
        if matches.size:
            start = int(matches[-1]) + 1
            return tokens[start:start + num_tokens].tolist()
    return []
