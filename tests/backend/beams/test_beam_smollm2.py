"""Beam search on the real default model (SmolLM2-135M-Instruct) in the engine against
transformers' `generate` on the same weights: sequences and scores, n up to num_beams,
with a chat prompt whose beams end on <|im_end|> at different steps."""

from __future__ import annotations

import pytest
import torch

from backend.contract import FinishReason
from backend.core.engine import LLMEngine
from backend.runner.convert import ensure_default_model
from backend.settings.engine import EngineConfig
from tests.helpers.beams import beam_request, generate_beams, run_outputs

CONFIGS = [(4, 4, 1.0, "false"), (2, 2, 0.6, "true"), (5, 3, 2.0, "never")]  # num_beams, n, length_penalty, rule
RULES = {"true": True, "false": False, "never": "never"}


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)),
        tokenizer.encode("The capital of France is"),
    ]
    engine = LLMEngine(EngineConfig(model_path=path, block_size=16, speculative="off"))
    return engine, hf, prompts, tuple(engine.eos_token_ids)


@pytest.mark.parametrize(("num_beams", "n", "length_penalty", "rule"), CONFIGS)
def test_smollm2_beams_equal_transformers(setup, num_beams, n, length_penalty, rule):
    engine, hf, prompts, eos = setup
    requests = {f"p{i}": beam_request(p, num_beams, n, 16, length_penalty, rule) for i, p in enumerate(prompts)}
    outputs = run_outputs(engine, requests)
    for i, prompt in enumerate(prompts):
        theirs = generate_beams(hf, prompt, num_beams, n, 16, length_penalty, RULES[rule], list(eos))
        ours = outputs[f"p{i}"].hypotheses
        assert len(ours) == len(theirs) == n
        for hyp, (tokens, score) in zip(ours, theirs, strict=True):
            stop = [tokens[-1]] if hyp.finish_reason is FinishReason.STOP else []
            assert hyp.token_ids + stop == tokens and abs(hyp.score - score) < 1e-4
    assert any(h.finish_reason is FinishReason.STOP for h in outputs["p0"].hypotheses)  # the chat one ends
    assert engine.num_free_blocks() == engine.num_total_blocks()
