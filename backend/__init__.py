"""The engine: scheduler, paged KV cache with prefix caching, model runner, sampler.

Importing this package imports nothing heavy; `backend.contract` is safe for the
frontend. Torch is imported only by the modules that need it.
"""
