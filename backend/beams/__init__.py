"""Beam search: transformers' rules, one request's search step by step (the engine's
scheduling of beam groups on the paged cache builds on it; issue 14, in progress)."""
