"""The batched sampler against plain reference implementations."""

import math
import random

import pytest
import torch

from backend.request import SamplingParams
from backend.sampler import SamplingRow, filtered_probs, sample, seed_for_token


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Plain Python: temperature, keep the top k, keep the smallest head reaching top_p, renormalize."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order[:top_k] if top_k > 0 else order
    m = max(scaled[i] for i in keep)
    weights = {i: math.exp(scaled[i] - m) for i in keep}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for i in keep:
        if mass >= top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    z = sum(weights[i] for i in kept)
    return [weights[i] / z if i in kept else 0.0 for i in range(len(logits))]


def row(**kw):
    return SamplingRow(SamplingParams(**kw), num_output_tokens=0, banned_until_min=())


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.5, 5, 0.6), (1.0, 1, 1.0), (2.0, 0, 0.05)],
)
def test_filtered_probs_match_the_reference(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=gen) * 3
    probs, order = filtered_probs(logits / temperature, torch.tensor([top_k] * 4), torch.tensor([top_p] * 4))
    unsorted = torch.zeros_like(probs).scatter_(1, order, probs)
    for r in range(4):
        expected = reference_probs(logits[r].tolist(), temperature, top_k, top_p)
        assert unsorted[r].tolist() == pytest.approx(expected, abs=1e-6)


def test_rows_with_different_settings_are_filtered_independently():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    top_k, top_p = torch.tensor([0, 4, 2]), torch.tensor([0.5, 1.0, 0.9])
    probs, order = filtered_probs(logits, top_k, top_p)
    unsorted = torch.zeros_like(probs).scatter_(1, order, probs)
    for r in range(3):
        expected = reference_probs(logits[r].tolist(), 1.0, int(top_k[r]), float(top_p[r]))
        assert unsorted[r].tolist() == pytest.approx(expected, abs=1e-6)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2))
    assert sample(logits.clone(), [row(temperature=0.0) for _ in range(5)]) == logits.argmax(-1).tolist()


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    torch.manual_seed(3)
    tokens = sample(logits.repeat(n, 1), [row(temperature=0.8, top_k=4, top_p=0.95) for _ in range(n)])
    expected = reference_probs(logits[0].tolist(), 0.8, 4, 0.95)
    for tok, p in enumerate(expected):
        freq = tokens.count(tok) / n
        sigma = math.sqrt(p * (1 - p) / n) + 1e-9
        assert abs(freq - p) < 5 * sigma + 1e-4, (tok, freq, p)


def test_a_seeded_row_draws_the_same_whatever_its_batch():
    vocab = 1000
    gen = torch.Generator().manual_seed(4)
    mine = torch.randn(1, vocab, generator=gen)
    alone = sample(mine.clone(), [SamplingRow(SamplingParams(temperature=1.0, seed=42), 7, ())])
    for batch_size, position in ((3, 0), (5, 2), (8, 7)):
        batch = torch.randn(batch_size, vocab, generator=gen)
        batch[position] = mine[0]
        rows = [row(temperature=random.choice([0.0, 0.5, 1.0])) for _ in range(batch_size)]
        rows[position] = SamplingRow(SamplingParams(temperature=1.0, seed=42), 7, ())
        assert sample(batch, rows)[position] == alone[0]


def test_seed_and_token_index_both_change_the_draw():
    logits = torch.zeros(1, 50000)  # uniform: any difference comes from the generator
    draws = {
        (seed, idx): sample(logits.clone(), [SamplingRow(SamplingParams(seed=seed), idx, ())])[0]
        for seed in (1, 2)
        for idx in (0, 1)
    }
    assert len(set(draws.values())) == 4
    assert seed_for_token(1, 0) != seed_for_token(1, 1) != seed_for_token(2, 0)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.full((2, 10), -5.0)
    logits[:, 3] = 10.0  # EOS would win
    logits[:, 4] = 9.0  # a stop token next
    banned = (3, 4)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, min_tokens=2), 1, banned),  # below min: masked
        SamplingRow(SamplingParams(temperature=0.0, min_tokens=2), 2, banned),  # reached: free
    ]
    tokens = sample(logits.clone(), rows)
    assert tokens[0] not in banned
    assert tokens[1] == 3
