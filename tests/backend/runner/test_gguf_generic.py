"""GGUF files of architectures neither transformers' reader nor our table knows, read
generically (backend/runner/gguf_generic.py): the file's architecture names the model type
(through an alias where llama.cpp's name differs), each key goes to the config field that holds
it, a key no field takes is refused in one line. Written here as llama.cpp's converter writes
them (names, keys, permuted q / k rows); `python -m bench.architectures --gguf` runs the
converter itself on every type it takes."""

from __future__ import annotations

import re

import pytest
import torch
from gguf import GGUFValueType, RopeScalingType

from backend.runner import gguf_model
from backend.runner.quant.formats import QuantizedWeight
from tests.backend.runner.test_transformers_quant import assert_close, build, greedy_reference, linears, serve
from tests.helpers.gguf_files import file_numbers, write_from_hf

# (model type, the file's architecture, the checkpoint's non-default settings, the file's keys
# for them, what the converter did to the tensors)
GENERIC = [
    # Command-R: llama.cpp's name differs; tied embeddings, a logit scale, LayerNorm
    ("cohere", "command-r", {"logit_scale": 0.25}, {"logit_scale": 0.25, "layer_norm_eps": 1e-5}, {}),
    # Phi-2: a quarter of each head turned (the config's default is half)
    ("phi", "phi2", {"partial_rotary_factor": 0.25}, {"rope_dimension_count": 8, "layer_norm_eps": 1e-5}, {}),
    # Arcee: its converter derives from Llama's, q / k rows permuted
    ("arcee", "arcee", {}, {"layer_norm_rms_eps": 1e-5}, {"permuted": True}),
    # EXAONE 4: which layers slide, a bool a layer (not the config's default pattern)
    ("exaone4", "exaone4", {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
     {"layer_norm_rms_eps": 1e-5, "sliding_window": 8, "sliding_window_pattern": [True, False]}, {}),
    # OLMo 3, which llama.cpp writes as "olmo2" with sliding windows; YaRN on its global layers
    ("olmo3", "olmo2", {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"], "rope_theta": 5e5,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
     {"layer_norm_rms_eps": 1e-5, "sliding_window": 8, "sliding_window_pattern": [False, True], "rope_freq_base": 5e5,
      "rope_scaling_type": RopeScalingType.YARN, "rope_scaling_factor": 4.0, "rope_scaling_orig_ctx_len": 16}, {}),
    # Ministral 3: YaRN with its own magnitude (mscale_all_dim, llama.cpp's log multiplier) and
    # Llama 4's attention temperature, which turns on at the original context's multiples: 4 here
    ("ministral3", "mistral3", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5, "llama_4_scaling_beta": 0.3}},
     {"layer_norm_rms_eps": 1e-5, "rope_freq_base": 1e6, "rope_scaling_type": RopeScalingType.YARN,
      "rope_scaling_factor": 4.0, "rope_scaling_orig_ctx_len": 4, "rope_scaling_yarn_beta_fast": 32.0,
      "rope_scaling_yarn_beta_slow": 1.0, "rope_scaling_yarn_log_mul": 0.5, "attn_temperature_scale": 0.3},
     {"permuted": True}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "arch", "overrides", "metadata", "written"), GENERIC, ids=[g[0] for g in GENERIC]
)
def test_a_gguf_file_of_an_architecture_read_generically_gives_its_checkpoints_tokens(
    tmp_path, monkeypatch, model_type, arch, overrides, metadata, written
):
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")  # the prepared folder; kernels built once
    model = build(model_type, **overrides)
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": 2, **metadata}  # fmt: skip
    source = write_from_hf(tmp_path / f"{model_type}.Q8_0.gguf", model, arch, "Q8_0", settings, **written)
    file_numbers(model)
    eng, tokens, logprobs = serve(source, quant="auto")
    assert eng.runner.model.config.architecture == type(model).__name__
    assert all(isinstance(row.weight_t, QuantizedWeight) for row in linears(eng).values())
    assert_close(tokens, logprobs, *greedy_reference(model))


