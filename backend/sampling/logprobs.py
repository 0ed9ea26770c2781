"""Logprobs of the model's raw distribution (vLLM's default): log_softmax of the float32
logits before logit bias, penalties, temperature and truncation.

Sampled tokens: one log_softmax over the rows that asked, one topk with the largest
k among them, one gather of the sampled ids. Prompt tokens: the logits of every
prompt position a step computes, gathered at the next prompt token (chunked, so a
long prompt never holds [num_tokens, vocab] at once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.contract import Logprob
from backend.types.sampling_row import SamplingRow
from backend.types.sequence import Sequence
from backend.types.step import ScheduledSeq

_PROMPT_ROWS_PER_CHUNK = 256  # [rows, vocab] float32 per chunk: 256 x 49k = 50 MB


@dataclass(slots=True)
class PromptLogprobSpan:
    """Prompt positions [start, start + count) computed this step, at flat batch rows
    [first_row, first_row + count); position p yields the logprob of prompt token p + 1."""

    seq: Sequence
    start: int
    first_row: int
    count: int


def raw_logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], torch.Tensor | None]:
    """The rows that asked for logprobs and their log_softmax, [len(wanted), V] float32.

    Call it before sampling: the sampler edits its logits in place.
    """
    wanted = [i for i, row in enumerate(rows) if row.params.wants_logprobs]
    if not wanted:
        return wanted, None
    index = torch.tensor(wanted, device=logits.device)
    return wanted, torch.log_softmax(logits[index].float(), dim=-1)


def token_logprobs(
    wanted: list[int], raw: torch.Tensor | None, rows: list[SamplingRow], tokens: list[int]
) -> list[Logprob | None]:
    """One entry per row: None for rows that did not ask."""
    result: list[Logprob | None] = [None] * len(rows)
    if raw is None:
        return result
    sampled = torch.tensor([tokens[i] for i in wanted], device=raw.device).unsqueeze(1)
    chosen = raw.gather(1, sampled).squeeze(1).tolist()
    k_max = max(rows[i].params.top_logprobs for i in wanted)
    top_values, top_ids = raw.topk(k_max, dim=-1) if k_max else (raw[:, :0], raw[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        k = rows[i].params.top_logprobs
        result[i] = Logprob(tokens[i], chosen[j], list(zip(top_ids[j][:k], top_values[j][:k], strict=True)))
    return result


def prompt_logprob_spans(scheduled: list[ScheduledSeq], query_start: list[int]) -> list[PromptLogprobSpan]:
    """The spans of this step's prompt positions whose next token's logprob is wanted."""
    spans = []
    for item, first_row in zip(scheduled, query_start, strict=False):
        seq = item.seq
        if seq.prompt_logprobs is None:
            continue
        start = seq.num_computed_tokens
        # the last prompt position predicts the first output token, not a prompt token
        count = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1) - start
        if count > 0:
            spans.append(PromptLogprobSpan(seq, start, first_row, count))
    return spans


def prompt_logprobs(
    hidden: torch.Tensor,
    spans: list[PromptLogprobSpan],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[list[Logprob]]:
    """For each span, the logprobs of prompt tokens start + 1 .. start + count, each with
    its request's `prompt_logprobs` alternatives."""
    device = hidden.device
    rows = torch.tensor([s.first_row + j for s in spans for j in range(s.count)], device=device)
    targets = [t for s in spans for t in s.seq.token_ids[s.start + 1 : s.start + 1 + s.count]]
    target_ids = torch.tensor(targets, device=device)
    k = max(s.seq.sampling.prompt_logprobs for s in spans)
    values: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for lo in range(0, len(targets), _PROMPT_ROWS_PER_CHUNK):
        hi = lo + _PROMPT_ROWS_PER_CHUNK
        logprobs = torch.log_softmax(compute_logits(hidden[rows[lo:hi]]).float(), dim=-1)
        values += logprobs.gather(1, target_ids[lo:hi].unsqueeze(1)).squeeze(1).tolist()
        if k:
            chunk_values, chunk_ids = logprobs.topk(k, dim=-1)
            tops += [
                list(zip(ids, vals, strict=True))
                for ids, vals in zip(chunk_ids.tolist(), chunk_values.tolist(), strict=True)
            ]
    out, offset = [], 0
    for span in spans:
        span_k = span.seq.sampling.prompt_logprobs
        entries = [
            Logprob(targets[i], values[i], tops[i][:span_k] if span_k else [])
            for i in range(offset, offset + span.count)
        ]
        out.append(entries)
        offset += span.count
    return out
