"""Beam search by transformers' rules: one request's search step by step (search.py) and its
rows on the paged cache (group.py). The scheduler's `BeamRows` (backend.core) drives them."""
