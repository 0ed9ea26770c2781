"""Model implementations: the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM)."""

from backend.runner.models.llama import LlamaForCausalLM, ModelConfig, RopeConfig

__all__ = ["LlamaForCausalLM", "ModelConfig", "RopeConfig"]
