"""Continuous batching: token budget, chunked prefill, admission limits, preemption."""

from backend.block_manager import BlockManager
from backend.request import EngineRequest
from backend.scheduler import Scheduler
from backend.sequence import Sequence, SequenceStatus

BS = 4


def make_seq(n, rid, start=0):
    return Sequence.from_request(EngineRequest(rid, list(range(start, start + n))))


def run_step(sched, plan, new_token=7):
    """What the engine does after the forward: advance, sample when caught up."""
    for item in plan.scheduled:
        completes = item.completes
        item.seq.num_computed_tokens += item.num_new_tokens
        if completes:
            item.seq.token_ids.append(new_token)
        sched.block_manager.cache_full_blocks(item.seq)


def plan_of(plan):
    return [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled]


def test_budget_chunks_a_long_prompt_and_mixes_in_decodes():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_seq(3, "a"), make_seq(25, "b", start=100)
    sched.add(a)
    sched.add(b)
    p1 = sched.schedule()
    assert plan_of(p1) == [("a", 3), ("b", 7)]
    run_step(sched, p1)
    p2 = sched.schedule()
    assert plan_of(p2) == [("a", 1), ("b", 9)]  # a decodes, b's prefill continues
    assert [s.completes for s in p2.scheduled] == [True, False]
    run_step(sched, p2)
    p3 = sched.schedule()
    assert plan_of(p3) == [("a", 1), ("b", 9)]
    run_step(sched, p3)
    assert b.num_computed_tokens == 25 and b.num_tokens == 26  # b sampled its first token


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(make_seq(2, f"s{i}", start=10 * i))
    p = sched.schedule()
    assert plan_of(p) == [("s0", 2), ("s1", 2)]
    assert [s.request_id for s in sched.waiting] == ["s2"]


def test_admission_waits_for_blocks():
    sched = Scheduler(BlockManager(3, BS), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make_seq(8, "a"))  # 2 blocks
    sched.add(make_seq(8, "b", start=50))  # 2 blocks: does not fit beside a
    p = sched.schedule()
    assert plan_of(p) == [("a", 8)]
    assert sched.block_manager.num_free_blocks() == 1


def test_preemption_recomputes_the_latest_sequence_when_blocks_run_out():
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(4, "a"), make_seq(4, "b", start=50)
    sched.add(a)
    sched.add(b)
    p1 = sched.schedule()
    assert plan_of(p1) == [("a", 4), ("b", 4)]
    assert (a.block_table, b.block_table) == ([0], [1])
    run_step(sched, p1)
    p2 = sched.schedule()  # both cross into a second block: 2 free blocks, fine
    assert plan_of(p2) == [("a", 1), ("b", 1)]
    assert (a.block_table, b.block_table) == ([0, 2], [1, 3])
    run_step(sched, p2)
    for _ in range(3):  # fill both second blocks
        run_step(sched, sched.schedule())
    assert a.num_tokens == 9 and bm.num_free_blocks() == 0
    p = sched.schedule()  # a needs a third block: b (the latest) is preempted
    assert plan_of(p) == [("a", 1)]
    assert p.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and b.num_preemptions == 1
    assert list(sched.waiting) == [b]
    assert a.block_table == [0, 2, 3]  # b's second block (freed first, partial) went to a
    assert bm.blocks[1].ref_count == 0 and bm.blocks[1].block_hash is not None


def test_preempted_sequence_resumes_from_its_cached_prefix():
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(4, "a"), make_seq(4, "b", start=50)
    sched.add(a)
    sched.add(b)
    for _ in range(5):
        run_step(sched, sched.schedule())
    p = sched.schedule()
    run_step(sched, p)
    assert p.preempted == [b]
    sched.finish(a)  # a ends: its blocks come free, b can come back
    p = sched.schedule()
    # b's first block (its prompt) is still cached; the rest of its 9 tokens are recomputed
    assert plan_of(p) == [("b", 5)]
    assert b.block_table[0] == 1 and b.num_computed_tokens == 4
    assert b.num_cached_tokens == 0  # reported cache hits are those of the first admission


def test_a_sequence_alone_that_cannot_grow_preempts_itself():
    bm = BlockManager(1, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq(4, "a")
    sched.add(a)
    run_step(sched, sched.schedule())
    p = sched.schedule()
    assert plan_of(p) == [] and p.preempted == [a]
    assert bm.num_free_blocks() == 1
