"""Longest repeats: which token would extend a repeat of the context's end, and how long.

For a context x[0..n-1] and a candidate token c, the repeat length of c is the largest
L such that the suffix x[n-L..n-1] followed by c already occurs in the context: some
j <= n-1 has x[j] = c and x[j-L..j-1] = x[n-L..n-1] (the two may overlap). Both DRY
and the LZ penalty are functions of it; `longest_repeats` computes it for every
candidate that has one, over a window of the context's last tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DRY_WINDOW = 1024  # DRY looks at the context's last 1024 tokens (llama.cpp: dry_penalty_last_n)
LZ_WINDOW = 256  # the LZ penalty at its last 256
MAX_REPEAT = 64  # repeat lengths are counted up to this, which bounds the cost of a row


def longest_repeats(
    token_ids: Sequence[int], window: int, max_len: int = MAX_REPEAT, breakers: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths): each candidate with a repeat length >= 1, and that length.

    Only the last `window` tokens count, lengths stop at `max_len`, and a repeated
    suffix may not contain a breaker (so it ends after the context's last breaker).
    """
    tokens = np.asarray(token_ids[-window:], dtype=np.int64)
    n = len(tokens)
    if breakers and n:
        is_breaker = np.isin(tokens, np.asarray(breakers, dtype=np.int64))
        last_breaker = int(np.flatnonzero(is_breaker)[-1]) if is_breaker.any() else -1
        max_len = min(max_len, n - 1 - last_breaker)
    max_len = min(max_len, n - 1)
    if max_len < 1:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # ends: every j whose x[j-1] equals the last token, the candidate being x[j]
    ends = np.flatnonzero(tokens[:-1] == tokens[-1]) + 1  # [C]
    back = np.arange(1, max_len + 1)  # [K]: k steps back
    before = ends[:, None] - back[None, :]  # [C, K]: j - k
    # x[j-k] == x[n-k] for k = 1..K, with j-k inside the window; L = the leading run of matches
    same = (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[n - back][None, :])
    lengths = np.cumprod(same, axis=1).sum(axis=1)
    found = lengths > 0
    return _max_per_id(tokens[ends[found]], lengths[found])


def _max_per_id(ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The largest length of each distinct id."""
    if not len(ids):
        return ids, lengths
    order = np.lexsort((-lengths, ids))  # by id, longest first
    ids, lengths = ids[order], lengths[order]
    first = np.ones(len(ids), dtype=bool)
    first[1:] = ids[1:] != ids[:-1]
    return ids[first], lengths[first]


def dry_penalties(
    token_ids: Sequence[int], multiplier: float, base: float, allowed_length: int, breakers: Sequence[int] = ()
) -> tuple[list[int], list[float]]:
    """(ids, amounts) to subtract: multiplier * base ** (L - allowed_length) where L >= allowed_length."""
    ids, lengths = longest_repeats(token_ids, DRY_WINDOW, MAX_REPEAT, breakers)
    hit = lengths >= allowed_length
    amounts = multiplier * np.power(float(base), (lengths[hit] - allowed_length).astype(np.float64))
    return ids[hit].tolist(), amounts.tolist()


def lz_penalties(token_ids: Sequence[int], penalty: float) -> tuple[list[int], list[float]]:
    """(ids, amounts) to subtract: penalty * L for every candidate with a repeat length L >= 1."""
    ids, lengths = longest_repeats(token_ids, LZ_WINDOW)
    return ids.tolist(), (penalty * lengths.astype(np.float64)).tolist()
