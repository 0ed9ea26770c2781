"""The KV block pool and prefix cache: exact block ids, ref counts, eviction order."""

from backend.contract import GenerationRequest
from backend.guards.policy import GuardState
from backend.guards.thinking import Markers, PhaseGuard
from backend.kv.block_manager import BlockManager, KVEventKind
from backend.lora.registry import AdapterVersion
from backend.types.sequence import Sequence

BS = 4


def make_seq(tokens, tenant="", adapter=0, rid="r"):
    """`adapter`: the adapter version the sequence was admitted with (0: the base model)."""
    request = GenerationRequest(list(tokens), lookup_tenant=tenant)
    seq = Sequence.of(rid, request, 0.0, GuardState(PhaseGuard(Markers())))
    if adapter:
        seq.adapter = AdapterVersion(f"adapter-{adapter}", 1, adapter, "/nowhere", 4, "")
    return seq


def admit(bm, seq):
    """What the scheduler does: hits, allocate, mark computed, register full blocks."""
    hits = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return len(hits) * BS


def test_allocate_takes_blocks_in_order_and_free_returns_tail_first():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(10))  # 3 blocks: 2 full + 1 partial
    assert bm.allocate_slots(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(3)] == [1, 1, 1]
    assert bm.num_free_blocks() == 5
    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks() == 8
    # freed tail first: the free queue is now 3..7, then 2, 1, 0
    assert list(bm._free) == [3, 4, 5, 6, 7, 2, 1, 0]


def test_allocate_fails_without_side_effects_when_full():
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(range(9))  # needs 3 blocks
    assert not bm.allocate_slots(seq, 9)
    assert seq.block_table == []
    assert bm.num_free_blocks() == 2


def test_decode_appends_a_block_only_at_a_boundary():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(range(4))
    assert bm.allocate_slots(seq, 4)
    seq.num_computed_tokens = 4
    seq.token_ids.append(99)
    assert bm.allocate_slots(seq, 1)  # token 5 starts block 2
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 5
    seq.token_ids.append(98)
    assert bm.allocate_slots(seq, 1)  # token 6 fits in block 1
    assert seq.block_table == [0, 1]


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(12), rid="a")  # 3 full blocks
    assert admit(bm, a) == 0
    assert bm.num_cached_blocks() == 3
    b = make_seq(range(12), rid="b")
    # the whole prompt is cached, but the last token must be recomputed: 2 blocks hit
    assert admit(bm, b) == 8
    assert b.block_table[:2] == [0, 1]
    assert b.block_table[2] != 2
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]


def test_prefix_cache_is_scoped_by_tenant_and_adapter():
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, make_seq(range(9), tenant="A", rid="a"))
    assert admit(bm, make_seq(range(9), tenant="B", rid="b")) == 0
    assert admit(bm, make_seq(range(9), tenant="A", adapter=1, rid="c")) == 0
    assert admit(bm, make_seq(range(9), tenant="A", rid="d")) == 8
    # the key is the adapter's version: another version (a reload) of it shares nothing
    assert admit(bm, make_seq(range(9), tenant="A", adapter=1, rid="e")) == 8
    assert admit(bm, make_seq(range(9), tenant="A", adapter=2, rid="f")) == 0


def test_freed_cached_blocks_are_reused_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(8), rid="a")  # blocks 0, 1 (both full, cached)
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks() == 4 and bm.num_cached_blocks() == 2
    # free queue: 2, 3, then a's blocks tail first: 1, 0
    assert list(bm._free) == [2, 3, 1, 0]
    hit = make_seq(list(range(8)) + [50], rid="hit")
    assert admit(bm, hit) == 8  # revived from the free queue
    assert hit.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [1, 1, 1]
    bm.free(hit)
    # a new unrelated sequence needing 4 blocks evicts in queue order: 3, 2, 1, 0
    other = make_seq(range(100, 116), rid="other")
    admit(bm, other)
    assert other.block_table == [3, 2, 1, 0]
    evicted = [e for e in bm.events if e.kind is KVEventKind.EVICTED]
    assert len(evicted) == 2
    assert bm.num_cached_blocks() == 4  # other's 4 full blocks
    assert bm.get_computed_blocks(make_seq(list(range(8)) + [7], rid="late")) == []


def test_eviction_order_prefers_the_least_recently_freed():
    bm = BlockManager(num_blocks=4, block_size=BS)
    old = make_seq(range(4), rid="old")
    new = make_seq(range(10, 14), rid="new")
    admit(bm, old)
    admit(bm, new)
    bm.free(old)
    bm.free(new)
    # queue: 2, 3 (never used), then old's block 0, then new's block 1
    filler = make_seq(range(20, 32), rid="filler")  # 3 blocks: takes 2, 3, 0
    admit(bm, filler)
    assert filler.block_table == [2, 3, 0]
    # old's block 0 was evicted, new's block 1 survived
    assert bm.get_computed_blocks(make_seq(list(range(4)) + [1], rid="o2")) == []
    assert [b.block_id for b in bm.get_computed_blocks(make_seq(list(range(10, 14)) + [1], rid="n2"))] == [1]


def test_duplicate_content_computed_concurrently_keeps_the_first_copy():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(range(4), rid="a"), make_seq(range(4), rid="b")
    for s in (a, b):
        assert bm.allocate_slots(s, 4)
    for s in (a, b):
        s.num_computed_tokens = 4
        bm.cache_full_blocks(s)
    assert bm.num_cached_blocks() == 1
    assert bm.blocks[a.block_table[0]].block_hash is not None
    assert bm.blocks[b.block_table[0]].block_hash is None


def test_fork_shares_full_blocks_copies_the_partial_one_and_leaks_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS)
    parent = make_seq(range(10), rid="parent")  # 2 full blocks + 2 tokens
    assert bm.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    bm.cache_full_blocks(parent)
    children = [make_seq([], rid=f"beam-{i}") for i in range(2)]
    copies = [bm.fork(parent, child) for child in children]
    full = parent.block_table[:2]
    for child, copy in zip(children, copies, strict=True):
        assert child.block_table[:2] == full and child.block_hashes == parent.block_hashes[:2]
        assert copy == (parent.block_table[2], child.block_table[2]) and copy[1] not in parent.block_table
    assert [bm.blocks[i].ref_count for i in full] == [3, 3]
    assert len({child.block_table[2] for child in children}) == 2
    aligned = make_seq(range(8), rid="aligned")  # a parent with no partial block: nothing to copy
    aligned_child = make_seq([], rid="aligned-child")
    assert bm.allocate_slots(aligned, 8)
    aligned.num_computed_tokens = 8
    assert bm.fork(aligned, aligned_child) is None
    assert aligned_child.block_table == aligned.block_table
    for seq in (parent, *children, aligned, aligned_child):
        bm.free(seq)
    assert bm.num_free_blocks() == 8 and all(b.ref_count == 0 for b in bm.blocks)
