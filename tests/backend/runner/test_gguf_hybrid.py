"""A GGUF file of a hybrid (layers keeping state besides attention's KV) read by transformers'
newer GGUF reader (transformers.integrations.gguf: Qwen3.5, LFM2), which lacks some of the block
formats llama.cpp's files mix in: an LFM2 file, written as llama.cpp's converter writes it
(its per-layer KV head counts, the convolution's kernel squeezed to 2-D), its linears in Q5_0
(a Q4_K_M file's format for rows K-quants do not divide), served on the transformers path with
each sequence's convolution state kept, its tokens and logprobs transformers' on the same numbers;
and a Granite 4.0-H file (`granitehybrid`, Mamba 2 layers), which transformers' older reader does
not map, read by ours (gguf_gaps, gguf_processors); a Falcon-H1 file (attention and a Mamba 2
mixer side by side in every layer), its multipliers folded into the weights as llama.cpp's converter
does; Mamba and Falcon-Mamba files (`mamba`), whose prompts the engine computes whole."""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from backend.runner import gguf_model
from backend.runner.quant.formats import QuantizedWeight
from tests.backend.runner.test_gguf_generic import granite_moe_layout
from tests.backend.runner.test_transformers_quant import assert_close, build, greedy_reference, linears, serve
from tests.helpers.gguf_files import file_numbers, write_from_hf
from tests.helpers.tiny_checkpoints import sharpen


def _lfm2_layout(name: str, data):
    if name.endswith("conv.conv.weight"):  # [channels, 1, kernel] -> [channels, kernel]
        layer = name.split(".")[2]
        return [(f"blk.{layer}.shortconv.conv.weight", data[:, 0, :])]
    return None


def test_an_lfm2_file_in_q5_0_gives_its_checkpoints_tokens_with_its_convolution_state(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    model = build("lfm2", layer_types=["conv", "full_attention"], num_key_value_heads=2, block_auto_adjust_ff_dim=False)
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": [0, 2], "layer_norm_rms_eps": model.config.norm_eps,
                "rope_freq_base": model.config.rope_parameters["rope_theta"]}  # fmt: skip
    extra = [("lfm2.shortconv.l_cache", model.config.conv_L_cache, GGUFValueType.UINT32)]
    file_numbers(model, "Q5_0")
    source = write_from_hf(tmp_path / "lfm2.Q5_0.gguf", model, "lfm2", "Q5_0", settings, extra=extra,
                           layout=_lfm2_layout)  # fmt: skip
    eng, tokens, logprobs = serve(source, quant="auto")
    assert eng.runner.model.config.architecture == "Lfm2ForCausalLM" and eng.runner.keeps_state
    assert all(isinstance(row.weight_t, QuantizedWeight) for row in linears(eng).values())  # the file's blocks
    assert_close(tokens, logprobs, *greedy_reference(model))


def _granite_hybrid_layout(groups: int):
    """llama.cpp's converter on Granite 4.0-H: the Mamba 2 layers' small tensors reshaped (A as
    -exp(A_log), A and D as columns, the kernel squeezed, the gated norm by group), the experts
    and shared MLP split as GraniteMoE's."""

    def layout(name: str, data):
        match = re.fullmatch(r"model\.layers\.(\d+)\.mamba\.(A_log|D|conv1d\.weight|conv1d\.bias|dt_bias|norm\.weight)",
                             name)  # fmt: skip
        if match is None:
            return granite_moe_layout(name, data)
        block, part = f"blk.{match[1]}.", match[2]
        written = {
            "A_log": lambda: -np.exp(data)[:, None],
            "D": lambda: data[:, None],
            "conv1d.weight": lambda: data[:, 0, :],
            "norm.weight": lambda: data.reshape(groups, -1),
        }.get(part, lambda: data)()
        suffix = {"A_log": "ssm_a", "D": "ssm_d", "dt_bias": "ssm_dt.bias"}.get(part, "ssm_" + part)
        return [(block + suffix, written)]

    return layout


