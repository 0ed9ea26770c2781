"""What transformers' GGUF reader (5.24) leaves out of a file's config, read from the file
itself: a Mixtral's experts (llama.cpp writes Mixtral as a "llama" file with an
`expert_count`; the reader makes it a dense Llama), a MoE's expert width (Qwen2/3-MoE),
Gemma 2 / 3's attention scale, soft-caps and RoPE settings, Falcon-Mamba (a "mamba" file whose
mixers normalize dt, B and C), and Phi-3's RoPE: the share of each head it turns
(`rope.dimension_count`: Phi-4-mini turns 96 of 128 dims), longrope (its factor tensors, the
original context, the attention factor) and the sliding window. Without them transformers
serves such a file with other numbers than the checkpoint it came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from backend.runner.gguf_archs import ARCHITECTURES, field_value
from backend.runner.gguf_generic import taught

_EXPERT_WIDTH = "expert_feed_forward_length"  # -> moe_intermediate_size
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}  # how llama.cpp tells the 27B models
_ROPE_SCALING = {
    "rope.scaling.factor": "factor",
    "rope.scaling.original_context_length": "original_max_position_embeddings",
    "rope.scaling.attn_factor": "attention_factor",
    "rope.scaling.yarn_attn_factor": "attention_factor",
    "rope.scaling.yarn_beta_fast": "beta_fast",
    "rope.scaling.yarn_beta_slow": "beta_slow",
}
# model types whose queries take Llama 4's attention temperature (rope_parameters' llama_4_scaling_beta)
_TEMPERATURE_SCALED = frozenset({"ministral3"})
_NOT_CARRIED = ("model_type", "architectures", "transformers_version", "rope_parameters", "layer_types", "dtype")
_LONGROPE_TENSORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}


def fill_gaps(config, source: Path):
    """`config` with the file's missing settings (a MixtralConfig in place of a Llama one, an
    OLMo 3 one in place of OLMo 2's) and its vocabulary as its embedding's rows."""
    from gguf import GGUFReader

    reader = GGUFReader(source)
    fields = {key: field_value(field) for key, field in reader.fields.items()}
    arch = fields["general.architecture"]
    local = {k.removeprefix(f"{arch}."): v for k, v in fields.items()}
    if config.model_type == "olmo2" and local.get("attention.sliding_window"):
        config = _olmo3(config, int(local["attention.sliding_window"]))
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is not None:  # the rows the file has (converters trim a checkpoint's padding rows)
        config.vocab_size = int(embedding.shape[-1])
    if config.model_type == "llama" and fields.get("llama.expert_count"):
        config = _mixtral(config, fields)
    width = fields.get(f"{arch}.{_EXPERT_WIDTH}")
    if width is not None and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(width)
    if config.model_type in _GEMMA_27B_LAYERS:
        _gemma(config, local)
    if taught(arch) or arch in ARCHITECTURES:  # what transformers' reader would not read for us
        try:
            _generic(config, local, reader.fields, arch)
        except ValueError as e:
            raise ValueError(f"{source.name}: {e}") from None
    if config.model_type == "granitemoehybrid":
        _granite_hybrid(config, local, {t.name: [int(n) for n in t.shape] for t in reader.tensors})
    if config.model_type == "falcon_h1":
        _falcon_h1(config, local, {t.name for t in reader.tensors})
    if config.model_type == "mamba" and local.get("ssm.dt_b_c_rms"):  # llama.cpp writes Falcon-Mamba so
        config = _falcon_mamba(config)
    if config.model_type == "gpt_oss":  # transformers' reader (5.24) reads its rope.scaling.* as raw bytes
        theta = local.get("rope.freq_base")
        config.rope_parameters = {**type(config)().rope_parameters, **({"rope_theta": float(theta)} if theta else {})}
        _rope_scaling(config, local, arch)
    if config.model_type == "phi3":
        tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors if t.name.startswith("rope_")}
        _phi3_rope(config, local, tensors)
    return config


def _olmo3(config, window: int):
    """An "olmo2" file with sliding windows is OLMo 3 (llama.cpp writes it so): its config,
    every 4th layer global unless the file says which (`_generic`)."""
    from transformers import Olmo3Config

    values = {k: v for k, v in config.to_dict().items() if k not in _NOT_CARRIED}
    theta = (config.rope_parameters or {}).get("rope_theta")
    return Olmo3Config(**values, sliding_window=window, **({"rope_theta": theta} if theta else {}))


def _falcon_h1(config, fields: dict[str, Any], tensors: set[str]) -> None:
    """Falcon-H1 (`falcon-h1`): its Mamba 2 mixers' width and head size (`ssm.inner_size` over
    `ssm.time_step_rank` heads) and their gated norm where the file holds one. Its multipliers
    stay at the config's defaults, 1: the converter folds each into the weights it scales."""
    inner = fields.get("ssm.inner_size")
    if inner:
        config.mamba_d_ssm = int(inner)
        config.mamba_d_head = int(inner) // config.mamba_n_heads
    config.mamba_rms_norm = "blk.0.ssm_norm.weight" in tensors


