"""Multi-token prediction layers, MiMo's layout: the checkpoint's own drafter.

MiMo-7B (`MiMoForCausalLM`, `num_nextn_predict_layers: 1`) is a Qwen2 decoder plus
`model.mtp_layers.{i}.*`: two RMSNorms, an input projection and one Qwen2 decoder
block, sharing the target's embedding and lm_head. At position p it reads the target's
hidden state there (the one that goes into lm_head, after the final norm) and the
embedding of the token at p + 1, and predicts the token at p + 2:

    u = input_proj(cat[hidden_layernorm(h_p), token_layernorm(embed(x_{p+1}))])   # hidden first
    g = final_layernorm(block(u))          # the block attends over its own KV cache
    logits = lm_head(g)

The embedding is zeroed at position 0, as vLLM does for MiMo and DeepSeek. Drafting k
tokens chains the layers: step m feeds its own output g and the embedding of the draft
it just made, one position further (layer m % num_layers; MiMo ships one).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from backend.runner.attention import build_attention_plan
from backend.runner.forward_batch import ForwardBatch
from backend.runner.models.llama import DecoderLayer, LlamaForCausalLM, empty_param, linear
from backend.runner.models.llama_weights import copy_weights, layer_targets
from backend.types.model_config import ModelConfig


class MtpLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.token_norm = empty_param(h, dtype=dtype, device=device)
        self.hidden_norm = empty_param(h, dtype=dtype, device=device)
        self.input_proj_t = empty_param(2 * h, h, dtype=dtype, device=device)  # [in, out], see `linear`
        self.block = DecoderLayer(cfg, 0, dtype, device)
        self.final_norm = empty_param(h, dtype=dtype, device=device)

    def forward(self, embeds, hidden, rope, kv_cache, batch: ForwardBatch, plan) -> torch.Tensor:
        shape = hidden.shape[-1:]
        joined = torch.cat(
            (
                F.rms_norm(hidden, shape, self.hidden_norm, self.eps),
                F.rms_norm(embeds, shape, self.token_norm, self.eps),
            ),
            dim=-1,
        )
        x = self.block(linear(joined, self.input_proj_t), rope, kv_cache, batch, plan)
        return F.rms_norm(x, shape, self.final_norm, self.eps)


class MtpHead(torch.nn.Module):
    """A checkpoint's MTP layers, run against the target model they belong to."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = cfg
        self.layers = torch.nn.ModuleList(MtpLayer(cfg, dtype, device) for _ in range(cfg.num_mtp_layers))

    @torch.inference_mode()
    def forward(
        self,
        target: LlamaForCausalLM,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        kv_caches: list[torch.Tensor],
        step: int,
    ) -> torch.Tensor:
        """hidden: [T, hidden], the state each position reads (the target's, or when
        chaining the layer's own output); batch.input_ids: the token after each position.
        Returns the layer's output [T, hidden], what lm_head reads."""
        table = target.lm_head_t.t() if target.embed_tokens is None else target.embed_tokens
        embeds = F.embedding(batch.input_ids, table).masked_fill((batch.positions == 0)[:, None], 0.0)
        rope = target.rotary(batch.positions, embeds.dtype)
        cfg, index = self.config, step % len(self.layers)
        plan = build_attention_plan(
            batch, kv_caches[index].shape[2], embeds.dtype, None, cfg.num_heads // cfg.num_kv_heads
        )
        return self.layers[index](embeds, hidden, rope, kv_caches[index], batch, plan)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        copy_weights(self, self._weight_targets(), weights, f"{self.config.architecture} MTP")

    def _weight_targets(self) -> dict[str, tuple[str, slice]]:
        own = {
            "token_layernorm.weight": ("token_norm", slice(None)),
            "hidden_layernorm.weight": ("hidden_norm", slice(None)),
            "input_proj.weight": ("input_proj_t", slice(None)),
            "final_layernorm.weight": ("final_norm", slice(None)),
        }
        own |= {suffix: (f"block.{attr}", rows) for suffix, (attr, rows) in layer_targets(self.config).items()}
        return {
            f"model.mtp_layers.{i}.{suffix}": (f"layers.{i}.{attr}", rows)
            for i in range(len(self.layers))
            for suffix, (attr, rows) in own.items()
        }