def test_a_granite_4_h_file_gives_its_checkpoints_tokens_with_its_mamba_state(tmp_path, monkeypatch):
    """A `granitehybrid` file as llama.cpp writes it (Mamba 2 layers between attention layers
    with RoPE, q / k rows permuted, routed experts beside a shared MLP, the KV head count an
    array): read into GraniteMoeHybrid (gguf_gaps, gguf_processors), served with each
    sequence's Mamba state kept, transformers' tokens and logprobs."""
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    mamba = {"mamba_n_heads": 8, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2}
    model = build("granitemoehybrid", layer_types=["mamba", "attention"], num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, shared_intermediate_size=64, position_embedding_type="rope",
                  **mamba)  # fmt: skip
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": [0, 2], "layer_norm_rms_eps": 1e-6, "expert_count": 4,
                "expert_used_count": 2, "expert_shared_feed_forward_length": 64, "embedding_scale": 1.0,
                "attention_scale": model.config.attention_multiplier, "residual_scale": 1.0, "logit_scale": 1.0,
                "rope_freq_base": model.config.rope_parameters["rope_theta"], "ssm_conv_kernel": 4,
                "ssm_inner_size": 256, "ssm_state_size": 16, "ssm_time_step_rank": 8, "ssm_group_count": 1,
                "rope_scaling_finetuned": True}  # fmt: skip
    with torch.no_grad():  # a long memory (A near 0, small steps) and no skip (D): the state moves the logits
        mixer = model.model.layers[0].mamba
        mixer.A_log.copy_(torch.linspace(0.01, 0.1, 8).log())
        mixer.dt_bias.fill_(-2.0)
        mixer.D.zero_()
        mixer.in_proj.weight.mul_(5)
        mixer.out_proj.weight.mul_(30)
    file_numbers(model)
    with torch.no_grad():  # A as the file holds it, -exp(A_log), read back as log(-A)
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.from_numpy(np.log(np.exp(param.numpy()))))
    source = write_from_hf(tmp_path / "granite-h.Q8_0.gguf", model, "granitehybrid", "Q8_0", settings, permuted=True,
                           layout=_granite_hybrid_layout(1))  # fmt: skip
    eng, tokens, logprobs = serve(source, quant="auto")
    assert eng.runner.model.config.architecture == "GraniteMoeHybridForCausalLM" and eng.runner.keeps_state
    assert eng.runner.model.state_layers == [0]
    assert_close(tokens, logprobs, *greedy_reference(model))


# Falcon-H1's multipliers (powers of two: folded into Q8_0 numbers they give Q8_0 numbers)
FALCON_H1_SCALES = {"key_multiplier": 0.5, "attention_in_multiplier": 2.0, "attention_out_multiplier": 0.5,
                    "ssm_in_multiplier": 2.0, "ssm_out_multiplier": 0.5, "lm_head_multiplier": 0.5,
                    "embedding_multiplier": 2.0, "mlp_multipliers": [2.0, 0.5],
                    "ssm_multipliers": [0.5, 2.0, 1.0, 0.25, 2.0]}  # fmt: skip


def _folded_falcon_h1(model):
    """The weights llama.cpp's converter writes for a Falcon-H1: each multiplier folded into the
    projection it scales (in_proj's rows by the mixer's five parts)."""
    c = model.config
    folded = copy.deepcopy(model)
    scales = {"self_attn.q_proj": c.attention_in_multiplier, "self_attn.v_proj": c.attention_in_multiplier,
              "self_attn.k_proj": c.attention_in_multiplier * c.key_multiplier,
              "self_attn.o_proj": c.attention_out_multiplier, "mamba.out_proj": c.ssm_out_multiplier,
              "feed_forward.gate_proj": c.mlp_multipliers[0], "feed_forward.down_proj": c.mlp_multipliers[1],
              "lm_head": c.lm_head_multiplier, "embed_tokens": c.embedding_multiplier}  # fmt: skip
    with torch.no_grad():
        for name, param in folded.named_parameters():
            part = next((p for p in scales if f"{p}.weight" in name), None)
            if part is not None:
                param.mul_(scales[part])
            elif name.endswith("mamba.in_proj.weight"):
                param.mul_(c.ssm_in_multiplier * model.model.layers[0].mamba.mup_vector.reshape(-1, 1))
    return folded


def _falcon_h1_layout(name: str, data):
    if name.endswith("pre_ff_layernorm.weight"):  # the converter's name has no ".weight"
        return [(f"blk.{name.split('.')[2]}.ffn_norm", data)]
    return _granite_hybrid_layout(1)(name, data)


