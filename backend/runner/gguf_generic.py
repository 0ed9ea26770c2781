"""A GGUF file of an architecture transformers' reader does not know (nor our table,
gguf_archs.ARCHITECTURES), taught to the reader from the file itself when transformers has a
decoder of that architecture: the file's architecture name (or its alias: llama.cpp's
`command-r` is transformers' `cohere`, `phi2` is `phi`) gives the model type, and each of the
file's `<arch>.*` keys goes to the field the model type's config holds it in (the first of its
candidates the config has: `attention.layer_norm_epsilon` is `layer_norm_eps` in one config,
`layer_norm_epsilon` in another). A key no candidate takes is refused, naming it: a setting the
config would leave at its default (another model than the file's) is never dropped silently.
Tensors are named by gguf-py's table for the architecture, as transformers does for its own;
the q / k rows of files whose converter permutes them as Llama's (PERMUTED) are put back.

Checked against llama.cpp's own converter: `python -m bench.architectures --gguf
LLAMA_CPP/convert_hf_to_gguf.py` (docs/models.md)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from backend.runner.gguf_processors import stacked_experts

# llama.cpp's architecture name -> transformers' model type, where they differ
ALIASES = {
    "command-r": "cohere",
    "phi2": "phi",
    "gptneox": "gpt_neox",
    "glm4moe": "glm4_moe",
    "hunyuan-dense": "hunyuan_v1_dense",
    "hunyuan-moe": "hunyuan_v1_moe",
    "ernie4_5-moe": "ernie4_5_moe",
    "exaone-moe": "exaone_moe",
    "cohere2moe": "cohere2_moe",
    "mistral3": "ministral3",
    "granitehybrid": "granitemoehybrid",
    "gemma3n": "gemma3n_text",
}
# architectures whose converter permutes the q / k rows as Llama's (a class derived from it)
PERMUTED = frozenset({"arcee", "afmoe", "minicpm", "deepseek", "mistral3"})

# a file key (after `<arch>.`) -> the config fields that may hold it, first match wins
_FIELDS: dict[str, tuple[str, ...]] = {
    "context_length": ("max_position_embeddings",),
    "block_count": ("num_hidden_layers",),
    "embedding_length": ("hidden_size",),
    "feed_forward_length": ("intermediate_size",),
    "vocab_size": ("vocab_size",),
    "attention.head_count": ("num_attention_heads",),
    "attention.head_count_kv": ("num_key_value_heads",),
    "attention.key_length": ("head_dim",),
    "attention.value_length": ("v_head_dim", "head_dim"),
    "attention.layer_norm_rms_epsilon": ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"),
    "attention.layer_norm_epsilon": ("layer_norm_eps", "layer_norm_epsilon", "norm_eps", "rms_norm_eps"),
    "attention.sliding_window": ("sliding_window",),
    "attention.q_lora_rank": ("q_lora_rank",),
    "attention.kv_lora_rank": ("kv_lora_rank",),
    "attention.clamp_kqv": ("clip_qkv",),
    "rope.freq_base": ("rope_theta",),
    "expert_count": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "expert_used_count": ("num_experts_per_tok", "moe_k", "num_experts_per_token", "top_k"),
    "expert_feed_forward_length": ("moe_intermediate_size",),
    "expert_shared_count": ("n_shared_experts", "num_shared_experts"),
    "expert_shared_feed_forward_length": ("shared_intermediate_size", "shared_expert_intermediate_size"),
    "leading_dense_block_count": ("first_k_dense_replace",),
    "expert_group_count": ("n_group",),
    "expert_group_used_count": ("topk_group",),
    "expert_weights_scale": ("routed_scaling_factor",),
    "expert_weights_norm": ("norm_topk_prob",),
    "logit_scale": ("logit_scale", "logits_scaling"),
    "attention.scale": ("attention_multiplier",),
    "embedding_scale": ("embedding_multiplier",),
    "residual_scale": ("residual_multiplier",),
    "attn_logit_softcapping": ("attn_logit_softcapping",),
    "final_logit_softcapping": ("final_logit_softcapping",),
    "ssm.conv_kernel": ("mamba_d_conv",),
    "ssm.state_size": ("mamba_d_state",),
    "ssm.group_count": ("mamba_n_groups",),
    "ssm.time_step_rank": ("mamba_n_heads",),
}
# keys gguf_gaps reads (the rotary share; each layer sliding or not: an array; RoPE scaling),
# with the config field they need (None: none)
READ_ELSEWHERE = {
    "rope.dimension_count": None,
    "attention.sliding_window_pattern": "layer_types",
    "nextn_predict_layers": "num_nextn_predict_layers",
    "rope.freq_base_swa": "rope_parameters",
    "attention.temperature_scale": "rope_parameters",
    "ssm.inner_size": "mamba_expand",  # and the head size: gguf_gaps
    "rope.scaling.finetuned": "position_embedding_type",  # Granite 4.0-H: False where it has no RoPE
}
READ_ELSEWHERE |= {
    f"rope.scaling.{key}": "rope_parameters"
    for key in (
        "type",
        "factor",
        "original_context_length",
        "attn_factor",
        "yarn_attn_factor",
        "yarn_beta_fast",
        "yarn_beta_slow",
        "yarn_log_multiplier",
    )
}
# how each mixture's router scores the experts, where its modeling code fixes it (llama.cpp's
# `expert_gating_func`: 1 softmax, 2 sigmoid)
_GATING = {"glm4_moe": 2}
# a model type transformers has for a variant of an architecture (OLMo 3 is written as "olmo2"
# with sliding windows: gguf_gaps makes its config) -> the file architecture naming its tensors
VARIANTS = {"olmo3": "olmo2", "granitemoeshared": "granitemoe", "falcon_mamba": "mamba"}
# a model type's variant transformers has for a file holding a key: (the key, its config
# field, the variant); GraniteMoE with a shared expert is GraniteMoeShared
KEYED_VARIANTS = {"granitemoe": ("expert_shared_feed_forward_length", "shared_intermediate_size", "granitemoeshared")}

# model types whose per-layer KV head counts (an array: 0 on a layer without attention) gguf_gaps reads
PER_LAYER_KV_HEADS = frozenset({"granitemoehybrid"})

_lock = threading.Lock()
_taught: dict[str, str] = {}  # file architecture -> model type, once taught
_wrapped = False


def model_type_of(arch: str) -> str | None:
    """transformers' decoder model type for llama.cpp's architecture name, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    for name in (ALIASES.get(arch), arch, arch.replace("-", "_")):
        if name in CAUSAL:
            return name
    return None


