"""Speculative decoding on the real default model (CPU, float32): exactly the tokens of
plain decoding, for every proposer, greedy and seeded sampling, next to requests that
do not speculate; and the verify step's bookkeeping, checked with proposers whose
drafts are known (an oracle that replays plain decoding, and one wrong at position j).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

from backend.contract import FinishReason, GenerationRequest, GuardParams, SamplingParams
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from backend.speculation.proposers import TokenLookup
from tests.helpers.engine_runs import run_to_completion

QUESTIONS = [
    "Repeat this list and add one more fruit: apples, bananas, cherries, dates, elderberries, figs.",
    "Copy this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Why do cats purr? Answer in two sentences.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SAMPLED = [
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=11, max_tokens=40),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.15, frequency_penalty=0.3, seed=5, max_tokens=40),
    SamplingParams(
        temperature=0.9, dry_multiplier=0.8, presence_penalty=0.4, logit_bias_ids=(13, 28),
        logit_bias_values=(3.0, -2.0), seed=3, max_tokens=40, logprobs=True, top_logprobs=2,
    ),
]  # fmt: skip


def _engine(model_path, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(model_path), kv_cache_bytes=256 << 20, **config))


@pytest.fixture(scope="module")
def engine(model_path):
    """Drafts whenever a proposer has something (SPECULATIVE=ngram): no cost model in the way."""
    return _engine(model_path, speculative="ngram")


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
            for q in QUESTIONS]  # fmt: skip


def _plain(request: GenerationRequest) -> GenerationRequest:
    return dataclasses.replace(request, disable_mtp=True)


def _predicted(request: GenerationRequest, reference: list[int]) -> GenerationRequest:
    """A prediction that is the reference with an edit: a token replaced, two dropped."""
    edited = [*reference[:6], 1000, *reference[7:15], *reference[17:]]
    return dataclasses.replace(request, prediction_tokens=tuple(edited))


def _runs(engine, requests: dict[str, GenerationRequest]):
    before = engine.spec_stats()
    tokens, finals = run_to_completion(engine, requests)
    after = engine.spec_stats()
    return (
        tokens,
        finals,
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
    )


@pytest.fixture(scope="module")
def reference(engine, prompts):
    tokens, _, drafted, _ = _runs(engine, {f"p{i}": GenerationRequest(p, GREEDY, disable_mtp=True)
                                           for i, p in enumerate(prompts)})  # fmt: skip
    assert drafted == 0, "disable_mtp never drafts"
    return [tokens[f"p{i}"] for i in range(len(prompts))]


def test_greedy_equals_plain_decoding_in_a_mixed_batch(engine, prompts, reference):
    requests = {}
    for i, p in enumerate(prompts):
        base = GenerationRequest(p, GREEDY)
        requests[f"ngram{i}"] = base
        requests[f"predicted{i}"] = _predicted(base, reference[i])
        requests[f"plain{i}"] = _plain(base)  # a neighbour that never drafts
    tokens, finals, drafted, accepted = _runs(engine, requests)
    for i in range(len(prompts)):
        assert tokens[f"ngram{i}"] == tokens[f"predicted{i}"] == tokens[f"plain{i}"] == reference[i], i
        assert finals[f"plain{i}"].num_accepted_prediction_tokens == 0
        # the prediction matches the output but for the edit, and counts as OpenAI's usage does
        final, predicted = finals[f"predicted{i}"], len(requests[f"predicted{i}"].prediction_tokens)
        assert final.num_accepted_prediction_tokens >= len(reference[i]) - 12
        assert final.num_accepted_prediction_tokens + final.num_rejected_prediction_tokens == predicted
    assert drafted > accepted > 0


def test_greedy_alone_equals_plain_decoding(engine, prompts, reference):
    for i in (0, 2):
        tokens, _, drafted, _ = _runs(engine, {"alone": GenerationRequest(prompts[i], GREEDY)})
        assert tokens["alone"] == reference[i] and drafted > 0


@pytest.mark.parametrize("params", SAMPLED, ids=["top-k-p", "min-p-penalties", "dry-bias-logprobs"])
def test_seeded_sampling_equals_plain_decoding(engine, prompts, params):
    plain = {f"p{i}": GenerationRequest(p, params, disable_mtp=True) for i, p in enumerate(prompts)}
    want, want_finals = run_to_completion(engine, plain)
    spec = {f"s{i}": GenerationRequest(p, params) for i, p in enumerate(prompts)}
    spec |= {f"pred{i}": _predicted(GenerationRequest(p, params), want[f"p{i}"]) for i, p in enumerate(prompts)}
    got, finals, drafted, accepted = _runs(engine, spec)
    for i in range(len(prompts)):
        assert got[f"s{i}"] == got[f"pred{i}"] == want[f"p{i}"], i
    assert accepted > 0, "some drafts were verified and taken"


def test_logprobs_are_those_of_plain_decoding(engine, prompts, reference):
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=True, top_logprobs=3)
    outs = {}
    for name, request in (("plain", _plain(GenerationRequest(prompts[1], params))),
                          ("spec", _predicted(GenerationRequest(prompts[1], params), reference[1]))):  # fmt: skip
        engine.add_request(name, request)
        outs[name] = []
        while name in engine.scheduler.requests:
            for out in engine.step():
                outs[name] += out.logprobs or []
    assert [lp.token_id for lp in outs["spec"]] == [lp.token_id for lp in outs["plain"]] == reference[1]
    for a, b in zip(outs["spec"], outs["plain"], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


# -- proposers whose drafts are known -------------------------------------------------------


class Replay(TokenLookup):
    """Proposes the reference continuation, with the draft at `wrong_at` made wrong."""

    name = "replay"

    def __init__(self, reference: list[int], wrong_at: int | None = None):
        self.reference, self.wrong_at = reference, wrong_at

    def draft(self, tokens, num_prompt_tokens, k, state):
        done = len(tokens) - num_prompt_tokens
        drafts = self.reference[done : done + k]
        if self.wrong_at is not None and self.wrong_at < len(drafts):
            drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 49152
        return drafts


def _replayed(engine, request_id, request, proposer, check=None):
    """Run one request with its drafts from `proposer`; `check(seq)` after every step."""
    engine.add_request(request_id, request)
    engine.scheduler.requests[request_id].spec.proposer = proposer
    tokens, final, seq = [], None, engine.scheduler.requests[request_id]
    while final is None:
        for out in engine.step():
            tokens += out.token_ids
            final = out.final or final
        if check is not None and not seq.is_finished:
            check(seq)
    return tokens, final, seq


def _committed_blocks_only(seq):
    """No block enters the prefix cache before all its positions are committed."""
    assert seq.num_registered_blocks * 16 <= seq.num_computed_tokens < seq.num_tokens


def test_an_oracle_draft_is_always_accepted_and_never_runs_past_max_tokens(engine, prompts):
    params = dataclasses.replace(GREEDY, max_tokens=38, ignore_eos=True)  # 38: not a multiple of 1 + k
    want, _ = run_to_completion(engine, {"plain": _plain(GenerationRequest(prompts[3], params))})
    before = engine.spec_stats()
    tokens, final, seq = _replayed(engine, "oracle", GenerationRequest(prompts[3], params), Replay(want["plain"]),
                                   _committed_blocks_only)  # fmt: skip
    after = engine.spec_stats()
    assert tokens == want["plain"] and final.num_output_tokens == 38
    drafted, accepted = (
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
    )
    assert drafted == accepted == seq.spec.num_accepted
    assert (final.num_accepted_prediction_tokens, final.num_rejected_prediction_tokens) == (0, 0)  # no prediction
    # 1 + 4 tokens a step, the prefill's step too; the last drafts only what is left
    steps = after.num_drafts - before.num_drafts
    assert steps == -(-38 // 5) and accepted == 38 - steps


@contextlib.contextmanager
def _watched(engine):
    """The (drafts, accepted) of every verify step while inside, from the real bookkeeping."""
    verified, real = [], engine.speculator.verified

    def spy(seq, drafts, accepted, emitted):
        verified.append((len(drafts), accepted))
        real(seq, drafts, accepted, emitted)

    engine.speculator.verified = spy
    try:
        yield verified
    finally:
        del engine.speculator.verified


@pytest.mark.parametrize("wrong_at", [0, 2])
def test_a_draft_wrong_at_position_j_accepts_exactly_j(engine, prompts, wrong_at):
    params = dataclasses.replace(GREEDY, ignore_eos=True)  # no EOS inside a run: only the wrong draft stops it
    want, _ = run_to_completion(engine, {"plain": _plain(GenerationRequest(prompts[0], params))})
    before = engine.spec_stats()
    with _watched(engine) as verified:
        tokens, final, seq = _replayed(engine, f"wrong{wrong_at}", GenerationRequest(prompts[0], params),
                                       Replay(want["plain"], wrong_at), _committed_blocks_only)  # fmt: skip
    after = engine.spec_stats()
    assert tokens == want["plain"]
    assert len(verified) > 5 and all(accepted == min(wrong_at, drafted) for drafted, accepted in verified)
    per_pos = [a - b for a, b in zip(after.accepted_per_pos, before.accepted_per_pos, strict=True)]
    assert per_pos == [sum(1 for drafted, _ in verified if drafted > i) if i < wrong_at else 0 for i in range(4)]
    assert seq.spec.num_accepted == sum(a for _, a in verified)
    assert after.num_drafts - before.num_drafts == len(verified)
    assert after.num_draft_tokens - before.num_draft_tokens == sum(d for d, _ in verified) == seq.spec.num_drafted


def test_committed_kv_equals_a_fresh_prefill(engine, model_path, prompts, reference):
    """After verify steps that wrote rejected drafts' KV, the KV of every committed
    position equals what a fresh prefill of the committed tokens computes."""
    request = GenerationRequest(prompts[2], dataclasses.replace(GREEDY, max_tokens=200))
    engine.add_request("kv", request)
    seq = engine.scheduler.requests["kv"]
    seq.spec.proposer = Replay(reference[2], wrong_at=2)
    while seq.num_output_tokens < 30:
        engine.step()
    committed, spec_kv = seq.token_ids[: seq.num_computed_tokens], _kv_of(engine, seq)
    engine.abort_request("kv")
    engine.step()
    fresh = _engine(model_path, speculative="off")
    fresh.add_request("fresh", GenerationRequest(committed, SamplingParams(max_tokens=4)))
    fresh.step()  # the whole prompt in one chunk
    fresh_kv = _kv_of(fresh, fresh.scheduler.requests["fresh"])
    assert spec_kv.shape == fresh_kv.shape
    torch.testing.assert_close(spec_kv, fresh_kv, atol=1e-4, rtol=1e-4)


def _kv_of(engine, seq) -> torch.Tensor:
    """[layers, 2, committed positions, kv heads, head dim] of a running sequence."""
    pos = torch.arange(seq.num_computed_tokens)
    table = torch.tensor(seq.block_table)
    blocks, offsets = table[pos // engine.config.block_size], pos % engine.config.block_size
    return torch.stack([kv[:, blocks, offsets] for kv in engine.runner.kv_caches])


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(engine, prompts, reference):
    ref = reference[2]
    stop = next(t for i, t in enumerate(ref) if i >= 9 and t not in ref[:i])
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    tokens, final, _ = _replayed(engine, "stop", GenerationRequest(prompts[2], params), Replay(ref))
    assert tokens == ref[: ref.index(stop)]  # the stop token is counted, not emitted
    assert final.finish_reason is FinishReason.STOP and final.num_output_tokens == ref.index(stop) + 1


def test_disable_mtp_never_reaches_a_proposer(engine, prompts):
    engine.add_request("off", GenerationRequest(prompts[0], GREEDY, disable_mtp=True))
    assert engine.scheduler.requests["off"].spec is None
    before = engine.spec_stats()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.spec_stats() == before


def test_a_grammar_sees_only_valid_drafts_and_only_verified_tokens(engine, prompts):
    """Drafts replay plain decoding with EOS as their second token, which the schema
    refuses until the document is whole: the grammar cuts each draft to its first token
    before the verify step, and the rejected EOS never advances it."""
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
              "required": ["fruits"]}  # fmt: skip
    request = GenerationRequest(prompts[0], dataclasses.replace(GREEDY, max_tokens=60),
                                grammar_kind="json_schema", grammar_spec=json.dumps(schema))  # fmt: skip
    want, _ = run_to_completion(engine, {"plain": _plain(request)})
    eos = engine.eos_token_ids[0]

    class EosSecond(Replay):
        def draft(self, tokens, num_prompt_tokens, k, state):
            drafts = super().draft(tokens, num_prompt_tokens, k, state)
            return drafts[:1] + [eos] + drafts[2:] if len(drafts) > 1 else drafts

    with _watched(engine) as verified:
        tokens, _, _ = _replayed(engine, "grammar", request, EosSecond(want["plain"]))
    assert tokens == want["plain"]
    json.loads(engine.tokenizer.decode(tokens))
    assert len(verified) > 5 and all(drafted == accepted == 1 for drafted, accepted in verified[:-1])


def test_preemption_under_speculation_keeps_the_tokens(model_path, prompts, reference):
    tight = _engine(model_path, speculative="ngram", num_blocks=14, max_num_batched_tokens=256)
    requests = {f"p{i}": GenerationRequest(p, GREEDY) for i, p in enumerate(prompts)}
    tokens, _ = run_to_completion(tight, requests)
    assert tight.num_preemptions > 0
    assert [tokens[f"p{i}"] for i in range(len(prompts))] == reference


def test_guards_end_runs_the_way_plain_decoding_does(thinking_model_path):
    """The thinking budget's forced marker and the loop detector cut an accepted run."""
    thinker = _engine(thinking_model_path, speculative="ngram")
    prompt = thinker.tokenizer.apply_chat_template([{"role": "user", "content": "Count."}], add_generation_prompt=True,
                                                   return_dict=False)  # fmt: skip
    looping = thinker.tokenizer.encode(" la", add_special_tokens=False)[0]
    loops = SamplingParams(temperature=0.0, max_tokens=60, logit_bias_ids=(looping,), logit_bias_values=(30.0,))
    requests = {
        "budget": GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=30),
                                    GuardParams(thinking_budget=7, loop_min_count=0)),
        "loops": GenerationRequest(prompt, loops, GuardParams(loop_min_pattern_size=1, loop_max_pattern_size=4,
                                                              loop_min_count=5)),
    }  # fmt: skip
    want, want_finals = run_to_completion(thinker, {k: _plain(r) for k, r in requests.items()})
    got, finals, drafted, accepted = _runs(thinker, requests)
    assert got == want and accepted > 0
    for name in requests:
        a, b = finals[name], want_finals[name]
        assert (a.finish_guard, a.thinking_guard, a.num_reasoning_tokens) == (b.finish_guard, b.thinking_guard,
                                                                             b.num_reasoning_tokens)  # fmt: skip
