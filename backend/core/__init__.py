"""The engine core: `LLMEngine`, and the scheduler that owns each sequence's lifecycle
(its waiting queue, admission, the encoder budget and the beam rows). It drives the
runner, the sampler, the guards, speculation, LoRA and beams; none of them imports it."""
