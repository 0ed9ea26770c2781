"""Gemma 2 / 3 GGUF files on our own forward: llama.cpp's tensor names (sandwich norms, its
ffn_norm the MLP's input norm), its norms stored as 1 + w, and the settings transformers'
reader leaves out (backend/runner/gguf_gaps.py: the attention scale as llama.cpp takes it,
the soft-caps, Gemma 3's local RoPE base and its global layers' linear scaling). The
reference: transformers on the model the file was written from, holding the file's Q8_0
numbers; the exact mode (float32 activations) gives its greedy tokens and logprobs."""

from __future__ import annotations

import random

import pytest
import torch
from gguf import RopeScalingType
from transformers import AutoConfig, AutoModelForCausalLM

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner import gguf_model
from backend.runner.quant.formats import QuantizedWeight
from backend.settings.engine import EngineConfig
from tests.helpers.gguf_files import VOCAB, file_numbers, write_from_hf

NEW = 10
PROMPT = [random.Random(5).randrange(3, 2000) for _ in range(40)]
DIMS = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, query_pre_attn_scalar=32, sliding_window=8, max_position_embeddings=1024, pad_token_id=2,
            bos_token_id=1, eos_token_id=2)  # fmt: skip
GLOBAL_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
CASES = {
    # every second layer global (llama.cpp's Gemma 2 pattern, transformers' default)
    "gemma2": (dict(num_hidden_layers=2, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
               dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_freq_base=10000.0)),
    # every sixth layer global, its RoPE scaled linearly (Gemma 3 4B and up)
    "gemma3": (dict(num_hidden_layers=6, rope_parameters={"full_attention": GLOBAL_ROPE, "sliding_attention": {
                    "rope_type": "default", "rope_theta": 10000.0}}),
               dict(rope_freq_base=1e6, rope_freq_base_swa=10000.0, rope_scaling_type=RopeScalingType.LINEAR,
                    rope_scaling_factor=4.0)),
}  # fmt: skip


def reference_and_file(tmp_path, arch: str, **extra):
    overrides, metadata = CASES[arch]
    metadata = {**metadata, **extra}
    config = AutoConfig.for_model("gemma3_text" if arch == "gemma3" else arch, **{**DIMS, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms away from (1 + 0), sharp enough to bend the soft-caps
        for name, param in model.named_parameters():
            param.copy_(0.1 * torch.randn_like(param) if "norm" in name else 0.08 * torch.randn_like(param))
    settings = {"block_count": config.num_hidden_layers, "context_length": 1024, "embedding_length": 128,
                "feed_forward_length": 256, "head_count": 4, "head_count_kv": 2, "key_length": 32,
                "value_length": 32, "layer_norm_rms_eps": config.rms_norm_eps, "sliding_window": 8,
                **metadata}  # fmt: skip
    source = write_from_hf(tmp_path / f"{arch}.Q8_0.gguf", model, arch, "Q8_0", settings, norm_shift=1.0)
    file_numbers(model)  # the reference holds the numbers the file does
    with torch.no_grad():
        model.generation_config.eos_token_id = None
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return source, out.sequences[0, len(PROMPT) :].tolist(), logprobs


@pytest.mark.parametrize("arch", list(CASES))
def test_a_gemma_file_on_our_own_forward_gives_transformers_tokens(tmp_path, monkeypatch, arch):
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    source, ref, expected = reference_and_file(tmp_path, arch)
    served_as_transformers(source, ref, expected)


def test_a_file_whose_converter_cut_the_padding_rows_serves_the_rows_it_has(tmp_path, monkeypatch):
    """llama.cpp's Gemma converter cuts the embedding's rows past the tokenizer's (Gemma 3 4B
    and up: 262208 in the checkpoint, 262144 in the file) but writes the checkpoint's
    vocabulary: the file's rows are what is served (a vocabulary larger than the embedding was
    refused), the same tokens as transformers on the cut checkpoint."""
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    source, ref, expected = reference_and_file(tmp_path, "gemma3", vocab_size=VOCAB + 64)
    eng = served_as_transformers(source, ref, expected)
    assert eng.runner.model.config.vocab_size == VOCAB


def served_as_transformers(source, ref: list[int], expected: torch.Tensor) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model_path=str(source), max_loras=0, speculative="off", quant="auto",
                                 quant_activations="float32", kv_cache_dtype="float32"))  # fmt: skip
    assert eng.runner.native
    assert isinstance(eng.runner.model.layers[0].qkv_t, QuantizedWeight)  # the file's blocks
    eng.add_request("r", GenerationRequest(prompt_tokens=list(PROMPT), sampling=SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=True, top_logprobs=1)), None)  # fmt: skip
    tokens, logprobs = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += out.token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
    assert tokens == ref
    for i, token in enumerate(ref):
        assert abs(logprobs[i] - float(expected[i, token])) < 1e-3, i
    return eng