def _falcon_mamba(config):
    """A "mamba" file whose mixers normalize dt, B and C (`ssm.dt_b_c_rms`) is Falcon-Mamba."""
    from transformers import FalconMambaConfig

    return FalconMambaConfig(**{k: v for k, v in config.to_dict().items() if k not in _NOT_CARRIED})


def _generic(config, fields: dict[str, Any], raw, arch: str) -> None:
    """A file's rotary share (`rope.dimension_count` of a head), which layers slide
    (`attention.sliding_window_pattern`, a bool a layer) and its RoPE scaling."""
    rotary = fields.get("rope.dimension_count")
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = dict(getattr(config, "rope_parameters", None) or {})
    if rotary is not None and (rotary != head or "partial_rotary_factor" in params):
        if not params:
            raise ValueError(f"its {arch}.rope.dimension_count ({rotary} of a head of {head}) has no field "
                             f"in transformers' {config.model_type} config")  # fmt: skip
        config.rope_parameters = {**params, "partial_rotary_factor": rotary / head}
    nextn = fields.get("nextn_predict_layers")
    if nextn:  # llama.cpp counts the multi-token-prediction layers in block_count; transformers does not
        config.num_nextn_predict_layers = int(nextn)
        config.num_hidden_layers -= int(nextn)
        for name in ("layer_types", "mlp_layer_types"):
            if isinstance(getattr(config, name, None), list):
                setattr(config, name, getattr(config, name)[: config.num_hidden_layers])
    pattern = raw.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None:
        slides = [bool(x) for x in pattern.contents()]
        config.layer_types = ["sliding_attention" if s else "full_attention" for s in slides]
    _rope_scaling(config, fields, arch)
    _temperature(config, fields, arch)
    swa_base = fields.get("rope.freq_base_swa")
    if swa_base is not None:  # the sliding layers' RoPE base, where the config keeps one by layer type
        if "sliding_attention" not in (config.rope_parameters or {}):
            raise ValueError(f"its {arch}.rope.freq_base_swa has no place in transformers' {config.model_type} config")
        config.rope_parameters = {**config.rope_parameters, "sliding_attention": {
            **config.rope_parameters["sliding_attention"], "rope_theta": float(swa_base)}}  # fmt: skip


def _rope_scaling(config, fields: dict[str, Any], arch: str) -> None:
    """Linear or YaRN RoPE scaling as llama.cpp writes it (its global layers' where the config
    keeps RoPE by layer type)."""
    kind = fields.get("rope.scaling.type")
    if kind in (None, "none"):
        return
    if kind not in ("linear", "yarn"):
        raise ValueError(f"its {arch}.rope.scaling.type {kind!r} is not read (linear and yarn are)")
    scaling = {name: fields[key] for key, name in _ROPE_SCALING.items() if fields.get(key) is not None}
    params = {key: dict(value) if isinstance(value, dict) else value for key, value in config.rope_parameters.items()}
    target = params["full_attention"] if "full_attention" in params else params
    if kind == "yarn":  # YaRN's magnitude as llama.cpp takes it: mscale 1, mscale_all_dim its log multiplier
        for name in ("mscale", "mscale_all_dim"):
            target.pop(name, None)
        if fields.get("rope.scaling.yarn_log_multiplier"):
            scaling.update(mscale=1.0, mscale_all_dim=float(fields["rope.scaling.yarn_log_multiplier"]))
    target.update(rope_type=kind, **scaling)
    config.rope_parameters = params


