"""KV_CACHE_DTYPE: the KV cache in float16 (half the bytes a decode step reads past the
weights) on the default model, served through the engine, or float32; auto picks float16
for quantized weights on the CPU and the model's dtype for float ones."""

from __future__ import annotations

import pytest
import torch

from backend.contract import SamplingParams
from backend.core.engine import LLMEngine
from backend.runner.model_runner import ModelRunner
from backend.settings.engine import EngineConfig

QUESTIONS = ["Name a bird that cannot fly.", "Why is ice slippery?", "Give me a word that rhymes with moon.",
             "What is 12 times 11?"]  # fmt: skip


def _engine(model_path, kv_cache_dtype: str, quant: str = "int4") -> LLMEngine:
    config = EngineConfig(model_path=str(model_path), kv_cache_bytes=32 << 20, quant=quant, speculative="off",
                          enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
                          quant_activations="float32")  # fmt: skip
    return LLMEngine(config)


def test_a_float16_cache_holds_twice_the_blocks_and_keeps_the_greedy_answers(model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]) for q in QUESTIONS]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    answers, blocks = {}, {}
    for name in ("float32", "float16"):
        engine = _engine(model_path, name)
        assert engine.runner.kv_caches[0].dtype == getattr(torch, name)
        blocks[name] = engine.runner.num_blocks
        answers[name] = [list(t) for t in engine.generate(prompts, params)]  # one batch: the paged kernel
        del engine
    assert blocks["float16"] // 2 == blocks["float32"]  # the same KV_CACHE_MB
    # measured: every prompt's 48 tokens the same (bench.kv_quality: 20 prompts x 64 tokens)
    assert sum(a == b for a, b in zip(answers["float32"], answers["float16"], strict=True)) >= 3


@pytest.mark.parametrize(("quant", "expected"), [("int4", torch.float16), ("none", torch.float32)])
def test_auto_keeps_quantized_weights_in_a_float16_cache_and_float_weights_in_their_own(model_path, quant, expected):
    runner = ModelRunner(EngineConfig(model_path=str(model_path), kv_cache_bytes=8 << 20, quant=quant,
                                      speculative="off"))  # fmt: skip
    assert runner.kv_dtype == expected
    assert all(cache.dtype == expected for cache in runner.kv_caches)


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_setting(model_path):
    with pytest.raises(ValueError, match="KV_CACHE_DTYPE must be one of auto, float16, float32, got 'fp8'"):
        ModelRunner(EngineConfig(model_path=str(model_path), kv_cache_dtype="fp8"))


def test_the_setting_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("KV_CACHE_DTYPE", "float16")
    assert EngineConfig.from_env("/some/model").kv_cache_dtype == "float16"
    monkeypatch.delenv("KV_CACHE_DTYPE")
    assert EngineConfig.from_env("/some/model").kv_cache_dtype == "auto"
