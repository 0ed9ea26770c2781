"""A GGUF file's routed experts for our own forward (Qwen3-MoE and Mixtral files): llama.cpp stores a routed
layer's experts as three 3-D tensors, `ffn_gate_exps` and `ffn_up_exps` [E, I, H] and
`ffn_down_exps` [E, H, I] (the router as `ffn_gate_inp` [E, H], a float). Each expert's rows
are a contiguous run of the tensor's rows, taken in the file's block format as they are
(gate and up in their common format, like a dense layer's gate|up), or as float32 under
the per-expert names of the family's Hugging Face checkpoints (backend/runner/models/moe.py).
Files of llama.cpp's first Mixtral layout (one tensor per expert, blk.N.ffn_gate.E) are
refused by name (gguf_weights.hf_name)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from backend.runner.models.moe import CHECKPOINT_NAMES
from backend.runner.quant.formats import QuantizedWeight, concat_rows, select_rows
from backend.runner.quant.gguf_blocks import GgufTensor
from backend.runner.quant.gguf_formats import common_format
from backend.types.model_config import ModelConfig

# the file's expert tensors (after blk.N.), in CHECKPOINT_NAMES's (gate, up, down) order
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def is_expert_tensor(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_PARTS


def expert_floats(tensor: GgufTensor, weight: torch.Tensor, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 [out, in]) of each expert in `tensor` (`weight`: its floats)."""
    _, layer, part, _ = tensor.name.split(".")
    block, *projections = CHECKPOINT_NAMES[cfg.architecture]
    projection = projections[EXPERT_PARTS.index(part)]
    experts = weight.reshape(tensor.shape)  # [E, out, in]
    for e in range(experts.shape[0]):
        yield f"model.layers.{layer}.{block}.experts.{e}.{projection}.weight", experts[e]


def expert_blocks(tensors: dict[str, GgufTensor], cfg: ModelConfig) -> dict[str, QuantizedWeight]:
    """Our parameter name ("layers.1.moe.experts.5.gate_up_t") -> the expert's weights as the
    file's blocks; a linear with a float part is left out (the caller quantizes it from floats)."""
    taken: dict[str, QuantizedWeight] = {}
    inter, hidden = cfg.moe.intermediate_size, cfg.hidden_size
    for layer in cfg.moe.layers:
        gate, up, down = (tensors[f"blk.{layer}.{part}.weight"].weight() for part in EXPERT_PARTS)
        for e in range(cfg.moe.num_experts):
            ours = f"layers.{layer}.moe.experts.{e}"
            gate_up = common_format([expert_rows(gate, e, inter), expert_rows(up, e, inter)])
            if gate_up is not None:
                taken[f"{ours}.gate_up_t"] = concat_rows(gate_up)
            if isinstance(down, QuantizedWeight):
                taken[f"{ours}.down_t"] = expert_rows(down, e, hidden)
    return taken


def expert_linear_names(key: str, cfg: ModelConfig) -> list[str]:
    """The Hugging Face names of an `expert_blocks` key's tensors."""
    _, layer, _, _, expert, ours = key.split(".")
    block, gate, up, down = CHECKPOINT_NAMES[cfg.architecture]
    projections = (gate, up) if ours == "gate_up_t" else (down,)
    return [f"model.layers.{layer}.{block}.experts.{expert}.{p}.weight" for p in projections]


def expert_rows(weight: QuantizedWeight | torch.Tensor, expert: int, rows: int) -> QuantizedWeight | torch.Tensor:
    """Expert `expert`'s `rows` rows of a [E * rows, in] weight (a view where it can be)."""
    run = slice(expert * rows, (expert + 1) * rows)
    return select_rows(weight, run) if isinstance(weight, QuantizedWeight) else weight[run]
