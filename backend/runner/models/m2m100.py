"""NLLB / M2M100 (`M2M100ForConditionalGeneration`): our encoder, for translation (issue 14, in progress).

The encoder runs once per request over its source tokens: the shared embedding table
(tied to lm_head) scaled by sqrt(d_model), plus fixed sinusoidal positions
(tensor2tensor's [sin | cos] layout; position ids count from pad + 1 and skip pads),
then pre-LN layers (self-attention with biases, no mask across the source; a ReLU
feed-forward), then a final LayerNorm. The decoder (self-attention on the paged cache,
cross-attention over the encoder's keys and values kept in the block pool) is not
built yet; nothing serves this model yet.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open


@dataclass(frozen=True, slots=True)
class M2M100Config:
    vocab_size: int
    d_model: int
    encoder_layers: int
    encoder_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    max_position_embeddings: int
    pad_token_id: int = 1
    scale_embedding: bool = True

    @classmethod
    def load(cls, folder: str | Path) -> M2M100Config:
        raw = json.loads((Path(folder) / "config.json").read_text())
        if raw.get("model_type") != "m2m_100" or raw.get("activation_function", "relu") != "relu":
            raise ValueError(f"{folder} is not an M2M100 / NLLB checkpoint with ReLU feed-forwards")
        return cls(raw["vocab_size"], raw["d_model"], raw["encoder_layers"], raw["encoder_attention_heads"],
                   raw["encoder_ffn_dim"], raw["decoder_layers"], raw["max_position_embeddings"],
                   raw.get("pad_token_id", 1), raw.get("scale_embedding", True))  # fmt: skip


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


class M2M100Encoder(torch.nn.Module):
    def __init__(self, cfg: M2M100Config, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.embed = weights["model.shared.weight"]
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.weights = weights
        self.head_dim = cfg.d_model // cfg.encoder_heads

    @classmethod
    def load(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> M2M100Encoder:
        cfg = M2M100Config.load(folder)
        weights = {}
        with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.startswith("model.encoder.") or name == "model.shared.weight":
                    weights[name] = f.get_tensor(name).to(dtype)
        return cls(cfg, weights)

    @torch.inference_mode()
    def forward(self, input_ids: list[int]) -> torch.Tensor:
        """The encoder's output [S, d_model] for one source sequence (pads skipped by position)."""
        cfg, ids = self.cfg, torch.tensor(input_ids)
        mask = (ids != cfg.pad_token_id).long()
        positions = torch.cumsum(mask, 0) * mask + cfg.pad_token_id
        table = sinusoidal_table(max(int(positions.max()) + 1, cfg.max_position_embeddings + 2), cfg.d_model,
                                 cfg.pad_token_id)  # fmt: skip
        x = F.embedding(ids, self.embed) * self.scale + table[positions].to(self.embed.dtype)
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
