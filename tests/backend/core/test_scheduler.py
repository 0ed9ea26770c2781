"""Continuous batching: token budget, chunked prefill, admission limits, preemption,
and the lifecycle the scheduler owns (add, update, abort)."""

import pytest

from backend.contract import ContractError, FinishGuard, FinishReason, GenerationRequest
from backend.core.scheduler import Scheduler
from backend.guards.policy import Guards, GuardState
from backend.guards.thinking import Markers, PhaseGuard
from backend.guards.tools import ToolGuards
from backend.kv.block_manager import BlockManager
from backend.settings.model_settings import ModelSettings
from backend.types.sequence import Sequence, SequenceStatus
from backend.types.step import StepResult

BS = 4
EOS = 0  # never the token run_step samples


def make_seq(n, rid, start=0):
    request = GenerationRequest(list(range(start, start + n)))
    return Sequence.of(rid, request, 0.0, GuardState(PhaseGuard(Markers())))


def make_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens, whole_prompts=False):
    guards = Guards((EOS,), 1 << 20, ModelSettings(), Markers(), ToolGuards())
    return Scheduler(BlockManager(num_blocks, BS), guards, max_num_seqs, max_num_batched_tokens,
                     whole_prompts=whole_prompts)  # fmt: skip


def run_step(sched, plan, new_token=7):
    """What the engine does after the forward: the scheduler advances the sequences and
    appends a token to each that caught up."""
    rows = list(range(len(plan.completing)))  # no drafts here: one logits row each
    return sched.update(plan, StepResult(lambda idx, _: ([new_token] * len(idx), [None] * len(idx)), first_rows=rows))


def plan_of(plan):
    return [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled]


def test_budget_chunks_a_long_prompt_and_mixes_in_decodes():
    sched = make_scheduler(64, max_num_seqs=8, max_num_batched_tokens=12)  # shared_chunk 3
    a, b = make_seq(3, "a"), make_seq(25, "b", start=100)
    sched.add(a)
    sched.add(b)
    p1 = sched.schedule()
    assert plan_of(p1) == [("a", 3), ("b", 9)]  # a shared the step with b waiting: at most 3
    [out] = run_step(sched, p1)  # only a caught up and sampled
    assert (out.request_id, out.token_ids, out.final) == ("a", [7], None)
    p2 = sched.schedule()
    assert plan_of(p2) == [("a", 1), ("b", 3)]  # a decodes; b's prefill continues, a quarter beside it
    assert [s.completes for s in p2.scheduled] == [True, False]
    run_step(sched, p2)
    sched.abort("a")
    p3 = sched.schedule()
    assert plan_of(p3) == [("b", 12)]  # alone again: the whole budget
    run_step(sched, p3)
    assert b.num_computed_tokens == 24 and b.num_tokens == 25


def _prefill_alone(sched, seq, steps):
    sched.add(seq)
    for _ in range(steps):
        plan = sched.schedule()
        assert plan_of(plan) == [(seq.request_id, sched.max_num_batched_tokens)]
        run_step(sched, plan)


def test_a_request_added_mid_prefill_is_admitted_at_the_next_step_and_decodes_beside_it():
    sched = make_scheduler(256, max_num_seqs=8, max_num_batched_tokens=16)  # shared_chunk 4
    long = make_seq(200, "long")
    _prefill_alone(sched, long, steps=3)
    short = make_seq(6, "short", start=500)
    short.sampling.max_tokens = 2
    sched.add(short)
    p = sched.schedule()
    assert plan_of(p) == [("long", 4), ("short", 6)]  # the long one left room: short admitted whole
    [out] = run_step(sched, p)
    assert out.request_id == "short" and out.token_ids == [7]
    p = sched.schedule()
    assert plan_of(p) == [("long", 4), ("short", 1)]  # its decode beside a quarter chunk
    [out] = run_step(sched, p)
    assert out.request_id == "short" and out.final is not None
    assert plan_of(sched.schedule()) == [("long", 16)]  # alone again


def _admit(sched, seqs):
    for seq in seqs:
        sched.add(seq)
    return sched.schedule()


def test_a_long_prompt_admitted_beside_decodes_takes_a_quarter_and_leaves_room_for_the_queue():
    sched = make_scheduler(256, max_num_seqs=8, max_num_batched_tokens=16)
    run_step(sched, _admit(sched, [make_seq(3, "d0"), make_seq(3, "d1", start=40)]))
    longs = [make_seq(100, f"p{i}", start=100 * (i + 1)) for i in range(4)]
    p = _admit(sched, longs)
    assert plan_of(p) == [("d0", 1), ("d1", 1), ("p0", 4), ("p1", 4), ("p2", 4), ("p3", 2)]
    run_step(sched, p)
    late = make_seq(5, "late", start=900)
    sched.add(late)
    p = sched.schedule()
    # d0, d1 decode; p0, p1 take a quarter each; p2 would leave less than a quarter; late admitted
    assert plan_of(p) == [("d0", 1), ("d1", 1), ("p0", 4), ("p1", 4), ("p2", 2), ("late", 4)]


