"""NLLB / M2M100 (`M2M100ForConditionalGeneration`): its config and our encoder, for translation (issue 14).

The encoder runs once per request over its source tokens: the shared embedding table
(tied to lm_head) scaled by sqrt(d_model), plus fixed sinusoidal positions
(tensor2tensor's [sin | cos] layout; position ids count from pad + 1 and skip pads),
then pre-LN layers (self-attention with biases, no mask across the source; a ReLU
feed-forward), then a final LayerNorm. The decoder on the paged cache, and the model
the engine loads (M2M100ForTranslation), are in m2m100_decoder.py; the cross-attention
over the encoder's keys and values kept in the block pool in m2m100_cross.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.runner.weights import eos_token_ids, iter_weights, weight_files

ARCHITECTURE = "M2M100ForConditionalGeneration"


@dataclass(frozen=True, slots=True)
class M2M100Config:
    """The checkpoint's config.json (and generation_config.json's EOS ids). Besides its own
    fields it answers to the names the engine reads of a model's config (llama.ModelConfig's:
    hidden_size, num_layers, num_heads, num_kv_heads, head_dim, ...); `num_layers` counts the
    decoder's layers, the ones that own a paged KV cache."""

    vocab_size: int
    d_model: int
    encoder_layers: int
    encoder_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    max_position_embeddings: int
    pad_token_id: int = 1
    scale_embedding: bool = True
    decoder_heads: int = 16
    decoder_ffn_dim: int = 4096
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (2,)
    decoder_start_token_id: int = 2
    tie_word_embeddings: bool = True
    architecture: str = ARCHITECTURE
    is_encoder_decoder: bool = True
    num_mtp_layers: int = 0
    sliding_windows: tuple[int | None, ...] = ()
    kv_free_layers: tuple[int, ...] = ()  # every decoder layer attends

    @classmethod
    def load(cls, folder: str | Path) -> M2M100Config:

        raw = json.loads((Path(folder) / "config.json").read_text())
        named = raw.get("model_type") == "m2m_100" or (raw.get("architectures") or [None])[0] == ARCHITECTURE
        if not named or raw.get("activation_function", "relu") != "relu":
            raise ValueError(f"{folder} is not an M2M100 / NLLB checkpoint with ReLU feed-forwards")
        return cls(
            vocab_size=raw["vocab_size"],
            d_model=raw["d_model"],
            encoder_layers=raw["encoder_layers"],
            encoder_heads=raw["encoder_attention_heads"],
            encoder_ffn_dim=raw["encoder_ffn_dim"],
            decoder_layers=raw["decoder_layers"],
            max_position_embeddings=raw["max_position_embeddings"],
            pad_token_id=raw.get("pad_token_id", 1),
            scale_embedding=raw.get("scale_embedding", True),
            decoder_heads=raw["decoder_attention_heads"],
            decoder_ffn_dim=raw["decoder_ffn_dim"],
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_token_ids(Path(folder), raw),
            decoder_start_token_id=raw.get("decoder_start_token_id", 2),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        )

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def num_layers(self) -> int:
        return self.decoder_layers

    @property
    def num_heads(self) -> int:
        return self.decoder_heads

    @property
    def num_kv_heads(self) -> int:
        return self.decoder_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_heads

    @property
    def position_offset(self) -> int:
        """Position p of a sequence (no pads before it) reads row p + pad_token_id + 1 of the table."""
        return self.pad_token_id + 1


def sinusoidal_table(num_positions: int, dim: int, padding_idx: int) -> torch.Tensor:
    """[num_positions, dim] float32: row p = [sin(p w) | cos(p w)], w_i = 10000^(-i / (dim/2 - 1));
    the padding row is zeros."""
    half = dim // 2
    rates = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num_positions, dtype=torch.int64).float()[:, None] * rates[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    table[padding_idx] = 0
    return table


class SinusoidalPositions:
    """The fixed position table in the model's dtype and device, grown on demand (as
    transformers grows its own) when a sequence runs past max_position_embeddings."""

    def __init__(self, cfg: M2M100Config, dtype: torch.dtype, device: torch.device | str):
        self.cfg = cfg
        self.table = self._make(cfg.max_position_embeddings + cfg.position_offset, dtype, device)

    def _make(self, rows: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        return sinusoidal_table(rows, self.cfg.d_model, self.cfg.pad_token_id).to(device=device, dtype=dtype)

    def lookup(self, rows: torch.Tensor, bound: int) -> torch.Tensor:
        """Table rows `rows`; `bound` (a host int) is at least their largest, so no device sync."""
        if bound >= self.table.shape[0]:
            self.table = self._make(2 * bound, self.table.dtype, self.table.device)
        return self.table[rows]


def is_encoder_weight(name: str) -> bool:
    return name.startswith("model.encoder.") and ".embed_" not in name


class M2M100Encoder(torch.nn.Module):
    """`weights`: the checkpoint's model.encoder.* tensors and the shared embedding
    ("model.shared.weight", possibly a view of a tied lm_head), in the model's dtype and device."""

    def __init__(self, cfg: M2M100Config, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.embed = weights["model.shared.weight"]
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.weights = weights
        self.head_dim = cfg.d_model // cfg.encoder_heads
        self.positions = SinusoidalPositions(cfg, self.embed.dtype, self.embed.device)

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> M2M100Encoder:

        cfg = M2M100Config.load(folder)
        weights = {
            name: tensor.to(dtype)
            for name, tensor in iter_weights(weight_files(Path(folder)))
            if is_encoder_weight(name) or name == "model.shared.weight"
        }
        return cls(cfg, weights)

    @torch.inference_mode()
    def forward(self, input_ids: list[int]) -> torch.Tensor:
        """The encoder's output [S, d_model] for one source sequence (pads skipped by position)."""
        cfg, ids = self.cfg, torch.tensor(input_ids, device=self.embed.device)
        mask = (ids != cfg.pad_token_id).long()
        positions = torch.cumsum(mask, 0) * mask + cfg.pad_token_id
        x = F.embedding(ids, self.embed) * self.scale + self.positions.lookup(positions, len(ids) + cfg.pad_token_id)
        for i in range(cfg.encoder_layers):
            x = self._layer(x, f"model.encoder.layers.{i}.")
        return self._norm(x, "model.encoder.layer_norm")

    def _layer(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        x = x + self._self_attention(self._norm(x, prefix + "self_attn_layer_norm"), prefix + "self_attn.")
        h = F.relu(self._linear(self._norm(x, prefix + "final_layer_norm"), prefix + "fc1"))
        return x + self._linear(h, prefix + "fc2")

    def _self_attention(self, h: torch.Tensor, prefix: str) -> torch.Tensor:
        n, heads, d = h.shape[0], self.cfg.encoder_heads, self.head_dim
        q, k, v = (
            self._linear(h, prefix + p).view(n, heads, d).transpose(0, 1) for p in ("q_proj", "k_proj", "v_proj")
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=d**-0.5)  # [heads, S, d]: every source token sees all
        return self._linear(out.transpose(0, 1).reshape(n, heads * d), prefix + "out_proj")

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.weights[name + ".weight"], self.weights[name + ".bias"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weights[name + ".weight"], self.weights[name + ".bias"], 1e-5)
