"""Loading a checkpoint on the generic path (backend/runner/models/transformers_lm.py): any
decoder-only `*ForCausalLM` transformers implements, checked at load by a probe that its layers
attend through our paged cache or keep state through transformers' cache interface, and
continue it from step to step (`probe`: over chunks of a prompt, or only one token at a time)."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from backend.runner.forward_batch import Span, build_forward_batch
from backend.runner.gguf_archs import register as register_gguf_architectures
from backend.runner.gguf_model import gguf_source
from backend.runner.models.transformers_lm import TransformersCausalLM, register_attention, row_linears
from backend.runner.quant.apply import QuantSpec
from backend.runner.quant.gguf_blocks import split_parts
from backend.runner.transformers_build import NotServable, build
from backend.runner.transformers_gguf import Kept, newer_reader, streamed
from backend.runner.transformers_quant import install_experts, multiplies_blocks, quantize_linears
from backend.runner.weights import eos_token_ids
from backend.types.model_config import ModelConfig

_PROBE = (3, 2, 1)  # tokens of the probe's steps (a prefill, a chunk continuing it, then a decode)


_WHY_SPLIT = {  # why a model gives other logits in steps than in one go: it has state layers, or not
    True: "transformers' code for its state layers continues their state neither over several new tokens nor one",
    False: "it keeps state outside attention's KV cache and transformers' cache interface (recurrent code of its own)",
}


def transformers_class(raw: dict[str, Any]) -> str:
    """The `*ForCausalLM` class transformers builds for a config.json (`raw`); NotServable where
    it has none, or the model is an encoder or an encoder-decoder."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED,
    )

    model_type = raw.get("model_type")
    if model_type not in CAUSAL:
        raise NotServable(f"model_type {model_type!r} has no causal language model in transformers")
    if raw.get("is_encoder_decoder") or model_type in MASKED:
        raise NotServable(f"model_type {model_type!r} is not a decoder-only model")
    kinds = _attention_of_its_own(raw.get("text_config") or raw)
    if kinds:
        raise NotServable(f"{CAUSAL[model_type]} has {', '.join(kinds)} layers, whose masks or selected keys the "
                          f"engine's attention does not make (it makes causal and sliding-window ones)")  # fmt: skip
    return CAUSAL[model_type]


# attention layers the engine's attention makes (linear attention: a state layer, transformers' own code)
_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "linear_attention")


def _attention_of_its_own(raw: dict[str, Any]) -> list[str]:
    """config.json's attention layer kinds the engine does not make: Llama 4's chunked attention,
    DeepSeek-V3.2's indexed, DeepSeek-V4's compressed ones (their masks would be ours, wrongly)."""
    kinds = {kind for kind in raw.get("layer_types") or () if isinstance(kind, str)}
    return sorted(kind for kind in kinds if kind.endswith("attention") and kind not in _ATTENTION_LAYERS)


def model_config(hf_config: Any, folder: Path, raw: dict[str, Any], class_name: str) -> ModelConfig:
    """Our ModelConfig of a transformers config: what the KV pool and the engine size by."""
    text = hf_config.get_text_config()
    heads = getattr(text, "num_attention_heads", None) or 1  # attention-free (Mamba): the pool's blocks count tokens
    kv_heads = _global(text, "num_key_value_heads") or heads  # attention_shape sees the layers' own
    window = _global(text, "sliding_window")
    layer_types = _global(text, "layer_types") or ()
    eos = eos_token_ids(folder, raw)
    if not eos and isinstance(text.eos_token_id, int):
        eos = (text.eos_token_id,)
    return ModelConfig(
        architecture=class_name,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=_global(text, "intermediate_size") or 0,
        num_layers=text.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_global(text, "head_dim") or text.hidden_size // heads,  # attention_shape sees the layers' own
        rms_norm_eps=getattr(text, "rms_norm_eps", None) or 1e-6,
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 4096,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        sliding_windows=_windows(layer_types, window),
        eos_token_ids=eos,
        bos_token_id=getattr(text, "bos_token_id", None),
    )


def _global(config: Any, name: str) -> Any:
    """A config's global value of `name`, or None (also where the field varies per layer: Gemma 4's
    head_dim, which transformers refuses to read globally)."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _windows(layer_types, window: int | None) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: a global layer); () where no layer has one."""
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types) if window else ()


