"""A tiny random Qwen2-VL (`Qwen2VLForConditionalGeneration`), written here: none can be
downloaded. Text: hidden 64, 2 layers, 4 heads (2 KV heads), a 256-token vocabulary with the
four vision token ids set inside it. Vision: Qwen2-VL's layout (patch 14, temporal patch 2,
2x2 merge, QuickGELU MLPs) at depth 2, embed_dim 32, 4 heads, its merger out to the text's
64. Weights are normal(0, 0.05) so activations stay finite but not trivially small; LayerNorm
gains are ones, their biases small. Qwen2-VL's PIL image processor is saved beside them.

With `tokenizer_from` (a model folder, e.g. the default SmolLM2), the build takes that
tokenizer plus Qwen2-VL's four vision tokens appended to it (the vocabulary grows to match)
and Qwen2-VL's chat template, so a server can run it from text; `vision_token_ids(folder)`
reads the ids back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_TOKEN_ID = 250
VIDEO_TOKEN_ID = 251
VISION_START_TOKEN_ID = 252
VISION_END_TOKEN_ID = 253
_STD = 0.05


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * _STD
            is_norm_gain = param.dim() == 1 and name.endswith("weight")
            param.copy_(1.0 + noise if is_norm_gain else noise)


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL-Instruct's chat template: an image part renders <|vision_start|><|image_pad|><|vision_end|>
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_qwen2_vl(dest: Path, seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """The tiny Qwen2-VL in `dest` (kept if written): safetensors weights, config.json,
    and the image processor's preprocessor_config.json; with `tokenizer_from`, a tokenizer."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision_ids = (VISION_START_TOKEN_ID, VISION_END_TOKEN_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID)
    vocab_size, tokenizer = 256, None
    if tokenizer_from is not None:
        tokenizer, ids = _vision_tokenizer(Path(tokenizer_from))
        vision_ids = tuple(tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)))
        vocab_size = len(tokenizer)
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                **ids)  # fmt: skip
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, in_channels=3,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")  # fmt: skip
    start, end, image, video = vision_ids
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                           vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False,
                           **ids)  # fmt: skip
    model = Qwen2VLForConditionalGeneration(config).eval()
    _randomize(model, seed)
    model.save_pretrained(dest)
    _save_image_processor(dest)
    if tokenizer is not None:
        tokenizer.save_pretrained(dest)
        (dest / "generation_config.json").write_text(json.dumps({**ids, "do_sample": False}))
    return dest


def _vision_tokenizer(source: Path):
    """`source`'s tokenizer plus the four vision tokens, with Qwen2-VL's chat template;
    and its (bos, eos, pad) ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return tokenizer, dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def vision_token_ids(folder: Path) -> dict[str, int]:
    """The build's image, video, vision start and end token ids, from its config.json."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return {name: raw[name] for name in names}


def _save_image_processor(dest: Path) -> None:
    try:
        from transformers import Qwen2VLImageProcessorPil
    except ImportError:  # an older transformers: no PIL-only processor to save
        return
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 256).save_pretrained(dest)


def write_tiny_qwen2_5_vl(dest: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) in `dest` (kept if
    written): the Qwen2-VL build's text part and token ids; a vision tower of depth 2, width 32,
    4 heads, SwiGLU 64, 56-pixel attention windows (2x2 merged tokens) in block 0 and full
    attention in block 1, its merger out to 64; 2 video tokens per second. No tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                **ids)  # fmt: skip
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=4,
                  in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu",
                  window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                              video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_TOKEN_ID,
                              vision_end_token_id=VISION_END_TOKEN_ID, tie_word_embeddings=False,
                              **ids)  # fmt: skip
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    _randomize(model, seed)
    model.save_pretrained(dest)
    _save_image_processor(dest)
    return dest
