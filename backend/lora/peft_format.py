"""Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors or .bin) for our model.

PEFT's math for an adapted projection: y = W x + B (A x) * scaling, with scaling =
lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA (`use_rslora`); a module's r and
alpha come from `rank_pattern` / `alpha_pattern` when a key there matches its name
(PEFT's rule: the key is a regular expression matching the name's end, on a dot).
The rank of each module is checked against its tensors and MAX_LORA_RANK, and the
scaling folded into B here, so the forward adds x A^T B^T.

What changes that math or adapts something other than the decoder layers' seven
projections is refused, with the config key that asks for it: DoRA, bias, extra
trainable modules or tokens, embedding / lm_head targets, and the other variants.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.contract import ContractError
from backend.runner.models.llama import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$"
)
# keys that, set, ask for something we do not compute (a value counts as unset when falsy)
_REFUSED = {
    "use_dora": "DoRA adapters",
    "bias": "bias training (only 'none')",
    "lora_bias": "LoRA bias terms",
    "modules_to_save": "fully trained extra modules",
    "trainable_token_indices": "trained token embeddings",
    "target_parameters": "LoRA on parameters (MoE experts)",
    "fan_in_fan_out": "the Conv1D (GPT-2) weight layout",
    "layer_replication": "replicated layers",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "alora_invocation_tokens": "activated LoRA",
    "megatron_config": "Megatron-sharded layers",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}
_UNSET = (None, False, "none", [], {}, "")


@dataclass(slots=True)
class LoraWeights:
    """An adapter's tensors on the host: (layer, projection) -> (A [r, in], B [out, r]
    with the scaling folded in), float32; `rank`: the largest r."""

    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    rank: int
    digest: str  # of the folder's config and weights files: tells a changed folder


def read_adapter(path: str | Path, model: ModelConfig, max_rank: int) -> LoraWeights:
    """The adapter in `path`, checked against `model`; ContractError naming lora_path."""
    folder = Path(path)
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise ContractError("lora_path", f"{folder} holds no adapter_config.json (a PEFT LoRA folder)")
    config_bytes = config_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise ContractError("lora_path", f"{config_path} is not JSON: {exc}") from None
    _check_config(config, config_path)
    tensors, weights_bytes = _read_tensors(folder)
    modules = _modules(tensors, config, model, max_rank, folder)
    digest = hashlib.sha256(config_bytes + weights_bytes).hexdigest()
    return LoraWeights(modules, max(a.shape[0] for a, _ in modules.values()), digest)


def folder_digest(path: str | Path) -> str:
    """The digest `read_adapter` would give the folder now (cheap: no parsing)."""
    folder = Path(path)
    return hashlib.sha256(
        (folder / "adapter_config.json").read_bytes() + _weights_file(folder).read_bytes()
    ).hexdigest()


def _check_config(config: dict, where: Path) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ContractError("lora_path", f"{where}: peft_type is {config['peft_type']!r}; only LORA adapters load")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in config:
            raise ContractError("lora_path", f"{where}: {key} is missing")
    for key, what in _REFUSED.items():
        if config.get(key) not in _UNSET:
            raise ContractError("lora_path", f"{where}: {key} = {config[key]!r}: {what} are not supported")


def _weights_file(folder: Path) -> Path:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (folder / name).is_file():
            return folder / name
    raise ContractError("lora_path", f"{folder} holds no adapter_model.safetensors (or adapter_model.bin)")


def _read_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    file = _weights_file(folder)
    data = file.read_bytes()
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load

            return load(data), data
        return torch.load(file, map_location="cpu", weights_only=True), data
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same refusal
        raise ContractError("lora_path", f"cannot read {file}: {exc}") from None


def _modules(tensors: dict, config: dict, model: ModelConfig, max_rank: int, folder: Path) -> dict:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None or match.group(2) not in PROJECTIONS:
            target = "embed_tokens / lm_head" if "embed" in name or "lm_head" in name else "this module"
            raise ContractError(
                "lora_path",
                f"{folder}: tensor {name!r} adapts {target}; only the decoder layers' "
                f"{', '.join(PROJECTIONS)} can be adapted (target_modules)",
            )
        layer, proj = int(match.group(1)), match.group(2)
        if layer >= model.num_layers:
            raise ContractError(
                "lora_path", f"{folder}: {name!r} is for layer {layer}; the model has {model.num_layers}"
            )
        pairs.setdefault((layer, proj), {})[match.group(3)] = tensor
    if not pairs:
        raise ContractError("lora_path", f"{folder}: the adapter holds no LoRA tensors")
    return {key: _module(key, ab, config, model, max_rank, folder) for key, ab in sorted(pairs.items())}


def _module(key, ab: dict, config: dict, model: ModelConfig, max_rank: int, folder: Path):
    layer, proj = key
    name = f"model.layers.{layer}.{'mlp' if proj in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{proj}"
    if set(ab) != {"A", "B"}:
        raise ContractError("lora_path", f"{folder}: {name} has lora_{''.join(ab)} but not both lora_A and lora_B")
    a, b = ab["A"].float(), ab["B"].float()
    rank = int(_pattern(config.get("rank_pattern") or {}, name, config["r"]))
    fan_in, fan_out = projection_shape(proj, model)
    if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
        raise ContractError(
            "lora_path",
            f"{folder}: {name}'s lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit this model's "
            f"[{fan_in} -> {fan_out}] projection at rank {rank} (r / rank_pattern)",
        )
    if rank > max_rank:
        raise ContractError(
            "lora_path", f"{folder}: {name} has rank {rank} (r / rank_pattern), above MAX_LORA_RANK={max_rank}"
        )
    alpha = float(_pattern(config.get("alpha_pattern") or {}, name, config["lora_alpha"]))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return a.contiguous(), (b * scaling).contiguous()


def _pattern(patterns: dict, name: str, default):
    """PEFT's pattern rule: the first key that, as a regex, matches the end of `name` after a dot."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def projection_shape(proj: str, model: ModelConfig) -> tuple[int, int]:
    """(in, out) features of a projection."""
    h, d, inter = model.hidden_size, model.head_dim, model.intermediate_size
    return {
        "q_proj": (h, model.num_heads * d),
        "k_proj": (h, model.num_kv_heads * d),
        "v_proj": (h, model.num_kv_heads * d),
        "o_proj": (model.num_heads * d, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }[proj]