def test_a_falcon_h1_file_gives_its_checkpoints_tokens_its_multipliers_folded_into_the_weights(tmp_path, monkeypatch):
    """A `falcon-h1` file as llama.cpp writes it: every multiplier folded into the weights (the
    file has no key for them), the Mamba 2 tensors reshaped, q / k rows as transformers has them:
    read into FalconH1 with every multiplier 1 (gguf_gaps), its tokens and logprobs those of the
    checkpoint with its multipliers."""
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    mamba = {"mamba_d_ssm": 256, "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1,
             "mamba_d_conv": 4}  # fmt: skip
    model = build("falcon_h1", num_key_value_heads=2, head_dim=32, **mamba, **FALCON_H1_SCALES)
    sharpen(model, "falcon_h1")  # a long memory: the state moves the logits
    file_numbers(model)
    with torch.no_grad():  # A as the file holds it, -exp(A_log), read back as log(-A)
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.from_numpy(np.log(np.exp(param.numpy()))))
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": 2, "key_length": 32, "value_length": 32,
                "layer_norm_rms_eps": model.config.rms_norm_eps, "ssm_conv_kernel": 4, "ssm_inner_size": 256,
                "ssm_state_size": 16, "ssm_time_step_rank": 8, "ssm_group_count": 1,
                "rope_freq_base": model.config.rope_parameters["rope_theta"]}  # fmt: skip
    source = write_from_hf(tmp_path / "falcon-h1.Q8_0.gguf", _folded_falcon_h1(model), "falcon-h1", "Q8_0", settings,
                           layout=_falcon_h1_layout)  # fmt: skip
    eng, tokens, logprobs = serve(source, quant="auto")
    assert eng.runner.model.config.architecture == "FalconH1ForCausalLM" and eng.runner.keeps_state
    assert eng.runner.model.hf.config.key_multiplier == 1.0 and eng.runner.model.hf.config.ssm_multipliers == [1.0] * 5
    assert_close(tokens, logprobs, *greedy_reference(model))


def _mamba_layout(name: str, data):
    """What llama.cpp's converter writes for a Mamba mixer's A (-exp(A_log)) and kernel (2-D)."""
    match = re.fullmatch(r"backbone\.layers\.(\d+)\.mixer\.(A_log|conv1d\.weight)", name)
    if match is None:
        return None
    layer, part = match.groups()
    return [(f"blk.{layer}.ssm_a", -np.exp(data))] if part == "A_log" else [(f"blk.{layer}.ssm_conv1d.weight",
                                                                             data[:, 0, :])]  # fmt: skip


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_a_mamba_file_gives_its_checkpoints_tokens_each_prompt_computed_whole(tmp_path, monkeypatch, model_type):
    """llama.cpp writes Mamba and Falcon-Mamba as one architecture, "mamba", Falcon's with its
    dt / B / C norms flagged (`ssm.dt_b_c_rms`): the flag makes the file a Falcon-Mamba (gguf_gaps);
    transformers continues their state over one new token, not several: each prompt in one step."""
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    model = build(model_type, intermediate_size=256, state_size=16, time_step_rank=8, conv_kernel=4)
    sharpen(model, model_type)  # a long memory: the state moves the logits
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 0,
                "head_count": 0, "ssm_conv_kernel": 4, "ssm_inner_size": 256, "ssm_state_size": 16,
                "ssm_time_step_rank": 8, "layer_norm_rms_eps": model.config.layer_norm_epsilon,
                "ssm_dt_b_c_rms": model_type == "falcon_mamba"}  # fmt: skip
    file_numbers(model)
    with torch.no_grad():  # A as the file holds it, -exp(A_log), read back as log(-A)
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.from_numpy(np.log(np.exp(param.numpy()))))
    source = write_from_hf(tmp_path / f"{model_type}.Q8_0.gguf", model, "mamba", "Q8_0", settings,
                           layout=_mamba_layout)  # fmt: skip
    eng, tokens, logprobs = serve(source, quant="auto")
    assert eng.runner.model.config.architecture == type(model).__name__ and eng.scheduler.whole_prompts
    blocks = {name.split(".")[-1] for name, row in linears(eng).items() if isinstance(row.weight_t, QuantizedWeight)}
    assert blocks == {"in_proj", "x_proj", "out_proj", "lm_head"}  # the file's blocks (dt_proj's rows of 8: F32)
    assert_close(tokens, logprobs, *greedy_reference(model))