def teach(arch: str, values: dict[str, Any], foreign: list[str], source: Path) -> None:
    """Teach transformers' reader file architecture `arch` (its file keys' values, without the
    `<arch>.` prefix); ValueError, one line, where the file holds a key no field takes or keys of
    another namespace (`foreign`: Apertus' `xielu.*` activation parameters)."""

    from gguf import MODEL_ARCH_NAMES

    model_type = model_type_of(arch)
    if model_type is None:
        return  # transformers' own refusal names the architectures read
    if (variant := KEYED_VARIANTS.get(model_type)) and values.get(variant[0]):
        model_type = variant[2]
    if arch not in MODEL_ARCH_NAMES.values():
        raise ValueError(f"{source.name}: the installed gguf package does not name the tensors of {arch} files "
                         f"(a newer llama.cpp's); transformers has the {model_type} model")  # fmt: skip
    defaults = _defaults(model_type)
    fields, unread = {}, list(foreign)
    for key, value in values.items():
        field = next((f for f in _FIELDS.get(key, ()) if _holds(defaults, f)), None)
        if field is not None and value is not None:
            fields[key] = field
        elif not _elsewhere(defaults, key) and not _implied(key, value, values, model_type):
            unread.append(key)
    if unread:
        names = ", ".join(key if key in foreign else f"{arch}.{key}" for key in unread)
        raise ValueError(f"{source.name}: transformers' {model_type} config has no field for {names} "
                         f"({arch} files are read generically: the model would compute without it)")  # fmt: skip
    with _lock:
        _install(arch, model_type, fields)