def test_a_key_no_config_field_takes_is_refused_in_one_line_naming_it(tmp_path, monkeypatch):
    """A setting the generic reading would drop (the model would compute other numbers than the
    file's) stops the load, naming the key."""
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": 2, "layer_norm_eps": 1e-5}  # fmt: skip
    source = tmp_path / "cohere.Q8_0.gguf"
    write_from_hf(source, build("cohere"), "command-r", "Q8_0", settings,
                  extra=[("command-r.expert_count", 8, GGUFValueType.UINT32)])  # fmt: skip
    with pytest.raises(
        ValueError, match=r"cohere\.Q8_0\.gguf: .*cohere config has no field for command-r\.expert_count"
    ) as e:
        gguf_model.model_folder(source)
    assert "\n" not in str(e.value)


def test_a_checkpoint_missing_weights_is_refused_not_served_with_random_ones(tmp_path):
    """transformers starts the weights a checkpoint lacks at random (a warning); the engine
    refuses the model, naming them (a file whose experts transformers' reader cannot place)."""
    from safetensors.torch import load_file, save_file

    from tests.helpers.tiny_checkpoints import engine

    build("cohere").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"CohereForCausalLM: 1 weights are not in the checkpoint "
                                         r"\(model\.layers\.1\.mlp\.up_proj\.weight\)"):  # fmt: skip
        engine(tmp_path)


def test_a_split_file_on_the_transformers_path_is_served_from_all_its_parts(tmp_path, monkeypatch):
    """llama.cpp's gguf-split spreads the tensors over several files; the transformers path
    reads every part's (transformers' own reader reads one file: backend/runner/transformers_gguf.py
    reads them instead), its linears in their blocks, and gives the tokens of the file whole."""
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": 2, "layer_norm_eps": 1e-5, "logit_scale": 0.25}  # fmt: skip
    model = build("cohere", logit_scale=0.25)
    (tmp_path / "whole").mkdir(), (tmp_path / "split").mkdir()
    whole = write_from_hf(tmp_path / "whole" / "cohere.Q8_0.gguf", model, "command-r", "Q8_0", settings)
    first = write_from_hf(tmp_path / "split" / "cohere.Q8_0.gguf", model, "command-r", "Q8_0", settings,
                          split_tensors=12)  # fmt: skip
    assert first.name == "cohere.Q8_0-00001-of-00002.gguf"
    file_numbers(model)  # the reference holds the numbers the file does
    eng, tokens, logprobs = serve(first, quant="auto")
    assert all(isinstance(row.weight_t, QuantizedWeight) for row in linears(eng).values())
    assert_close(tokens, logprobs, *greedy_reference(model))
    assert serve(whole, quant="auto")[1] == tokens


