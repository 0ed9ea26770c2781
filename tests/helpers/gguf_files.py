"""Small GGUF files written with the `gguf` package, for the GGUF tests: a Llama- or Qwen2-family
model whose layers each store their linears in a chosen block format, with the default model's
tokenizer and chat template in the metadata (copied from its GGUF file).

The `gguf` package quantizes the legacy formats (Q4_0 .. Q8_0) and the floats in numpy, not the
K-quants nor the IQ types: their blocks are random bytes with small float16 scales written over
the scale fields (a valid block of random weights; the reference, transformers, reads the same
file).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from backend.runner.convert import gguf_path

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 49152
# a K-quant block: (bytes, offsets of its float16 scale fields)
_K_BLOCKS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
             "Q6_K": (210, (208,))}  # fmt: skip
_SCALE = {"Q2_K": 0.01, "Q3_K": 0.002, "Q4_K": 0.005, "Q5_K": 0.002, "Q6_K": 0.0002}
# types without a kernel of ours (re-quantized at load): the float16 scale's offset and size
_REQUANTIZED = {"IQ4_NL": (0, 0.0004), "IQ4_XS": (0, 0.00002), "IQ3_S": (0, 0.002), "IQ2_XXS": (0, 0.004)}
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@lru_cache(maxsize=1)
def tokenizer_fields() -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """The default model's tokenizer.* metadata: (key, value, type, array item type)."""
    reader = GGUFReader(gguf_path())
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            item = field.types[1] if len(field.types) > 1 else None
            fields.append((key, field.contents(), field.types[0], item))
    return fields


def blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A [rows, cols] weight in `type_name`: the file's bytes (uint8 [rows, row bytes]) or floats."""
    if type_name in _K_BLOCKS:
        size, scale_at = _K_BLOCKS[type_name]
        raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
        for at in scale_at:
            scales = (rng.uniform(0.5, 1.5, size=(rows, cols // 256)) * _SCALE[type_name]).astype(np.float16)
            raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, cols // 256, 2)
        return raw.reshape(rows, -1)
    if type_name in _REQUANTIZED:
        at, scale = _REQUANTIZED[type_name]
        per_block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        raw = rng.integers(0, 256, size=(rows, cols // per_block, size), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.5, size=raw.shape[:2]) * scale).astype(np.float16)
        raw[..., at : at + 2] = scales[..., None].view(np.uint8)
        return raw.reshape(rows, -1)
    weights = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if type_name == "F32":
        return weights
    return quantize(weights, GGMLQuantizationType[type_name])


def write_model(
    path: Path, layer_types: list[dict[str, str] | str], arch: str = "llama", embed: str = "Q8_0",
    output: str | None = None, tokenizer: bool = True, chat_template: bool = True, seed: int = 0,
    extra: list[tuple[str, object, GGUFValueType]] = (), split_tensors: int = 0,
) -> Path:  # fmt: skip
    """A GGUF model of len(layer_types) layers; each entry a block type for all its linears, or
    {linear: type}. `output`: an untied lm_head's type (None: tied to the embedding);
    `tokenizer`, `chat_template`: whether the metadata holds them; `extra`: (key, value, type)
    as they are; `split_tensors`: at most so many tensors a file, as llama.cpp's gguf-split
    writes them (`name-00001-of-0000N.gguf`, the metadata in the first; its path returned)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, arch, split_max_tensors=split_tensors)
    for key, value, kind in extra:
        writer.add_key_value(key, value, kind)
    writer.add_block_count(len(layer_types))
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        for key, value, kind, item in tokenizer_fields():
            if chat_template or key != "tokenizer.chat_template":
                writer.add_key_value(key, value, kind, sub_type=item)
    _tensor(writer, "token_embd.weight", embed, VOCAB, HIDDEN, rng)
    _tensor(writer, "output_norm.weight", "F32", 1, HIDDEN, rng, norm=True)
    if output is not None:
        _tensor(writer, "output.weight", output, VOCAB, HIDDEN, rng)
    for i, types in enumerate(layer_types):
        types = types if isinstance(types, dict) else dict.fromkeys(LINEARS, types)
        for norm in ("attn_norm", "ffn_norm"):
            _tensor(writer, f"blk.{i}.{norm}.weight", "F32", 1, HIDDEN, rng, norm=True)
        shapes = _shapes()
        for name in LINEARS:
            rows, cols = shapes[name]
            _tensor(writer, f"blk.{i}.{name}.weight", types[name], rows, cols, rng)
        if arch == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                _tensor(writer, f"blk.{i}.{name}.bias", "F32", 1, shapes[name][0], rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(Path(path))[0] if split_tensors else path


def _shapes() -> dict[str, tuple[int, int]]:
    head = HIDDEN // HEADS
    return {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head, HIDDEN), "attn_v": (KV_HEADS * head, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
            "ffn_down": (HIDDEN, FFN)}  # fmt: skip


def _tensor(writer: GGUFWriter, name: str, type_name: str, rows: int, cols: int, rng, norm: bool = False) -> None:
    if norm:
        data = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
        writer.add_tensor(name, data)
        return
    data = blocks(type_name, rows, cols, rng)
    if rows == 1:
        data = data.reshape(-1)
    if type_name == "F32":
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[type_name])


def write_phi3(
    path: Path, type_name: str, rotary_dims: int, original_context: int | None = None, seed: int = 0
) -> Path:
    """A Phi-3 GGUF as llama.cpp's converter writes one: fused attn_qkv and ffn_up (gate|up),
    `rope.dimension_count` for a partial rotary, and with `original_context` longrope's factor
    tensors, its original context and attention factor."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "phi3")
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": HIDDEN, "feed_forward_length": FFN,
                "head_count": HEADS, "head_count_kv": KV_HEADS, "rope_freq_base": 10000.0,
                "layer_norm_rms_eps": 1e-5, "rope_dimension_count": rotary_dims}  # fmt: skip
    for name, value in settings.items():
        getattr(writer, f"add_{name}")(value)
    for key, value, kind, item in tokenizer_fields():
        writer.add_key_value(key, value, kind, sub_type=item)
    if original_context is not None:
        writer.add_rope_scaling_orig_ctx_len(original_context)
        writer.add_rope_scaling_attn_factors(1.25)
        for name, low in (("rope_factors_long.weight", 2.0), ("rope_factors_short.weight", 1.0)):
            writer.add_tensor(name, (low + rng.random(rotary_dims // 2)).astype(np.float32))
    _tensor(writer, "token_embd.weight", "Q8_0", VOCAB, HIDDEN, rng)
    _tensor(writer, "output_norm.weight", "F32", 1, HIDDEN, rng, norm=True)
    shapes = _shapes()
    qkv = shapes["attn_q"][0] + 2 * shapes["attn_k"][0]
    for i in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            _tensor(writer, f"blk.{i}.{norm}.weight", "F32", 1, HIDDEN, rng, norm=True)
        for name, (rows, cols) in (("attn_qkv", (qkv, HIDDEN)), ("attn_output", shapes["attn_output"]),
                                   ("ffn_up", (2 * FFN, HIDDEN)), ("ffn_down", shapes["ffn_down"])):  # fmt: skip
            _tensor(writer, f"blk.{i}.{name}.weight", type_name, rows, cols, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_from_hf(
    path: Path, model, arch: str, linear_type: str, settings: dict[str, object], permuted: bool = False,
    norm_shift: float = 0.0, extra: list[tuple[str, object, GGUFValueType]] = (), layout=None,
    split_tensors: int = 0, stacked: bool = False,
) -> Path:  # fmt: skip
    """`model`'s tensors (a transformers model) as a GGUF file of architecture `arch`, named by
    gguf-py's map (as llama.cpp's converter names them), its 2-D weights in `linear_type`
    (q / k rows `permuted` as the converter does for Llama-derived models, `norm_shift` added
    to every norm as it does for Gemma's); `settings`: GGUFWriter.add_<key> values
    (block_count ...), `extra` (key, value, type) as they are, plus the default model's tokenizer;
    `layout(name, array)`: the (file name, array) pairs a converter writes for a parameter it
    handles itself, or None; `split_tensors`: write_model's; `stacked`: the 3-D tensors (a
    mixture's stacked experts) in `linear_type` too (else float, as a layout's 2-D parts)."""
    import gguf

    writer = GGUFWriter(path, arch, split_max_tensors=split_tensors)
    for name, value in settings.items():
        getattr(writer, f"add_{name}")(value)
    for key, value, kind, item in tokenizer_fields():
        writer.add_key_value(key, value, kind, sub_type=item)
    for key, value, kind in extra:
        writer.add_key_value(key, value, kind)
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, settings["block_count"])
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        data = tensor.float().numpy() + (norm_shift if name.endswith("norm.weight") else 0.0)
        parts = layout(name, data) if layout else None
        if parts is not None:
            for gguf_name, part in parts:
                kind = linear_type if stacked and part.ndim == 3 else "F32"
                _add(writer, gguf_name, np.ascontiguousarray(part), kind)
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
        if permuted and name.rsplit(".", 2)[-2] in heads:  # each head's rows (half, i) as (i, half)
            rows = heads[name.rsplit(".", 2)[-2]]
            data = data.reshape(rows, 2, -1, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        _add(writer, gguf_name, data, linear_type if data.ndim == 2 or (stacked and data.ndim == 3) else "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(Path(path))[0] if split_tensors else path


def _add(writer: GGUFWriter, name: str, data: np.ndarray, type_name: str) -> None:
    """`data` as tensor `name`: in `type_name` where its rows are a multiple of 32 long, else float."""
    if data.shape[-1] % 32 == 0 and type_name != "F32":
        writer.add_tensor(name, quantize(data, GGMLQuantizationType[type_name]),
                          raw_dtype=GGMLQuantizationType[type_name])  # fmt: skip
    else:
        writer.add_tensor(name, data)


def file_numbers(model, type_name: str = "Q8_0", stacked: bool = False) -> None:
    """Put in `model` the numbers `write_from_hf` writes for it in `type_name`: each 2-D weight
    it quantizes (a row a multiple of 32 long), and the 3-D ones where `stacked`, quantized and
    dequantized by gguf-py."""
    import torch
    from gguf.quants import dequantize

    kind = GGMLQuantizationType[type_name]
    with torch.no_grad():
        for param in model.parameters():
            if (param.dim() == 2 or (stacked and param.dim() == 3)) and param.shape[-1] % 32 == 0:
                data = dequantize(quantize(param.detach().float().numpy(), kind), kind)
                param.copy_(torch.from_numpy(data).reshape(param.shape))
