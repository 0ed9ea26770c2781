"""Qwen3-MoE and Mixtral GGUF files on our own forward (backend/runner/gguf_experts.py):
llama.cpp's 3-D expert tensors served per expert from the file's own blocks (QUANT=auto,
float32 activations: the exact mode) and dequantized (QUANT=none), each giving the greedy
tokens transformers gives: on the model it loads from the same file (Qwen3-MoE), or, as it
loads no Mixtral file, on the model the file was written from, holding the file's weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner import gguf_model
from backend.runner.models.moe import MoeDecoderLayer
from backend.runner.quant.formats import QuantizedWeight
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.gguf_files import VOCAB, blocks, tokenizer_fields

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, EXPERT_FFN = 256, 4, 2, 64, 4, 2, 256
# each layer's experts: (gate and up, down) block types
LAYERS = [("Q8_0", "Q8_0"), ("Q4_K", "Q6_K")]
PROMPT = [504, 3458, 282, 260, 1345, 7055, 30, 378, 314, 1564, 1148, 47, 216, 1085, 5345, 28]
NEW_TOKENS = 12


def write_qwen3_moe(path, seed: int = 0):
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "qwen3moe")
    for add, value in ((writer.add_block_count, len(LAYERS)), (writer.add_context_length, 2048),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, 512),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_key_length, HEAD_DIM), (writer.add_value_length, HEAD_DIM),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_expert_count, EXPERTS), (writer.add_expert_used_count, TOP_K),
                       (writer.add_expert_feed_forward_length, EXPERT_FFN)):  # fmt: skip
        add(value)
    for key, value, kind, item in tokenizer_fields():
        writer.add_key_value(key, value, kind, sub_type=item)

    def tensor(name: str, type_name: str, *shape: int) -> None:
        if type_name == "norm":
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32))
            return
        rows = int(np.prod(shape[:-1]))
        data = blocks(type_name, rows, shape[-1], rng).reshape(*shape[:-1], -1)
        raw = None if type_name == "F32" else GGMLQuantizationType[type_name]
        writer.add_tensor(name, data, raw_dtype=raw)

    tensor("token_embd.weight", "Q8_0", VOCAB, HIDDEN)
    tensor("output_norm.weight", "norm", HIDDEN)
    tensor("output.weight", "Q8_0", VOCAB, HIDDEN)
    for i, (gate_up, down) in enumerate(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            tensor(f"blk.{i}.{norm}.weight", "norm", HIDDEN)
        for norm in ("attn_q_norm", "attn_k_norm"):
            tensor(f"blk.{i}.{norm}.weight", "norm", HEAD_DIM)
        for name, rows in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
            tensor(f"blk.{i}.{name}.weight", "Q8_0", rows * HEAD_DIM, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", "Q8_0", HIDDEN, HEADS * HEAD_DIM)
        tensor(f"blk.{i}.ffn_gate_inp.weight", "F32", EXPERTS, HIDDEN)
        tensor(f"blk.{i}.ffn_gate_exps.weight", gate_up, EXPERTS, EXPERT_FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up_exps.weight", gate_up, EXPERTS, EXPERT_FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down_exps.weight", down, EXPERTS, HIDDEN, EXPERT_FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_model, "cache_dir", lambda: cache)
        path = write_qwen3_moe(tmp_path_factory.mktemp("qwen3moe") / "tiny-qwen3moe.gguf")
        # transformers' GGUF reader misses the experts' width: the prepared folder's config has it
        config = AutoConfig.from_pretrained(gguf_model.model_folder(path))
        reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                         dtype=torch.float32)  # fmt: skip
        with torch.no_grad():
            out = reference.eval().generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                            min_new_tokens=NEW_TOKENS, output_logits=True,
                                            return_dict_in_generate=True)  # fmt: skip
        yield path, out.sequences[0, len(PROMPT) :].tolist(), torch.cat(out.logits).float()


def served_greedy(path, quant: str, ref: list[int], logits: torch.Tensor) -> LLMEngine:
    """The file on our own forward (`quant`, the exact mode): its greedy tokens are `ref`, up to
    a near-tie of the reference's top two logits. The engine, for a look at its layers."""
    eng = LLMEngine(EngineConfig(model_path=str(path), quant=quant, quant_activations="float32", max_loras=0,
                                 speculative="off"))  # fmt: skip
    assert eng.runner.native
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens, _ = run_to_completion(eng, {"r": GenerationRequest(prompt_tokens=PROMPT, sampling=sampling)})
    for i, (a, b) in enumerate(zip(tokens["r"], ref, strict=True)):
        if a != b:  # only where the reference's top two logits nearly tie
            top = logits[i].topk(2).values
            assert float(top[0] - top[1]) < 1e-3 * max(1.0, float(top[0].abs())), (quant, i, tokens, ref)
            break
    return eng


