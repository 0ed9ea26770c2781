"""Sampling: the batched sampler and its draw, logprobs, the repeat penalties (DRY, LZ),
grammars (xgrammar) and the vocabulary they read."""
