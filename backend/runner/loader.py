"""Load a local Hugging Face folder (config.json + *.safetensors, sharded or not) into our model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from backend.runner.models.llama import LlamaForCausalLM, ModelConfig, RopeConfig
from backend.runner.models.m2m100 import ARCHITECTURE as M2M100_ARCHITECTURE
from backend.runner.models.m2m100_decoder import M2M100ForTranslation
from backend.runner.models.mtp import MtpHead

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MiMoForCausalLM",  # Qwen2 plus MTP layers (backend/runner/models/mtp.py)
)
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mimo": "MiMoForCausalLM",
}
_QWEN2_LIKE = ("Qwen2ForCausalLM", "MiMoForCausalLM")
_MTP_PREFIX = "model.mtp_layers."
_ROPE_TYPES = ("default", "linear", "llama3")


def load_model_config(path: str | Path) -> ModelConfig:
    folder = Path(path)
    raw = json.loads((folder / "config.json").read_text())
    arch = _architecture(raw)
    num_heads = raw["num_attention_heads"]
    model_type = raw.get("model_type", "")
    # Qwen2 always has q/k/v biases and no o_proj bias; Llama/Mistral/Qwen3 put
    # `attention_bias` on all four projections.
    qwen2 = model_type in ("qwen2", "mimo") or arch in _QWEN2_LIKE
    attention_bias = qwen2 or bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rope=_rope_config(raw, arch),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_proj_bias=attention_bias and not qwen2,
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_windows=_sliding_windows(raw, arch),
        eos_token_ids=_eos_token_ids(folder, raw),
        bos_token_id=raw.get("bos_token_id"),
        num_mtp_layers=int(raw.get("num_nextn_predict_layers", 0)) if arch == "MiMoForCausalLM" else 0,
    )


def is_m2m100(path: str | Path) -> bool:
    """Whether the folder holds an NLLB / M2M100 (encoder-decoder) checkpoint."""
    raw = json.loads((Path(path) / "config.json").read_text())
    return raw.get("model_type") == "m2m_100" or (raw.get("architectures") or [None])[0] == M2M100_ARCHITECTURE


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM | M2M100ForTranslation:
    """The folder's model; its MTP layers, when the checkpoint ships them, in `model.mtp`.
    An NLLB / M2M100 folder gives M2M100ForTranslation (backend/runner/models/m2m100_decoder.py)."""
    folder = Path(path)
    if is_m2m100(folder):
        return M2M100ForTranslation.load(folder, dtype, device)
    cfg = load_model_config(folder)
    model = LlamaForCausalLM(cfg, dtype, device)
    mtp_weights: list[tuple[str, torch.Tensor]] = []

    def trunk():
        for name, tensor in _iter_weights(_weight_files(folder)):
            if cfg.num_mtp_layers and name.startswith(_MTP_PREFIX):
                mtp_weights.append((name, tensor))
            else:
                yield name, tensor

    model.load_weights(trunk())
    if cfg.num_mtp_layers:
        model.mtp = MtpHead(cfg, dtype, device)
        model.mtp.load_weights(mtp_weights)
    return model.eval()


def _architecture(raw: dict[str, Any]) -> str:
    # A config without `architectures` (hand-written, or from to_dict()) names its model_type.
    archs = raw.get("architectures") or [
        _BY_MODEL_TYPE.get(raw.get("model_type"), f"model_type={raw.get('model_type')!r}")
    ]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if raw.get("hidden_act", "silu") != "silu" or raw.get("mlp_bias", False):
        raise ValueError(f"unsupported {arch} variant: hidden_act={raw.get('hidden_act')}, mlp_bias")
    return arch


def _rope_config(raw: dict[str, Any], arch: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta included); older configs have
    # top-level `rope_theta` and an optional `rope_scaling` using "type" or "rope_type".
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES or params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"unsupported RoPE scaling {params} for {arch}; supported types: {_ROPE_TYPES}")
    return RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _sliding_windows(raw: dict[str, Any], arch: str) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    # Qwen configs carry a sliding_window that is off unless use_sliding_window is set.
    if arch in (*_QWEN2_LIKE, "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return ()
    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None and arch == "MistralForCausalLM":
        layer_types = ["sliding_attention"] * num_layers
    elif layer_types is None:
        first_sliding = raw.get("max_window_layers", num_layers)
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _eos_token_ids(folder: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [raw]
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        sources.append(json.loads(gen_path.read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        for token in eos if isinstance(eos, list) else [eos]:
            if token is not None and token not in ids:
                ids.append(token)
    return tuple(ids)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return files


def _iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
