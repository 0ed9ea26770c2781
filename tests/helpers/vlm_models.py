"""A tiny random Qwen2-VL (`Qwen2VLForConditionalGeneration`), written here: none can be
downloaded. Text: hidden 64, 2 layers, 4 heads (2 KV heads), a 256-token vocabulary with the
four vision token ids set inside it. Vision: Qwen2-VL's layout (patch 14, temporal patch 2,
2x2 merge, QuickGELU MLPs) at depth 2, embed_dim 32, 4 heads, its merger out to the text's
64. Weights are normal(0, 0.05) so activations stay finite but not trivially small; LayerNorm
gains are ones, their biases small. Qwen2-VL's PIL image processor is saved beside them.
"""

from __future__ import annotations

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


def write_tiny_qwen2_vl(dest: Path, seed: int = 0) -> Path:
    """The tiny Qwen2-VL in `dest` (kept if written): safetensors weights, config.json,
    and the image processor's preprocessor_config.json."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, in_channels=3,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")  # fmt: skip
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                           video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_TOKEN_ID,
                           vision_end_token_id=VISION_END_TOKEN_ID, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2VLForConditionalGeneration(config).eval()
    _randomize(model, seed)
    model.save_pretrained(dest)
    _save_image_processor(dest)
    return dest


def _save_image_processor(dest: Path) -> None:
    try:
        from transformers import Qwen2VLImageProcessorPil
    except ImportError:  # an older transformers: no PIL-only processor to save
        return
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 256).save_pretrained(dest)
