"""The batched sampler against plain reference implementations."""

import math
import random
import statistics
from collections import Counter

import pytest
import torch

from backend.contract import ContractError, GenerationRequest, SamplingParams
from backend.sampling.draw import filtered_probs, seed_for_token
from backend.sampling.repeats import DRY_WINDOW, LZ_WINDOW, MAX_REPEAT, longest_repeats
from backend.sampling.sampler import (
    apply_logit_bias,
    apply_penalties,
    apply_repeat_penalties,
    sample,
    token_counts,
)
from backend.types.sampling_row import SamplingRow


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


def history_row(
    params: SamplingParams, prompt: list[int], output: list[int], dry_breaker_ids: tuple[int, ...] = ()
) -> SamplingRow:
    return SamplingRow(params, len(output), (), prompt + output, dry_breaker_ids=dry_breaker_ids)


def validate(params: SamplingParams, vocab_size: int | None = None) -> None:
    """The sampling values' checks, which live on the request."""
    GenerationRequest([1], params).validate(vocab_size=vocab_size)


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
    unsorted = torch.zeros(len(probs), logits.shape[1]).scatter_(1, order, probs)
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
    unsorted = torch.zeros(len(probs), logits.shape[1]).scatter_(1, order, probs)
    assert unsorted[0].tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0])  # min_p 1 keeps both tied tops
    assert unsorted[1].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])  # std 0: every finite tie stays
    assert unsorted[2].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])  # std over the finite logits only
    for r in range(3):
        expected = reference_probs(logits[r].tolist(), 1.0, 0, 1.0, [1.0, 0.0, 0.0][r], [0.0, 2.0, 0.1][r])
        assert unsorted[r].tolist() == pytest.approx(expected, abs=1e-6)


def test_top_k_with_ties_keeps_k_of_them():
    probs, order = filtered_probs(torch.zeros(1, 5), torch.tensor([2]), torch.tensor([1.0]))
    unsorted = torch.zeros(len(probs), 5).scatter_(1, order, probs)
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
    row_of, ids, all_counts, output_counts = token_counts(rows, 6, "cpu")
    entries = list(zip(row_of.tolist(), ids.tolist(), all_counts.tolist(), output_counts.tolist(), strict=True))
    assert entries == [(0, 1, 1, 0), (0, 2, 3, 1), (0, 3, 3, 3), (2, 4, 1, 0)]


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
        validate(SamplingParams(**kwargs), vocab_size=100)
    assert info.value.field == field


def test_limits_themselves_are_valid():
    validate(
        SamplingParams(
            min_p=1.0,
            top_n_sigma=0.0,
            repetition_penalty=0.01,
            presence_penalty=-2.0,
            frequency_penalty=2.0,
            logit_bias_ids=(0, 99),
            logit_bias_values=(-100.0, 100.0),
        ),
        vocab_size=100,
    )


def test_rows_with_different_settings_are_filtered_independently():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    top_k, top_p = torch.tensor([0, 4, 2]), torch.tensor([0.5, 1.0, 0.9])
    probs, order = filtered_probs(logits, top_k, top_p)
    unsorted = torch.zeros(len(probs), logits.shape[1]).scatter_(1, order, probs)
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


# ---------------------------------------------------------------------------
# DRY and LZ: repeat lengths against brute force


def reference_repeat_lengths(context, window, max_len, breakers=()):
    """Plain Python: for every candidate c, the largest L <= max_len such that the last L
    tokens of the window, breaker-free, followed by c occur somewhere in the window."""
    ctx = list(context[-window:])
    n = len(ctx)
    best = {}
    for length in range(1, min(max_len, n - 1) + 1):
        suffix = ctx[n - length :]
        if any(t in breakers for t in suffix):
            break
        for j in range(length, n):  # c = ctx[j], preceded by ctx[j - length : j]
            if ctx[j - length : j] == suffix:
                best[ctx[j]] = max(best.get(ctx[j], 0), length)
    return best


def reference_dry(logits, context, multiplier, base, allowed, breakers=()):
    out = list(logits)
    for c, length in reference_repeat_lengths(context, DRY_WINDOW, MAX_REPEAT, breakers).items():
        if length >= allowed:
            out[c] -= multiplier * base ** (length - allowed)
    return out


def reference_lz(logits, context, penalty):
    out = list(logits)
    for c, length in reference_repeat_lengths(context, LZ_WINDOW, MAX_REPEAT).items():
        out[c] -= penalty * length
    return out


def _as_dict(found):
    ids, lengths = found
    return dict(zip(ids.tolist(), lengths.tolist(), strict=True))


@pytest.mark.parametrize("seed", range(40))
def test_repeat_lengths_match_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5])  # small vocabularies repeat a lot
    context = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 2, 6, 20, 60]))]
    if seed % 3 == 0:  # a planted loop: long matches
        context = (context[:5] * 12)[: rng.randrange(10, 60)]
    window, max_len = rng.choice([(256, 64), (15, 64), (256, 4)])
    breakers = rng.choice([(), (0,), (1, 2)])
    expected = reference_repeat_lengths(context, window, max_len, breakers)
    assert _as_dict(longest_repeats(context, window, max_len, breakers)) == expected


