"""Beam search in the engine (paged KV, forked rows, whole-group scheduling) against
transformers' `generate` on the same weights: sequences and scores.

A tiny random Llama whose EOS row is scaled up, so that beams end at different steps
(every early-stopping rule matters), with a small block size so that forks copy partial
blocks; then mixed batches, preemption, chunked prefill, logprobs, processors, abort.
SmolLM2's own beams are in test_beam_smollm2.py.
"""

from __future__ import annotations

import pytest
import torch

from backend.contract import EARLY_STOPPING, FinishReason, GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from tests.helpers.beams import beam_request, generate_beams, run_outputs

EOS = 2
RULES = {"true": True, "false": False, "never": "never"}  # the contract's -> transformers'
PROMPTS = [[1, 5, 9, 13], [1, 40, 41, 42, 7, 7, 30, 31, 32, 33, 34], [1, 17]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS, bos_token_id=1,
                         pad_token_id=0, tie_word_embeddings=False, max_position_embeddings=128)  # fmt: skip
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
        hf.lm_head.weight[EOS] *= 2.5
    dest = tmp_path_factory.mktemp("beam-llama")
    hf.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _engine(folder, **overrides) -> LLMEngine:
    config = dict(model_path=str(folder), block_size=4, num_blocks=256, speculative="off")
    return LLMEngine(EngineConfig(**{**config, **overrides}))


@pytest.fixture(scope="module")
def engine(folder):
    return _engine(folder)


def _assert_same(ours, theirs, prompt):
    assert len(ours) == len(theirs)
    for hyp, (tokens, score) in zip(ours, theirs, strict=True):
        generated = hyp.token_ids + ([EOS] if hyp.finish_reason is FinishReason.STOP else [])
        assert generated == tokens, (prompt, generated, tokens)
        assert abs(hyp.score - score) < 1e-4


@pytest.mark.parametrize("num_beams", [2, 4, 5])
@pytest.mark.parametrize("length_penalty", [0.6, 1.0, 2.0])
@pytest.mark.parametrize("early_stopping", EARLY_STOPPING)
def test_engine_beams_equal_transformers(engine, hf, num_beams, length_penalty, early_stopping):
    """Every prompt of the grid in one batch; n = num_beams (all hypotheses compared)."""
    max_new = {0: 12, 1: 7, 2: 16}
    requests = {
        f"p{i}": beam_request(p, num_beams, num_beams, max_new[i], length_penalty, early_stopping)
        for i, p in enumerate(PROMPTS)
    }
    outputs = run_outputs(engine, requests)
    for i, prompt in enumerate(PROMPTS):
        theirs = generate_beams(hf, prompt, num_beams, num_beams, max_new[i], length_penalty,
                                RULES[early_stopping], EOS)  # fmt: skip
        _assert_same(outputs[f"p{i}"].hypotheses, theirs, prompt)
    assert engine.num_free_blocks() == engine.num_total_blocks()  # forks and copies all given back


def test_n_below_num_beams_is_the_best_n(engine, hf):
    outputs = run_outputs(engine, {"a": beam_request(PROMPTS[0], 4, 2, 12, 1.0, "false")})
    _assert_same(outputs["a"].hypotheses, generate_beams(hf, PROMPTS[0], 4, 2, 12, 1.0, False, EOS), PROMPTS[0])
    final = outputs["a"].final
    assert final.num_output_tokens == sum(len(h.token_ids) + (h.finish_reason is FinishReason.STOP)
                                          for h in outputs["a"].hypotheses)  # fmt: skip


def _mixed_requests() -> dict[str, GenerationRequest]:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    return {
        "beam4": beam_request(PROMPTS[1], 4, 3, 9, 1.0, "false"),
        "greedy": GenerationRequest([1, 3, 5, 7, 9, 11], greedy),
        "beam2": beam_request(PROMPTS[0], 2, 2, 12, 0.6, "never"),
        "sampled": GenerationRequest([1, 8, 8, 8], sampled),
        "beam5": beam_request(PROMPTS[2], 5, 5, 16, 2.0, "true"),
    }


def _result(out):
    """What must not change with the batch: tokens and how each hypothesis ended (scores:
    within 1e-4, `_same_scores`; the batch may change their last bits)."""
    if out.hypotheses is not None:
        return [(h.token_ids, h.finish_reason) for h in out.hypotheses]
    return out.token_ids


def _same_scores(a: dict, b: dict) -> bool:
    return all(
        abs(x.score - y.score) < 1e-4
        for rid in a
        if a[rid].hypotheses is not None
        for x, y in zip(a[rid].hypotheses, b[rid].hypotheses, strict=True)
    )