def load_transformers_model(
    folder: Path, raw: dict[str, Any], dtype: torch.dtype, device: torch.device, quant: QuantSpec | None = None
) -> TransformersCausalLM:
    """The folder's checkpoint on the generic path; NotServable where it cannot run there."""
    from transformers import AutoConfig

    class_name = transformers_class(raw)
    register_attention()
    hf_config = AutoConfig.from_pretrained(folder)
    quant = quant or QuantSpec()
    source = gguf_source(folder)  # a GGUF file: read a tensor at a time, its linears kept in blocks
    if source is not None:
        register_gguf_architectures(source)
        _one_file(source)
    where = {"pretrained_model_name_or_path": folder} if source is None else {
        "pretrained_model_name_or_path": source.parent, "gguf_file": source.name}  # fmt: skip
    kept = Kept() if quant.kind == "auto" and multiplies_blocks(quant, dtype, device) else None
    with streamed(kept) if source is not None else nullcontext():
        hf_model, loading, hf_config = build(where, hf_config, dtype, class_name)
    whose = type(hf_model).__name__
    alone = f" (its language model alone: {whose})" if hf_config.model_type != raw.get("model_type") else ""
    missing = sorted(loading.get("missing_keys") or ())
    if missing:  # transformers would start them at random
        raise NotServable(f"{class_name}: {len(missing)} weights are not in the checkpoint "
                          f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})")  # fmt: skip
    hf_model = hf_model.to(device).eval()
    q_heads = getattr(hf_config, "num_attention_heads", None)
    heads = {"attn_q": q_heads, "attn_k": _global(hf_config, "num_key_value_heads") or q_heads}
    quantized = quantize_linears(row_linears(hf_model, kept and kept.linears), quant, source, heads)
    experts = install_experts(hf_model, kept.experts, quant) if kept else None
    quantized = "; ".join(part for part in (quantized, experts) if part) or None
    model = TransformersCausalLM(hf_model, model_config(hf_config, folder, raw, class_name))
    model.config = attention_shape(model, device)
    probe(model, dtype, device)
    whole = "; each prompt in one step (its state layers continue over one new token, not several)"
    print(f"model: {class_name} on the transformers path{alone}" + (f"; {quantized}" if quantized else "")
          + (whole if model.whole_prompts else ""), file=sys.stderr)  # fmt: skip
    return model


def _one_file(source: Path) -> None:
    """NotServable for a GGUF split into parts that transformers' newer reader reads: it reads
    the tensors of one file (every other file is read by transformers_gguf, every part)."""
    parts = split_parts(source)
    if len(parts) > 1 and newer_reader(source):
        raise NotServable(f"{source.name} is split into {len(parts)} files, and the transformers path reads one: "
                          f"merge them first: llama-gguf-split --merge {source.name} merged.gguf")  # fmt: skip


@torch.inference_mode()
def attention_shape(model: TransformersCausalLM, device: torch.device) -> ModelConfig:
    """The model's config with the heads and head size its attention calls pass (what the KV
    cache holds), seen in a forward that computes no attention: a config's own fields can
    miss them (multi-head latent attention's keys of 192 and values of 128, expanded to every
    head; Gemma 4's global layers with other head sizes and fewer KV heads than its sliding
    ones). Every layer's cache holds the most KV heads any layer has (a layer with fewer
    repeats each, as grouped-query attention shares them) and the largest head size (attention
    zero-pads the smaller). A model keeping state: the layers that never attend hold no KV."""
    model.attention_shapes = shapes = {}
    try:
        model(build_forward_batch([Span([1, 2], 0, [0], 1)], 16, device), [])
    except Exception as e:  # the modeling code does what our forward does not give it
        raise NotServable(f"{model.config.architecture} fails on the engine's forward ({type(e).__name__}: {e})") from e
    finally:
        model.attention_shapes = None
    # a model keeping state: its layers that never attend (state layers, MLP-only ones) hold no KV
    free = tuple(i for i in range(model.config.num_layers) if i not in shapes) if model.state_layers else ()
    if not shapes:  # attention-free: the probe says so
        return replace(model.config, kv_free_layers=free)
    q_heads = {q for q, _, _, _ in shapes.values()}
    kv_heads = max(kv for _, kv, _, _ in shapes.values())
    if len(q_heads) != 1 or any(kv_heads % kv or next(iter(q_heads)) % kv_heads for _, kv, _, _ in shapes.values()):
        counts = sorted({(q, kv) for q, kv, _, _ in shapes.values()})
        raise NotServable(f"{model.config.architecture}: its layers' (query, KV) head counts {counts} do not "
                          f"share one cache layout")  # fmt: skip
    size = max(max(k, v) for _, _, k, v in shapes.values())
    return replace(model.config, num_heads=q_heads.pop(), num_kv_heads=kv_heads, head_dim=size, kv_free_layers=free)


