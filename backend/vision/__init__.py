"""The language model's side of a vision-language model (Qwen2-VL, Qwen2.5-VL): a request's
items placed in its prompt (state.py), the encoder outputs cache (encoder_cache.py) and
M-RoPE (mrope.py). The towers themselves are runner/models/; the encoder budget per step is
the scheduler's (backend.core.vision_scheduling)."""
