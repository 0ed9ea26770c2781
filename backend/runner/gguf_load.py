"""Filling our own forward from a GGUF file (MODEL=file.gguf on Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE):
QUANT=auto serves the decoder's linears and the lm_head in the file's own block formats (a
linear the file keeps in floats stays float32); QUANT=none dequantizes them to float32
(the float model llama.cpp's blocks stand for); QUANT=int8 / int4 quantize that float model."""

from __future__ import annotations

from pathlib import Path

import torch

from backend.kernels import native
from backend.runner.gguf_weights import PERMUTED_MODEL_TYPES, block_linears, float_weights, linear_names
from backend.runner.models.llama import LlamaForCausalLM
from backend.runner.quant.apply import QuantSpec, quantize_model
from backend.runner.quant.gguf_blocks import read_tensor_table


def load_gguf_weights(model: LlamaForCausalLM, source: Path, model_type: str, quant: QuantSpec, device) -> None:
    tensors = {t.name: t for t in read_tensor_table(source)}
    cfg, permuted = model.config, model_type in PERMUTED_MODEL_TYPES
    float32 = model.lm_head_t.dtype == torch.float32
    blocks = quant.kind == "auto" and torch.device(device).type == "cpu" and float32 and native() is not None
    taken = block_linears(tensors, cfg, permuted) if blocks else {}
    model.load_weights(float_weights(tensors, cfg, permuted, linear_names(cfg, taken)), linear_names(cfg, taken))
    if taken:  # a linear the file keeps in floats (F16 ...) stays float
        quantize_model(model, quant, blocks=taken)
    elif quant.kind not in ("none", "auto"):
        quantize_model(model, quant)
