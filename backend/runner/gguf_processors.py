"""Tensor processors for transformers' GGUF reader (5.24) where its own do not read llama.cpp's
files: Qwen2-MoE's shared-expert gate of a float file (made 3-D), the stacked experts of an
architecture taught generically, and gpt-oss, whose own processor expects other names
(`ffn_*_projs`) and another layout than llama.cpp's converter writes: each expert's
gate and up projections (rows of `ffn_gate_exps` / `ffn_up_exps`, [experts, width, hidden],
their biases [experts, width]) interleaved back into transformers' `gate_up_proj` [experts,
hidden, 2 x width] (gate in the even columns), `ffn_down_exps` [experts, hidden, width]
transposed into `down_proj`, and the attention sinks (`attn_sinks.weight`) into `sinks`;
GraniteMoE (and -Shared: a `granitemoe` file with a shared expert), whose converter permutes
the q / k rows as Llama's and splits transformers' fused expert and shared-MLP matrices, put
back together under transformers 5's names (`granite_moe_tensor`); Granite 4.0-H (`granitehybrid`),
the same plus its Mamba 2 layers' small tensors as the converter reshaped them (`ssm_tensor`:
A stored as -exp(A_log), A and D as columns, the convolution's kernel squeezed to 2-D, the
gated norm by group) and its attention layers' q / k rows un-permuted by their own head counts
(the file's KV head count is an array, 0 on the Mamba layers); Falcon-H1 (`falcon-h1`): the
same Mamba 2 tensors (its q / k rows as transformers has them), and its pre-MLP norm, which the
converter names without ".weight"."""

from __future__ import annotations

import re

import numpy as np
import torch

_EXPERTS = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<part>gate|up|down)_exps\.(?P<kind>weight|bias)$")
_SINKS = re.compile(r"blk\.(?P<layer>\d+)\.attn_sinks\.weight$")
# a GraniteMoE file's tensor -> (transformers' parameter in layer N, the half it fills: 0 gate, 1 up, None all)
_GRANITE_MOE_PARTS = {
    "gate_inp": ("block_sparse_moe.router.weight", None),
    "gate_exps": ("block_sparse_moe.experts.gate_up_proj", 0),
    "up_exps": ("block_sparse_moe.experts.gate_up_proj", 1),
    "down_exps": ("block_sparse_moe.experts.down_proj", None),
    "gate_shexp": ("shared_mlp.input_linear.weight", 0),
    "up_shexp": ("shared_mlp.input_linear.weight", 1),
    "down_shexp": ("shared_mlp.output_linear.weight", None),
}
_GRANITE_MOE = re.compile(rf"blk\.(?P<layer>\d+)\.ffn_(?P<part>{'|'.join(_GRANITE_MOE_PARTS)})\.weight$")


_SSM = re.compile(r"blk\.(?P<layer>\d+)\.ssm_(?P<part>a|d|conv1d\.weight|conv1d\.bias|dt\.bias|norm\.weight)$")
# a Mamba 2 layer's tensor of the file -> transformers' parameter (GraniteMoeHybrid's `mamba.*`)
_FFN_NORM = re.compile(r"blk\.(?P<layer>\d+)\.ffn_norm(\.weight)?$")
_SSM_PARAMS = {"a": "A_log", "d": "D", "conv1d.weight": "conv1d.weight", "conv1d.bias": "conv1d.bias",
               "dt.bias": "dt_bias", "norm.weight": "norm.weight"}  # fmt: skip


def processors() -> dict:
    """Processors by file architecture, to put in transformers' TENSOR_PROCESSORS."""
    return {"gpt-oss": _gpt_oss(), "qwen2moe": _qwen2_moe(), "granitemoe": _granite_moe(),
            "granitehybrid": _granite_hybrid(), "falcon-h1": _falcon_h1()}  # fmt: skip


def stacked_experts():
    """transformers' processor of stacked expert tensors into fused `mlp.experts.gate_up_proj` /
    `down_proj`, leaving a file's expert tensors unread where the model keeps its experts
    otherwise (its load then refuses the weights it misses: transformers_loader)."""
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, Qwen2MoeTensorProcessor

    class StackedExperts(Qwen2MoeTensorProcessor):
        def process(self, weights, name: str, **kwargs):
            try:
                return super().process(weights, name, **kwargs)
            except KeyError:
                return GGUFTensor(weights, name, {})

    return StackedExperts


