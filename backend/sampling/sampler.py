"""The batched sampler. Order of operations, per row:

1. logits in float32;
2. logit bias (added; a repeated id adds up), then min_tokens: EOS and stop tokens
   get -inf until the row has produced min_tokens; then the engine's guard masks
   (`SamplingRow.masked`: tool-call guards);
3. penalties: repetition (HF / vLLM: over prompt and output tokens, a positive logit
   is divided by the penalty, a negative one multiplied), then presence and frequency
   (OpenAI: over output tokens only, logit -= presence * (count > 0) + frequency * count),
   then DRY (llama.cpp: logit -= multiplier * base ** (L - allowed_length) where the
   candidate would extend a repeat of length L >= allowed_length of the context's end),
   then LZ (ours: logit -= lz_penalty * L for every L >= 1); L from backend.sampling.repeats;
   then the grammar mask (structured output, tool calls): -inf on every token the
   row's grammar refuses now (a row left with no token falls back to the grammar's
   tokens alone: the grammar wins over min_tokens, bias and guards);
4. greedy rows (temperature 0): argmax, done (bias and penalties apply to them too);
5. temperature: logits / t;
6. filters, on the descending sort of the row (only when some row asks; a partial
   sort of the top max(top_k) when every row sets top_k): top-k, then
   top-p over the top-k renormalized probabilities, then min-p (keep p >= min_p * max p),
   then top-n-sigma (keep logit >= max - n * std, the std over the row's finite
   temperature-scaled logits, population std, as llama.cpp). min-p and top-n-sigma are
   thresholds relative to the top token, which every filter keeps, so they cut the
   same tokens whether they come before or after top-k / top-p (vLLM also applies
   min-p after top-k / top-p); only top-p's mass depends on what came before it;
7. draw: argmax(p / q) with q ~ Exp(1) (the exponential race, an exact draw from p;
   q is never 0),
   q = -log u with u a counter-based hash of (seed, output index, token id) when the
   request is seeded, so a seeded request gets the same tokens whatever else shares
   its batch, and whatever its batch did before;
8. a token the engine forces (`SamplingRow.forced`: a thinking marker) replaces the draw.

Each step is one batched op over the rows that use it; a batch where no row uses a
feature skips it entirely.
"""

from __future__ import annotations

import itertools

import torch

from backend.contract import SamplingParams
from backend.sampling.draw import draw, first_max
from backend.sampling.grammar import apply_grammar_masks
from backend.sampling.repeats import dry_penalties, lz_penalties
from backend.types.sampling_row import SamplingRow

# ---------------------------------------------------------------------------
# logits processors: in place on [B, V] float32 logits


def _add_at(logits: torch.Tensor, rows: list[int], ids: list[int], values: list[float] | float) -> None:
    """logits[rows[j], ids[j]] += values[j], repeated (row, id) pairs adding up."""
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
    if isinstance(values, float):
        source = torch.full((len(ids),), values, device=device)
    else:
        source = torch.tensor(values, dtype=torch.float32, device=device)
    logits.index_put_(index, source, accumulate=True)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    biased = [(i, r.params) for i, r in enumerate(rows) if r.params.logit_bias_ids]
    if not biased:
        return
    row_index = [i for i, p in biased for _ in p.logit_bias_ids]
    ids = [t for _, p in biased for t in p.logit_bias_ids]
    values = [v for _, p in biased for v in p.logit_bias_values]
    _add_at(logits, row_index, ids, values)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    masked = [
        (i, r.banned_until_min)
        for i, r in enumerate(rows)
        if r.num_output_tokens < r.params.min_tokens and r.banned_until_min
    ]
    if masked:
        # adding -inf is masking, whatever the logit was
        _add_at(logits, [i for i, b in masked for _ in b], [t for _, b in masked for t in b], float("-inf"))


def apply_guard_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    masked = [(i, r.masked) for i, r in enumerate(rows) if r.masked]
    if masked:
        _add_at(logits, [i for i, m in masked for _ in m], [t for _, m in masked for t in m], float("-inf"))


