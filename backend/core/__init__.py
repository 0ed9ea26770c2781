"""The engine core: `LLMEngine`, the scheduler that owns each sequence's lifecycle, the
sequences, the KV block pool with its prefix cache, and the engine's config."""
