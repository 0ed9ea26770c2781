"""Model implementations: the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM)."""

from backend.runner.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