def _temperature(config, fields: dict[str, Any], arch: str) -> None:
    """Llama 4's attention temperature (queries scaled by 1 + beta * log(1 + floor(position /
    the original context))), where the model computes it: beta the file's, none without one."""
    beta = fields.get("attention.temperature_scale")
    if config.model_type not in _TEMPERATURE_SCALED:
        if beta is not None:
            raise ValueError(f"its {arch}.attention.temperature_scale has no field in transformers' "
                             f"{config.model_type} config")  # fmt: skip
        return
    config.rope_parameters = {**config.rope_parameters, "llama_4_scaling_beta": float(beta or 0.0)}


def _gemma(config, fields: dict[str, Any]) -> None:
    """Gemma 2 / 3: the attention scale as llama.cpp takes it (1 / sqrt(hidden / heads) for the
    27B models, whose query_pre_attn_scalar that is, else 1 / sqrt(head size); transformers'
    reader leaves its default of 256), the soft-caps, the sliding layers' RoPE base and the
    global layers' linear RoPE scaling (Gemma 3 4B and up) where the file has them."""
    big = config.num_hidden_layers == _GEMMA_27B_LAYERS[config.model_type]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else config.head_dim
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if fields.get(key) is not None:
            setattr(config, key, float(fields[key]))
    if config.model_type != "gemma3_text":
        return
    params = {kind: dict(value) for kind, value in (config.rope_parameters or {}).items()}
    if fields.get("rope.freq_base_swa") and "sliding_attention" in params:
        params["sliding_attention"]["rope_theta"] = float(fields["rope.freq_base_swa"])
    if fields.get("rope.scaling.type") == "linear" and fields.get("rope.scaling.factor") and "full_attention" in params:
        params["full_attention"].update(rope_type="linear", factor=float(fields["rope.scaling.factor"]))
    config.rope_parameters = params


def _mixtral(config, fields: dict[str, Any]):
    from transformers import MixtralConfig

    settings = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
    settings.update(num_local_experts=int(fields["llama.expert_count"]),
                    num_experts_per_tok=int(fields["llama.expert_used_count"]))  # fmt: skip
    return MixtralConfig(**settings)


def _phi3_rope(config, fields: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
    head_dim = config.hidden_size // config.num_attention_heads
    params = dict(config.rope_parameters or {})
    dims = fields.get("rope.dimension_count")
    if dims:
        params["partial_rotary_factor"] = int(dims) / head_dim
    window = fields.get("attention.sliding_window")
    if window:
        config.sliding_window = int(window)
    if all(name in tensors for name in _LONGROPE_TENSORS.values()):
        original = int(fields.get("rope.scaling.original_context_length") or config.max_position_embeddings)
        config.original_max_position_embeddings = original
        params.update(rope_type="longrope", original_max_position_embeddings=original,
                      **{key: tensors[name].tolist() for key, name in _LONGROPE_TENSORS.items()})  # fmt: skip
        if fields.get("rope.scaling.attn_factor"):
            params["attention_factor"] = float(fields["rope.scaling.attn_factor"])
    config.rope_parameters = params


def _granite_hybrid(config, fields: dict[str, Any], shapes: dict[str, list[int]]) -> None:
    """Granite 4.0-H (`granitehybrid`): which layers attend (those holding attn_q: the file's KV
    head count is an array, 0 on the Mamba layers, which a converter reading other layer names
    writes all 0), their KV heads (attn_k's rows over the head size), the Mamba 2 layers' width
    and head size (`ssm.inner_size`), RoPE or none (`rope.scaling.finetuned`, False where the
    checkpoint has none), and no routed experts where the file has none (a shared MLP alone)."""
    attends = [f"blk.{i}.attn_q.weight" in shapes for i in range(config.num_hidden_layers)]
    config.layer_types = ["full_attention" if a else "linear_attention" for a in attends]
    head = config.hidden_size // config.num_attention_heads
    keys = next((shapes[f"blk.{i}.attn_k.weight"] for i, a in enumerate(attends) if a), None)
    config.num_key_value_heads = keys[-1] // head if keys else config.num_attention_heads  # ggml: [in, out]
    inner = fields.get("ssm.inner_size")
    if inner:
        config.mamba_expand = int(inner) // config.hidden_size
        config.mamba_d_head = int(inner) // config.mamba_n_heads
    config.position_embedding_type = "rope" if fields.get("rope.scaling.finetuned") else None
    if not fields.get("expert_count"):
        config.num_local_experts = 0
