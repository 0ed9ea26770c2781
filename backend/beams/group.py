"""One beam request in the engine: its search, and the sequences its beams run on.

A beam request starts as one sequence, the lead (the one the scheduler knows by request
id), which computes the prompt. When the prompt's logits are in, the search's first
step picks num_beams continuations of it, and the lead forks into num_beams rows. From
then on every row decodes one token per step, all in the same step (the scheduler
schedules a group whole and preempts it whole), and after each step `advance` feeds
the rows' log-probs to the search and moves each row to the beam it now runs:

- the first child of a beam keeps its row (its KV as it is, one token appended);
- a beam's other children take the rows of beams that have no child: such a row's
  blocks are freed, then it forks its new parent (BlockManager.fork: full blocks
  shared, the partial last block copied, a copy the engine runs before the next
  forward). Rows are all the same length and partial blocks are never shared, so the
  rows given up free as many blocks as the forks take; only the first step, which
  makes num_beams - 1 rows out of nothing, needs free blocks. When they are not there,
  the new rows start without KV and compute their tokens again in the steps that
  follow (the group's rows still complete together: backend.core.beam_scheduling).

The search scores the raw distribution (log_softmax) after the processors that apply to
beams, as transformers does: min_tokens masks the stopping tokens, logit_bias adds to
the log-probs; a translation's first token is its target language (forced, score 0, as
transformers' forced BOS). Logprobs, when asked, are the raw distribution's, as elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from backend.beams.search import BeamSearch, BeamStep
from backend.contract import FinalEvent, FinishGuard, FinishReason, Logprob, RequestOutput
from backend.kv.block_manager import BlockManager
from backend.types.sequence import Sequence


@dataclass(eq=False)
class BeamGroup:
    lead: Sequence  # the request's sequence; always one of `rows`
    search: BeamSearch
    rows: list[Sequence]  # row i runs the search's running beam i (one row until the first step)
    stop_ids: tuple[int, ...]  # what ends a beam: EOS (unless ignore_eos) and the stop tokens
    eos_token_ids: tuple[int, ...]  # the model's, to tell an EOS from a stop token
    length_guard: FinishGuard  # what the length limit is: max_tokens or the context

    @classmethod
    def start(cls, lead: Sequence, stop_ids: tuple[int, ...], eos_ids: tuple[int, ...], max_model_len: int):
        request = lead.request
        room = max_model_len - lead.num_prompt_tokens
        max_tokens = request.sampling.max_tokens
        max_new = room if max_tokens is None else min(max_tokens, room)
        guard = FinishGuard.MAX_TOKENS if max_tokens is not None and max_tokens <= room else FinishGuard.CONTEXT_LENGTH
        search = BeamSearch(request.num_beams, max_new, stop_ids, request.length_penalty, request.early_stopping)
        group = cls(lead, search, [lead], stop_ids, eos_ids, guard)
        lead.beam = group
        return group

    @property
    def num_beams(self) -> int:
        return self.search.num_beams

    # -- a step ---------------------------------------------------------------

    def advance(self, log_probs: torch.Tensor, block_manager: BlockManager) -> tuple[list[Sequence], list]:
        """The rows' raw log-probs [rows, vocab] -> the search's step, and the rows moved
        to their new beams: (rows made now, block copies to run)."""
        if self.search.num_generated == 0:  # every beam is the prompt
            log_probs = log_probs[:1].expand(self.num_beams, -1)
        step = self.search.step(self._processed(log_probs), self._logprob_of(log_probs))
        return self._move_rows(step, block_manager)

    def _processed(self, log_probs: torch.Tensor) -> torch.Tensor:
        params, encoder = self.lead.sampling, self.lead.encoder
        scores = log_probs.clone()
        if encoder is not None and self.search.num_generated == 0:  # the target language, with score 0
            scores.fill_(float("-inf"))
            scores[:, encoder.tgt_lang_id] = 0.0
            return scores
        if self.search.num_generated < params.min_tokens and self.stop_ids:
            scores[:, list(self.stop_ids)] = float("-inf")
        if params.logit_bias_ids:
            bias = torch.zeros(scores.shape[1], dtype=scores.dtype)
            bias.index_add_(0, torch.tensor(params.logit_bias_ids), torch.tensor(params.logit_bias_values))
            scores += bias
        return scores

    def _logprob_of(self, log_probs: torch.Tensor):
        params = self.lead.sampling
        if not params.wants_logprobs:
            return None
        k = params.top_logprobs
        top_values, top_ids = log_probs.topk(k, dim=-1) if k else (None, None)

        def logprob_of(parent: int, token: int) -> Logprob:
            top = list(zip(top_ids[parent].tolist(), top_values[parent].tolist(), strict=True)) if k else []
            return Logprob(token, float(log_probs[parent, token]), top)

        return logprob_of

    def _move_rows(self, step: BeamStep, bm: BlockManager) -> tuple[list[Sequence], list]:
        old = self.rows
        parents = step.parents if len(old) > 1 else [0] * len(step.parents)  # at first, every beam is the lead
        kept = {p: j for j, p in reversed(list(enumerate(parents)))}  # a beam's first child keeps its row
        spare = [row for i, row in enumerate(old) if i not in kept]
        made = [self._new_row(len(old) + i) for i in range(self.num_beams - len(old))]
        for row in spare:
            bm.free(row)
        has_kv = len(made) * bool(old[0].num_computed_tokens % bm.block_size) <= bm.num_free_blocks()
        spare += made
        rows, copies = [], []
        for j, p in enumerate(parents):
            if kept[p] == j:
                rows.append(old[p])
                continue
            row = spare.pop()
            row.token_ids = list(old[p].token_ids)
            if has_kv:
                row.num_computed_tokens = old[p].num_computed_tokens
                pair = bm.fork(old[p], row)
                copies += [pair] if pair is not None else []
            rows.append(row)
        for row, token in zip(rows, step.tokens, strict=True):
            row.token_ids.append(token)
        self.rows = rows
        return made, copies

    def _new_row(self, index: int) -> Sequence:
        lead = self.lead
        row = Sequence(f"{lead.request_id}#beam-{index}", lead.request, lead.arrival_time, lead.guard_state,
                       [], lead.num_prompt_tokens, adapter=lead.adapter, adapter_weights=lead.adapter_weights,
                       encoder=lead.encoder, vision=lead.vision)  # fmt: skip
        row.beam, row.status = self, lead.status
        row.first_scheduled_time, row.first_token_time = lead.first_scheduled_time, lead.first_token_time
        return row

    # -- the end --------------------------------------------------------------

    def output(self, final: FinalEvent) -> RequestOutput:
        """The request's only output: the n best hypotheses and the final event (`final`:
        the lead's, recounted here for the hypotheses)."""
        request = self.lead.request
        hyps = self.search.best(request.num_return_sequences, request.sampling.wants_logprobs)
        if self.search.num_generated == 0:  # ended before its first step (aborted, timed out)
            hyps = []
        out = RequestOutput(self.lead.request_id, [], hypotheses=hyps)
        num_output = sum(len(h.token_ids) + (h.finish_reason is FinishReason.STOP) for h in hyps)
        out.final = replace(final, num_output_tokens=num_output)
        if self.search.done and hyps:
            out.final = replace(out.final, finish_reason=hyps[0].finish_reason, finish_guard=self._guard(hyps[0]))
        if self.lead.prompt_logprobs is not None:
            out.prompt_logprobs = [Logprob(self.lead.token_ids[0], None, []), *self.lead.prompt_logprobs]
        return out

    def _guard(self, best) -> FinishGuard:
        if best.finish_reason is FinishReason.LENGTH:
            return self.length_guard
        return FinishGuard.EOS if self.search.best_stop_token() in self.eos_token_ids else FinishGuard.STOP_TOKEN