@torch.inference_mode()
def probe(model: TransformersCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """NotServable unless every layer attends through our cache once a forward and the model
    keeps no other state than its state layers', which they continue from one step to the next:
    a prompt computed in one forward must give the logits, and each state layer the output, of
    the same prompt in a prefill, a chunk continuing it and a decode step (a recurrent layer run
    without its state would give others). Where only a chunk gives others, and the prompt in
    one step then a decode step do not, the model's state layers continue a state over one new
    token but not several (Mamba's, Jamba's, Falcon-Mamba's): `model.whole_prompts` is set, and
    the engine computes each prompt in one step."""
    cfg = model.config
    tokens = list(range(1, sum(_PROBE) + 1))
    try:
        one_go = _probe_run(model, [tokens], dtype, device)
        if _same(one_go, _probe_run(model, _steps(tokens, _PROBE), dtype, device)):
            return
        whole = (sum(_PROBE[:-1]), _PROBE[-1])
        if model.state_layers and _same(one_go, _probe_run(model, _steps(tokens, whole), dtype, device)):
            model.whole_prompts = True
            return
    except NotServable:
        raise
    except Exception as e:  # the modeling code does what our forward does not give it
        raise NotServable(f"{cfg.architecture} fails on the engine's forward ({type(e).__name__}: {e})") from e
    raise NotServable(f"{cfg.architecture} gives other logits when a prompt is computed in steps than in one "
                      f"go: {_WHY_SPLIT[bool(model.state_layers)]}")  # fmt: skip


def _steps(tokens: list[int], lengths: tuple[int, ...]) -> list[list[int]]:
    ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
    return [tokens[e - n : e] for n, e in zip(lengths, ends, strict=True)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two probe runs' outputs (the last logits, then each state layer's) agree."""
    return all(torch.allclose(x, y, rtol=1e-3, atol=1e-3 * float(x.abs().max())) for x, y in zip(a, b, strict=True))


def _probe_run(model: TransformersCausalLM, steps: list[list[int]], dtype, device) -> list[torch.Tensor]:
    """The last step's logits of `steps`, then each state layer's output at its last row."""
    model.state_outputs = outputs = {}
    try:
        logits = _probe_logits(model, steps, dtype, device)
    finally:
        model.state_outputs = None
    return [logits, *(outputs[layer] for layer in sorted(outputs))]


def _probe_logits(model: TransformersCausalLM, steps: list[list[int]], dtype, device) -> torch.Tensor:
    """Run `steps` (token lists) as successive steps of one sequence over a scratch cache; the
    last step's logits. NotServable unless each step had some layer attend or keep state and none
    attend twice (a layer that attends by code of its own gives other logits split than in one go)."""
    cfg, block_size = model.config, 16
    caches = [torch.zeros(2, 2, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
              for _ in range(cfg.num_layers)]  # fmt: skip
    start, logits, states = 0, None, [{}] if model.state_layers else None
    for step in steps:
        model.attention_calls = calls = []
        try:
            batch = build_forward_batch([Span(step, start, [0, 1], 1)], block_size, device)
            batch.layer_states = states
            logits = model.compute_logits(model(batch, caches)[batch.logits_indices])
        finally:
            model.attention_calls = None
        # a layer may do neither (Nemotron-H's MLP layers) or both (Falcon-H1's)
        if not (calls or model.state_layers) or len(set(calls)) != len(calls):
            raise NotServable(f"{cfg.architecture}: no layer attends through transformers' attention interface "
                              f"or keeps state through its cache interface, or one does twice a forward (attention "
                              f"code of its own, as ALiBi models have)")  # fmt: skip
        start += len(step)
    return logits