def supplement(arch: str, values: dict[str, Any]) -> None:
    """The standard keys of a file of an architecture transformers' reader reads (under `arch`,
    its name there) that its table lacks, where the config holds them; none refused."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    model_type = model_type_of(arch)
    if model_type is None:
        return
    defaults = _defaults(model_type)
    with _lock:
        table = GGUF_CONFIG_MAPPING[arch]
        for key in values:
            field = next((f for f in _FIELDS.get(key, ()) if _holds(defaults, f)), None)
            if key not in table and field is not None:
                table[key] = field


def taught(arch: str) -> bool:
    """Whether file architecture `arch` was taught here (gguf_gaps then reads the rest)."""
    return arch in _taught


def _defaults(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def _elsewhere(config, key: str) -> bool:
    return key in READ_ELSEWHERE and (READ_ELSEWHERE[key] is None or _holds(config, READ_ELSEWHERE[key]))


def _holds(config, field: str) -> bool:
    """Whether `config` takes `field` (RoPE's base: inside rope_parameters in transformers 5)."""
    return hasattr(config, field) or (field == "rope_theta" and hasattr(config, "rope_parameters"))


def _implied(key: str, value: Any, values: dict[str, Any], model_type: str) -> bool:
    """Whether the file's `key` says what the model computes anyway: a head size of hidden /
    heads, the router's scoring function."""
    if key == "attention.head_count_kv" and value is None:  # an array, a count a layer
        return model_type in PER_LAYER_KV_HEADS
    if key in ("attention.key_length", "attention.value_length"):
        heads = values.get("attention.head_count")
        return bool(heads) and value == values.get("embedding_length", 0) // heads
    return key == "expert_gating_func" and _GATING.get(model_type) == value


def _install(arch: str, model_type: str, fields: dict[str, str]) -> None:
    """The reader takes `arch` (once) and `fields` (each file's: the table is the union)."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    wrap()
    if arch not in _taught:
        GGUF_CONFIG_MAPPING[arch] = reader.GGUF_TO_TRANSFORMERS_MAPPING["config"][arch] = {}
        reader.GGUF_SUPPORTED_ARCHITECTURES.append(arch)
        if arch in reader.TENSOR_PROCESSORS:  # one of ours (gguf_processors)
            pass
        elif arch in PERMUTED:
            reader.TENSOR_PROCESSORS[arch] = reader.LlamaTensorProcessor
        elif "expert_count" in fields:  # stacked experts into transformers 5's fused gate_up_proj / down_proj
            reader.TENSOR_PROCESSORS[arch] = stacked_experts()
        _taught[arch] = model_type
    GGUF_CONFIG_MAPPING[arch].update(fields)


def wrap() -> None:
    """The reader's config names the model type, its tensor map the file's architecture (once)."""
    from transformers import modeling_gguf_pytorch_utils as reader

    global _wrapped
    if _wrapped:
        return
    _wrapped = True
    load, weights_map = reader.load_gguf_checkpoint, reader.get_gguf_hf_weights_map

    def load_gguf_checkpoint(*args, **kwargs):
        parsed = load(*args, **kwargs)
        config = parsed.get("config", {})
        model_type = _taught.get(config.get("model_type"), config.get("model_type"))
        if (variant := KEYED_VARIANTS.get(model_type)) and config.get(variant[1]):
            model_type = variant[2]
        config["model_type"] = model_type
        scaling = config.get("rope_scaling")
        if isinstance(scaling, dict) and any(type(v).__module__.startswith("numpy") for v in scaling.values()):
            del config["rope_scaling"]  # gpt-oss' read as raw parts (5.24); gguf_gaps reads it from the file
        return parsed

    def get_gguf_hf_weights_map(hf_model, processor, model_type=None, *args, **kwargs):
        model_type = hf_model.config.model_type if model_type is None else model_type
        archs = [arch for arch, taught in _taught.items() if taught == model_type]
        arch = archs[0] if archs else VARIANTS.get(model_type, model_type)
        mapping = weights_map(hf_model, processor, arch, *args, **kwargs)
        top = not args and not kwargs.get("qual_name")  # the model itself, not one of its children
        return mapping | _underscored_biases(hf_model, arch, mapping) if top else mapping

    reader.load_gguf_checkpoint, reader.get_gguf_hf_weights_map = load_gguf_checkpoint, get_gguf_hf_weights_map


def _underscored_biases(hf_model, arch: str, mapping: dict[str, str]) -> dict[str, str]:
    """Parameters named `<x>_bias` (a router's `e_score_correction_bias`), which gguf-py's
    table knows as `<x>` + `.bias` (blk.N.exp_probs_b.bias) and transformers' map misses."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    model_arch = next((key for key, name in MODEL_ARCH_NAMES.items() if name == arch), None)
    if model_arch is None:
        return {}
    names = get_tensor_name_map(model_arch, hf_model.config.num_hidden_layers)
    mapped = set(mapping.values())
    found = {}
    for name in hf_model.state_dict():
        gguf_name = names.get_name(name.removesuffix("_bias")) if name.endswith("_bias") else None
        if gguf_name is not None and name not in mapped:
            found[f"{gguf_name}.bias"] = name
    return found
