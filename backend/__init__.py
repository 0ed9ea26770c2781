"""The engine behind model `llm`, importable and testable without Triton.

- contract/  the wire: the typed request, the events, the model's facts, errors (pure data)
- core/      LLMEngine, the scheduler, sequences, the KV block pool and prefix cache
- runner/    the model runner and the forwards in runner/models/
- sampling/  the batched sampler, logprobs, penalties, grammars
- guards/    stopping and steering: thinking, loops, tool calls, deadlines
- settings/  per-model settings (MODEL.toml, presets/)
- serving/   what model.py runs on: the engine thread, live requests, the sender

Importing this package imports nothing heavy; `backend.contract` is safe for the
frontend. Torch is imported only by the modules that need it.
"""
