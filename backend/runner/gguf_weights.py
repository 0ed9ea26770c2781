"""A GGUF file's tensors for our own forward (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE,
Phi-3, Gemma 2 / 3 files): the decoder's
linears and the lm_head as the file stores them, each in its own block format
(quant/gguf_formats.py; the parts of a fused q|k|v or gate|up in their common format), and the
rest (norms, biases, the embedding table) as float32 under Hugging Face's names.

llama.cpp's converter permutes the q and k rows of Llama-family files (its RoPE pairs
neighbours; ours, as Hugging Face's, halves): `_unpermute` restores the order, as
transformers' GGUF loader does. Qwen files are not permuted. Phi-3 files store q|k|v and
gate|up fused (attn_qkv, a 2 x wide ffn_up), as our parameters are; a partial rotary's heads
take our order (backend/runner/models/rope.py) here for the blocks, in load_weights for floats.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from backend.runner.gguf_experts import expert_blocks, expert_floats, expert_linear_names, is_expert_tensor
from backend.runner.models.rope import qkv_order
from backend.runner.quant.formats import QuantizedWeight, concat_rows, dequantize, select_rows
from backend.runner.quant.gguf_blocks import GgufTensor
from backend.runner.quant.gguf_formats import common_format
from backend.types.model_config import ModelConfig

PERMUTED_MODEL_TYPES = ("llama", "mistral", "mixtral")  # files whose q / k rows llama.cpp permuted
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}  # fmt: skip
_LAYER = {  # after blk.N. -> after model.layers.N.
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a routed layer's router (its experts: gguf_experts.py)
}
_FUSED_LAYER = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
# Gemma's sandwich norms (its ffn_norm is the MLP's input norm); llama.cpp stores every Gemma
# norm as 1 + w, transformers' checkpoints (and so our load) w
_GEMMA_LAYER = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}  # fmt: skip
_GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# RoPE's factors (llama3's, Phi-3's longrope): our RoPE takes them from config.json
_IGNORED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# our fused linears: their parts, in row order
LINEAR_PARTS = {"qkv_t": ("attn_q", "attn_k", "attn_v"), "o_proj_t": ("attn_output",),
                "gate_up_t": ("ffn_gate", "ffn_up"), "down_t": ("ffn_down",)}  # fmt: skip
FUSED_PARTS = {**LINEAR_PARTS, "qkv_t": ("attn_qkv",), "gate_up_t": ("ffn_up",)}  # Phi-3's
_FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)


def _fused(cfg: ModelConfig) -> bool:
    return cfg.architecture in _FUSED_ARCHITECTURES


def hf_name(name: str, cfg: ModelConfig) -> str:
    """A GGUF tensor's Hugging Face name; ValueError for one our forward has no place for."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    layer = {**_LAYER, **(_FUSED_LAYER if _fused(cfg) else {}),
             **(_GEMMA_LAYER if cfg.architecture in _GEMMA_ARCHITECTURES else {})}  # fmt: skip
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}"
    raise ValueError(f"GGUF tensor {name} has no place in our forward")


def block_linears(tensors: dict[str, GgufTensor], cfg: ModelConfig, permuted: bool) -> dict[str, QuantizedWeight]:
    """Our parameter name ("layers.3.qkv_t", "lm_head_t") -> its weights as the file's blocks;
    a linear with a float part (F16 ...) is left out (the caller quantizes it from floats)."""
    taken: dict[str, QuantizedWeight] = {}
    rotary = qkv_order(cfg)
    routed = cfg.moe.layers if cfg.moe is not None else ()
    for layer in range(cfg.num_layers):
        for ours, names in (FUSED_PARTS if _fused(cfg) else LINEAR_PARTS).items():
            if layer in routed and ours in ("gate_up_t", "down_t"):
                continue  # experts instead: expert_blocks
            parts = [_oriented(tensors[f"blk.{layer}.{n}.weight"], cfg, permuted) for n in names]
            common = common_format(parts)
            if common is not None:
                weight = _concat(common)
                taken[f"layers.{layer}.{ours}"] = (
                    weight if ours != "qkv_t" or rotary is None else select_rows(weight, rotary)
                )
    if routed:
        taken.update(expert_blocks(tensors, cfg))
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    weight = head.weight()
    if isinstance(weight, QuantizedWeight):
        taken["lm_head_t"] = weight
    return taken


def float_weights(
    tensors: dict[str, GgufTensor], cfg: ModelConfig, permuted: bool, skip: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) of every tensor but the `skip`ped HF names: the
    quantized ones dequantized (what QUANT=none serves, or a linear left out of the blocks)."""
    for tensor in tensors.values():
        if tensor.name in _IGNORED:
            continue
        if is_expert_tensor(tensor.name):
            weight = tensor.weight()
            floats = dequantize(weight) if isinstance(weight, QuantizedWeight) else weight
            yield from ((name, w) for name, w in expert_floats(tensor, floats, cfg) if name not in skip)
            continue
        name = hf_name(tensor.name, cfg)
        if name in skip:
            continue
        weight = _oriented(tensor, cfg, permuted)
        if isinstance(weight, QuantizedWeight):
            weight = dequantize(weight)
        if cfg.architecture in _GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            weight = weight - 1  # exact: the file's 1 + w lies in [0.5, 2] for any w in [-0.5, 1]
        yield name, weight.reshape(tensor.shape)


def linear_names(cfg: ModelConfig, taken: dict[str, QuantizedWeight]) -> set[str]:
    """The Hugging Face names of the tensors `block_linears` took."""
    hf = {"qkv_t": ("q", "k", "v"), "o_proj_t": ("o",), "gate_up_t": ("gate", "up"), "down_t": ("down",)}
    if _fused(cfg):
        hf.update(qkv_t=("qkv",), gate_up_t=("gate_up",))
    names = set()
    for key in taken:
        if key == "lm_head_t":
            names.add("lm_head.weight" if not cfg.tie_word_embeddings else "")
            continue
        if ".moe.experts." in key:
            names.update(expert_linear_names(key, cfg))
            continue
        _, layer, ours = key.split(".")
        section = "self_attn" if ours in ("qkv_t", "o_proj_t") else "mlp"
        names.update(f"model.layers.{layer}.{section}.{p}_proj.weight" for p in hf[ours])
    return names - {""}


def _oriented(tensor: GgufTensor, cfg: ModelConfig, permuted: bool) -> QuantizedWeight | torch.Tensor:
    """The tensor's weights with q / k rows in Hugging Face's order."""
    weight = tensor.weight()
    part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(part)
    if not permuted or heads is None:
        return weight
    if len(tensor.shape) == 1:  # a bias: its entries are the rows
        return weight.reshape(-1)[permuted_row_order(tensor.cols, heads)]
    order = permuted_row_order(tensor.rows, heads)
    if isinstance(weight, torch.Tensor):
        return weight[order]
    return select_rows(weight, order)


def permuted_row_order(rows: int, heads: int) -> torch.Tensor:
    """GGUF row (h, i, half) is Hugging Face row (h, half, i): the rows to take, in HF order."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    return concat_rows(parts)
