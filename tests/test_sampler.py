"""The batched sampler against plain reference implementations."""

import math
import random
import statistics
from collections import Counter

import pytest
import torch

from backend.contract import ContractError
from backend.request import SamplingParams
from backend.sampler import (
    SamplingRow,
    apply_logit_bias,
    apply_penalties,
    filtered_probs,
    sample,
    seed_for_token,
    token_counts,
)


def reference_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float = 0.0, top_n_sigma: float = 0.0
) -> list[float]:
    """Plain Python: temperature, keep the top k, keep the smallest head reaching top_p,
    keep p >= min_p * max p, keep logit >= max - n * std (of the finite logits), renormalize."""
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
    p_max = max(weights[i] / total for i in kept)
    kept = [i for i in kept if weights[i] / total >= min_p * p_max]
    if top_n_sigma > 0:
        sigma = statistics.pstdev([x for x in scaled if math.isfinite(x)])
        kept = [i for i in kept if scaled[i] >= m - top_n_sigma * sigma]
    z = sum(weights[i] for i in kept)
    return [weights[i] / z if i in kept else 0.0 for i in range(len(logits))]


def reference_penalties(logits, prompt, output, repetition, presence, frequency):
    """Plain Python, one row: HF repetition over prompt + output, then OpenAI presence/frequency over output."""
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t, count in Counter(output).items():
        out[t] -= presence + frequency * count
    return out


def history_row(params: SamplingParams, prompt: list[int], output: list[int]) -> SamplingRow:
    return SamplingRow(params, len(output), (), prompt + output)


def row(**kw):
    return SamplingRow(SamplingParams(**kw), num_output_tokens=0, banned_until_min=())


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p,top_n_sigma",
    [
        (1.0, 0, 1.0, 0.0, 0.0),
        (0.7, 3, 1.0, 0.0, 0.0),
        (1.3, 0, 0.8, 0.0, 0.0),
        (0.5, 5, 0.6, 0.0, 0.0),
        (1.0, 1, 1.0, 0.0, 0.0),
        (2.0, 0, 0.05, 0.0, 0.0),
        (1.0, 0, 1.0, 0.1, 0.0),
        (0.6, 8, 0.9, 0.05, 0.0),
        (1.0, 0, 1.0, 0.0, 1.0),
        (1.7, 0, 1.0, 0.0, 0.5),
        (0.8, 6, 0.95, 0.02, 1.5),
        (1.0, 50, 1.0, 0.0, 0.0),  # top_k above the vocabulary: off
        (1.0, 0, 1.0, 1.0, 0.0),  # min_p 1: the top token only
        (1.0, 0, 1.0, 0.0, 1e-6),  # a tiny sigma: the top token only
    ],
)
def test_filtered_probs_match_the_reference(temperature, top_k, top_p, min_p, top_n_sigma):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=gen) * 3
    probs, order = filtered_probs(
        logits / temperature,
        torch.tensor([top_k] * 4),
        torch.tensor([top_p] * 4),
        torch.tensor([min_p] * 4),
        torch.tensor([top_n_sigma] * 4),
    )
    unsorted = torch.zeros_like(probs).scatter_(1, order, probs)
    for r in range(4):
        expected = reference_probs(logits[r].tolist(), temperature, top_k, top_p, min_p, top_n_sigma)
        assert unsorted[r].tolist() == pytest.approx(expected, abs=1e-6)


def test_thresholds_keep_ties_and_ignore_masked_tokens():
    inf = float("inf")
    logits = torch.tensor([[2.0, 2.0, 1.0, -inf], [3.0, 3.0, 3.0, -inf], [5.0, 1.0, 0.0, -inf]])
    probs, order = filtered_probs(
        logits,
        torch.zeros(3, dtype=torch.long),
        torch.ones(3),
        torch.tensor([1.0, 0.0, 0.0]),
        torch.tensor([0.0, 2.0, 0.1]),
    )
    unsorted = torch.zeros_like(probs).scatter_(1, order, probs)
    assert unsorted[0].tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0])  # min_p 1 keeps both tied tops
    assert unsorted[1].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])  # std 0: every finite tie stays
    assert unsorted[2].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])  # std over the finite logits only
    for r in range(3):
        expected = reference_probs(logits[r].tolist(), 1.0, 0, 1.0, [1.0, 0.0, 0.0][r], [0.0, 2.0, 0.1][r])
        assert unsorted[r].tolist() == pytest.approx(expected, abs=1e-6)


def test_top_k_with_ties_keeps_k_of_them():
    probs, order = filtered_probs(torch.zeros(1, 5), torch.tensor([2]), torch.tensor([1.0]))
    unsorted = torch.zeros_like(probs).scatter_(1, order, probs)
    assert sorted(unsorted[0].tolist()) == pytest.approx([0, 0, 0, 0.5, 0.5])


def test_logit_bias_matches_the_reference():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    biases = [((3, 7), (100.0, -2.5)), ((), ()), ((0, 0, 29), (1.0, 2.0, -100.0)), ((12,), (0.5,))]
    rows = [row(logit_bias_ids=ids, logit_bias_values=vals) for ids, vals in biases]
    out = logits.clone()
    apply_logit_bias(out, rows)
    for r, (ids, vals) in enumerate(biases):
        expected = logits[r].tolist()
        for t, v in zip(ids, vals, strict=True):
            expected[t] += v  # a repeated id adds up
        assert out[r].tolist() == pytest.approx(expected, abs=1e-5)


