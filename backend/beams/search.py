"""Beam search for one request, step by step, as transformers' `generate` does it (v5).

The engine computes each running beam's next-token log-probs (the raw distribution's
log_softmax, then the processors that apply to beams); `BeamSearch.step` takes them
and says which beams run next: for each, the beam it continues (so the engine forks
that beam's KV blocks) and the token it appends. The rules are transformers' own
(generation/utils.py `_beam_search`), in float32 like theirs so that ties break alike:

- Candidates: the top K = max(2, 1 + number of EOS ids) * B continuations of all running
  beams by cumulative log-prob (raw, not length-normalized). At the first step only
  beam 0 is live (the others start at -1e9).
- A candidate that ends (an EOS id, or the length limit) is a hypothesis when it ranks in
  the top B of the K; its score is sum_logprobs / generated_len ** length_penalty, the
  length counting every token generated, the EOS included. The best B hypotheses are kept.
- The B best candidates that did not end run on.
- The search ends when no candidate can continue, when `early_stopping` is True and B
  hypotheses are in, or when the best running beam cannot beat the worst hypothesis:
  its cumulative log-prob over the current generated length ** length_penalty (False,
  transformers' default heuristic) or, for "never" with length_penalty > 0, over the
  longest length allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backend.contract import FinishReason, Hypothesis, Logprob

_NEG = -1.0e9
# (parent beam, token) -> the token's logprob entry, for a request that asks for logprobs
LogprobOf = Callable[[int, int], Logprob]


@dataclass(slots=True)
class BeamStep:
    """The beams that run next: beam i continues `parents[i]` (the running beam it was
    at this step) with `tokens[i]`."""

    parents: list[int]
    tokens: list[int]


@dataclass
class BeamSearch:
    num_beams: int
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    length_penalty: float = 1.0
    early_stopping: str = "false"  # "false", "true" or "never" (backend.contract.EARLY_STOPPING)
    running: list[list[int]] = field(init=False)  # each running beam's generated tokens
    done: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        b = self.num_beams
        self.running = [[] for _ in range(b)]
        self._running_logprobs: list[list[Logprob]] = [[] for _ in range(b)]
        self._finished_logprobs: list[list[Logprob]] = [[] for _ in range(b)]
        self._running_scores = torch.full((b,), _NEG, dtype=torch.float32)
        self._running_scores[0] = 0.0
        self._finished: list[list[int]] = [[] for _ in range(b)]
        self._finished_scores = torch.full((b,), _NEG, dtype=torch.float32)
        self._is_finished = torch.zeros(b, dtype=torch.bool)
        self._improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self._top_b = torch.arange(max(2, 1 + len(self.eos_token_ids)) * b) < b

    @property
    def num_generated(self) -> int:
        return len(self.running[0])

    def step(self, log_probs: torch.Tensor, logprob_of: LogprobOf | None = None) -> BeamStep:
        """log_probs [num_beams, vocab] (float32) of the running beams -> the next running
        beams. `logprob_of`: what each chosen token's logprob entry is, when asked."""
        b, vocab = log_probs.shape
        k = self._top_b.numel()
        accumulated = (log_probs.float() + self._running_scores[:, None]).reshape(-1)
        top_scores, top_indices = torch.topk(accumulated, k=k)
        parents, tokens = (top_indices // vocab).tolist(), (top_indices % vocab).tolist()
        length = self.num_generated + 1
        ends = torch.tensor([t in self.eos_token_ids or length >= self.max_new_tokens for t in tokens])
        candidates = [self.running[p] + [t] for p, t in zip(parents, tokens, strict=True)]
        entries = [
            self._running_logprobs[p] + ([logprob_of(p, t)] if logprob_of else [])
            for p, t in zip(parents, tokens, strict=True)
        ]
        self._update_finished(top_scores, candidates, entries, ends, length)
        running_scores = top_scores + ends.to(torch.float32) * _NEG
        chosen = torch.topk(running_scores, k=b)[1].tolist()
        self.running = [candidates[i] for i in chosen]
        self._running_logprobs = [entries[i] for i in chosen]
        self._running_scores = running_scores[chosen]
        self._check_done(length, bool(ends.all()))
        return BeamStep([parents[i] for i in chosen], [tokens[i] for i in chosen])

    def best(self, n: int, with_logprobs: bool = False) -> list[Hypothesis]:
        """The n best hypotheses, best first (n <= num_beams). A search cut short (its
        deadline) counts its running beams as hypotheses, as the length limit does."""
        scores, seqs, entries = self._finished_scores, self._finished, self._finished_logprobs
        if not bool(self._is_finished[:n].all()) and self.num_generated:
            running = self._running_scores / (self.num_generated**self.length_penalty)
            scores = torch.cat((scores.masked_fill(~self._is_finished, 2 * _NEG), running))
            seqs, entries = seqs + self.running, entries + self._running_logprobs
        order = torch.topk(scores, k=n)[1].tolist()
        return [self._hypothesis(seqs[i], float(scores[i]), entries[i] if with_logprobs else None) for i in order]

    def best_stop_token(self) -> int | None:
        """The token the best finished hypothesis stopped on (None: it ran to the limit)."""
        tokens = self._finished[int(torch.argmax(self._finished_scores))]
        return tokens[-1] if tokens and tokens[-1] in self.eos_token_ids else None

    def _hypothesis(self, tokens: list[int], score: float, logprobs: list[Logprob] | None) -> Hypothesis:
        """A stopping token is counted in the score, not emitted (nor its logprob)."""
        if tokens and tokens[-1] in self.eos_token_ids:
            return Hypothesis(tokens[:-1], score, FinishReason.STOP, logprobs[:-1] if logprobs is not None else None)
        return Hypothesis(list(tokens), score, FinishReason.LENGTH, logprobs)

    def _update_finished(self, top_scores, candidates: list[list[int]], entries: list, ends, length: int) -> None:
        just_finished = ends & self._top_b
        scores = top_scores / (length**self.length_penalty)
        if bool(self._is_finished.all()) and self.early_stopping == "true":
            scores = scores + _NEG
        if not self._improvable:
            scores = scores + _NEG
        scores = scores + (~just_finished).to(torch.float32) * _NEG
        merged_scores = torch.cat((self._finished_scores, scores))
        merged = self._finished + candidates
        merged_entries = self._finished_logprobs + entries
        merged_is_finished = torch.cat((self._is_finished, just_finished))
        keep = torch.topk(merged_scores, k=self.num_beams)[1].tolist()
        self._finished = [merged[i] for i in keep]
        self._finished_logprobs = [merged_entries[i] for i in keep]
        self._finished_scores = merged_scores[keep]
        self._is_finished = merged_is_finished[keep]

    def _check_done(self, length: int, nothing_continues: bool) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            hypothetical = self.max_new_tokens
        else:
            hypothetical = length
        best_running = self._running_scores[:1] / (hypothetical**self.length_penalty)
        worst = torch.where(self._is_finished, torch.min(self._finished_scores), torch.tensor(_NEG))
        self._improvable = self._improvable and bool(torch.any(best_running > worst))
        all_in = bool(self._is_finished.all()) and self.early_stopping == "true"
        self.done = not self._improvable or all_in or nothing_continues
