"""LoopDetector against a plain reference that rescans the tail for every period."""

from __future__ import annotations

import random

import pytest

from backend.contract import ContractError
from backend.guards.loops import LoopDetector


def reference_period(tokens: list[int], min_size: int, max_size: int, min_count: int) -> int | None:
    """The smallest p whose last min_count * p tokens are min_count copies of one block."""
    for p in range(min_size, max_size + 1):
        span = min_count * p
        if len(tokens) >= span:
            tail = tokens[-span:]
            if tail == tail[:p] * min_count:
                return p
    return None


def assert_matches_reference(tokens: list[int], min_size: int, max_size: int, min_count: int) -> list[int | None]:
    """Push every token; at each position the detector must agree with the reference."""
    detector = LoopDetector(min_size, max_size, min_count)
    results = []
    for i, token in enumerate(tokens):
        got = detector.push(token)
        want = reference_period(tokens[: i + 1], min_size, max_size, min_count)
        assert got == want, f"position {i}: got {got}, want {want} for {tokens[: i + 1]}"
        results.append(got)
    return results


def distinct_block(p: int, start: int = 100) -> list[int]:
    """p distinct tokens, so the block has no smaller period of its own."""
    return list(range(start, start + p))


@pytest.mark.parametrize("min_count", [2, 3, 4])
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_each_period_fires_exactly_when_the_last_repeat_completes(p, min_count):
    prefix = [1, 2, 3]
    tokens = prefix + distinct_block(p) * min_count
    results = assert_matches_reference(tokens, 1, 8, min_count)
    first_fire = next(i for i, r in enumerate(results) if r is not None)
    assert first_fire == len(tokens) - 1
    assert results[-1] == p


def test_longest_allowed_period_fires_and_longer_does_not():
    assert_matches_reference(distinct_block(8) * 3, 1, 8, 3)
    detector = LoopDetector(1, 8, 3)
    assert [detector.push(t) for t in distinct_block(9) * 3][-1] is None


def test_periods_below_the_minimum_are_ignored():
    # a run of one token is below the minimum as period 1, but it is also a period-3 loop
    results = assert_matches_reference([7] * 20, 3, 8, 2)
    assert results[:5] == [None] * 5 and results[5:] == [3] * 15
    results = assert_matches_reference([1, 2] * 10, 3, 8, 2)
    assert results[:7] == [None] * 7 and results[7:] == [4] * 13


def test_smallest_period_wins():
    # "a a a a a a" repeats with period 1, 2 and 3; report 1
    detector = LoopDetector(1, 4, 2)
    results = [detector.push(5) for _ in range(6)]
    assert results == [None, 1, 1, 1, 1, 1]


def test_near_miss_one_token_off_does_not_fire():
    for p in range(1, 7):
        block = distinct_block(p)
        for position in range(p):
            last = list(block)
            last[position] = 999  # the third repeat differs in one token
            tokens = block + block + last
            results = assert_matches_reference(tokens, 1, 6, 3)
            assert results[-1] is None


def test_repeats_split_by_a_different_token_do_not_count_together():
    block = distinct_block(4)
    tokens = block + block + [999] + block + block
    results = assert_matches_reference(tokens, 1, 6, 3)
    assert all(r is None for r in results)
    # the same stream with min_count 2 fires on each half
    results = assert_matches_reference(tokens, 1, 6, 2)
    assert results[7] == 4 and results[-1] == 4


def test_shorter_than_needed_never_fires():
    p, min_count = 5, 4
    tokens = distinct_block(p) * min_count
    detector = LoopDetector(p, p, min_count)
    results = [detector.push(t) for t in tokens]
    assert results[:-1] == [None] * (len(tokens) - 1)
    assert results[-1] == p


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences_over_tiny_alphabets(seed):
    rng = random.Random(seed)
    alphabet = rng.randint(1, 3)
    min_size = rng.randint(1, 4)
    max_size = rng.randint(min_size, 9)
    min_count = rng.randint(2, 4)
    tokens = []
    while len(tokens) < 300:
        # mostly random tokens, sometimes a pasted repeat so long loops occur too
        if rng.random() < 0.1:
            block = [rng.randrange(alphabet) for _ in range(rng.randint(1, max_size + 1))]
            tokens += block * rng.randint(1, min_count + 1)
        else:
            tokens.append(rng.randrange(alphabet))
    assert_matches_reference(tokens, min_size, max_size, min_count)


def test_reset_forgets_the_history():
    detector = LoopDetector(1, 4, 3)
    for t in [1, 2, 1, 2, 1]:
        detector.push(t)
    detector.reset()
    assert detector.push(2) is None  # would complete "1 2" x3 without the reset
    fresh = LoopDetector(1, 4, 3)
    fresh.push(2)
    for t in [1, 2, 1, 2, 1]:
        assert detector.push(t) == fresh.push(t)


@pytest.mark.parametrize(
    "args, field",
    [
        ((0, 4, 2), "loop_min_pattern_size"),
        ((3, 2, 2), "loop_max_pattern_size"),
        ((1, 4, 1), "loop_min_count"),
        ((1, 4, 0), "loop_min_count"),
        ((1.5, 4, 2), "loop_min_pattern_size"),
        ((1, True, 2), "loop_max_pattern_size"),
    ],
)
def test_bad_arguments_name_the_field(args, field):
    with pytest.raises(ContractError) as error:
        LoopDetector(*args)
    assert error.value.field == field
