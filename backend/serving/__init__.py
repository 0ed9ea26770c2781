"""The Triton-facing pieces of model `llm`: the engine's thread, the registry of live
requests (with per-stream coalescing of outputs), the sender loop, the model's gauges."""