def test_greedy_rows_with_a_full_bias_pick_the_biased_token():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(6)) * 5
    rows = [row(temperature=0.0, logit_bias_ids=(t,), logit_bias_values=(100.0,)) for t in (4, 17, 39)]
    assert sample(logits.clone(), rows) == [4, 17, 39]
    drawn = [row(temperature=1.0, seed=1, logit_bias_ids=(t,), logit_bias_values=(100.0,)) for t in (4, 17, 39)]
    assert sample(logits.clone(), drawn) == [4, 17, 39]


def test_token_counts_split_prompt_and_output():
    rows = [
        history_row(SamplingParams(), [1, 2, 2], [2, 3, 3, 3]),
        history_row(SamplingParams(), [], []),
        history_row(SamplingParams(), [4], []),
    ]
    all_counts, output_counts = token_counts(rows, 6, "cpu")
    assert all_counts.tolist() == [[0, 1, 3, 3, 0, 0], [0] * 6, [0, 0, 0, 0, 1, 0]]
    assert output_counts.tolist() == [[0, 0, 1, 3, 0, 0], [0] * 6, [0] * 6]


@pytest.mark.parametrize("seed", range(5))
def test_penalties_match_the_reference(seed):
    rng = random.Random(seed)
    vocab, batch = 25, 6
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 4  # half negative
    rows, histories = [], []
    for _ in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 5, 30]))]
        output = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 7, 40]))]
        params = SamplingParams(
            repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
            presence_penalty=rng.choice([0.0, -1.5, 0.5, 2.0]),
            frequency_penalty=rng.choice([0.0, -0.3, 1.0, 2.0]),
        )
        rows.append(history_row(params, prompt, output))
        histories.append((prompt, output, params))
    out = logits.clone()
    apply_penalties(out, rows)
    for r, (prompt, output, p) in enumerate(histories):
        expected = reference_penalties(
            logits[r].tolist(), prompt, output, p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        )
        assert out[r].tolist() == pytest.approx(expected, abs=1e-5)


def test_repetition_penalty_pushes_negative_logits_down_and_positive_ones_toward_zero():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    apply_penalties(logits, [history_row(SamplingParams(repetition_penalty=2.0), [0, 1], [])])
    assert logits.tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_penalties_apply_to_greedy_rows():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    rows = [history_row(SamplingParams(temperature=0.0, presence_penalty=0.5), [], [0])]
    assert sample(logits.clone(), rows) == [1]
    rows = [history_row(SamplingParams(temperature=0.0, repetition_penalty=1.1), [0], [])]
    assert sample(logits.clone(), rows) == [1]


def test_a_batch_mixing_features_equals_each_row_alone():
    vocab = 300
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    logits = torch.randn(8, vocab, generator=gen) * 3
    settings = [
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0),
        dict(temperature=0.9, seed=3),
        dict(temperature=0.9, seed=3, presence_penalty=1.0, min_p=0.05),
        dict(temperature=1.2, seed=4, top_k=20, top_p=0.9, top_n_sigma=1.0),
        dict(temperature=0.7, seed=5, logit_bias_ids=(1, 2), logit_bias_values=(5.0, -5.0), repetition_penalty=0.8),
        dict(temperature=1.0, seed=6, min_p=0.2, top_n_sigma=2.0),
        dict(temperature=0.0, logit_bias_ids=(9,), logit_bias_values=(3.0,)),
    ]
    rows = [
        history_row(
            SamplingParams(**kw),
            [rng.randrange(vocab) for _ in range(rng.randrange(50))],
            [rng.randrange(vocab) for _ in range(rng.randrange(20))],
        )
        for kw in settings
    ]
    together = sample(logits.clone(), rows)
    assert together == [sample(logits[r : r + 1].clone(), [rows[r]])[0] for r in range(8)]


def test_draws_follow_min_p_and_top_n_sigma():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    torch.manual_seed(8)
    tokens = sample(logits.repeat(n, 1), [row(temperature=0.9, min_p=0.2, top_n_sigma=1.2) for _ in range(n)])
    expected = reference_probs(logits[0].tolist(), 0.9, 0, 1.0, 0.2, 1.2)
    assert 0 < sum(p > 0 for p in expected) < 7  # both filters cut something
    for tok, p in enumerate(expected):
        freq = tokens.count(tok) / n
        sigma = math.sqrt(p * (1 - p) / n) + 1e-9
        assert abs(freq - p) < 5 * sigma + 1e-4, (tok, freq, p)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"top_n_sigma": -1.0}, "top_n_sigma"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias_ids": (1, 2), "logit_bias_values": (1.0,)}, "logit_bias_values"),
        ({"logit_bias_ids": (-1,), "logit_bias_values": (1.0,)}, "logit_bias_ids"),
        ({"logit_bias_ids": (100,), "logit_bias_values": (1.0,)}, "logit_bias_ids"),  # vocab 100
        ({"logit_bias_ids": (1,), "logit_bias_values": (100.5,)}, "logit_bias_values"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ContractError) as info:
        SamplingParams(**kwargs).validate(vocab_size=100)
    assert info.value.field == field


def test_limits_themselves_are_valid():
    SamplingParams(
        min_p=1.0,
        top_n_sigma=0.0,
        repetition_penalty=0.01,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        logit_bias_ids=(0, 99),
        logit_bias_values=(-100.0, 100.0),
    ).validate(vocab_size=100)


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
