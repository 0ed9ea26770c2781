"""Checkpoint tensors into our Llama-family parameters: which tensor fills which fused
parameter, and where in it (`layer_targets`), and the copy that checks every target is filled
(`copy_weights`, also the NLLB decoder's and the MTP head's)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from backend.types.model_config import ModelConfig


def copy_weights(
    module: torch.nn.Module,
    targets: dict[str, tuple[str, slice]],
    weights: Iterable[tuple[str, torch.Tensor]],
    what: str,
) -> None:
    """Copy checkpoint tensors into `module`'s parameters by `targets` (checkpoint name ->
    (parameter, the checkpoint rows' place in it)); every target must be filled."""
    loaded: set[tuple[str, int | None]] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in targets:
            raise ValueError(f"unexpected weight {name!r} in a {what} checkpoint")
        param_name, rows = targets[name]
        param = module.get_parameter(param_name)
        # A checkpoint's [out, in] rows are the columns of our [in, out] _t weights.
        dst, src = (param[:, rows], tensor.t()) if param_name.endswith("_t") else (param[rows], tensor)
        # Qwen3's q_norm/k_norm [D] are broadcast over their head rows; every other
        # tensor must have exactly its target's shape.
        if src.shape != dst.shape and not param_name.endswith("qk_norm"):
            raise ValueError(f"weight {name!r} of shape {tuple(tensor.shape)} does not fit {param_name}")
        with torch.no_grad():
            dst.copy_(src)
        loaded.add((param_name, rows.start))
    missing = [name for name, (param, rows) in targets.items() if (param, rows.start) not in loaded]
    if missing:
        raise ValueError(f"{what} checkpoint is missing weights: {missing[:8]}")


def layer_targets(cfg: ModelConfig) -> dict[str, tuple[str, slice]]:
    """Checkpoint name (after `model.layers.N.`) -> (our parameter, the rows' place in it)."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    targets = {
        "input_layernorm.weight": ("input_norm", slice(None)),
        "post_attention_layernorm.weight": ("post_norm", slice(None)),
        "self_attn.q_proj.weight": ("qkv_t", slice(0, q)),
        "self_attn.k_proj.weight": ("qkv_t", slice(q, q + kv)),
        "self_attn.v_proj.weight": ("qkv_t", slice(q + kv, q + 2 * kv)),
        "self_attn.o_proj.weight": ("o_proj_t", slice(None)),
        "mlp.gate_proj.weight": ("gate_up_t", slice(0, inter)),
        "mlp.up_proj.weight": ("gate_up_t", slice(inter, 2 * inter)),
        "mlp.down_proj.weight": ("down_t", slice(None)),
    }
    if cfg.architecture == "Phi3ForCausalLM":  # Phi-3's checkpoint fuses them as we do
        for name in ("q_proj", "k_proj", "v_proj"):
            del targets[f"self_attn.{name}.weight"]
        del targets["mlp.gate_proj.weight"], targets["mlp.up_proj.weight"]
        targets["self_attn.qkv_proj.weight"] = ("qkv_t", slice(None))
        targets["mlp.gate_up_proj.weight"] = ("gate_up_t", slice(None))
    if cfg.attention_bias:
        targets["self_attn.q_proj.bias"] = ("qkv_bias", slice(0, q))
        targets["self_attn.k_proj.bias"] = ("qkv_bias", slice(q, q + kv))
        targets["self_attn.v_proj.bias"] = ("qkv_bias", slice(q + kv, q + 2 * kv))
    if cfg.o_proj_bias:
        targets["self_attn.o_proj.bias"] = ("o_bias", slice(None))
    if cfg.qk_norm:
        # q_norm.weight [D] fills every q head's row; k_norm likewise (see DecoderLayer.qk_norm).
        targets["self_attn.q_norm.weight"] = ("qk_norm", slice(0, cfg.num_heads))
        targets["self_attn.k_norm.weight"] = (
            "qk_norm",
            slice(cfg.num_heads, cfg.num_heads + cfg.num_kv_heads),
        )
    return targets
