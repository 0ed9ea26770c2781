"""The reasoning variant of the default model (tests/helpers/thinking_model.py): its markers are
single tokens the frontend's decode keeps, its template honours enable_thinking, and on
prompts without markers it is the default model, in transformers and in our engine."""

from __future__ import annotations

import pytest
import torch

from backend.contract import GenerationRequest, SamplingParams
from backend.runner.convert import COMPLETE_MARKER, default_model_path
from backend.settings.engine import EngineConfig
from backend.settings.model_settings import ModelSettings, ReasoningSettings
from openai_frontend.generation.detokenizer import make_decode
from tests.helpers.thinking_model import BUILD_VERSION, build_thinking_model

pytestmark = pytest.mark.skipif(
    not (default_model_path() / COMPLETE_MARKER).exists(), reason="the default model is not converted"
)

THINK_START_ID, THINK_END_ID = 49152, 49153
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
CHATML_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SMALL_KV = 64 << 20  # two engines on the CPU: a small KV pool each


@pytest.fixture(scope="module")
def source():
    return default_model_path()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_thinking_model(tmp_path_factory.mktemp("models") / "SmolLM2-thinking")


@pytest.fixture(scope="module")
def tokenizers(source, folder):
    """(the default model's tokenizer, the thinking model's)"""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source)), AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def plain_prompt(tokenizers):
    """A chat prompt without markers, through the default model's template."""
    ids = tokenizers[0].apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_build_is_idempotent(folder):
    weights = folder / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_thinking_model(folder) == folder
    assert weights.stat().st_mtime_ns == before
    assert (folder / ".thinking-complete").read_text().strip() == BUILD_VERSION


def test_markers_are_single_tokens_that_decode_keeps(tokenizers):
    tokenizer = tokenizers[1]
    assert tokenizer.encode("<think>", add_special_tokens=False) == [THINK_START_ID]
    assert tokenizer.encode("</think>", add_special_tokens=False) == [THINK_END_ID]
    text = "<think>\nplan</think>\n\nanswer"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == THINK_START_ID and THINK_END_ID in ids
    # the frontend's decode skips special tokens: the markers are not special, so they stay
    for decode in (make_decode(tokenizer), lambda i: tokenizer.decode(i, skip_special_tokens=True)):
        assert decode(ids) == text
        assert decode([THINK_START_ID]) == "<think>"
        assert decode([THINK_END_ID]) == "</think>"
        assert decode(tokenizer.encode("<|im_end|>", add_special_tokens=False)) == ""  # still skipped


@pytest.mark.parametrize(
    "kwargs, ending",
    [
        ({}, "<|im_start|>assistant\n<think>\n"),
        ({"enable_thinking": True}, "<|im_start|>assistant\n<think>\n"),
        ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ],
)
def test_template_honours_enable_thinking(tokenizers, kwargs, ending):
    original, thinking = tokenizers
    text = thinking.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs)
    assert text.startswith(CHATML_SYSTEM)
    assert text.endswith(ending)
    # the rest is the original ChatML
    assert text[: -len(ending)] + "<|im_start|>assistant\n" == original.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )


def test_template_without_generation_prompt_is_the_original(tokenizers):
    original, thinking = tokenizers
    chat = [{"role": "system", "content": "Be brief."}, *MESSAGES, {"role": "assistant", "content": "4"}]
    assert thinking.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)


def test_weights_are_the_source_plus_two_rows(source, folder):
    from safetensors import safe_open

    with safe_open(source / "model.safetensors", "pt") as old, safe_open(folder / "model.safetensors", "pt") as new:
        assert sorted(new.keys()) == sorted(old.keys())
        old_embedding, new_embedding = (
            old.get_tensor("model.embed_tokens.weight"),
            new.get_tensor("model.embed_tokens.weight"),
        )
    assert new_embedding.shape == (THINK_END_ID + 1, old_embedding.shape[1])
    assert torch.equal(new_embedding[:THINK_START_ID], old_embedding)


def test_transformers_logits_equal_the_default_models(source, folder, plain_prompt):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([plain_prompt])
    logits = []
    for path in (source, folder):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits[0])  # [num_tokens, vocab]
    original, thinking = logits
    assert thinking.shape[-1] == THINK_END_ID + 1
    torch.testing.assert_close(thinking[:, :THINK_START_ID], original, rtol=0, atol=1e-5)


def test_engine_generates_as_the_default_model(source, folder, tokenizers, plain_prompt):
    from backend.core.engine import LLMEngine

    original = LLMEngine(EngineConfig(model_path=str(source), kv_cache_bytes=SMALL_KV))
    expected = original.generate([plain_prompt], GREEDY)
    del original
    engine = LLMEngine(EngineConfig(model_path=str(folder), kv_cache_bytes=SMALL_KV))
    assert engine.vocab_size == THINK_END_ID + 1
    assert engine.generate([plain_prompt], GREEDY) == expected
    # inside a thinking block: it runs (what it writes is not the point)
    thinking_prompt = tokenizers[1].apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    thinking_prompt = list(thinking_prompt["input_ids"] if hasattr(thinking_prompt, "keys") else thinking_prompt)
    assert thinking_prompt[-2:] == tokenizers[1].encode("<think>\n", add_special_tokens=False)
    [tokens] = engine.generate([thinking_prompt], SamplingParams(temperature=0.0, max_tokens=4))
    assert 0 < len(tokens) <= 4
    # the prompt opened the block (the template does): the first output says so, read
    # from the prompt (it was `starts_in_thinking = true` in MODEL.toml before)
    assert _first_output(engine, thinking_prompt).starts_in_thinking is True
    assert _first_output(engine, plain_prompt).starts_in_thinking is False


def _first_output(engine, prompt):
    request_id = f"first-{len(prompt)}-{prompt[-1]}"
    engine.add_request(request_id, GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=2)))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs[0]


def test_model_settings(source, folder):
    settings = ModelSettings.load(folder)
    assert settings.source == folder / "MODEL.toml"
    assert settings.reasoning == ReasoningSettings(think_start="<think>", think_end="</think>")
    assert settings.sampling == ModelSettings.load(source).sampling == {"temperature": 0.2, "top_p": 0.9}
    assert settings.tools.parser == "hermes"
    assert settings.guards.loop_min_count == 0  # detectors off: a test sees every token
