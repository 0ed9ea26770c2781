"""The vision encoder's outputs of recent items, by content hash, so that a prompt computed
again (a prefix-cache miss on its text, a preemption, a chunk that splits an image) or the
same picture in another request does not run the encoder again.

Bounded by the tokens it holds (ENCODER_CACHE_TOKENS), least recently used out first. The
scheduler asks what is cached (a cached item costs the step no encoder time); the model
runner fills it. An item larger than the whole cache is still kept, alone, until the next
insertion, so a prompt chunked across steps finds it in the step after.
"""

from __future__ import annotations

import collections

import torch


class EncoderCache:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def get(self, content_hash: str) -> torch.Tensor | None:
        embeds = self._entries.get(content_hash)
        if embeds is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(content_hash)
        return embeds

    def put(self, content_hash: str, embeds: torch.Tensor) -> None:
        """Keep `embeds` [tokens, hidden]; evicts the least recently used beyond the bound."""
        old = self._entries.pop(content_hash, None)
        if old is not None:
            self._tokens -= old.shape[0]
        self._entries[content_hash] = embeds
        self._tokens += embeds.shape[0]
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= evicted.shape[0]
