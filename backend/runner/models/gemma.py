"""Our Gemma 2 and Gemma 3 (text) forward: Llama's layer (backend/runner/models/llama.py) with
Gemma's differences.

- The embedding is scaled by sqrt(hidden_size), the factor rounded to the model dtype first
  (as transformers makes it).
- Every RMSNorm multiplies by (1 + w): the 1 is added to the weights at load (transformers adds
  it in float32, so in a float32 model the sum is the same number).
- Sandwich norms: the attention's output and the MLP's are normed before their residual adds
  (post_attention_layernorm, post_feedforward_layernorm); pre_feedforward_layernorm is the
  MLP's input norm, Llama's `post_norm`.
- GeGLU: gelu(gate, tanh approximation) * up.
- Attention scaled by query_pre_attn_scalar ** -0.5 (`ModelConfig.attention_scale`), its
  sliding-window layers between global ones (one attention plan per window, as for Llama).
- Gemma 2: attention scores soft-capped in our paged kernel (`ModelConfig.attn_logit_softcapping`)
  and the final logits too: cap * tanh(x / cap).
- Gemma 3: q/k norms (1 + w), and two RoPE tables: the sliding layers' (rope_local_base_freq,
  plain) and the global layers' (rope_theta with its scaling, e.g. linear).

A step whose linears are all tiles (QUANT, a GGUF file's blocks) runs each layer as one
decode_layer call (the sandwich's norms, the q / k norms, GELU and the soft-cap are its
operands); otherwise layer by layer with our `linear` (so LoRA adapters work as for Llama),
by the same kernels: a row's numbers are the same in either.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F

from backend.kernels import gelu_mul, rms_norm
from backend.lora.batch import DOWN, GATE_UP, add_lora
from backend.runner.attention import AttentionPlan, PagedKv
from backend.runner.forward_batch import ForwardBatch
from backend.runner.models.llama import DecoderLayer, LlamaForCausalLM, Rope, empty_param, linear
from backend.runner.models.rope import RopeTable, rope_inv_freq
from backend.types.model_config import ModelConfig

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# checkpoint name (after `model.layers.N.`) -> our parameter, where Gemma's layer differs from Llama's
_NORMS = {
    "post_attention_layernorm.weight": "attn_out_norm",
    "pre_feedforward_layernorm.weight": "post_norm",
    "post_feedforward_layernorm.weight": "mlp_out_norm",
}


class GemmaDecoderLayer(DecoderLayer):
    gelu = True  # GeGLU: gelu(gate, tanh approximation) * up

    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: torch.device):
        super().__init__(cfg, index, dtype, device)
        self.attn_out_norm = empty_param(cfg.hidden_size, dtype=dtype, device=device)
        self.mlp_out_norm = empty_param(cfg.hidden_size, dtype=dtype, device=device)

    def output_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sandwich's norms, which decode_layer applies before each residual add."""
        return self.attn_out_norm, self.mlp_out_norm

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor | PagedKv, batch: ForwardBatch, plan: AttentionPlan
    ) -> torch.Tensor:
        # x: [T, hidden]
        attn = self._attention(rms_norm(x, self.input_norm, self.eps), rope, kv_cache, batch, plan)
        x = x + rms_norm(attn, self.attn_out_norm, self.eps)
        h = rms_norm(x, self.post_norm, self.eps)
        gate_up = linear(h, self.gate_up_t)
        if batch.lora is not None:
            add_lora(gate_up, h, batch.lora, self.index, GATE_UP)
        act = gelu_mul(gate_up)
        down = linear(act, self.down_t)
        if batch.lora is not None:
            add_lora(down, act, batch.lora, self.index, DOWN)
        return x + rms_norm(down, self.mlp_out_norm, self.eps)

    def norms(self) -> list[torch.Tensor]:
        """The layer's (1 + w) norm weights."""
        return [self.input_norm, self.attn_out_norm, self.post_norm, self.mlp_out_norm] + (
            [] if self.qk_norm is None else [self.qk_norm]
        )


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__(cfg, dtype, device)
        # Gemma 3's sliding layers' RoPE, its own table; None: every layer takes `rotary`'s (Gemma 2)
        local = None if cfg.local_rope is None else rope_inv_freq(replace(cfg, rope=cfg.local_rope)).to(device)
        self.register_buffer("local_inv_freq", local, persistent=False)
        self._local_rope_table = RopeTable(replace(cfg, rope=cfg.local_rope) if cfg.local_rope else cfg)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's new tokens; writes their k/v into kv_caches."""
        table = self.lm_head_t.t() if self.embed_tokens is None else self.embed_tokens
        x = F.embedding(batch.input_ids, table)  # [T, hidden]
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        plans, kvs = self._step_operands(batch, kv_caches, x.dtype)
        top = max(batch.context_lens) - 1
        full = self.rotary(batch.positions, x.dtype, top)
        local = full
        if self.local_inv_freq is not None:
            local = self._local_rope_table.rows(self.local_inv_freq, batch.positions, x.dtype, top)
        fused = self._fused_decode(batch, plans, x)
        for layer, kv in zip(self.layers, kvs, strict=True):
            rope = full if layer.sliding_window is None else local
            plan = plans[layer.sliding_window]
            x = layer.decode(x, rope, kv, plan.rows, batch.slot_mapping) if fused else layer(x, rope, kv, batch, plan)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32, soft-capped where the model says."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], elsewhere: set[str] = frozenset()) -> None:
        """Llama's load, then the 1 of every (1 + w) norm added to its weight."""
        super().load_weights(weights, elsewhere)
        with torch.no_grad():
            for norm in [self.norm, *(n for layer in self.layers for n in layer.norms())]:
                norm.add_(1.0)

    def _weight_targets(self) -> dict[str, tuple[str, slice]]:
        targets = super()._weight_targets()
        for i in range(self.config.num_layers):
            for suffix, attr in _NORMS.items():
                targets[f"model.layers.{i}.{suffix}"] = (f"layers.{i}.{attr}", slice(None))
        return targets
