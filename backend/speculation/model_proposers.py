"""Proposers with weights: a draft model (SPEC_DRAFT_MODEL) and the checkpoint's MTP layers.

Each keeps, per sequence, how far its own KV cache (in the sequence's blocks, see
backend/runner/drafters.py) holds the sequence's real tokens; drafting first catches
that cache up, then chains one token at a time. A draft's KV beyond what the verify
step accepts is simply overwritten later, as the target's is.

Draft model: its KV at position p is valid when the tokens it was fed at 0..p are the
sequence's, so after a verify step the fed drafts that match the committed tokens stay
valid; a preemption (the blocks are gone) starts it over. On a sequence of N tokens
it reads the tokens its cache lacks (the last one always), predicts the token at N,
then feeds each draft to predict the next.

MTP: position p reads the target's hidden state at p and the token at p + 1, so it
runs one step behind the target. The engine hands each sequence the hidden states of
the positions a step committed (`keep`); drafting runs the layer over them (position
num_computed - 1, fed the last token, predicts the token after it), then chains on
its own output. A prefix-cache hit reuses the blocks' MTP keys as the sequence that
computed them left them (none, if it had disable_mtp): only acceptance can suffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.runner.drafters import DraftModelRunner, MtpRunner
from backend.runner.forward_batch import Span
from backend.speculation.proposers import Want


@dataclass(slots=True)
class DraftPlace:
    valid: int = 0  # leading positions whose draft KV holds the sequence's own tokens
    fed: list[int] = field(default_factory=list)  # drafts fed after them, at valid, valid + 1, ...
    num_preemptions: int = 0


@dataclass(slots=True)
class MtpPlace:
    start: int = 0  # position of the first kept hidden state
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n, hidden] pieces, positions start..


class DraftModelProposer:
    name = "draft"

    def __init__(self, drafter: DraftModelRunner):
        self.drafter = drafter

    def propose(self, wants: list[Want]) -> list[list[int]]:
        spans = []
        for seq, _ in wants:
            start = self._valid(seq)
            spans.append(Span(seq.token_ids[start:], start, seq.block_table, 1))
        drafts = [[token] for token in self.drafter.greedy(spans)]
        for step in range(1, max(k for _, k in wants)):
            live = [i for i, (_, k) in enumerate(wants) if k > step]
            spans = [Span([drafts[i][-1]], wants[i][0].num_tokens + step - 1, wants[i][0].block_table, 1) for i in live]
            for i, token in zip(live, self.drafter.greedy(spans), strict=True):
                drafts[i].append(token)
        for (seq, k), found in zip(wants, drafts, strict=True):
            seq.spec.place.valid, seq.spec.place.fed = seq.num_tokens, found[: k - 1]
        return drafts

    @staticmethod
    def _valid(seq) -> int:
        """Where the draft's cache must restart for `seq` (the last token is always new)."""
        if seq.spec.place is None or seq.spec.place.num_preemptions != seq.num_preemptions:
            seq.spec.place = DraftPlace(num_preemptions=seq.num_preemptions)
        place, tokens = seq.spec.place, seq.token_ids
        valid = place.valid
        for token in place.fed:
            if valid >= len(tokens) or tokens[valid] != token:
                break
            valid += 1
        return min(valid, len(tokens) - 1)


class MtpProposer:
    name = "mtp"

    def __init__(self, mtp: MtpRunner):
        self.mtp = mtp

    @staticmethod
    def keep(seq, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states of positions start.. that a step committed."""
        place = seq.spec.place
        if place is None or start != place.start + sum(len(h) for h in place.hidden):
            place = seq.spec.place = MtpPlace(start)  # the first step, or after a preemption
        if len(hidden):
            place.hidden.append(hidden.clone())

    def propose(self, wants: list[Want]) -> list[list[int]]:
        ready = [i for i, (seq, _) in enumerate(wants) if self._ready(seq)]
        drafts: list[list[int]] = [[] for _ in wants]
        if not ready:
            return drafts
        spans, hidden = [], []
        for i in ready:
            seq = wants[i][0]
            place, end = seq.spec.place, seq.num_computed_tokens
            spans.append(Span(seq.token_ids[place.start + 1 : end + 1], place.start, seq.block_table, 1))
            hidden += place.hidden
            seq.spec.place = MtpPlace(end)
        out, tokens = self.mtp.greedy(spans, torch.cat(hidden), 0)
        rows = ready  # the sequence of each row of `out`
        for i, token in zip(rows, tokens, strict=True):
            drafts[i].append(token)
        for step in range(1, max(wants[i][1] for i in ready)):
            keep = [j for j, i in enumerate(rows) if wants[i][1] > step]
            rows = [rows[j] for j in keep]
            spans = [self._chained(wants[i][0], drafts[i][-1], step) for i in rows]
            out, tokens = self.mtp.greedy(spans, out[keep], step)
            for i, token in zip(rows, tokens, strict=True):
                drafts[i].append(token)
        return drafts

    @staticmethod
    def _chained(seq, draft: int, step: int) -> Span:
        # step 0 ran at num_computed - 1 (fed the last token); step m runs m positions on, fed draft m
        return Span([draft], seq.num_computed_tokens + step - 1, seq.block_table, 1)

    @staticmethod
    def _ready(seq) -> bool:
        """The layer can draft when it has the hidden states up to the last computed position."""
        place = seq.spec.place
        return (
            place is not None
            and bool(place.hidden)
            and place.start + sum(len(h) for h in place.hidden) == seq.num_computed_tokens
        )
