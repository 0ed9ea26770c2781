"""Building a checkpoint's transformers model for the generic path (transformers_loader.py):
the folder's own `*ForCausalLM`, or, for a multimodal folder whose full model needs a package
that is not installed (Gemma 3n's vision tower: timm), its language model alone."""

from __future__ import annotations

from typing import Any

import torch

from backend.runner.models.transformers_lm import ATTENTION

# a multimodal checkpoint's language-model weights under the text model's own names: transformers
# 5's layout (model.language_model.*) and the older one (language_model.model.*, language_model.lm_head)
LANGUAGE_MODEL_KEYS = {r"^model\.language_model\.": "model.", r"^language_model\.model\.": "model.",
                       r"^language_model\.lm_head\.": "lm_head."}  # fmt: skip


class NotServable(ValueError):
    """A checkpoint the generic path cannot serve, and why."""


def text_config(hf_config: Any) -> Any | None:
    """A multimodal config's text config, where transformers has a `*ForCausalLM` of its own
    for it (Gemma 3n's gemma3n_text); else None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    text = hf_config.get_text_config()
    if text is hf_config or CAUSAL.get(text.model_type) in (None, CAUSAL.get(hf_config.model_type)):
        return None
    return text


def build(where: dict[str, Any], hf_config: Any, dtype: torch.dtype, class_name: str) -> tuple[Any, dict, Any]:
    """(model, its loading info, the config it was built from): the folder's own class, or
    where that needs a package not installed and the folder is multimodal, its language model
    (images and audio then refused, as on every model without a vision tower of ours)."""
    try:
        return _pretrained(where, hf_config, dtype) + (hf_config,)
    except KeyError as e:  # modeling code that picks its attention class by name (Falcon)
        if ATTENTION not in str(e):
            raise
        raise NotServable(f"{class_name}'s modeling code has attention of its own, not transformers' "
                          f"attention interface, which the engine's paged cache goes through") from None  # fmt: skip
    except ImportError as e:  # a part built on a package not installed (Gemma 3n's vision tower: timm)
        text = text_config(hf_config)
        if text is None:
            why = " ".join(str(e).split())[:200] or "transformers names none"
            raise NotServable(f"{class_name} needs a package that is not installed ({why})") from None
    return _pretrained(where, text, dtype, key_mapping=LANGUAGE_MODEL_KEYS) + (text,)


def _pretrained(where: dict[str, Any], config: Any, dtype: torch.dtype, **extra: Any) -> tuple[Any, dict]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        **where, config=config, dtype=dtype, attn_implementation=ATTENTION, output_loading_info=True, **extra
    )