def apply_grammars(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Each grammar row keeps only the tokens its grammar accepts now. The grammar wins
    over the masks and biases before it: a row they left with no token the grammar
    accepts (min_tokens masking the EOS a finished grammar needs) falls back to the
    grammar's tokens alone, at their raw logits."""
    states = [r.grammar for r in rows]
    constrained = [i for i, s in enumerate(states) if s is not None]
    if not constrained:
        return
    index = torch.tensor(constrained, device=logits.device)
    before = logits[index]  # a copy: the rows as they were, for the rescue below
    apply_grammar_masks(logits, states)
    dead = (~torch.isfinite(logits[index]).any(dim=-1)).nonzero().flatten().tolist()
    if dead:
        rescue = before[dead].nan_to_num(neginf=0.0)
        apply_grammar_masks(rescue, [states[constrained[j]] for j in dead])
        logits[index[dead]] = rescue


def token_counts(rows: list[SamplingRow], vocab: int, device) -> tuple[torch.Tensor, ...]:
    """Sparse counts of each row's history: (row, id, all_counts, output_counts), [N] each,
    one entry per distinct (row, token) pair of the rows' prompt + output tokens."""
    lengths = [len(r.token_ids) for r in rows]
    flat = torch.tensor(list(itertools.chain.from_iterable(r.token_ids for r in rows)), dtype=torch.long)
    length_t = torch.tensor(lengths, dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(len(rows)), length_t)  # [N]
    starts = length_t.cumsum(0) - length_t
    position = torch.arange(flat.numel()) - starts[row_of]  # index within its row
    num_prompt = torch.tensor([max(n - r.num_output_tokens, 0) for n, r in zip(lengths, rows, strict=True)])
    is_output = (position >= num_prompt[row_of]).float()
    slots, which, all_counts = torch.unique(row_of * vocab + flat, return_inverse=True, return_counts=True)
    output_counts = torch.zeros(len(slots)).scatter_add_(0, which, is_output)
    to = dict(device=device)
    return (slots // vocab).to(**to), (slots % vocab).to(**to), all_counts.float().to(**to), output_counts.to(**to)


def penalize(
    logits: torch.Tensor,
    all_counts: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Elementwise, any shape (here [N] history entries): the penalized logits."""
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(all_counts > 0, repeated, logits)
    return logits - presence * (output_counts > 0) - frequency * output_counts


def _counts_penalized(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition, presence and frequency: the penalties that count tokens."""
    penalized = [i for i, r in enumerate(rows) if _counts_penalized(r.params)]
    if not penalized:
        return
    sub = [rows[i] for i in penalized]
    device = logits.device
    # only the tokens of the histories change: gather them, penalize, scatter back
    row_of, ids, all_counts, output_counts = token_counts(sub, logits.shape[1], device)
    index = (torch.tensor(penalized, device=device)[row_of], ids)

    def per_entry(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[row_of]

    logits[index] = penalize(
        logits[index],
        all_counts,
        output_counts,
        per_entry([r.params.repetition_penalty for r in sub]),
        per_entry([r.params.presence_penalty for r in sub]),
        per_entry([r.params.frequency_penalty for r in sub]),
    )


def apply_repeat_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """DRY, then LZ: the penalties on candidates that would extend a repeat.

    The matching is per-row (numpy over a bounded window); rows with neither pay nothing.
    All subtractions of the batch land in one scatter.
    """
    row_index, ids, amounts = [], [], []
    for i, r in enumerate(rows):
        p = r.params
        found = []
        if p.dry_multiplier > 0:
            found.append(
                dry_penalties(r.token_ids, p.dry_multiplier, p.dry_base, p.dry_allowed_length, r.dry_breaker_ids)
            )
        if p.lz_penalty > 0:
            found.append(lz_penalties(r.token_ids, p.lz_penalty))
        for row_ids, row_amounts in found:
            row_index += [i] * len(row_ids)
            ids += row_ids
            amounts += [-a for a in row_amounts]
    if ids:
        _add_at(logits, row_index, ids, amounts)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [B, V] -> one token id per row."""
    logits = logits.float()
    apply_logit_bias(logits, rows)
    apply_min_tokens(logits, rows)
    apply_guard_masks(logits, rows)
    apply_penalties(logits, rows)
    apply_repeat_penalties(logits, rows)
    apply_grammars(logits, rows)
    tokens = first_max(logits)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        index = torch.tensor(drawn, device=logits.device)
        tokens[index] = draw(logits[index], [rows[i] for i in drawn])
    result = tokens.tolist()
    for i, row in enumerate(rows):
        if row.forced is not None:
            result[i] = row.forced
    return result
