"""The batched sampler. Order of operations, per row:

1. logits in float32;
2. min_tokens: EOS and stop tokens get -inf until the row has produced min_tokens;
3. greedy rows (temperature 0): argmax, done;
4. temperature: logits / t;
5. top-k, then top-p, on the descending sort of the row (only when some row asks);
6. draw: argmax(p / q) with q ~ Exp(1) (the exponential race, an exact draw from p),
   q from the row's own generator when the request is seeded. That generator is
   seeded from (seed, output index), so a seeded request gets the same tokens
   whatever else shares its batch, and whatever its batch did before.
"""

from __future__ import annotations

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


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if row.num_output_tokens < row.params.min_tokens and row.banned_until_min:
            logits[i, list(row.banned_until_min)] = float("-inf")


def filtered_probs(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Top-k then top-p over temperature-scaled logits.

    logits: [B, V] float32; top_k: [B] int64 (0: off); top_p: [B] float32 (1.0: off).
    Returns (probs, order): probs [B, V] over the descending order `order` [B, V].
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass
    # before it is still below top_p (so the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
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


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [R, V] of non-greedy rows -> token ids [R]."""
    temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
    logits = logits / temps.unsqueeze(1)
    if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
        top_k = torch.tensor([r.params.top_k for r in rows], device=logits.device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=logits.device)
        probs, order = filtered_probs(logits, top_k, top_p)
    else:
        probs, order = logits.softmax(dim=-1), None
    choice = (probs / _exponential_noise(probs.shape, rows, logits.device)).argmax(dim=-1)
    return choice if order is None else order.gather(1, choice.unsqueeze(1)).squeeze(1)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [B, V] -> one token id per row."""
    logits = logits.float()
    apply_min_tokens(logits, rows)
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        index = torch.tensor(drawn, device=logits.device)
        tokens[index] = _draw(logits[index], [rows[i] for i in drawn])
    return tokens.tolist()
