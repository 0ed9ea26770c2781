"""QUANT on the transformers path (backend/runner/transformers_quant.py): QUANT=int8 / int4
quantize every linear at load but a mixture's router, and a GGUF file of an architecture
our own forward does not take serves its linears from the file's own blocks. The exact
mode (float32 activations) gives transformers' tokens on the same numbers: the quantized
weights dequantized into transformers' model, or transformers' own load of the file."""

from __future__ import annotations

import random
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner import gguf_model
from backend.runner.models.transformers_lm import RowLinear
from backend.runner.quant.formats import QuantizedWeight, dequantize, quantize
from backend.settings.engine import EngineConfig
from tests.helpers.gguf_files import VOCAB, file_numbers, write_from_hf

NEW = 12
PROMPT = [random.Random(4).randrange(3, 500) for _ in range(30)]
DIMS = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)  # fmt: skip


def build(model_type: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**DIMS, **overrides})).eval()
    with torch.no_grad():  # sharp attention (see test_architectures.sharpen)
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8)
    return model


def greedy_reference(model: torch.nn.Module) -> tuple[list[int], torch.Tensor]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, len(PROMPT) :].tolist(), torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def serve(path, **config) -> tuple[LLMEngine, list[int], list[float]]:
    eng = LLMEngine(EngineConfig(model_path=str(path), max_loras=0, speculative="off", quant_activations="float32",
                                 model_impl="transformers", **config))  # fmt: skip
    eng.add_request("r", GenerationRequest(prompt_tokens=list(PROMPT), sampling=SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=True, top_logprobs=1)), None)  # fmt: skip
    tokens, logprobs = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += out.token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
    return eng, tokens, logprobs


def linears(eng: LLMEngine) -> dict[str, RowLinear]:
    """The served model's RowLinears by transformers' names (its base model sits apart: TransformersCausalLM)."""
    model = eng.runner.model
    prefix = model.hf.base_model_prefix
    found = {f"{prefix}.{n}": m for n, m in model.base.named_modules() if isinstance(m, RowLinear)}
    return {**found, **{n: m for n, m in model.hf.named_modules() if isinstance(m, RowLinear)}}


def assert_close(tokens, logprobs, ref, expected) -> None:
    assert tokens == ref
    for i, token in enumerate(ref):
        assert abs(logprobs[i] - float(expected[i, token])) < 1e-3, i


@pytest.mark.parametrize(("model_type", "overrides"), [
    ("starcoder2", {}),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
])  # fmt: skip
def test_quant_int8_quantizes_every_linear_but_routers_and_keeps_transformers_numbers(tmp_path, model_type, overrides):
    model = build(model_type, **overrides)
    model.save_pretrained(tmp_path)
    eng, tokens, logprobs = serve(tmp_path, quant="int8")
    served = linears(eng)
    assert len(served) > 8
    routers = {n for n in served if n.endswith((".gate", ".router"))}
    assert all(isinstance(served[n].weight_t, QuantizedWeight) for n in served if n not in routers)
    assert all(not isinstance(served[n].weight_t, QuantizedWeight) for n in routers)
    with torch.no_grad():  # the reference: transformers on the weights int8 stands for
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name in served and name not in routers:
                head = name == "lm_head"  # a new tensor: a tied embedding table stays float, as ours
                module.weight = torch.nn.Parameter(dequantize(quantize(module.weight, "int8", 32, head)))
    assert_close(tokens, logprobs, *greedy_reference(model))


@pytest.mark.parametrize("linear_type", ["Q8_0", "Q4_0", "Q5_1"])
def test_a_gguf_file_on_the_transformers_path_serves_its_own_blocks(tmp_path, monkeypatch, linear_type):
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")  # the prepared folder; kernels built once
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": 2, "layer_norm_eps": 1e-5}  # fmt: skip
    source = write_from_hf(
        tmp_path / f"sc2.{linear_type}.gguf", build("starcoder2"), "starcoder2", linear_type, settings
    )
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=source.name).eval()
    eng, tokens, logprobs = serve(source, quant="auto")
    assert all(isinstance(row.weight_t, QuantizedWeight) for row in linears(eng).values())
    assert_close(tokens, logprobs, *greedy_reference(reference))


