"""A model's architecture as the loader reads it from its config.json (or a GGUF file's
metadata): what every forward, the LoRA lanes and the KV pool size themselves by."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.contract.vision import VisionInfo


@dataclass(slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default", "linear", "llama3" or "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3, longrope
    # Phi-3's longrope: the per-frequency factors the served context chose (short_factor, or
    # long_factor where it exceeds original_max_position_embeddings) and cos / sin's scale
    ext_factors: tuple[float, ...] = ()
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0  # the share of head_dim RoPE turns (Phi-4-mini: 0.75)


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v
    o_proj_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    sliding_windows: tuple[int | None, ...] = ()  # per layer; empty means no window anywhere
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    num_mtp_layers: int = 0  # MiMo's model.mtp_layers (backend/runner/models/mtp.py)
    # Qwen2-VL's M-RoPE: frequency pairs per (t, h, w) row (backend/vision/mrope.py); empty: 1-D RoPE
    mrope_section: tuple[int, ...] = ()
    vision: VisionInfo | None = None  # a vision-language model's token ids and patch layout
    # a mixture of experts' routed MLPs (backend/runner/models/moe.py); None: every layer dense
    moe: MoeConfig | None = None
    # Gemma 2 / 3 (backend/runner/models/gemma.py); other architectures keep the defaults
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcapping: float = 0.0  # > 0: attention scores soft-capped (Gemma 2); 0: off
    final_logit_softcapping: float = 0.0  # > 0: logits soft-capped; 0: off
    local_rope: RopeConfig | None = None  # the sliding-window layers' RoPE (Gemma 3); None: `rope`
    # layers that never attend (a hybrid's state layers, Mamba's every layer): their KV caches are empty
    kv_free_layers: tuple[int, ...] = ()


@dataclass(slots=True)
class MoeConfig:
    """Qwen3-MoE's and Mixtral's routed MLP blocks: softmax over the router's logits, the top
    `top_k` experts, their outputs weighted by those probabilities."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's; a dense layer's is ModelConfig.intermediate_size
    norm_topk_prob: bool  # the top-k probabilities renormalized to sum to 1 (Mixtral: always)
    layers: tuple[int, ...]  # the routed layers; the others are dense MLPs
