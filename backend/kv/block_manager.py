"""The KV block pool, block tables and the prefix cache: the scheduler's only door to memory.

Blocks hold `block_size` tokens. A full block gets a chain hash over its parent's
hash, the tenant, the adapter *version* and its tokens, so a block is reused only by a
sequence with the very same history under the same tenant and adapter weights: one
tenant never reads another's cached prefix, one adapter never another's, and an
adapter loaded again (a new version) never its former version's. A block holding an
image's or video's placeholder tokens also hashes that item's content hash (as vLLM's
extra keys do), so the same picture hits the cache and a different one never does. The
hash is SHA-256 (truncated), so a caller cannot craft a collision into another tenant's blocks.

Free blocks wait in one LRU queue, cached or not. Allocation takes from the front;
taking a cached block evicts its hash. A freed sequence returns its blocks tail
first, so a prefix outlives its suffixes.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import json
from dataclasses import dataclass

from backend.contract.routing import routing_scope
from backend.types.sequence import EncoderState, Sequence


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class KVEventKind(enum.Enum):
    STORED = "stored"
    EVICTED = "evicted"


@dataclass(slots=True, frozen=True)
class KVEvent:
    """A block entered (STORED) or left (EVICTED) the prefix cache. A stored block also
    carries what a KV-aware router needs to match it: its parent's hash (None: the chain's
    first block), its tokens and its routing scope (backend.contract.routing)."""

    kind: KVEventKind
    block_hash: bytes
    parent_hash: bytes | None = None
    tokens: tuple[int, ...] = ()
    scope: str | None = None


def _root_hash(seq: Sequence) -> bytes:
    """A chain's root: the tenant, the request's cache salt (a scope within the tenant), the
    adapter version and, for a translation, its source (the decoder's tokens mean nothing
    without it)."""
    version = seq.adapter.version if seq.adapter is not None else 0
    scope = json.dumps(["root", seq.request.lookup_tenant, seq.request.cache_salt, version])  # no salt spells a tenant
    root = hashlib.sha256(scope.encode()).digest()[:16]
    return chain_hash(root, seq.encoder.tokens) if seq.encoder is not None else root


def _routing_scope(seq: Sequence) -> str | None:
    adapter = seq.adapter.name if seq.adapter is not None else ""
    return routing_scope(seq.request.lookup_tenant, seq.request.cache_salt, adapter)


def chain_hash(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """A block's hash: its parent's, its tokens and `extra` (the content hashes of the images
    whose placeholder tokens it holds: the tokens are the same for every picture)."""
    data = parent + b"".join(t.to_bytes(4, "little", signed=True) for t in tokens) + extra
    return hashlib.sha256(data).digest()[:16]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: collections.OrderedDict[int, Block] = collections.OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        self.events: collections.deque[KVEvent] = collections.deque(maxlen=4096)

    # -- pool state ---------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------

    def _hash_full_blocks(self, seq: Sequence, upto_tokens: int) -> None:
        """Extend seq.block_hashes over the full blocks among its first `upto_tokens`."""
        parent = seq.block_hashes[-1] if seq.block_hashes else _root_hash(seq)
        bs = self.block_size
        for i in range(len(seq.block_hashes), upto_tokens // bs):
            extra = seq.vision.block_keys(i * bs, (i + 1) * bs) if seq.vision is not None else b""
            parent = chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], extra)
            seq.block_hashes.append(parent)

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """The longest run of cached blocks matching the start of the sequence.

        The last token is never a hit: its logits must be computed to sample the next.
        """
        if not self.enable_prefix_caching:
            return []
        self._hash_full_blocks(seq, seq.num_tokens - 1)
        hits = []
        for block_hash in seq.block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_registered_blocks:
            return
        self._hash_full_blocks(seq, seq.num_computed_tokens)
        scope = _routing_scope(seq)
        for i in range(seq.num_registered_blocks, num_full):
            block, block_hash = self.blocks[seq.block_table[i]], seq.block_hashes[i]
            # The same content may have been computed twice concurrently: keep the first copy.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                parent = seq.block_hashes[i - 1] if i else None
                self.events.append(KVEvent(KVEventKind.STORED, block_hash, parent, tokens, scope))
        seq.num_registered_blocks = num_full

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first (at most the last 4096 are kept)."""
        events = list(self.events)
        self.events.clear()
        return events

    # -- allocation ---------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: list[Block] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens of seq; False (nothing changed) if full.

        `computed` are prefix-cache hits of a sequence being admitted (empty block table).
        """
        reviving = sum(1 for b in computed if b.ref_count == 0)
        total = len(seq.block_table) + len(computed)
        needed = self.blocks_needed(seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens)
        new = max(0, needed - total)
        if new + reviving > len(self._free):
            return False
        seq.num_registered_blocks += len(computed)
        for block in computed:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
        for _ in range(new):
            seq.block_table.append(self._take_free_block().block_id)
        return True

    def _take_free_block(self) -> Block:
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                self.events.append(KVEvent(KVEventKind.EVICTED, block.block_hash))
            block.block_hash = None
        block.ref_count = 1
        return block

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (holding no blocks) `parent`'s computed KV, for a beam that continues
        another: the full blocks are shared (their reference counts raised; nobody writes
        into a full block again) and the partial last block, if any, is a new block the
        runner must fill with the parent's: its (source, destination) is returned.
        The caller makes sure a free block is there (`num_free_blocks`)."""
        assert not child.block_table, "fork into a sequence that holds blocks"
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        for block_id in parent.block_table[:num_full]:
            self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        if not partial:
            return None
        copy = self._take_free_block().block_id
        child.block_table.append(copy)
        return parent.block_table[num_full], copy

    def allocate_encoder(self, encoder: EncoderState) -> bool:
        """Blocks for a source's encoder states (once; False, nothing changed, if the pool is short)."""
        needed = self.blocks_needed(len(encoder.tokens))
        if encoder.blocks or needed > len(self._free):
            return bool(encoder.blocks)
        encoder.blocks = [self._take_free_block().block_id for _ in range(needed)]
        return True

    def free_encoder(self, encoder: EncoderState) -> None:
        """Release a source's encoder blocks; it is encoded again if it runs again."""
        for block_id in reversed(encoder.blocks):
            self.blocks[block_id].ref_count = 0
            self._free[block_id] = self.blocks[block_id]
        encoder.blocks, encoder.encoded = [], False

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first; cached ones stay reusable until evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = block
        seq.block_table.clear()
        seq.num_registered_blocks = 0
