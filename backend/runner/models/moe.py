"""Our mixture-of-experts forward: Qwen3-MoE and Mixtral, the Llama-family layer
(backend/runner/models/llama.py) with a routed MLP block in its routed layers.

The block routes a step's T rows together: softmax over the router's logits in float32, each
row's top-k experts (ties to the lower expert index), the rows grouped by expert and one
gate|up and one down matmul per active expert, each row's k outputs summed in rank order.
Every op is per row (the matmuls' sums too: `linear`), so a row's numbers never depend on
the other rows of its step: the engine's batch invariance. The fused decode_layer kernel
does not take routed layers; they run layer by layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from backend.kernels import silu_mul
from backend.runner.forward_batch import ForwardBatch
from backend.runner.models.llama import DecoderLayer, LlamaForCausalLM, empty_param, linear
from backend.types.model_config import ModelConfig, MoeConfig

# a checkpoint's names of a routed block, after `model.layers.N.`: the block's prefix and an
# expert's (gate, up, down) projections, as released checkpoints name each expert
CHECKPOINT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
}
# transformers 5's in-memory names (what a state_dict of its model holds): experts fused into
# gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]; the router at mlp.gate
_FUSED = re.compile(r"(model\.layers\.\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)")


class Expert(torch.nn.Module):
    """One expert's SwiGLU MLP; its weights [in, out] like the dense layer's (`linear`)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.gate_up_t = empty_param(hidden, 2 * inter, dtype=dtype, device=device)
        self.down_t = empty_param(inter, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, hidden] -> [M, hidden]
        return linear(silu_mul(linear(x, self.gate_up_t)), self.down_t)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, k] float32, experts [T, k]), by descending probability.
    A stable sort rather than topk: equal probabilities go to the lower expert index on every
    platform (topk's order among ties is unspecified)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoeBlock(torch.nn.Module):
    """The routed MLP: a float router (QUANT leaves it float) and `num_experts` experts."""

    def __init__(self, hidden: int, moe: MoeConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.router_t = empty_param(hidden, moe.num_experts, dtype=dtype, device=device)
        self.experts = torch.nn.ModuleList(
            Expert(hidden, moe.intermediate_size, dtype, device) for _ in range(moe.num_experts)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [T, hidden]
        weights, chosen = route(linear(h, self.router_t), self.top_k, self.renormalize)
        picks = expert_outputs(h, chosen, self.experts)  # [T, k, hidden]
        weights = weights.to(h.dtype)
        out = picks[:, 0] * weights[:, :1]
        for rank in range(1, self.top_k):  # a row's k outputs in one order: rank order
            out = torch.addcmul(out, picks[:, rank], weights[:, rank : rank + 1])
        return out


def expert_outputs(h: torch.Tensor, chosen: torch.Tensor, experts: torch.nn.ModuleList) -> torch.Tensor:
    """Each row's chosen experts' outputs [T, k, hidden] (chosen: [T, k]): the rows grouped by
    expert, one call per expert that any row chose."""
    num_rows, top_k = chosen.shape
    flat = chosen.flatten()  # [T * k]: row r's picks at r*k .. r*k + k - 1
    order = torch.argsort(flat, stable=True)  # picks grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    out = h.new_empty(num_rows * top_k, h.shape[1])
    start = 0
    for expert, count in zip(experts, counts, strict=True):
        if count:
            group = order[start : start + count]
            out[group] = expert(h[group // top_k])
        start += count
    return out.view(num_rows, top_k, -1)


class MoeDecoderLayer(DecoderLayer):
    """A routed layer: Llama-family attention (Qwen3's q/k norms where the config has them),
    then the routed block in place of the dense MLP."""

    def init_mlp(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.moe = SparseMoeBlock(cfg.hidden_size, cfg.moe, dtype, device)

    def decode_operands(self) -> list[torch.Tensor] | None:
        return None  # decode_layer runs dense MLPs only

    def mlp(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.moe(h)  # LoRA adapters are refused on these models (backend/lora/peft_format.py)


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE and Mixtral: LlamaForCausalLM with MoeDecoderLayer in the config's routed layers."""

    @staticmethod
    def make_layer(cfg: ModelConfig, index: int, dtype: torch.dtype, device: torch.device) -> DecoderLayer:
        routed = cfg.moe is not None and index in cfg.moe.layers
        return (MoeDecoderLayer if routed else DecoderLayer)(cfg, index, dtype, device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], elsewhere: set[str] = frozenset()) -> None:
        super().load_weights(per_expert_weights(weights, self.config), elsewhere)

    def _weight_targets(self) -> dict[str, tuple[str, slice]]:
        """LlamaForCausalLM's targets, a routed layer's dense MLP names replaced by its block's."""
        targets = super()._weight_targets()
        block, gate, up, down = CHECKPOINT_NAMES[self.config.architecture]
        inter = self.config.moe.intermediate_size
        for i in self.config.moe.layers:
            for name in ("gate_proj", "up_proj", "down_proj"):
                del targets[f"model.layers.{i}.mlp.{name}.weight"]
            targets[f"model.layers.{i}.{block}.gate.weight"] = (f"layers.{i}.moe.router_t", slice(None))
            for e in range(self.config.moe.num_experts):
                ours, theirs = f"layers.{i}.moe.experts.{e}", f"model.layers.{i}.{block}.experts.{e}"
                targets[f"{theirs}.{gate}.weight"] = (f"{ours}.gate_up_t", slice(0, inter))
                targets[f"{theirs}.{up}.weight"] = (f"{ours}.gate_up_t", slice(inter, 2 * inter))
                targets[f"{theirs}.{down}.weight"] = (f"{ours}.down_t", slice(None))
        return targets


def per_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with transformers 5's in-memory forms (`_FUSED`) renamed and
    split as released checkpoints have them: one tensor per expert and projection."""
    block, gate, up, down = CHECKPOINT_NAMES[cfg.architecture]
    inter = cfg.moe.intermediate_size
    for name, tensor in weights:
        fused = _FUSED.fullmatch(name)
        if fused is None:
            yield name, tensor
            continue
        layer, part = fused.groups()
        if part == "gate.weight":
            yield f"{layer}.{block}.gate.weight", tensor
            continue
        for e in range(tensor.shape[0]):
            expert = f"{layer}.{block}.experts.{e}"
            if part == "experts.down_proj":
                yield f"{expert}.{down}.weight", tensor[e]
            else:
                yield f"{expert}.{gate}.weight", tensor[e, :inter]
                yield f"{expert}.{up}.weight", tensor[e, inter:]
