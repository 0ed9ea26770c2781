"""Proposers: where draft tokens come from. One interface: up to k tokens per sequence, 0 allowed,
for all of a step's drafting sequences at once (a model proposer runs one batched forward).

Drafts are deterministic guesses. The verify step samples every position through the
ordinary sampler and keeps a draft only when it equals the token sampled there, so a
proposer decides how fast a sequence goes, never what it says.

- `NgramProposer` (prompt lookup): the longest suffix of the sequence (prompt + output,
  `min_n`..`max_n` tokens) that occurred earlier proposes what followed its latest
  occurrence.
- `PredictionProposer` (OpenAI's Predicted Outputs): the predicted text's tokens are the
  source. The output's longest suffix found in the prediction, at or after where the
  last draft left off, proposes what follows it there; with no output yet, the
  prediction's start. A mismatch re-aligns by the same lookup, as prompt lookup does.
- `DraftModelProposer` and `MtpProposer` (backend.speculation.model_proposers): a small
  model's, or the checkpoint's MTP layers', greedy continuation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

Want = tuple[Any, int]  # (a backend.types.sequence.Sequence, in seq.spec its SpecState; k)


class Proposer(Protocol):
    name: str

    def propose(self, wants: list[Want]) -> list[list[int]]:
        """For each (sequence, k): up to k draft tokens to follow its tokens."""


class TokenLookup:
    """A proposer that looks each sequence's drafts up in tokens it already has."""

    name = "lookup"

    def propose(self, wants: list[Want]) -> list[list[int]]:
        return [self.draft(seq.token_ids, seq.num_prompt_tokens, k, seq.spec) for seq, k in wants]

    def draft(self, tokens: Sequence[int], num_prompt_tokens: int, k: int, state) -> list[int]:
        """Up to k draft tokens to follow `tokens` (prompt + output); `state`: the
        sequence's SpecState, for a lookup that keeps its place."""
        raise NotImplementedError


def occurrences(corpus: np.ndarray, tail: np.ndarray, limit: int) -> np.ndarray:
    """Start positions i < limit where corpus[i : i + len(tail)] == tail."""
    if limit <= 0:
        return np.empty(0, dtype=np.int64)
    match = np.ones(limit, dtype=bool)
    for j, token in enumerate(tail):
        match &= corpus[j : j + limit] == token
    return np.flatnonzero(match)


class NgramProposer(TokenLookup):
    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def draft(self, tokens: Sequence[int], num_prompt_tokens: int, k: int, state=None) -> list[int]:
        corpus = np.asarray(tokens, dtype=np.int64)
        size = len(corpus)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # an earlier occurrence, with at least one token after it
            found = occurrences(corpus, corpus[size - n :], size - n)
            if len(found):
                start = int(found[-1]) + n  # the latest occurrence: the nearest context
                return corpus[start : start + k].tolist()
        return []


class PredictionProposer(TokenLookup):
    name = "prediction"

    def __init__(self, min_n: int = 1, max_n: int = 8):
        self.min_n, self.max_n = min_n, max_n

    def draft(self, tokens: Sequence[int], num_prompt_tokens: int, k: int, state) -> list[int]:
        prediction = state.prediction
        output = np.asarray(tokens[num_prompt_tokens:], dtype=np.int64)
        if not len(output):
            state.prediction_pos = 0
            return prediction[:k].tolist()
        for n in range(min(self.max_n, len(output)), self.min_n - 1, -1):
            found = occurrences(prediction, output[len(output) - n :], len(prediction) - n + 1)
            if len(found):
                ends = found + n
                ahead = ends[ends >= state.prediction_pos]  # keep the alignment moving forward
                end = int(ahead[0] if len(ahead) else ends[-1])
                state.prediction_pos = end  # moved on by what the verify step accepts
                return prediction[end : end + k].tolist()
        return []