# architectures transformers' GGUF reader learns from backend/runner/gguf_archs.py: the file's
# metadata as llama.cpp's converter writes it, q / k rows permuted where it permutes them
LEARNED = [
    ("granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                 "logits_scaling": 8.0},
     {"attention_scale": 0.0078125, "embedding_scale": 12.0, "residual_scale": 0.22, "logit_scale": 8.0},
     {"permuted": True}),
    ("olmo2", {}, {}, {}),
    ("smollm3", {"tie_word_embeddings": True, "pad_token_id": 2}, {}, {"permuted": True}),
    # Gemma (1): norms stored as 1 + w, the embedding scaled by sqrt(hidden), GeGLU, head size 32
    ("gemma", {"head_dim": 32}, {"key_length": 32, "value_length": 32}, {"norm_shift": 1.0}),
    # OLMo (1): norms without weights, q / k / v clipped to +-1.5
    ("olmo", {"clip_qkv": 1.5}, {"clamp_kqv": 1.5}, {"permuted": True}),
]  # fmt: skip


@pytest.mark.parametrize(("model_type", "overrides", "metadata", "written"), LEARNED, ids=[a[0] for a in LEARNED])
def test_a_gguf_file_of_an_architecture_transformers_reader_lacks(tmp_path, monkeypatch, model_type, overrides,
                                                                   metadata, written):  # fmt: skip
    """The file's config, tokenizer and weights come out as the checkpoint's: transformers on
    the model the file was written from (holding the file's Q8_0 numbers) is the reference."""
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")  # the prepared folder; kernels built once
    model = build(model_type, **overrides)
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": 2, "layer_norm_rms_eps": getattr(model.config, "rms_norm_eps", 1e-5),
                "rope_freq_base": model.config.rope_parameters["rope_theta"], **metadata}  # fmt: skip
    source = write_from_hf(tmp_path / f"{model_type}.Q8_0.gguf", model, model_type, "Q8_0", settings, **written)
    file_numbers(model)  # the reference holds the numbers the file does
    eng, tokens, logprobs = serve(source, quant="auto")
    assert eng.runner.model.config.architecture == type(model).__name__
    assert all(isinstance(row.weight_t, QuantizedWeight) for row in linears(eng).values())  # q / k too
    assert_close(tokens, logprobs, *greedy_reference(model))


def experts_layout(name: str, data):
    """llama.cpp's converter on a mixture transformers 5 stacks: each layer's experts as
    `ffn_gate_exps` / `ffn_up_exps` [E, I, H] (the halves of gate_up_proj) and `ffn_down_exps`,
    the router as `ffn_gate_inp`."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)", name)
    if match is None:
        return None
    block, half = f"blk.{match[1]}.", data.shape[-2] // 2
    return {
        "gate.weight": [(block + "ffn_gate_inp.weight", data)],
        "experts.down_proj": [(block + "ffn_down_exps.weight", data)],
        "experts.gate_up_proj": [(block + "ffn_gate_exps.weight", data[:, :half]),
                                 (block + "ffn_up_exps.weight", data[:, half:])],
    }[match[2]]  # fmt: skip


@pytest.mark.parametrize(("model_type", "arch", "overrides"), [
    ("olmoe", "olmoe", {"num_experts": 4, "num_experts_per_tok": 2}),
    ("qwen2_moe", "qwen2moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                               "shared_expert_intermediate_size": 64}),
])  # fmt: skip
def test_a_mixtures_experts_from_a_gguf_file_stay_in_their_blocks(tmp_path, monkeypatch, model_type, arch, overrides):
    """transformers 5 holds a layer's experts in stacked float parameters; from a GGUF file they
    stay in the file's blocks, each expert multiplied by our kernels (transformers_experts.py),
    and the exact mode gives transformers' tokens on the same numbers."""
    from backend.runner.models.transformers_experts import ExpertBlocks

    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    model = build(model_type, **overrides)
    file_numbers(model, stacked=True)  # the reference holds the numbers the file does
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": 2, "layer_norm_rms_eps": model.config.rms_norm_eps,
                "rope_freq_base": model.config.rope_parameters["rope_theta"], "expert_count": 4,
                "expert_used_count": 2}  # fmt: skip
    if model_type == "qwen2_moe":
        settings |= {"expert_feed_forward_length": 64, "expert_shared_feed_forward_length": 64}
    source = write_from_hf(tmp_path / f"{model_type}.Q8_0.gguf", model, arch, "Q8_0", settings, layout=experts_layout,
                           stacked=True)  # fmt: skip
    eng, tokens, logprobs = serve(source, quant="auto")
    modules = [m for m in eng.runner.model.base.modules() if hasattr(m, "expert_blocks")]  # the base model's
    assert len(modules) == 2 and all(isinstance(m.expert_blocks, ExpertBlocks) for m in modules)
    assert all(w.tiles is not None for m in modules for w in m.expert_blocks.weights())
    assert all(m.gate_up_proj.stride() == (0, 0, 0) for m in modules)  # no float copy kept
    assert_close(tokens, logprobs, *greedy_reference(model))