@pytest.mark.parametrize("quant", ["auto", "none"])
def test_a_qwen3_moe_file_gives_transformers_greedy_tokens(gguf, quant):
    path, ref, logits = gguf
    eng = served_greedy(path, quant, ref, logits)
    layer = eng.runner.model.layers[1]
    assert isinstance(layer, MoeDecoderLayer)
    expert = layer.moe.experts[3]
    assert isinstance(expert.gate_up_t, QuantizedWeight) == (quant == "auto")
    if quant == "auto":  # Q4_K gate | up as int4, Q6_K down as int8 groups of 16: the file's blocks
        assert (expert.gate_up_t.kind, expert.down_t.kind, expert.down_t.group) == ("int4", "int8", 16)


# -- Mixtral: llama.cpp writes it as a "llama" file with an expert count ---------------------

MIXTRAL_EXPERTS = [("Q4_0", "Q8_0"), ("Q8_0", "Q5_0")]  # each layer's (gate and up, down) blocks


def write_mixtral(path, model) -> None:
    """`model` (a transformers Mixtral) as llama.cpp's converter writes it: the attention in
    Q8_0 (q / k rows permuted), each layer's experts stacked [E, out, in] in MIXTRAL_EXPERTS's
    blocks. `model` takes the weights the file holds (each dequantized), as the reference."""
    from gguf.quants import dequantize, quantize

    cfg = model.config
    writer = GGUFWriter(path, "llama")
    for add, value in ((writer.add_block_count, cfg.num_hidden_layers), (writer.add_context_length, 2048),
                       (writer.add_embedding_length, cfg.hidden_size),
                       (writer.add_feed_forward_length, cfg.intermediate_size),
                       (writer.add_head_count, cfg.num_attention_heads),
                       (writer.add_head_count_kv, cfg.num_key_value_heads),
                       (writer.add_rope_freq_base, 1e6), (writer.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (writer.add_expert_count, cfg.num_local_experts),
                       (writer.add_expert_used_count, cfg.num_experts_per_tok)):  # fmt: skip
        add(value)
    for key, value, kind, item in tokenizer_fields():
        writer.add_key_value(key, value, kind, sub_type=item)

    def add(name: str, param: torch.Tensor, type_name: str = "F32", heads: int = 0) -> None:
        data = param.detach().float().numpy()
        if type_name != "F32":
            kind = GGMLQuantizationType[type_name]
            param.data.copy_(torch.from_numpy(dequantize(quantize(data, kind), kind)).reshape(param.shape))
        if heads:  # llama.cpp's order: each head's rows (half, i) as (i, half)
            data = data.reshape(heads, 2, -1, data.shape[-1]).swapaxes(1, 2).reshape(data.shape)
        writer.add_tensor(
            name, data if type_name == "F32" else quantize(data, kind), raw_dtype=None if type_name == "F32" else kind
        )

    inter, layers = cfg.intermediate_size, model.model.layers
    add("token_embd.weight", model.model.embed_tokens.weight, "Q8_0")
    add("output_norm.weight", model.model.norm.weight)
    add("output.weight", model.lm_head.weight, "Q8_0")
    for i, ((gate_up, down), layer) in enumerate(zip(MIXTRAL_EXPERTS, layers, strict=True)):
        attn, moe = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        add(f"blk.{i}.attn_q.weight", attn.q_proj.weight, "Q8_0", cfg.num_attention_heads)
        add(f"blk.{i}.attn_k.weight", attn.k_proj.weight, "Q8_0", cfg.num_key_value_heads)
        add(f"blk.{i}.attn_v.weight", attn.v_proj.weight, "Q8_0")
        add(f"blk.{i}.attn_output.weight", attn.o_proj.weight, "Q8_0")
        add(f"blk.{i}.ffn_gate_inp.weight", moe.gate.weight)
        add(f"blk.{i}.ffn_gate_exps.weight", moe.experts.gate_up_proj.data[:, :inter], gate_up)
        add(f"blk.{i}.ffn_up_exps.weight", moe.experts.gate_up_proj.data[:, inter:], gate_up)
        add(f"blk.{i}.ffn_down_exps.weight", moe.experts.down_proj, down)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from transformers import MixtralConfig

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, rope_theta=1e6, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for layer in reference.model.layers:  # sharper attention than the init's, fewer near-ties
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(6)
        path = tmp_path_factory.mktemp("mixtral") / "tiny-mixtral.gguf"
        write_mixtral(path, reference)
        out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 min_new_tokens=NEW_TOKENS, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_model, "cache_dir", lambda: cache)
        yield path, out.sequences[0, len(PROMPT) :].tolist(), torch.cat(out.logits).float()


@pytest.mark.parametrize("quant", ["auto", "none"])
def test_a_mixtral_file_gives_transformers_greedy_tokens(mixtral, quant):
    path, ref, logits = mixtral
    eng = served_greedy(path, quant, ref, logits)
    assert eng.runner.model.config.architecture == "MixtralForCausalLM"
    expert = eng.runner.model.layers[0].moe.experts[2]
    assert isinstance(expert.gate_up_t, QuantizedWeight) == (quant == "auto")
    if quant == "auto":  # the file's blocks: Q4_0 gate | up as int4, Q8_0 down as int8
        assert (expert.gate_up_t.kind, expert.down_t.kind) == ("int4", "int8")
