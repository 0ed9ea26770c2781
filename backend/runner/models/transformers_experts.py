"""A mixture's experts on the transformers path, multiplied from a GGUF file's blocks.

transformers 5 keeps a layer's routed experts in two stacked parameters, `gate_up_proj`
[experts, 2 x width, hidden] (each expert's gate rows, then its up rows) and `down_proj`
[experts, hidden, width], and multiplies them in float through its ExpertsInterface. Where
each expert's rows in the file hold exactly those numbers (backend/runner/transformers_gguf.py
checks, as the file is read), the module keeps them as each expert's QuantizedWeight instead
(`ExpertBlocks`; the parameters are placeholders of no memory) and its forward is this one: for
each expert some token picked, in the experts' order, those tokens' rows through its gate|up
blocks, the module's own gate (`_apply_gate`: the activation of the gate times the up), its
down blocks, weighted by the router and summed, as transformers' eager loop does. Modules of
another layout (transposed, biased, interleaved gate / up, no gate: gpt-oss) keep their floats."""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from backend.runner.models.llama import linear
from backend.runner.quant.formats import QuantizedWeight


@dataclass
class ExpertBlocks:
    """A layer's experts as blocks: expert e's gate|up [2 x width, hidden], its down [hidden, width]."""

    gate_up: list[QuantizedWeight]
    down: list[QuantizedWeight]

    def weights(self) -> list[QuantizedWeight]:
        return [*self.gate_up, *self.down]


def stacked_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is a transformers experts module of the layout this forward takes."""
    flags = ("is_concatenated", "has_gate", "is_transposed", "has_bias", "has_post_expert_norm")
    if not all(hasattr(module, flag) for flag in flags):  # not one of transformers' decorated experts
        return False
    params = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    return (
        all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in params)
        and module.is_concatenated
        and module.has_gate
        and not (module.is_transposed or module.has_bias or module.has_post_expert_norm)
    )


def install(module: torch.nn.Module, blocks: ExpertBlocks) -> None:
    """Multiply `module`'s experts from `blocks` from now on."""
    module.expert_blocks = blocks
    module.forward = types.MethodType(_forward, module)


def _forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' experts forward: hidden [tokens, hidden], each token's top-k experts and
    their weights [tokens, k] -> the weighted sum of its experts' outputs [tokens, hidden]."""
    blocks: ExpertBlocks = self.expert_blocks
    out = torch.zeros_like(hidden_states)
    picks = top_k_index.reshape(-1)
    order = torch.argsort(picks, stable=True)  # the picks grouped by expert, tokens in order
    tokens, weights = order // top_k_index.shape[-1], top_k_weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(torch.bincount(picks, minlength=len(blocks.gate_up)).tolist()):
        if count and expert < len(blocks.gate_up):  # an index past the experts: none (expert parallel)
            rows = tokens[start : start + count]
            x = self._apply_gate(linear(hidden_states[rows], blocks.gate_up[expert], None))
            y = linear(x, blocks.down[expert], None) * weights[start : start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out
