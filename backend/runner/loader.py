"""Load a local Hugging Face folder (config.json + *.safetensors, sharded or not) into our model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from backend.runner.convert import source_gguf
from backend.runner.gguf_load import load_gguf_weights
from backend.runner.gguf_model import gguf_source
from backend.runner.hf_config import SUPPORTED_ARCHITECTURES, is_m2m100, load_model_config
from backend.runner.huge_pages import release_freed_memory
from backend.runner.models.gemma import ARCHITECTURES as GEMMA_ARCHITECTURES
from backend.runner.models.gemma import GemmaForCausalLM
from backend.runner.models.llama import LlamaForCausalLM
from backend.runner.models.m2m100_decoder import M2M100ForTranslation
from backend.runner.models.moe import MoeForCausalLM
from backend.runner.models.mtp import MtpHead
from backend.runner.models.qwen2_5_vl_vision import Qwen2_5VisionEncoder
from backend.runner.models.qwen2_vl_vision import Qwen2VisionEncoder, is_vision_weight, strip_vision_prefix
from backend.runner.models.transformers_lm import TransformersCausalLM
from backend.runner.quant.apply import QuantSpec, quantize_model, resolve_auto
from backend.runner.transformers_loader import NotServable, load_transformers_model, transformers_class
from backend.runner.weights import iter_weights, weight_files, weight_formats
from backend.settings.paths import model_name

GENERIC_PATH = "transformers' modeling code, our paged attention and matmuls"
MODEL_IMPLS = ("auto", "native", "transformers")  # MODEL_IMPL: which forward runs a model (load_model)
_MTP_PREFIX = "model.mtp_layers."
# transformers 5 saves a vision-language model's text weights under model.language_model.
_TEXT_PREFIX, _LEGACY_TEXT_PREFIX = "model.language_model.", "model."
# a vision-language checkpoint whose language model alone runs on our forward (Gemma 3 4B and
# up: hf_config.LANGUAGE_MODEL_OF): its text weights' names as the text model's, the rest unread
_LANGUAGE_MODEL_NAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                         (_TEXT_PREFIX, _LEGACY_TEXT_PREFIX))  # fmt: skip
_UNREAD_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                 "model.visual.")  # fmt: skip
# our forwards other than LlamaForCausalLM, by architecture (_load_native)
# our own forward's model class by architecture (the rest: LlamaForCausalLM)
_NATIVE_CLASSES = {"Qwen3MoeForCausalLM": MoeForCausalLM, "MixtralForCausalLM": MoeForCausalLM,
                   **dict.fromkeys(GEMMA_ARCHITECTURES, GemmaForCausalLM)}  # fmt: skip


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantSpec | None = None,
    impl: str = "auto",
    context: int | None = None,
) -> LlamaForCausalLM | M2M100ForTranslation | TransformersCausalLM:
    """The folder's model: on our own forward where it takes the architecture (its MTP layers,
    when the checkpoint ships them, in `model.mtp`), else on the generic path (transformers'
    modeling code: backend/runner/models/transformers_lm.py); `impl` (MODEL_IMPL) forces one:
    native | transformers. An NLLB / M2M100 folder gives M2M100ForTranslation
    (backend/runner/models/m2m100_decoder.py). `quant` (QUANT) quantizes the decoder's linears:
    backend/runner/quant/apply.py. `context` (MAX_MODEL_LEN) picks longrope's factors
    (backend/runner/hf_config.py)."""
    folder = Path(path)
    if impl not in MODEL_IMPLS:
        raise ValueError(f"MODEL_IMPL must be one of {', '.join(MODEL_IMPLS)}; got {impl!r}")
    if is_m2m100(folder):
        if quant is not None and quant.kind not in ("none", "auto"):
            raise ValueError(f"QUANT={quant.kind} serves decoder-only models; {folder} is an NLLB / M2M100 model")
        return M2M100ForTranslation.load(folder, dtype, device)
    refusal = "MODEL_IMPL=transformers" if impl == "transformers" else _native_refusal(folder)
    if refusal is not None and impl == "native":
        raise ValueError(f"MODEL_IMPL=native: {refusal}")
    try:
        if refusal is None:
            return _load_native(folder, dtype, device, quant, context)
        return _load_generic(folder, dtype, device, quant, refusal)
    finally:
        release_freed_memory()  # the load's float copies, one tensor at a time, freed but held by malloc


def _native_refusal(folder: Path) -> str | None:
    """Why our own forward does not take the folder's model (None: it does)."""
    try:
        load_model_config(folder)
    except ValueError as e:
        return str(e)
    return None


