"""The KV cache's blocks: the pool, each sequence's block table, the prefix cache and its
events (`BlockManager`). The scheduler, beam search and the KV event publisher use it."""