def gpt_oss_layout(name: str, data):
    """llama.cpp's converter on gpt-oss: each expert's gate and up projections split out of the
    interleaved gate_up_proj, transposed to rows, down_proj transposed, the sinks named."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp\.experts\.(\w+)|self_attn\.sinks)", name)
    if match is None:
        return None
    block, part = f"blk.{match[1]}.", match[2]
    if part is None:
        return [(block + "attn_sinks.weight", data)]
    if part == "gate_up_proj":
        rows = data.transpose(0, 2, 1)
        return [(block + "ffn_gate_exps.weight", rows[:, ::2]), (block + "ffn_up_exps.weight", rows[:, 1::2])]
    if part == "gate_up_proj_bias":
        return [(block + "ffn_gate_exps.bias", data[:, ::2]), (block + "ffn_up_exps.bias", data[:, 1::2])]
    return [(block + "ffn_down_exps." + ("weight" if part == "down_proj" else "bias"),
             data.transpose(0, 2, 1) if part == "down_proj" else data)]  # fmt: skip


def test_a_gpt_oss_file_as_llama_cpp_writes_it_gives_its_checkpoints_tokens(tmp_path, monkeypatch):
    """transformers' reader (5.24) expects other names and layout for gpt-oss' experts and drops
    its sinks and its YaRN (backend/runner/gguf_gpt_oss.py, gguf_gaps.py)."""
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    model = build("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=32, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    with torch.no_grad():  # sinks and biases away from 0
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "_bias")):
                param.copy_(torch.randn_like(param))
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "expert_feed_forward_length": 256, "head_count": 4, "head_count_kv": 2, "key_length": 32,
                "value_length": 32, "layer_norm_rms_eps": 1e-5, "expert_count": 4, "expert_used_count": 2,
                "sliding_window": 8, "rope_freq_base": model.config.rope_parameters["rope_theta"],
                "rope_scaling_type": RopeScalingType.YARN, "rope_scaling_factor": 32.0,
                "rope_scaling_orig_ctx_len": 4096, "rope_scaling_yarn_beta_fast": 32.0,
                "rope_scaling_yarn_beta_slow": 1.0}  # fmt: skip
    file_numbers(model)  # first: the 2-D biases the layout writes as floats hold the reference's numbers too
    source = write_from_hf(tmp_path / "gpt-oss.Q8_0.gguf", model, "gpt-oss", "Q8_0", settings, layout=gpt_oss_layout)
    eng, tokens, logprobs = serve(source, quant="auto")
    assert eng.runner.model.config.architecture == "GptOssForCausalLM"
    assert_close(tokens, logprobs, *greedy_reference(model))


def granite_moe_layout(name: str, data):
    """llama.cpp's converter on GraniteMoE(-Shared): the fused expert and shared-MLP matrices
    split into their gate and up halves, the router as `ffn_gate_inp`."""
    moe = r"block_sparse_moe\.(?:experts\.\w+|router\.weight)"
    match = re.fullmatch(rf"model\.layers\.(\d+)\.({moe}|shared_mlp\.\w+\.weight)", name)
    if match is None:
        return None
    block, part = f"blk.{match[1]}.", match[2].rsplit(".", 2)[-2] if match[2].endswith("weight") else match[2]
    half = data.shape[-2] // 2
    return {
        "router": [(block + "ffn_gate_inp.weight", data)],
        "block_sparse_moe.experts.down_proj": [(block + "ffn_down_exps.weight", data)],
        "block_sparse_moe.experts.gate_up_proj": [(block + "ffn_gate_exps.weight", data[:, :half]),
                                                  (block + "ffn_up_exps.weight", data[:, half:])],
        "input_linear": [(block + "ffn_gate_shexp.weight", data[:half]), (block + "ffn_up_shexp.weight", data[half:])],
        "output_linear": [(block + "ffn_down_shexp.weight", data)],
    }[part]  # fmt: skip


def test_a_granite_moe_shared_file_as_llama_cpp_writes_it_gives_its_checkpoints_tokens(tmp_path, monkeypatch):
    """A `granitemoe` file with a shared expert is GraniteMoeShared: its experts, router and
    shared MLP put back under transformers 5's names, its q / k rows un-permuted, Granite's four
    multipliers read (gguf_processors.py, gguf_generic.KEYED_VARIANTS)."""
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    multipliers = {"embedding_multiplier": 2.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5,
                   "logits_scaling": 4.0}  # fmt: skip
    model = build("granitemoeshared", num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                  **multipliers)  # fmt: skip
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": 2, "layer_norm_rms_eps": 1e-6, "expert_count": 4,
                "expert_used_count": 2, "expert_shared_feed_forward_length": 64, "embedding_scale": 2.0,
                "attention_scale": 0.1, "residual_scale": 0.5, "logit_scale": 4.0,
                "rope_freq_base": model.config.rope_parameters["rope_theta"]}  # fmt: skip
    file_numbers(model, stacked=True)  # first: the 2-D parts the layout writes as floats hold them too
    source = write_from_hf(tmp_path / "granite-moe.Q8_0.gguf", model, "granitemoe", "Q8_0", settings, permuted=True,
                           layout=granite_moe_layout, stacked=True)  # fmt: skip
    eng, tokens, logprobs = serve(source, quant="auto")
    assert eng.runner.model.config.architecture == "GraniteMoeSharedForCausalLM"
    assert sum(hasattr(m, "expert_blocks") for m in eng.runner.model.base.modules()) == 2  # experts in Q8_0 blocks
    assert_close(tokens, logprobs, *greedy_reference(model))