def _qwen2_moe():
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, Qwen2MoeTensorProcessor

    class Qwen2MoeFiles(Qwen2MoeTensorProcessor):
        def process(self, weights, name: str, **kwargs):
            result = super().process(weights, name, **kwargs)
            if "ffn_gate_inp_shexp" in name and result.weights.ndim > 2:  # a float file's is 2-D already
                return GGUFTensor(result.weights.reshape(1, -1), result.name, result.metadata)
            return result

    return Qwen2MoeFiles


def _gpt_oss():
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


def _granite_moe():
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, LlamaTensorProcessor

    class GraniteMoeFiles(LlamaTensorProcessor):
        def process(self, weights, name: str, **kwargs):
            parsed = kwargs.get("parsed_parameters")
            if parsed is not None and (m := _GRANITE_MOE.match(name)):
                granite_moe_tensor(parsed["tensors"], weights, int(m["layer"]), m["part"])
                return GGUFTensor(weights, None, {})
            return super().process(weights, name, **kwargs)

    return GraniteMoeFiles


def granite_moe_tensor(tensors: dict[str, torch.Tensor], weights: np.ndarray, layer: int, part: str) -> None:
    """A GraniteMoE file's router, expert or shared-MLP tensor into transformers' parameter: the
    gate and up halves (rows [.., width, hidden] each) stacked as the fused matrix's first and
    second halves of its rows, as transformers' `chunk(2)` splits them."""
    target, half = _GRANITE_MOE_PARTS[part]
    key = f"model.layers.{layer}.{target}"
    data = torch.from_numpy(np.copy(weights))
    if half is None:
        tensors[key] = data
        return
    rows = data.shape[-2]
    if key not in tensors:
        tensors[key] = torch.zeros(*data.shape[:-2], 2 * rows, data.shape[-1], dtype=data.dtype)
    tensors[key][..., half * rows : (half + 1) * rows, :] = data


def _granite_hybrid():
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor

    class GraniteHybridFiles(_granite_moe()):
        def process(self, weights, name: str, **kwargs):
            parsed = kwargs.get("parsed_parameters")
            if ".attn_k." in name or ".attn_q." in name:  # this layer's heads: the rows over the head size
                heads = weights.shape[0] // (self.config["hidden_size"] // self.config["num_attention_heads"])
                return GGUFTensor(self._reverse_permute_weights(weights, heads, heads), name, {})
            if parsed is not None and (m := _SSM.match(name)):
                key = f"model.layers.{m['layer']}.mamba.{_SSM_PARAMS[m['part']]}"
                parsed["tensors"][key] = torch.from_numpy(ssm_tensor(weights, m["part"]))
                return GGUFTensor(weights, None, {})
            return super().process(weights, name, **kwargs)

    return GraniteHybridFiles


def _falcon_h1():
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, TensorProcessor

    class FalconH1Files(TensorProcessor):
        def process(self, weights, name: str, **kwargs):
            parsed = kwargs.get("parsed_parameters")
            if parsed is not None and (m := _SSM.match(name)):
                key = f"model.layers.{m['layer']}.mamba.{_SSM_PARAMS[m['part']]}"
                parsed["tensors"][key] = torch.from_numpy(ssm_tensor(weights, m["part"]))
                return GGUFTensor(weights, None, {})
            if parsed is not None and (m := _FFN_NORM.match(name)):  # written without ".weight"
                parsed["tensors"][f"model.layers.{m['layer']}.pre_ff_layernorm.weight"] = torch.from_numpy(
                    np.copy(weights)
                )
                return GGUFTensor(weights, None, {})
            return super().process(weights, name, **kwargs)

    return FalconH1Files


def ssm_tensor(weights: np.ndarray, part: str) -> np.ndarray:
    """A Mamba 2 layer's small tensor as transformers holds it (see the module's doc)."""
    data = np.array(weights, dtype=np.float32)
    if part == "a":
        return np.log(-data.reshape(-1))
    if part == "conv1d.weight":  # [channels, kernel] -> [channels, 1, kernel]
        return data.reshape(data.shape[0], 1, data.shape[-1])
    return data.reshape(-1)
