"""The batched sampler. Order of operations, per row:

1. logits in float32;
2. logit bias (added; a repeated id adds up), then min_tokens: EOS and stop tokens
   get -inf until the row has produced min_tokens;
3. penalties: repetition (HF / vLLM: over prompt and output tokens, a positive logit
   is divided by the penalty, a negative one multiplied), then presence and frequency
   (OpenAI: over output tokens only, logit -= presence * (count > 0) + frequency * count);
4. greedy rows (temperature 0): argmax, done (bias and penalties apply to them too);
5. temperature: logits / t;
6. filters, on the descending sort of the row (only when some row asks): top-k, then
   top-p over the top-k renormalized probabilities, then min-p (keep p >= min_p * max p),
   then top-n-sigma (keep logit >= max - n * std, the std over the row's finite
   temperature-scaled logits, population std, as llama.cpp). min-p and top-n-sigma are
   thresholds relative to the top token, which every filter keeps, so they cut the
   same tokens whether they come before or after top-k / top-p (vLLM also applies
   min-p after top-k / top-p); only top-p's mass depends on what came before it;
7. draw: argmax(p / q) with q ~ Exp(1) (the exponential race, an exact draw from p),
   q from the row's own generator when the request is seeded. That generator is
   seeded from (seed, output index), so a seeded request gets the same tokens
   whatever else shares its batch, and whatever its batch did before.

Each step is one batched op over the rows that use it; a batch where no row uses a
feature skips it entirely.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend.request import SamplingParams

_MASK64 = (1 << 64) - 1


def seed_for_token(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for token `index` of a request seeded with `seed` (splitmix64)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    num_output_tokens: int  # tokens the request has produced before this draw
    banned_until_min: tuple[int, ...]  # EOS + stop tokens, masked while below min_tokens
    # prompt + output tokens so far (the last num_output_tokens are output); read only
    # when params.uses_penalties, so penalty-free rows may leave it empty
    token_ids: Sequence[int] = ()


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


def token_counts(rows: list[SamplingRow], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_counts, output_counts): [R, V] float32 occurrences of each token in each
    row's prompt + output, and in its output only."""
    lengths = [len(r.token_ids) for r in rows]
    flat = torch.tensor(list(itertools.chain.from_iterable(r.token_ids for r in rows)), dtype=torch.long)
    length_t = torch.tensor(lengths, dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(len(rows)), length_t)  # [N]
    starts = length_t.cumsum(0) - length_t
    position = torch.arange(flat.numel()) - starts[row_of]  # index within its row
    num_prompt = torch.tensor([max(n - r.num_output_tokens, 0) for n, r in zip(lengths, rows, strict=True)])
    is_output = (position >= num_prompt[row_of]).float()
    slot = (row_of * vocab + flat).to(device)  # [N] index into the flattened [R, V]
    all_counts = torch.zeros(len(rows) * vocab, device=device)
    all_counts.scatter_add_(0, slot, torch.ones(flat.numel(), device=device))
    output_counts = torch.zeros(len(rows) * vocab, device=device)
    output_counts.scatter_add_(0, slot, is_output.to(device))
    return all_counts.view(len(rows), vocab), output_counts.view(len(rows), vocab)


def penalize(
    logits: torch.Tensor,
    all_counts: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """logits, counts: [R, V]; repetition, presence, frequency: [R] -> penalized [R, V]."""
    repetition = repetition.unsqueeze(1)
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(all_counts > 0, repeated, logits)
    return logits - presence.unsqueeze(1) * (output_counts > 0) - frequency.unsqueeze(1) * output_counts


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    penalized = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if not penalized:
        return
    sub = [rows[i] for i in penalized]
    device = logits.device
    all_counts, output_counts = token_counts(sub, logits.shape[1], device)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r.params, name) for r in sub], dtype=torch.float32, device=device)

    index = torch.tensor(penalized, device=device)
    logits[index] = penalize(
        logits[index],
        all_counts,
        output_counts,
        per_row("repetition_penalty"),
        per_row("presence_penalty"),
        per_row("frequency_penalty"),
    )


# ---------------------------------------------------------------------------
# filters and the draw


def _finite_std(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R]: population std over each row's finite entries."""
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    values = torch.where(finite, logits, 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    variance = torch.where(finite, (values - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count
    return variance.sqrt().squeeze(1)


def filtered_probs(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
    top_n_sigma: torch.Tensor | None = None,
):
    """Top-k, top-p, min-p, then top-n-sigma over temperature-scaled logits.

    logits: [B, V] float32; top_k: [B] int64 (0: off); top_p: [B] float32 (1.0: off);
    min_p: [B] float32 (0: off); top_n_sigma: [B] float32 (0: off).
    Returns (probs, order): probs [B, V] over the descending order `order` [B, V].
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    masked_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = masked_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass
    # before it is still below top_p (so the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    if min_p is not None:
        drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
    if top_n_sigma is not None:
        spread = top_n_sigma * _finite_std(logits)
        floor = torch.where(top_n_sigma > 0, sorted_logits[:, 0] - spread, float("-inf"))
        drop |= sorted_logits < floor.unsqueeze(1)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


def _exponential_noise(shape, rows: list[SamplingRow], device) -> torch.Tensor:
    noise = torch.empty(shape, device=device)
    for i, row in enumerate(rows):
        if row.params.seed is None:
            noise[i].exponential_()
        else:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed_for_token(row.params.seed, row.num_output_tokens))
            noise[i].exponential_(generator=gen)
    return noise


def _per_row(rows: list[SamplingRow], name: str, device, used: bool) -> torch.Tensor | None:
    return torch.tensor([getattr(r.params, name) for r in rows], device=device) if used else None


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [R, V] of non-greedy rows -> token ids [R]."""
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], device=device)
    logits = logits / temps.unsqueeze(1)
    uses_min_p = any(r.params.min_p > 0 for r in rows)
    uses_sigma = any(r.params.top_n_sigma > 0 for r in rows)
    if uses_min_p or uses_sigma or any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
        probs, order = filtered_probs(
            logits,
            _per_row(rows, "top_k", device, True),
            _per_row(rows, "top_p", device, True),
            _per_row(rows, "min_p", device, uses_min_p),
            _per_row(rows, "top_n_sigma", device, uses_sigma),
        )
    else:
        probs, order = logits.softmax(dim=-1), None
    # The noise is indexed by token id, sorted or not, so a seeded row draws the same
    # token whether or not another row of its batch asked for the sorted path.
    noise = _exponential_noise(probs.shape, rows, device)
    if order is None:
        return (probs / noise).argmax(dim=-1)
    choice = (probs / noise.gather(1, order)).argmax(dim=-1)
    return order.gather(1, choice.unsqueeze(1)).squeeze(1)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [B, V] -> one token id per row."""
    logits = logits.float()
    apply_logit_bias(logits, rows)
    apply_min_tokens(logits, rows)
    apply_penalties(logits, rows)
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        index = torch.tensor(drawn, device=logits.device)
        tokens[index] = _draw(logits[index], [rows[i] for i in drawn])
    return tokens.tolist()