def test_mixed_batch_gives_each_request_its_solo_result(folder):
    engine = _engine(folder)
    requests = _mixed_requests()
    solo = {rid: run_outputs(engine, {rid: r})[rid] for rid, r in requests.items()}
    together = run_outputs(engine, requests)
    assert {rid: _result(out) for rid, out in together.items()} == {rid: _result(out) for rid, out in solo.items()}
    assert _same_scores(together, solo)
    assert engine.num_free_blocks() == engine.num_total_blocks()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_blocks=14),  # beams and the others preempt each other, groups whole
        dict(max_num_batched_tokens=6),  # prompts in chunks; a group's rows complete together
        dict(max_num_seqs=6),  # a 5-beam group waits for room for all its rows
        dict(enable_prefix_caching=False),
    ],
)
def test_squeezed_engines_give_the_same_results(folder, overrides):
    requests = _mixed_requests()
    expected = run_outputs(_engine(folder), requests)
    engine = _engine(folder, **overrides)
    got = run_outputs(engine, requests)
    assert {rid: _result(out) for rid, out in got.items()} == {rid: _result(out) for rid, out in expected.items()}
    assert _same_scores(got, expected)
    assert engine.num_free_blocks() == engine.num_total_blocks()
    if "num_blocks" in overrides:
        assert engine.num_preemptions > 0


def test_logprobs_are_the_raw_distribution_and_add_up_to_the_score(engine):
    request = beam_request(PROMPTS[0], 3, 3, 12, 1.0, "false")
    request.sampling.logprobs, request.sampling.top_logprobs = True, 3
    hyps = run_outputs(engine, {"a": request})["a"].hypotheses
    for hyp in hyps:
        assert len(hyp.logprobs) == len(hyp.token_ids)
        assert [e.token_id for e in hyp.logprobs] == hyp.token_ids
        assert all(len(e.top) == 3 and e.top[0][1] >= e.logprob - 1e-6 for e in hyp.logprobs)
        if hyp.finish_reason is FinishReason.LENGTH:  # no stopping token left out of the sum
            assert abs(sum(e.logprob for e in hyp.logprobs) / len(hyp.token_ids) - hyp.score) < 1e-4


def test_min_tokens_and_logit_bias_are_transformers_processors(engine, hf):
    request = beam_request(PROMPTS[0], 3, 3, 12, 1.0, "false")
    request.sampling.min_tokens = 6
    request.sampling.logit_bias_ids, request.sampling.logit_bias_values = (20, 21), (3.0, -100.0)
    hyps = run_outputs(engine, {"a": request})["a"].hypotheses
    theirs = generate_beams(hf, PROMPTS[0], 3, 3, 12, 1.0, False, EOS, min_new_tokens=6,
                            sequence_bias={(20,): 3.0, (21,): -100.0})  # fmt: skip
    _assert_same(hyps, theirs, PROMPTS[0])
    assert all(len(h.token_ids) >= 6 for h in hyps)


def test_num_beams_1_is_greedy_search(engine, hf):
    request = GenerationRequest(list(PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=9))
    tokens = run_outputs(engine, {"a": request})["a"].token_ids
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPTS[1]]), num_beams=1, do_sample=False, max_new_tokens=9, eos_token_id=EOS)
    theirs = out[0, len(PROMPTS[1]) :].tolist()
    assert tokens == [t for t in theirs if t != EOS][: len(tokens)]


def test_abort_mid_search_gives_blocks_back(folder):
    engine = _engine(folder)
    engine.add_request("a", beam_request(PROMPTS[1], 4, 2, 40, 1.0, "never"))
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].final.finish_reason is FinishReason.ABORT
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_num_beams_above_max_beams_is_refused(folder):
    from backend.contract import ContractError

    engine = _engine(folder, max_beams=4)
    with pytest.raises(ContractError) as err:
        engine.add_request("a", beam_request(PROMPTS[0], 5, 1, 8, 1.0, "false"))
    assert err.value.field == "num_beams"
    assert engine.model_info().max_beams == 4


def test_a_group_the_pool_cannot_hold_ends_with_its_beams_so_far(folder):
    """8 blocks of 4 tokens cannot hold 5 beams of 18 tokens: the search is cut, as the
    context length cuts it, and answers with its best beams."""
    engine = _engine(folder, num_blocks=8)
    out = run_outputs(engine, {"a": beam_request(PROMPTS[2], 5, 3, 16, 1.0, "never", ignore_eos=True)})["a"]
    assert out.final.finish_reason is FinishReason.LENGTH and out.final.finish_guard.value == "context_length"
    assert len(out.hypotheses) == 3 and all(h.token_ids for h in out.hypotheses)
    assert out.hypotheses[0].score >= out.hypotheses[1].score >= out.hypotheses[2].score
    assert engine.num_free_blocks() == engine.num_total_blocks()
