"""gpt-oss files as llama.cpp's converter writes them, for transformers' reader (5.24), whose
own gpt-oss processor expects other names (`ffn_*_projs`) and another layout: each expert's
gate and up projections (rows of `ffn_gate_exps` / `ffn_up_exps`, [experts, width, hidden],
their biases [experts, width]) interleaved back into transformers' `gate_up_proj` [experts,
hidden, 2 x width] (gate in the even columns), `ffn_down_exps` [experts, hidden, width]
transposed into `down_proj`, and the attention sinks (`attn_sinks.weight`) into `sinks`."""

from __future__ import annotations

import re

import numpy as np
import torch

_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)_exps\.(?P<kind>weight|bias)$")
_SINKS = re.compile(r"blk\.(?P<layer>\d+)\.attn_sinks\.weight$")


def processor_class():
    """A TensorProcessor (transformers' base) for gpt-oss files."""
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, TensorProcessor

    class GptOssFileProcessor(TensorProcessor):
        def process(self, weights, name: str, **kwargs):
            parsed = kwargs.get("parsed_parameters")
            if parsed is not None and (m := _EXPERTS.match(name)):
                _place(parsed["tensors"], weights, int(m["layer"]), m["part"], m["kind"])
                return GGUFTensor(weights, None, {})
            if parsed is not None and (m := _SINKS.match(name)):
                parsed["tensors"][f"model.layers.{m['layer']}.self_attn.sinks"] = torch.from_numpy(np.copy(weights))
                return GGUFTensor(weights, None, {})
            return GGUFTensor(weights, name, {})

    return GptOssFileProcessor


def _place(tensors: dict[str, torch.Tensor], weights: np.ndarray, layer: int, part: str, kind: str) -> None:
    """One expert tensor of the file into transformers' fused expert parameters."""
    prefix = f"model.layers.{layer}.mlp.experts."
    data = torch.from_numpy(np.copy(weights))
    if part == "down":
        tensors[prefix + ("down_proj" if kind == "weight" else "down_proj_bias")] = (
            data.transpose(1, 2).contiguous() if kind == "weight" else data
        )
        return
    if kind == "weight":  # [experts, width, hidden] -> columns of [experts, hidden, 2 x width]
        data = data.transpose(1, 2)
    key = prefix + ("gate_up_proj" if kind == "weight" else "gate_up_proj_bias")
    if key not in tensors:
        tensors[key] = torch.zeros(*data.shape[:-1], 2 * data.shape[-1], dtype=data.dtype)
    tensors[key][..., 0 if part == "gate" else 1 :: 2] = data
