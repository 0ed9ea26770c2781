"""A Hugging Face folder's config.json as our ModelConfig, for our own forward (the
architectures it takes, and the variants of them it does not: backend/runner/loader.py then
tries the generic path)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from backend.contract.vision import VisionInfo
from backend.runner.models.m2m100 import ARCHITECTURE as M2M100_ARCHITECTURE
from backend.runner.weights import eos_token_ids
from backend.types.model_config import ModelConfig, MoeConfig, RopeConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MiMoForCausalLM",  # Qwen2 plus MTP layers (backend/runner/models/mtp.py)
    "Qwen2VLForConditionalGeneration",  # a Qwen2 with M-RoPE plus a vision tower (visual.*)
    "Qwen2_5_VLForConditionalGeneration",
    "Phi3ForCausalLM",  # Phi-3 / 3.5 / 4 and Phi-4-mini: fused q|k|v and gate|up, longrope, partial rotary
    "Qwen3MoeForCausalLM",  # Qwen3 with routed experts (backend/runner/models/moe.py)
    "MixtralForCausalLM",  # Mistral with routed experts
    "Gemma2ForCausalLM",  # backend/runner/models/gemma.py
    "Gemma3ForCausalLM",  # Gemma 3's text model
)
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mimo": "MiMoForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_vl": "Qwen3ForCausalLM",
}
# vision-language architectures: their family (backend.contract.vision.VisionInfo.family)
_VISION_FAMILIES = {"Qwen2VLForConditionalGeneration": "qwen2_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
_QWEN2_LIKE = ("Qwen2ForCausalLM", "MiMoForCausalLM", *_VISION_FAMILIES)
# configs whose sliding_window, without layer_types, is every layer's (as transformers reads them)
_EVERY_LAYER_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM")
_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_LONGROPE_NAMES = ("su", "yarn")  # Phi-3's older names of longrope (transformers' Phi3Config)
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# vision-language checkpoints whose language model our forward runs as the text model's
# architecture (their images are not served on it: no vision tower of ours for them)
# (Qwen3-VL's text is Qwen3's: its M-RoPE, given one position for all three axes as text is,
# is Qwen3's RoPE)
LANGUAGE_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                     "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM"}  # fmt: skip


def load_model_config(path: str | Path, context: int | None = None) -> ModelConfig:
    """`context`: the served context (MAX_MODEL_LEN; None: max_position_embeddings), which picks
    longrope's factors (`_longrope`)."""
    folder = Path(path)
    top = json.loads((folder / "config.json").read_text())
    # A vision-language config nests the language model's settings in text_config (transformers
    # 5); released checkpoints have them top-level. Nested values win; model_type stays the top's.
    raw = dict(top)
    if top.get("text_config"):
        raw.update(top["text_config"], model_type=top.get("model_type"))
    arch = _architecture(raw)
    num_heads = raw["num_attention_heads"]
    model_type = raw.get("model_type", "")
    # Qwen2 always has q/k/v biases and no o_proj bias; Llama/Mistral/Qwen3 put
    # `attention_bias` on all four projections.
    qwen2 = model_type in ("qwen2", "mimo") or arch in _QWEN2_LIKE
    attention_bias = qwen2 or bool(raw.get("attention_bias", False))
    config = ModelConfig(
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
        rope=_rope_config(raw, arch, context),
        # transformers reads a composite config's tie top-level, or (older saves) in text_config
        tie_word_embeddings=bool(top.get("tie_word_embeddings", False) or raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_proj_bias=attention_bias and not qwen2,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_windows=_sliding_windows(raw, arch),
        eos_token_ids=eos_token_ids(folder, raw),
        bos_token_id=raw.get("bos_token_id"),
        num_mtp_layers=int(raw.get("num_nextn_predict_layers", 0)) if arch == "MiMoForCausalLM" else 0,
        mrope_section=_mrope_section(raw, arch),
        vision=_vision_info(top, arch),
        moe=_moe_config(raw, arch),
    )
    return replace(config, **_gemma_fields(raw, arch))


def is_m2m100(path: str | Path) -> bool:
    """Whether the folder holds an NLLB / M2M100 (encoder-decoder) checkpoint."""
    raw = json.loads((Path(path) / "config.json").read_text())
    return raw.get("model_type") == "m2m_100" or (raw.get("architectures") or [None])[0] == M2M100_ARCHITECTURE


def _architecture(raw: dict[str, Any]) -> str:
    # A config without `architectures` (hand-written, or from to_dict()) names its model_type.
    archs = raw.get("architectures") or [
        _BY_MODEL_TYPE.get(raw.get("model_type"), f"model_type={raw.get('model_type')!r}")
    ]
    arch = LANGUAGE_MODEL_OF.get(archs[0], archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if raw.get("model_type") and raw["model_type"] not in _BY_MODEL_TYPE:
        # another family that transformers builds with one of these classes (EXAONE 3 as Llama,
        # renaming its weights at load): the transformers path, which renames them
        raise ValueError(f"model_type {raw['model_type']!r} is not one our forward was written for")
    # Gemma names its activation hidden_activation (GeGLU's gelu, tanh approximation)
    act_key, act = ("hidden_activation", "gelu_pytorch_tanh") if arch in _GEMMA else ("hidden_act", "silu")
    if raw.get(act_key, act) != act or raw.get("mlp_bias", False):
        raise ValueError(f"unsupported {arch} variant: {act_key}={raw.get(act_key)}, mlp_bias")
    return arch


def _rope_config(
    raw: dict[str, Any], arch: str, context: int | None = None, params: dict[str, Any] | None = None
) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta included); older configs have
    # top-level `rope_theta` and an optional `rope_scaling` using "type" or "rope_type".
    if params is None:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope" and arch in _VISION_FAMILIES:  # Qwen2-VL's older name: default frequencies
        rope_type = "default"
    if rope_type in _LONGROPE_NAMES and arch == "Phi3ForCausalLM":
        rope_type = "longrope"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling {params} for {arch}; supported types: {_ROPE_TYPES}")
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    rope = RopeConfig(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(params.get("factor") or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        partial_rotary_factor=float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
    )
    if rope_type == "longrope":
        _longrope(rope, params, raw.get("max_position_embeddings", 4096), context)
    return rope


def _longrope(rope: RopeConfig, params: dict[str, Any], max_positions: int, context: int | None) -> None:
    """Phi-3's longrope, as transformers computes it, with one choice made once: the long
    factors when the served context exceeds the pretraining one (llama.cpp's choice). transformers
    switches by the length of the sequence at hand, which would turn a sequence's cached keys
    by other frequencies than its later queries (and make a row's numbers depend on its batch)."""
    original = rope.original_max_position_embeddings or max_positions
    rope.original_max_position_embeddings = original
    factor = float(params.get("factor") or max_positions / original)
    if params.get("attention_factor") is not None:
        rope.attention_factor = float(params["attention_factor"])
    elif factor > 1.0:
        rope.attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    long = (context or max_positions) > original
    rope.ext_factors = tuple(float(f) for f in params["long_factor" if long else "short_factor"])


def _mrope_section(raw: dict[str, Any], arch: str) -> tuple[int, ...]:
    """A vision-language model's M-RoPE split of the frequency pairs; () for 1-D RoPE models."""
    if arch not in _VISION_FAMILIES:
        return ()
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not params.get("mrope_section"):
        raise ValueError(f"{arch} config has no mrope_section in rope_parameters or rope_scaling")
    return tuple(int(n) for n in params["mrope_section"])


def _vision_info(top: dict[str, Any], arch: str) -> VisionInfo | None:
    """The vision facts of a vision-language config (token ids top-level, or in text_config for
    some saves; patch layout in vision_config); None for text-only models."""
    family = _VISION_FAMILIES.get(arch)
    if family is None:
        return None
    text, vision = top.get("text_config") or {}, top.get("vision_config") or {}
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    missing = [n for n in names if top.get(n, text.get(n)) is None]
    if missing:
        raise ValueError(f"{arch} config is missing {missing}")
    return VisionInfo(
        family,
        *(int(top.get(n, text.get(n))) for n in names),
        patch_size=int(vision.get("patch_size", vision.get("spatial_patch_size", 14))),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        # transformers' Qwen2_5_VLVisionConfig default, for a config that leaves it out
        tokens_per_second=float(vision.get("tokens_per_second", 4)) if family == "qwen2_5_vl" else 0.0,
    )


def _sliding_windows(raw: dict[str, Any], arch: str) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    # Qwen configs carry a sliding_window that is off unless use_sliding_window is set.
    if arch in (*_QWEN2_LIKE, "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not raw.get("use_sliding_window", False):
        window = None
    if window is None:
        return ()
    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None and arch in _EVERY_LAYER_WINDOWED:
        layer_types = ["sliding_attention"] * num_layers
    elif layer_types is None and arch in _GEMMA:  # older configs: every Nth layer global
        every = 2 if arch == "Gemma2ForCausalLM" else raw.get("sliding_window_pattern", 6)
        layer_types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)]
    elif layer_types is None:
        first_sliding = raw.get("max_window_layers", num_layers)
        layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _moe_config(raw: dict[str, Any], arch: str) -> MoeConfig | None:
    """The routed blocks of a Mixtral (every layer; top-k renormalized) or a Qwen3-MoE (every
    `decoder_sparse_step`-th layer not in `mlp_only_layers`; renormalized where norm_topk_prob)."""
    num_layers = raw["num_hidden_layers"]
    # released Qwen3-MoE configs say num_experts; transformers 5 saves both families' as num_local_experts
    experts = raw.get("num_local_experts", raw.get("num_experts", 0))
    if arch == "MixtralForCausalLM":
        return MoeConfig(experts, raw["num_experts_per_tok"], raw["intermediate_size"], True, tuple(range(num_layers)))
    if arch != "Qwen3MoeForCausalLM":
        return None
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    top_k, norm = raw["num_experts_per_tok"], bool(raw.get("norm_topk_prob", False))
    return MoeConfig(experts, top_k, raw["moe_intermediate_size"], norm, layers)


def _gemma_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 2 / 3's settings as ModelConfig fields, with transformers' defaults for what a
    config leaves out; {} for other architectures."""
    if arch not in _GEMMA:
        return {}
    gemma3 = arch == "Gemma3ForCausalLM"
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"unsupported {arch} variant: use_bidirectional_attention (an embedding model)")
    fields = {
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "qk_norm": gemma3,
        "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        # Gemma 3's attention takes no soft-capping (transformers passes none), its logits may
        "attn_logit_softcapping": 0.0 if gemma3 else float(raw.get("attn_logit_softcapping", 50.0) or 0.0),
        "final_logit_softcapping": float(raw.get("final_logit_softcapping", None if gemma3 else 30.0) or 0.0),
    }
    if gemma3:  # two RoPEs: full layers' rope_theta with its scaling, sliding layers' plain local base
        params = raw.get("rope_parameters") or {}
        full = params.get("full_attention") or raw.get("rope_scaling") or {}
        local = params.get("sliding_attention") or {}
        local_theta = raw.get("rope_local_base_freq", 10000.0)
        fields["rope"] = _rope_config(raw, arch, params={"rope_theta": raw.get("rope_theta", 1_000_000.0), **full})
        fields["local_rope"] = _rope_config(raw, arch, params={"rope_theta": local_theta, **local})
    return fields
