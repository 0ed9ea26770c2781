"""Gemma 2 / 3 on our own forward (backend/runner/models/gemma.py), beyond the parity with
transformers in test_architectures.py: the configs released checkpoints ship (older keys,
transformers' defaults), LoRA adapters against PEFT, and QUANT=int8."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend import kernels
from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner.drafters import allocate_kv
from backend.runner.forward_batch import Span, build_forward_batch
from backend.runner.hf_config import load_model_config
from backend.runner.quant.formats import QuantizedWeight
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.lora_models import engine_logits_with_adapter, peft_model, write_adapter

DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24)  # fmt: skip
PROMPT = [random.Random(3).randrange(3, 256) for _ in range(30)]


def _write(folder, model_type: str, gain: float = 0.1, **overrides):
    """A tiny random checkpoint: norms away from (1 + 0), weights of std `gain` (0.1: large
    enough to bend the soft-caps)."""
    config = AutoConfig.for_model(model_type, **{**DIMS, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.2 * torch.randn_like(param) if "norm" in name else gain * torch.randn_like(param))
    model.save_pretrained(folder)
    return model


def _config_json(folder, config: dict):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return load_model_config(folder)


def test_older_gemma_2_config_keys_and_transformers_defaults(tmp_path):
    """google/gemma-2-2b's keys: hidden_act beside hidden_activation, no layer_types (every
    second layer global, the first sliding), no tie_word_embeddings (tied), soft-caps given."""
    cfg = _config_json(tmp_path, {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "rope_theta": 10000.0})  # fmt: skip
    assert cfg.sliding_windows == (4096, None, 4096, None)
    assert cfg.tie_word_embeddings and not cfg.qk_norm
    assert (cfg.attention_scale, cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1 / 16, 50.0, 30.0)
    assert cfg.local_rope is None


def test_older_gemma_3_config_keys_two_ropes(tmp_path):
    """google/gemma-3-4b's text keys: rope_scaling (linear, 8) for the global layers, the sliding
    layers' rope_local_base_freq, sliding_window_pattern 6; no soft-capping by default."""
    cfg = _config_json(tmp_path, {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}})  # fmt: skip
    assert cfg.sliding_windows == (1024,) * 5 + (None, 1024)
    assert cfg.qk_norm and cfg.attn_logit_softcapping == 0.0 and cfg.final_logit_softcapping == 0.0
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (1e6, "linear", 8.0)
    assert (cfg.local_rope.theta, cfg.local_rope.rope_type) == (10000.0, "default")


def test_an_embedding_gemma_is_refused(tmp_path):
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        _config_json(tmp_path, {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                                "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
                                "num_hidden_layers": 2, "num_attention_heads": 4,
                                "use_bidirectional_attention": True})  # fmt: skip


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_lora_logits_equal_peft_within_1e_4(tmp_path, model_type):
    """An adapter on every projection: the LoRA deltas land before Gemma's GeGLU and sandwich norms."""
    base = tmp_path / "base"
    _write(base, model_type, attn_logit_softcapping=1.0, final_logit_softcapping=5.0)
    adapter = write_adapter(base, tmp_path / "a", r=4, alpha=8)
    reference = peft_model(base, {"a": adapter})
    engine = LLMEngine(EngineConfig(model_path=str(base), device="cpu", dtype="float32", num_blocks=32,
                                    max_loras=2, speculative="off", quant="none"))  # fmt: skip
    ours = engine_logits_with_adapter(engine, "a", adapter, PROMPT)
    with torch.inference_mode():
        theirs = reference(torch.tensor([PROMPT]), adapter_names=["a"]).logits[0]
        base_logits = reference(torch.tensor([PROMPT]), adapter_names=["__base__"]).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert (theirs - base_logits).abs().max().item() > 0.1


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_head_dim_256_logits_equal_transformers_within_1e_4(tmp_path, model_type):
    """Released Gemma 2 / 3 checkpoints have 256-wide heads: our paged kernel takes them (every
    prompt row through paged_attention_rows, soft-capped for Gemma 2)."""
    model = _write(tmp_path, model_type, head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                   attn_logit_softcapping=1.0, final_logit_softcapping=5.0)  # fmt: skip
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), num_blocks=32, max_loras=0, speculative="off",
                                    quant="none"))  # fmt: skip
    runner = engine.runner
    kv = allocate_kv(runner.model_config, runner.model_config.num_layers, 8, 16, torch.float32, runner.device)
    batch = build_forward_batch([Span(PROMPT, 0, [0, 1], len(PROMPT))], 16, runner.device)
    assert kernels.native() is None or kernels.paged_attention_rows(
        torch.zeros(1, 2, 256), (kv[0][0].view(-1, 1, 256), kv[0][1].view(-1, 1, 256)), batch.block_tables.long(),
        torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 16, 1.0, None) is not None  # fmt: skip
    ours = runner.model.compute_logits(runner.model(batch, kv))
    with torch.inference_mode():
        theirs = model(torch.tensor([PROMPT])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


def _greedy(prompt: list[int], max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(list(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def test_quant_int8_serves_gemma_batch_invariant_and_close_to_float(tmp_path):
    """QUANT=int8 quantizes Gemma's linears like Llama's; a row's tokens are the same alone and
    in a busy batch with chunked prefill, and its first tokens are float32's."""
    _write(tmp_path, "gemma2", gain=0.02, attn_logit_softcapping=1.0, final_logit_softcapping=5.0)

    def engine(quant: str, budget: int = 512) -> LLMEngine:
        return LLMEngine(EngineConfig(model_path=str(tmp_path), max_loras=0, speculative="off", quant=quant,
                                      max_num_batched_tokens=budget))  # fmt: skip

    quantized = engine("int8")
    assert all(isinstance(layer.qkv_t, QuantizedWeight) for layer in quantized.runner.model.layers)
    alone = run_to_completion(quantized, {"t": _greedy(PROMPT)})[0]["t"]
    rng = random.Random(5)
    others = {f"o{i}": _greedy([rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))], rng.randrange(2, 16))
              for i in range(5)}  # fmt: skip
    busy = run_to_completion(engine("int8", budget=16), {**others, "t": _greedy(PROMPT)})[0]["t"]
    assert busy == alone
    float32 = run_to_completion(engine("none"), {"t": _greedy(PROMPT)})[0]["t"]
    assert alone[:6] == float32[:6], (alone, float32)  # measured: all 12 agree
