"""Phi-3 / Phi-4 on our own forward against transformers (issue "Any model a user brings"):
fused q|k|v and gate|up checkpoints, partial rotary (Phi-4-mini turns 3/4 of each head),
longrope with its short and long factors (picked once by the served context) and the
attention factor it scales cos / sin by, a sliding window on every layer; the fused decode
kernel gives the layer-by-layer path's numbers on the reordered heads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner.gguf_model import model_folder
from backend.runner.models.llama import LlamaForCausalLM
from backend.settings.engine import EngineConfig
from tests.helpers.gguf_files import write_phi3

VOCAB, NEW = 512, 16
HEAD, ROTARY = 32, 24  # partial_rotary_factor 0.75: 12 frequency pairs turn
DIMS = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, partial_rotary_factor=ROTARY / HEAD)  # fmt: skip
PROMPT = [random.Random(3).randrange(3, VOCAB) for _ in range(40)]


def longrope(original: int) -> dict:
    rng = random.Random(original)
    return dict(
        original_max_position_embeddings=original,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1 + rng.random() for _ in range(ROTARY // 2)],
                      "long_factor": [2 + 8 * rng.random() for _ in range(ROTARY // 2)]},
    )  # fmt: skip


def build(folder: Path, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("phi3", **{**DIMS, **overrides}))
    with torch.no_grad():  # sharp attention: scores that RoPE's every frequency moves (0.02-std weights barely attend)
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight[: (4 + 2) * HEAD] *= 8
    model.save_pretrained(folder)
    return model.eval()


def reference(model: torch.nn.Module) -> tuple[list[int], torch.Tensor]:
    model.generation_config.eos_token_id = None  # EOS allowed, as ignore_eos allows it
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, len(PROMPT) :].tolist(), torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def run(folder: Path, **config) -> tuple[list[int], list[float]]:
    return _greedy(LLMEngine(EngineConfig(model_path=str(folder), max_loras=0, speculative="off", **config)))


def _greedy(eng: LLMEngine) -> tuple[list[int], list[float]]:
    assert eng.runner.native
    request = GenerationRequest(prompt_tokens=list(PROMPT), sampling=SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=True, top_logprobs=1))  # fmt: skip
    eng.add_request("r", request, None)
    tokens, logprobs = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += out.token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
    return tokens, logprobs


def assert_like_transformers(folder: Path, model: torch.nn.Module, **config) -> None:
    ref, expected = reference(model)
    tokens, logprobs = run(folder, quant="none", **config)
    assert tokens == ref  # random weights, 16 steps: no near-tie in these seeds
    for i, token in enumerate(ref):
        assert abs(logprobs[i] - float(expected[i, token])) < 1e-3, i


@pytest.mark.parametrize(
    ("overrides", "config"),
    [
        ({}, {}),  # partial rotary, default RoPE
        (longrope(original=64), {"max_model_len": 64}),  # served context within pretraining: short factors
        (longrope(original=32), {}),  # 1024 > 32: long factors (transformers: the 40-token prompt is past 32)
        ({**longrope(original=32), "sliding_window": 8}, {}),  # a window on every layer
    ],
    ids=["partial", "longrope-short", "longrope-long", "sliding"],
)
def test_greedy_tokens_and_logprobs_match_transformers(tmp_path, overrides, config):
    assert_like_transformers(tmp_path, build(tmp_path, **overrides), **config)


def test_the_fused_decode_kernel_gives_the_layer_paths_numbers_on_reordered_heads(tmp_path, monkeypatch):
    """QUANT=int8: decode steps run as one decode_layer call a layer (its RoPE over the
    reordered heads' table); forcing the layer-by-layer path gives the same tokens and logprobs."""
    build(tmp_path, **longrope(original=32))
    calls = []
    fused_decode = LlamaForCausalLM._fused_decode
    monkeypatch.setattr(LlamaForCausalLM, "_fused_decode", lambda *a: calls.append(fused_decode(*a)) or calls[-1])
    fused = run(tmp_path, quant="int8")
    assert any(calls)
    monkeypatch.setattr(LlamaForCausalLM, "_fused_decode", lambda *a: False)
    assert run(tmp_path, quant="int8") == fused


@pytest.mark.parametrize("quant", ["auto", "none"])
def test_a_phi3_gguf_file_with_partial_rotary_and_longrope_matches_transformers(tmp_path, monkeypatch, quant):
    """llama.cpp's Phi-3 layout (fused attn_qkv / ffn_up, longrope's factor tensors, rope's
    dimension count) served from its blocks (auto, the exact mode) or dequantized (none);
    the reference is transformers' Phi-3 on transformers' dequantized weights, with the RoPE
    its GGUF reader leaves out (backend/runner/gguf_gaps.py) set as ours."""
    monkeypatch.setenv("LLM_CACHE_DIR", str(tmp_path / "cache"))  # the prepared folder
    source = write_phi3(tmp_path / "phi3.Q8_0.gguf", "Q8_0", rotary_dims=48, original_context=32)
    folder = model_folder(source)
    reader = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=source.name)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).eval()
    model.load_state_dict(reader.state_dict())
    ref, expected = reference(model)
    eng = LLMEngine(EngineConfig(model_path=str(source), max_loras=0, speculative="off", quant=quant,
                                 quant_activations="float32"))  # fmt: skip
    tokens, logprobs = _greedy(eng)
    assert tokens == ref
    for i, token in enumerate(ref):
        assert abs(logprobs[i] - float(expected[i, token])) < 1e-3, i