def test_whole_prompts_are_never_chunked_and_a_long_one_runs_with_nothing_but_decodes_before_it():
    """A model whose state layers cannot continue a chunk (Mamba's): each prompt in one step."""
    sched = make_scheduler(256, max_num_seqs=8, max_num_batched_tokens=16, whole_prompts=True)
    p = _admit(sched, [make_seq(3, "d0"), make_seq(10, "a", start=40), make_seq(30, "long", start=100)])
    assert plan_of(p) == [("d0", 3), ("a", 10)]  # long fits neither the budget left nor comes first
    run_step(sched, p)
    sched.add(make_seq(4, "late", start=300))
    p = sched.schedule()
    assert plan_of(p) == [("d0", 1), ("a", 1), ("long", 30)]  # beyond the budget: only decodes before it
    run_step(sched, p)
    assert plan_of(sched.schedule()) == [("d0", 1), ("a", 1), ("long", 1), ("late", 4)]


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(64, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(make_seq(2, f"s{i}", start=10 * i))
    p = sched.schedule()
    assert plan_of(p) == [("s0", 2), ("s1", 2)]
    assert [s.request_id for s in sched.waiting] == ["s2"]


def test_admission_waits_for_blocks():
    sched = make_scheduler(3, max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make_seq(8, "a"))  # 2 blocks
    sched.add(make_seq(8, "b", start=50))  # 2 blocks: does not fit beside a
    p = sched.schedule()
    assert plan_of(p) == [("a", 8)]
    assert sched.block_manager.num_free_blocks() == 1


def test_preemption_recomputes_the_latest_sequence_when_blocks_run_out():
    sched = make_scheduler(4, max_num_seqs=8, max_num_batched_tokens=100)
    bm = sched.block_manager
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
    sched = make_scheduler(4, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(4, "a"), make_seq(4, "b", start=50)
    sched.add(a)
    sched.add(b)
    for _ in range(5):
        run_step(sched, sched.schedule())
    p = sched.schedule()
    run_step(sched, p)
    assert p.preempted == [b]
    sched.abort("a")  # a ends: its blocks come free, b can come back
    assert a.is_finished and "a" not in sched.requests
    p = sched.schedule()
    # b's first block (its prompt) is still cached; the rest of its 9 tokens are recomputed
    assert plan_of(p) == [("b", 5)]
    assert b.block_table[0] == 1 and b.num_computed_tokens == 4
    assert b.num_cached_tokens == 0  # reported cache hits are those of the first admission


def test_a_sequence_alone_that_cannot_grow_preempts_itself():
    sched = make_scheduler(1, max_num_seqs=8, max_num_batched_tokens=100)
    bm = sched.block_manager
    a = make_seq(4, "a")
    sched.add(a)
    run_step(sched, sched.schedule())
    p = sched.schedule()
    assert plan_of(p) == [] and p.preempted == [a]
    assert bm.num_free_blocks() == 1


def test_a_request_id_already_added_is_refused():
    sched = make_scheduler(8, max_num_seqs=8, max_num_batched_tokens=100)
    first = make_seq(2, "a")
    sched.add(first)
    with pytest.raises(ContractError) as info:
        sched.add(make_seq(3, "a", start=10))
    assert info.value.field == "request_id"
    assert sched.requests == {"a": first} and list(sched.waiting) == [first]


def test_abort_frees_the_blocks_and_the_next_update_reports_the_final():
    sched = make_scheduler(8, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(5, "a"), make_seq(3, "b", start=50)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    sched.abort("a")
    sched.abort("a")  # a second abort changes nothing
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert list(sched.requests) == ["b"] and sched.running == [b]
    plan = sched.schedule()
    assert plan_of(plan) == [("b", 1)]
    aborted, decoded = run_step(sched, plan)
    assert (aborted.request_id, aborted.token_ids) == ("a", [])
    assert aborted.final.finish_reason is FinishReason.ABORT and aborted.final.finish_guard is FinishGuard.CANCELLED
    assert aborted.final.num_prompt_tokens == 5 and aborted.final.num_output_tokens == 1
    assert (decoded.request_id, decoded.token_ids, decoded.final) == ("b", [7], None)
    assert run_step(sched, sched.schedule())[0].request_id == "b"  # reported once


def test_eos_finishes_the_sequence_counted_but_not_emitted():
    sched = make_scheduler(8, max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq(3, "a", start=10)
    sched.add(a)
    [first] = run_step(sched, sched.schedule())
    [last] = run_step(sched, sched.schedule(), new_token=EOS)
    assert first.token_ids == [7] and first.final is None
    assert last.token_ids == [] and last.final.finish_guard is FinishGuard.EOS  # counted, not emitted
    assert last.final.finish_reason is FinishReason.STOP and last.final.num_output_tokens == 2
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks() == 8