@pytest.mark.parametrize(
    ("context", "breakers", "expected"),
    [
        ([], (), {}),
        ([7], (), {}),
        ([1, 2, 3, 4], (), {}),  # no repeats
        ([5, 5], (), {5: 1}),  # the match may overlap the suffix
        ([1, 2, 3, 1, 2, 3, 1, 2], (), {3: 5}),
        ([1, 2, 3, 1, 2, 3, 1, 2], (3,), {3: 2}),  # the suffix stops after the last breaker
        ([1, 2, 9, 1, 2], (9,), {9: 2}),  # a breaker may be the candidate
        ([1, 2, 3, 1, 2, 9], (9,), {}),  # the context ends on a breaker
    ],
)
def test_repeat_length_edge_cases(context, breakers, expected):
    assert _as_dict(longest_repeats(context, 256, 64, breakers)) == expected


def _penalty_rows(rng, vocab, settings):
    """`dry_breaker_ids` in a setting: the row's breakers as token ids (what the engine
    makes of the request's breaker strings)."""
    rows = []
    for kw in settings:
        kw = dict(kw)
        breakers = kw.pop("dry_breaker_ids", ())
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([0, 3, 12]))]
        output = [rng.randrange(vocab) for _ in range(rng.choice([0, 5, 30]))]
        if rng.random() < 0.5:
            output = (prompt + output)[:4] * 6  # loop
        rows.append(history_row(SamplingParams(**kw), prompt, output, breakers))
    return rows


@pytest.mark.parametrize("seed", range(8))
def test_dry_and_lz_match_the_reference(seed):
    rng = random.Random(seed)
    vocab = 6
    settings = [
        dict(dry_multiplier=0.8),
        dict(dry_multiplier=1.5, dry_base=2.0, dry_allowed_length=1),
        dict(dry_multiplier=0.5, dry_allowed_length=100),  # longer than any match: no effect
        dict(dry_multiplier=0.8, dry_breaker_ids=(0, 3)),
        dict(lz_penalty=1.0),
        dict(lz_penalty=0.3),
        dict(dry_multiplier=0.8, lz_penalty=0.5, repetition_penalty=1.2),
        dict(),
    ]
    rows = _penalty_rows(rng, vocab, settings)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3
    out = logits.clone()
    apply_penalties(out, rows)
    counted = out.clone()
    apply_repeat_penalties(out, rows)
    for r, sampling_row in enumerate(rows):
        p, context = sampling_row.params, list(sampling_row.token_ids)
        expected = counted[r].tolist()
        if p.dry_multiplier > 0:
            expected = reference_dry(
                expected, context, p.dry_multiplier, p.dry_base, p.dry_allowed_length, sampling_row.dry_breaker_ids
            )
        if p.lz_penalty > 0:
            expected = reference_lz(expected, context, p.lz_penalty)
        assert out[r].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-4)
    assert out[2].tolist() == counted[2].tolist()  # allowed_length 100
    assert out[7].tolist() == logits[7].tolist()  # off


def test_dry_and_lz_worked_examples():
    # the examples of docs/sampling.md
    context = [1, 2, 3, 1, 2, 3, 1, 2]
    logits = torch.zeros(1, 5)
    apply_repeat_penalties(logits, [history_row(SamplingParams(lz_penalty=0.5), context, [])])
    assert logits.tolist() == [[0.0, 0.0, 0.0, -2.5, 0.0]]  # 3 extends a repeat of length 5
    context = [4, 1, 2, 3, 4, 1, 2]
    logits = torch.zeros(1, 5)
    apply_repeat_penalties(logits, [history_row(SamplingParams(dry_multiplier=0.8), context, [])])
    assert logits[0].tolist() == pytest.approx([0.0, 0.0, 0.0, -0.8 * 1.75, 0.0])  # L = 3, allowed 2
    logits = torch.zeros(1, 5)
    breaker = SamplingParams(dry_multiplier=0.8)
    apply_repeat_penalties(logits, [history_row(breaker, context, [], dry_breaker_ids=(4,))])
    assert logits[0].tolist() == pytest.approx([0.0, 0.0, 0.0, -0.8, 0.0])  # L = 2: the suffix starts after the 4


def test_dry_stops_a_greedy_loop():
    context = [1, 2, 3, 1, 2, 3, 1, 2]
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.0]])  # 3 would continue the loop
    assert sample(logits.clone(), [history_row(SamplingParams(temperature=0.0), context, [])]) == [3]
    dry = SamplingParams(temperature=0.0, dry_multiplier=0.8)
    assert sample(logits.clone(), [history_row(dry, context, [])]) == [4]