def _load_generic(folder: Path, dtype, device, quant: QuantSpec | None, refusal: str) -> TransformersCausalLM:
    """The generic path's model, or one error saying why neither path serves it."""
    raw = json.loads((folder / "config.json").read_text())
    try:
        return load_transformers_model(folder, raw, dtype, device, quant)
    except NotServable as e:
        raise _not_served(folder, raw, e, refusal) from None


def _not_served(folder: Path, raw: dict, reason: NotServable, refusal: str) -> ValueError:
    """One error saying why neither path serves the folder's model, and what each takes."""
    # a supported architecture's variant our forward refused: say which, else the list
    ours = refusal if (raw.get("architectures") or [None])[0] in SUPPORTED_ARCHITECTURES else None
    return ValueError(
        f"{model_name(folder)} is not served: {reason}. Our own forward takes {', '.join(SUPPORTED_ARCHITECTURES)}"
        + (f" ({ours})" if ours else "")
        + "; transformers' modeling code takes any decoder-only *ForCausalLM it implements whose layers attend "
        "through its attention interface or keep state through its cache interface"
    )


def describe_model(path: str | Path, impl: str = "auto") -> str:
    """One line for `make serve`: which forward runs the folder's model and its weights' formats;
    ValueError where neither can (from config.json: the generic path's probe runs at load)."""
    folder = Path(path)
    if is_m2m100(folder):
        return f"{model_name(folder)}: an NLLB / M2M100 translation model on our own forward"
    refusal = "MODEL_IMPL=transformers" if impl == "transformers" else _native_refusal(folder)
    raw = json.loads((folder / "config.json").read_text())
    if refusal is None:
        where = f"{raw['architectures'][0] if raw.get('architectures') else raw.get('model_type')} on our own forward"
    elif impl == "native":
        raise ValueError(f"MODEL_IMPL=native: {refusal}")
    else:
        try:
            where = f"{transformers_class(raw)} on the transformers path ({GENERIC_PATH})"
        except NotServable as e:
            raise _not_served(folder, raw, e, refusal) from None
    return f"{model_name(folder)}: {where}; weights {weight_formats(folder)}"


def _load_native(folder: Path, dtype, device, quant: QuantSpec | None, context: int | None) -> LlamaForCausalLM:
    cfg = load_model_config(folder, context)
    model = _NATIVE_CLASSES.get(cfg.architecture, LlamaForCausalLM)(cfg, dtype, device)
    source = gguf_source(folder)
    if source is not None:  # a GGUF file's prepared folder: the weights come from the file
        load_gguf_weights(model, source, _raw_model_type(folder), quant or QuantSpec(), device)
        print(f"model: {cfg.architecture} on our own forward", file=sys.stderr)
        return model.eval()
    mtp_weights: list[tuple[str, torch.Tensor]] = []
    vision_weights: dict[str, torch.Tensor] = {}

    def trunk():
        for name, tensor in iter_weights(weight_files(folder)):
            if cfg.num_mtp_layers and name.startswith(_MTP_PREFIX):
                mtp_weights.append((name, tensor))
            elif cfg.vision is not None and is_vision_weight(name):
                vision_weights[strip_vision_prefix(name)] = tensor.to(device=device, dtype=dtype)
            elif cfg.vision is not None and name.startswith(_TEXT_PREFIX):
                yield _LEGACY_TEXT_PREFIX + name[len(_TEXT_PREFIX) :], tensor
            elif cfg.vision is None and name.startswith(_UNREAD_PARTS):
                continue
            else:
                yield _language_model_name(name), tensor

    model.load_weights(trunk())
    if cfg.num_mtp_layers:
        model.mtp = MtpHead(cfg, dtype, device)
        model.mtp.load_weights(mtp_weights)
    if cfg.vision is not None:
        model.visual = _vision_encoder(folder, cfg.vision.family, vision_weights)
    if quant is not None:
        gguf_file = source_gguf(folder)
        quantize_model(model, resolve_auto(quant, model, device, gguf_file), gguf_file)
    print(f"model: {cfg.architecture} on our own forward", file=sys.stderr)
    return model.eval()


def _language_model_name(name: str) -> str:
    """A vision-language checkpoint's text weight named as the text model's (others as they are)."""
    for prefix, ours in _LANGUAGE_MODEL_NAMES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name


def _raw_model_type(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text()).get("model_type", "")


def _vision_encoder(folder: Path, family: str, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The family's vision encoder from the checkpoint's vision tensors (prefix dropped)."""
    encoder = Qwen2_5VisionEncoder if family == "qwen2_5_vl" else Qwen2VisionEncoder
    if "patch_embed.proj.weight" not in weights:
        raise ValueError(f"no vision weights (visual.*) in {folder}")
    return encoder(encoder.config_class.load(folder), weights)
