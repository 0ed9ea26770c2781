"""Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors or .bin) for our model.

PEFT's math for an adapted projection: y = W x + B (A x) * scaling, with scaling =
lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA (`use_rslora`); a module's r and
alpha come from `rank_pattern` / `alpha_pattern` when a key there matches its name
(PEFT's rule: the key is a regular expression matching the name's end, on a dot).
The rank of each module is checked against its tensors and MAX_LORA_RANK, and the
scaling folded into B here, so the forward adds x A^T B^T.

Every file's size is checked before it is opened (a 1 GB file read whole had raised the
model process's memory by ~850 MB before its refusal): the weights against
MAX_LORA_FILE_BYTES, by default the largest file a float32 adapter of rank MAX_LORA_RANK
on every projection of the served model needs (`largest_adapter_bytes`: a fixed bound
would need ~3.3 GB for a rank-64 adapter of a 70B Llama, while the default model's
largest is ~80 MB); the config against CONFIG_MAX_BYTES, since JSON parsed takes many
times its bytes and a real config is a few KB.

What changes that math or adapts something other than the decoder layers' seven
projections is refused, with the config key that asks for it: DoRA, bias, extra
trainable modules or tokens, embedding / lm_head targets, and the other variants.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.contract import ContractError
from backend.types.model_config import ModelConfig

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
CONFIG_MAX_BYTES = 1 << 20  # rank / alpha patterns for every module of a 70B model: ~40 KB
TENSOR_HEADER_BYTES = 4096  # per tensor, room for a file's own entry (safetensors' JSON, torch.save's zip and pickle)


@dataclass(slots=True)
class LoraWeights:
    """An adapter's tensors on the host: (layer, projection) -> (A [r, in], B [out, r]
    with the scaling folded in), float32; `rank`: the largest r."""

    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    rank: int
    digest: str  # of the folder's config and weights files: tells a changed folder


def read_adapter(path: str | Path, model: ModelConfig, max_rank: int, max_file_bytes: int | None = None) -> LoraWeights:
    """The adapter in `path`, checked against `model`; ContractError naming lora_path.
    `max_file_bytes`: MAX_LORA_FILE_BYTES (None: `largest_adapter_bytes`)."""
    folder = Path(path)
    if model.moe is not None:  # the lanes (backend/lora/lanes.py) hold one gate_up and one down per layer
        raise ContractError("lora_path", f"LoRA adapters are not served on mixture-of-experts models "
                            f"({model.architecture}): a layer's MLP is {model.moe.num_experts} experts")  # fmt: skip
    config_bytes = _config_bytes(folder)
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise ContractError("lora_path", f"{folder / 'adapter_config.json'} is not JSON: {exc}") from None
    _check_config(config, folder / "adapter_config.json")
    tensors, weights_bytes = _read_tensors(folder, max_file_bytes or largest_adapter_bytes(model, max_rank))
    modules = _modules(tensors, config, model, max_rank, folder)
    digest = hashlib.sha256(config_bytes + weights_bytes).hexdigest()
    return LoraWeights(modules, max(a.shape[0] for a, _ in modules.values()), digest)


def folder_digest(path: str | Path, max_file_bytes: int) -> str:
    """The digest `read_adapter` would give the folder now (cheap: no parsing)."""
    folder = Path(path)
    weights = _read_capped(_weights_file(folder), max_file_bytes, _WEIGHTS_BOUND)
    return hashlib.sha256(_config_bytes(folder) + weights).hexdigest()


def largest_adapter_bytes(model: ModelConfig, max_rank: int) -> int:
    """MAX_LORA_FILE_BYTES's default: the file of an adapter of rank `max_rank` on every
    projection of every layer of `model`, in float32, with its per-tensor headers."""
    per_layer = sum(sum(projection_shape(proj, model)) for proj in PROJECTIONS)  # A [r, in] + B [out, r]
    tensors = 2 * len(PROJECTIONS) * model.num_layers
    return 4 * max_rank * per_layer * model.num_layers + TENSOR_HEADER_BYTES * tensors


_WEIGHTS_BOUND = "MAX_LORA_FILE_BYTES allows (unset: what a float32 adapter of rank MAX_LORA_RANK needs for this model)"


def _config_bytes(folder: Path) -> bytes:
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise ContractError("lora_path", f"{folder} holds no adapter_config.json (a PEFT LoRA folder)")
    return _read_capped(config_path, CONFIG_MAX_BYTES, "a PEFT adapter_config.json may take")


def _read_capped(file: Path, limit: int, bound: str) -> bytes:
    """The file's bytes, its size checked before it is opened (and as it is read: it may grow)."""
    size = os.stat(file).st_size
    if size <= limit:
        with open(file, "rb") as f:
            data = f.read(limit + 1)
        if len(data) <= limit:
            return data
        size = len(data)
    raise ContractError("lora_path", f"{file} is {size:,} bytes, over the {limit:,} bytes {bound}")


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


def _read_tensors(folder: Path, max_file_bytes: int) -> tuple[dict[str, torch.Tensor], bytes]:
    file = _weights_file(folder)
    data = _read_capped(file, max_file_bytes, _WEIGHTS_BOUND)
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load

            return load(data), data
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), data
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
