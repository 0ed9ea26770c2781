"""NLLB / M2M100 for the engine (`M2M100ForConditionalGeneration`): the encoder of
m2m100.py plus our decoder on the paged KV cache.

Per request, `encode` runs the encoder once over its source and writes every decoder
layer's cross-attention keys and values into that layer's KV cache at the request's
cross slots (see m2m100_cross.py). Each step, `forward` runs the decoder over a flat
ForwardBatch of decoder tokens: the shared embedding scaled by sqrt(d_model) plus
sinusoidal positions (token p of a sequence reads row p + pad + 1), then pre-LN layers:
causal self-attention on the paged cache (backend/runner/attention.py), cross-attention
over the sequence's own encoder states, a ReLU feed-forward; then a final LayerNorm.
All projections have biases; q is scaled by head_dim ** -0.5.

Weights are stored as llama.py's are ([in, out], q|k|v fused, the cross k|v fused), and
the tied lm_head is the embedding table's transposed storage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from backend.runner.attention import AttentionPlan, build_attention_plan, paged_attention, write_kv
from backend.runner.forward_batch import ForwardBatch
from backend.runner.models.llama import empty_param, linear
from backend.runner.models.llama_weights import copy_weights
from backend.runner.models.m2m100 import M2M100Config, M2M100Encoder, SinusoidalPositions, is_encoder_weight
from backend.runner.models.m2m100_cross import CrossPlan, cross_attention
from backend.runner.weights import iter_weights, weight_files

LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which M2M100 keeps
_EMBEDDING_NAMES = ("model.shared.weight", "model.decoder.embed_tokens.weight", "model.encoder.embed_tokens.weight")
_NORMS = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")


class M2M100DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: M2M100Config, dtype: torch.dtype, device: torch.device):
        super().__init__()
        d, ffn = cfg.d_model, cfg.decoder_ffn_dim
        self.num_heads, self.head_dim, self.scale = cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5
        for norm in _NORMS:
            setattr(self, norm + "_weight", empty_param(d, dtype=dtype, device=device))
            setattr(self, norm + "_bias", empty_param(d, dtype=dtype, device=device))
        # Matmul weights (suffix _t) are stored [in, out]; see llama.linear.
        shapes = {"qkv": (d, 3 * d), "self_out": (d, d), "cross_q": (d, d), "cross_kv": (d, 2 * d),
                  "cross_out": (d, d), "fc1": (d, ffn), "fc2": (ffn, d)}  # fmt: skip
        for name, (rows, cols) in shapes.items():
            setattr(self, name + "_t", empty_param(rows, cols, dtype=dtype, device=device))
            setattr(self, name + "_bias", empty_param(cols, dtype=dtype, device=device))

    def forward(
        self, x: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, plan: AttentionPlan, cross: CrossPlan
    ) -> torch.Tensor:
        # x: [T, d_model]
        x = x + self._self_attention(self._norm(x, "self_attn_layer_norm"), kv_cache, batch, plan)
        x = x + self._cross_attention(self._norm(x, "encoder_attn_layer_norm"), kv_cache, cross)
        h = F.relu(linear(self._norm(x, "final_layer_norm"), self.fc1_t, self.fc1_bias))
        return x + linear(h, self.fc2_t, self.fc2_bias)

    def _self_attention(self, h: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, plan: AttentionPlan):
        n = h.shape[0]
        q, k, v = linear(h, self.qkv_t, self.qkv_bias).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        out = paged_attention(q, k, v, kv_cache, batch, self.scale, plan).reshape(n, -1)
        return linear(out, self.self_out_t, self.self_out_bias)

    def _cross_attention(self, h: torch.Tensor, kv_cache: torch.Tensor, cross: CrossPlan) -> torch.Tensor:
        q = linear(h, self.cross_q_t, self.cross_q_bias).view(h.shape[0], self.num_heads, self.head_dim)
        out = cross_attention(q, kv_cache, cross, self.scale).reshape(h.shape[0], -1)
        return linear(out, self.cross_out_t, self.cross_out_bias)

    def write_cross_kv(self, states: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """The keys and values of encoder `states` [S, d_model], into kv_cache at `slots` [S]."""
        kv = linear(states, self.cross_kv_t, self.cross_kv_bias).view(states.shape[0], 2, self.num_heads, -1)
        write_kv(kv_cache, kv[:, 0], kv[:, 1], slots)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight, bias = getattr(self, name + "_weight"), getattr(self, name + "_bias")
        return F.layer_norm(x, x.shape[-1:], weight, bias, LAYER_NORM_EPS)


def decoder_layer_targets(cfg: M2M100Config) -> dict[str, tuple[str, slice]]:
    """Checkpoint name (after `model.decoder.layers.N.`) -> (our parameter, the rows' place in it)."""
    d, whole = cfg.d_model, slice(None)
    targets: dict[str, tuple[str, slice]] = {}
    for norm in _NORMS:
        targets[f"{norm}.weight"], targets[f"{norm}.bias"] = (f"{norm}_weight", whole), (f"{norm}_bias", whole)
    parts = {"self_attn.q_proj": ("qkv", slice(0, d)), "self_attn.k_proj": ("qkv", slice(d, 2 * d)),
             "self_attn.v_proj": ("qkv", slice(2 * d, 3 * d)), "self_attn.out_proj": ("self_out", whole),
             "encoder_attn.q_proj": ("cross_q", whole), "encoder_attn.k_proj": ("cross_kv", slice(0, d)),
             "encoder_attn.v_proj": ("cross_kv", slice(d, 2 * d)), "encoder_attn.out_proj": ("cross_out", whole),
             "fc1": ("fc1", whole), "fc2": ("fc2", whole)}  # fmt: skip
    for name, (ours, rows) in parts.items():
        targets[f"{name}.weight"], targets[f"{name}.bias"] = (f"{ours}_t", rows), (f"{ours}_bias", rows)
    return targets


class M2M100ForTranslation(torch.nn.Module):
    """The engine's NLLB / M2M100: `encode` once per request, `forward` per step, then
    `compute_logits`. Built by `load` (the encoder's weights are not parameters of this
    module: load it on its device rather than moving it)."""

    def __init__(self, cfg: M2M100Config, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = cfg
        self.layers = torch.nn.ModuleList(M2M100DecoderLayer(cfg, dtype, device) for _ in range(cfg.decoder_layers))
        self.norm_weight = empty_param(cfg.d_model, dtype=dtype, device=device)
        self.norm_bias = empty_param(cfg.d_model, dtype=dtype, device=device)
        self.lm_head_t = empty_param(cfg.d_model, cfg.vocab_size, dtype=dtype, device=device)
        # Tied: the embedding table is lm_head_t's [vocab, d_model] view, not a copy.
        tied = cfg.tie_word_embeddings
        self.embed_tokens = None if tied else empty_param(cfg.vocab_size, cfg.d_model, dtype=dtype, device=device)
        self.final_logits_bias: torch.Tensor | None = None  # [vocab], when the checkpoint has one
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.positions = SinusoidalPositions(cfg, dtype, device)
        self.encoder: M2M100Encoder | None = None  # built by load_weights
        self.mtp = None  # the runner asks; seq2seq has no MTP head

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):

        files = weight_files(Path(folder))
        cfg = M2M100Config.load(folder)
        if not any("lm_head.weight" in _names(file) for file in files):  # then lm_head is the embedding
            cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
        model = cls(cfg, dtype, torch.device(device))
        model.load_weights(iter_weights(files))
        return model.eval()

    def embedding(self) -> torch.Tensor:
        return self.lm_head_t.t() if self.embed_tokens is None else self.embed_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face checkpoint tensors (name, tensor): the decoder's into our parameters, the
        encoder's into self.encoder (built here, on the embedding table), final_logits_bias if any."""
        encoder: dict[str, torch.Tensor] = {}
        dtype, device = self.norm_weight.dtype, self.norm_weight.device
        skip_lm_head = self.config.tie_word_embeddings  # the embedding table is the lm_head then

        def decoder_side():
            for name, tensor in weights:
                if is_encoder_weight(name):
                    encoder[name] = tensor.to(device=device, dtype=dtype)
                elif name == "final_logits_bias":
                    self.final_logits_bias = tensor.reshape(-1).to(device=device, dtype=dtype)
                elif "embed_positions" not in name and not (name == "lm_head.weight" and skip_lm_head):
                    yield name, tensor

        copy_weights(self, self._weight_targets(), decoder_side(), self.config.architecture)
        self.encoder = M2M100Encoder(self.config, {**encoder, "model.shared.weight": self.embedding()})

    def _weight_targets(self) -> dict[str, tuple[str, slice]]:
        """Checkpoint name -> (our parameter, the checkpoint rows' place in it)."""
        table = "lm_head_t" if self.config.tie_word_embeddings else "embed_tokens"
        targets = {name: (table, slice(None)) for name in _EMBEDDING_NAMES}  # copies of one tied table
        targets["model.decoder.layer_norm.weight"] = ("norm_weight", slice(None))
        targets["model.decoder.layer_norm.bias"] = ("norm_bias", slice(None))
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = ("lm_head_t", slice(None))
        for suffix, (attr, rows) in decoder_layer_targets(self.config).items():
            for i in range(self.config.decoder_layers):
                targets[f"model.decoder.layers.{i}.{suffix}"] = (f"layers.{i}.{attr}", rows)
        return targets

    @torch.inference_mode()
    def encode(self, source_ids: list[int], cross_slots: torch.Tensor, kv_caches: list[torch.Tensor]) -> None:
        """Run the encoder over one source and write each decoder layer's cross-attention keys
        and values into kv_caches[layer] at `cross_slots` ([S] flat slots, S = len(source_ids))."""
        if cross_slots.shape != (len(source_ids),):
            raise ValueError(f"{len(source_ids)} source tokens need as many slots, not {tuple(cross_slots.shape)}")
        states = self.encoder(source_ids)  # [S, d_model]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer.write_cross_kv(states, kv_cache, cross_slots)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor], cross: CrossPlan) -> torch.Tensor:
        """Hidden states [T, d_model] of the batch's decoder tokens (after the final LayerNorm);
        writes their self-attention k/v into kv_caches at batch.slot_mapping."""
        offset = self.config.position_offset
        x = F.embedding(batch.input_ids, self.embedding()) * self.embed_scale
        x = x + self.positions.lookup(batch.positions + offset, max(batch.context_lens) + offset)
        plan = build_attention_plan(batch, kv_caches[0].shape[2], x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, batch, plan, cross)
        return F.layer_norm(x, x.shape[-1:], self.norm_weight, self.norm_bias, LAYER_NORM_EPS)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, d_model] -> logits [N, vocab] float32."""
        logits = linear(hidden, self.lm_head_t, self.final_logits_bias)
        return logits.float()


def _names(file: Path) -> list[str]:
    with safe_open(file, framework="pt", device="cpu") as f:
        return list(f.keys())
