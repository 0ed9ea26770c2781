"""Speculative decoding: proposers draft tokens (n-gram, Predicted Outputs, a draft model,
MTP) and the speculator decides who drafts how many; the scheduler's `Verifier`
(backend.core.verify) checks them through the ordinary sampler, so the output is plain
decoding's."""
