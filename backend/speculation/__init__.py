"""Speculative decoding: proposers draft tokens, the scheduler verifies them through the
ordinary sampler (backend.core.scheduler), so the output is plain decoding's."""