def test_a_batch_mixing_repeat_penalties_and_plain_rows_equals_each_row_alone():
    vocab = 50
    rng = random.Random(11)
    settings = [
        dict(temperature=0.0),
        dict(temperature=0.0, dry_multiplier=0.8),
        dict(temperature=0.9, seed=3, lz_penalty=1.0),
        dict(temperature=0.9, seed=3),
        dict(temperature=1.1, seed=4, dry_multiplier=1.0, dry_base=1.2, lz_penalty=0.2, top_k=10),
        dict(temperature=0.0, lz_penalty=2.0, presence_penalty=0.5),
    ]
    rows = _penalty_rows(rng, vocab, settings)
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(11)) * 2
    together = sample(logits.clone(), rows)
    assert together == [sample(logits[r : r + 1].clone(), [rows[r]])[0] for r in range(len(rows))]


def test_rows_without_repeat_penalties_are_untouched():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(12))
    out = logits.clone()
    apply_repeat_penalties(out, [history_row(SamplingParams(), [1, 2, 1, 2], [1, 2]), row()])
    assert torch.equal(out, logits)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dry_multiplier": -0.1}, "dry_multiplier"),
        ({"dry_base": 0.9}, "dry_base"),
        ({"dry_allowed_length": 0}, "dry_allowed_length"),
        ({"lz_penalty": -1.0}, "lz_penalty"),
        ({"lz_penalty": float("nan")}, "lz_penalty"),
    ],
)
def test_repeat_penalty_validation_names_the_field(kwargs, field):
    with pytest.raises(ContractError) as info:
        validate(SamplingParams(**kwargs))
    assert info.value.field == field


def test_repeat_penalties_need_the_token_history():
    assert SamplingParams(dry_multiplier=0.5).uses_penalties
    assert SamplingParams(lz_penalty=0.5).uses_penalties
    assert not SamplingParams(dry_base=3.0, dry_allowed_length=5).uses_penalties
    validate(SamplingParams(dry_multiplier=0.0, dry_base=1.0, dry_allowed_length=1, lz_penalty=0.0))


def test_the_wire_carries_the_repeat_penalties():
    from backend.contract import decode_request, encode_request

    sent = SamplingParams(dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3, lz_penalty=0.5)
    params = decode_request(encode_request(GenerationRequest([1], sent))).sampling
    assert (params.dry_multiplier, params.dry_base, params.dry_allowed_length) == pytest.approx((0.8, 2.0, 3))
    assert params.lz_penalty == 0.5


def test_a_top_k_row_draws_the_same_with_or_without_a_full_sort_in_its_batch():
    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(13))
    mine = SamplingRow(SamplingParams(seed=9, top_k=20, top_p=0.9, min_p=0.01, top_n_sigma=2.0), 3, ())
    other = SamplingRow(SamplingParams(seed=1, top_p=0.8), 0, ())  # top_k off: the batch sorts everything
    for index in range(5):
        mine.num_output_tokens = index
        alone = sample(logits[:1].clone(), [mine])  # top_k everywhere: a partial sort
        assert sample(logits.clone(), [mine, other])[0] == alone[0]


@pytest.mark.parametrize("filters", [dict(), dict(top_k=4, top_p=0.95)])
def test_seeded_draws_follow_the_distribution(filters):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    rows = [SamplingRow(SamplingParams(temperature=0.8, seed=s, **filters), s % 7, ()) for s in range(n)]
    tokens = sample(logits.repeat(n, 1), rows)
    expected = reference_probs(logits[0].tolist(), 0.8, filters.get("top_k", 0), filters.get("top_p", 1.0))
    for tok, p in enumerate(expected):
        freq = tokens.count(tok) / n
        sigma = math.sqrt(p * (1 - p) / n) + 1e-9
        assert abs(freq - p) < 5 * sigma + 1e-4, (tok, freq, p)


def test_noise_is_never_zero_so_filtered_tokens_never_win():
    """A noise of 0 turned p / q into 0 / 0 = NaN for a filtered-out token, and argmax
    picks NaN: the largest hash must still give positive noise."""
    from backend.sampling.draw import exponential_from_bits

    noise = exponential_from_bits(torch.tensor([0xFFFFFFFF, 0xFFFFFF00, 0], dtype=torch.long))
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    # and end to end: 2000 seeded rows over a 49k vocabulary with all but 3 tokens
    # masked (as a grammar masks them) draw one of the 3 (before the fix 5 did not)
    vocab, rows = 49152, 2000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    top3 = logits.topk(3, dim=-1).indices
    masked = torch.full_like(logits, float("-inf")).scatter(1, top3, logits.gather(1, top3))
    batch = [SamplingRow(SamplingParams(temperature=1.0, seed=i), 0, ()) for i in range(rows)]
    tokens = torch.tensor(sample(masked, batch))
    assert bool((top3 == tokens.unsqueeze(1)).any(dim=1).all())
