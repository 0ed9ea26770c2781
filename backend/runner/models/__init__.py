"""Model implementations: the Llama family (llama.py: Llama 2/3, Mistral, Qwen2, Qwen3,
SmolLM, MiMo with its MTP layers in mtp.py; RoPE in rope.py), NLLB / M2M100 (m2m100*.py) and
the Qwen2-VL / Qwen2.5-VL vision towers."""

from backend.runner.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
