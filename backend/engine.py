"""The engine: requests in, a step at a time, outputs out. Not thread-safe by design:
one thread (backend.engine_thread) owns it.
"""

from __future__ import annotations

import threading
import time

from backend.block_manager import BlockManager
from backend.config import EngineConfig
from backend.contract import ContractError
from backend.grammar import GrammarCompiler
from backend.logprobs import TokenLogprobs
from backend.model_runner import ModelRunner
from backend.model_settings import ModelSettings
from backend.request import (
    EngineRequest,
    FinalStats,
    FinishReason,
    RequestOutput,
    SamplingParams,
    StopGuard,
)
from backend.sampler import SamplingRow
from backend.scheduler import Scheduler, SchedulerOutput
from backend.sequence import Sequence
from backend.thinking import LoopLimits, Markers, SequenceGuards
from backend.tool_guards import ToolGuards
from backend.vocab import Vocabulary, load_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None):
        self.config = config
        self.runner = runner or ModelRunner(config)
        mc = self.runner.model_config
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = tuple(mc.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings,
            mc.max_position_embeddings,
            self.runner.num_blocks * config.block_size,
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.tokenizer = load_tokenizer(config.model_path)
        self.vocab = Vocabulary(self.tokenizer, self.vocab_size) if self.tokenizer is not None else None
        self.settings = ModelSettings.load(config.model_path)
        self.tool_guards = ToolGuards.for_model(self.settings.tools.call_tags, self.tokenizer)
        self.markers = Markers.for_model(self.settings.reasoning, self.tokenizer)
        self._grammars: GrammarCompiler | None = None  # made on the first grammar request
        self._grammars_lock = threading.Lock()
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        self.num_preemptions = 0

    # -- requests -----------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raise ContractError naming the field if it cannot be served."""
        self._validate(request)
        params = request.sampling
        if params.dry_multiplier and self.vocab is not None:
            params.dry_sequence_breakers = self.vocab.ids_containing(params.dry_breaker_strings)
        self.prepare_request(request)
        seq = Sequence.from_request(request)
        seq.guards = self._sequence_guards(request)
        if request.grammar is not None:
            if seq.guards.thinking or seq.guards.forced:
                seq.guards.pending_grammar = request.grammar  # the answer's, after thinking
            else:
                seq.grammar = request.grammar.new_state()
        timeout_ms = params.deadline_ms if params.deadline_ms is not None else self.settings.guards.timeout_s * 1e3
        if timeout_ms:
            seq.deadline = request.arrival_time + timeout_ms / 1e3
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def _validate(self, request: EngineRequest) -> None:
        prompt = request.prompt_token_ids
        if not prompt:
            raise ContractError("prompt_tokens", "must hold at least one token")
        if request.request_id in self._seqs:
            raise ContractError("request_id", f"{request.request_id!r} is already in flight")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ContractError("prompt_tokens", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ContractError(
                "prompt_tokens",
                f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len} "
                "tokens, which must hold the prompt and at least one generated token",
            )
        request.sampling.validate(self.vocab_size)

    def _sequence_guards(self, request: EngineRequest) -> SequenceGuards:
        params = request.sampling
        budget = params.thinking_budget
        if budget is None:
            budget = self.settings.reasoning.thinking_budget or None
        loops = LoopLimits.of(params, self.settings.guards)
        guards = SequenceGuards(self.markers, budget, loops)
        guards.start(request.prompt_token_ids, params.enable_thinking)
        return guards

    def prepare_request(self, request: EngineRequest) -> None:
        """What a request needs before `add_request` that may run on any thread: its
        grammar, compiled (or taken from the cache). The Triton model calls it on the
        request's own thread, so a slow compilation never stalls the running batch.
        Raises ContractError naming grammar_kind / grammar_spec."""
        if request.grammar_kind and request.grammar is None:
            request.grammar = self.grammar_compiler().compile(request.grammar_kind, request.grammar_spec)

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (and its cache of compiled grammars); thread-safe."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ContractError("grammar_kind", "this model folder has no tokenizer, which grammars need")
                self._grammars = GrammarCompiler(self.config.model_path, self.vocab_size, self.eos_token_ids)
            return self._grammars

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its final output (ABORT) comes out of the next step()."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return
        seq.finish(FinishReason.ABORT, StopGuard.CANCELLED)
        self.scheduler.finish(seq)
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks()

    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    def num_running(self) -> int:
        """Sequences admitted to the batch (vLLM's num_requests_running)."""
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        """Sequences queued for admission, preempted ones included (num_requests_waiting)."""
        return len(self.scheduler.waiting)

    # -- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self._expire_deadlines()
        outputs = [self._final_output(seq, []) for seq in self._aborted]
        self._aborted.clear()
        plan = self.scheduler.schedule()
        self.num_preemptions += len(plan.preempted)
        if plan.is_empty:
            return outputs
        _note_first_scheduled(plan, time.monotonic())
        completing = [item for item in plan.scheduled if item.completes]
        rows = [self._sampling_row(item.seq) for item in completing]
        result = self.runner.execute(plan.scheduled, rows)
        for seq, start, computed in result.prompt_logprobs:
            del seq.prompt_logprobs[start:]  # a preempted prompt is recomputed from its start
            seq.prompt_logprobs.extend(computed.values)
            if computed.top is not None:
                del seq.prompt_top_logprobs[start:]
                seq.prompt_top_logprobs.extend(computed.top)
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        now = time.monotonic()
        logprobs = result.logprobs or [None] * len(result.tokens)
        for item, token, token_lp in zip(completing, result.tokens, logprobs, strict=False):
            out = self._append_token(item.seq, token, now)
            if out is not None:
                _attach_logprobs(out, item.seq, token_lp)
                outputs.append(out)
        for item in plan.scheduled:
            if not item.seq.is_finished:
                self.block_manager.cache_full_blocks(item.seq)
        return outputs

    def _expire_deadlines(self) -> None:
        """Finish every sequence past its deadline, with what it has (its final output
        comes out of this step, like an abort's)."""
        now = time.monotonic()
        for seq in self._seqs.values():
            if seq.deadline is not None and now >= seq.deadline and not seq.is_finished:
                seq.finish(FinishReason.LENGTH, StopGuard.DEADLINE)
                self.scheduler.finish(seq)
                self._aborted.append(seq)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.sampling
        stop_ids = self._stop_ids(params)
        banned = () if params.min_tokens == 0 else stop_ids
        # The live list, not a copy: the sampler reads it before this step appends.
        history = seq.token_ids if params.uses_penalties else ()
        masked = self.tool_guards.masked(seq, stop_ids)
        forced = seq.guards.next_forced()
        return SamplingRow(params, seq.num_output_tokens, banned, history, masked, seq.grammar, forced)

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        eos = () if params.ignore_eos else self.eos_token_ids
        return eos + params.stop_token_ids

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput | None:
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_ids.append(token)
        if seq.grammar is not None and not seq.grammar.accept(token):
            # only a token the grammar's mask let through is drawn, so this is a bug
            raise RuntimeError(f"request {seq.request_id}: the grammar refused token {token} it had allowed")
        self.tool_guards.observe(seq)
        guard, thinking_ended = seq.guards.observe(token)
        if thinking_ended and seq.guards.pending_grammar is not None:
            seq.grammar = seq.guards.pending_grammar.new_state()
        guard = guard or self._check_stop(seq, token)
        if guard is None:
            return RequestOutput(seq.request_id, [token])
        reason = FinishReason.STOP if guard in (StopGuard.EOS, StopGuard.STOP_TOKEN) else FinishReason.LENGTH
        # A stopping token (EOS or a stop token) is counted but not emitted.
        emitted = [] if reason is FinishReason.STOP else [token]
        seq.finish(reason, guard)
        self.block_manager.cache_full_blocks(seq)
        self.scheduler.finish(seq)
        return self._final_output(seq, emitted)

    def _check_stop(self, seq: Sequence, token: int) -> StopGuard | None:
        params = seq.sampling
        if seq.grammar is not None and seq.grammar.is_terminated:
            return StopGuard.EOS  # the grammar is complete: it accepted a stop token
        if seq.num_output_tokens > params.min_tokens:  # the sampler masks them before that
            if not params.ignore_eos and token in self.eos_token_ids:
                return StopGuard.EOS
            if token in params.stop_token_ids and not self.tool_guards.continues_turn(params, token):
                return StopGuard.STOP_TOKEN
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return StopGuard.MAX_TOKENS
        if seq.num_tokens >= self.max_model_len:
            return StopGuard.CONTEXT_LENGTH
        return None

    def _final_output(self, seq: Sequence, emitted: list[int]) -> RequestOutput:
        self._seqs.pop(seq.request_id, None)
        now = time.monotonic()
        arrival = seq.request.arrival_time
        first = seq.first_token_time
        stats = FinalStats(
            finish_reason=seq.finish_reason,
            stop_guard=seq.stop_guard,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_prompt_tokens=seq.num_cached_tokens or 0,
            time_to_first_token_s=(first - arrival) if first is not None else 0.0,
            decode_time_s=(now - first) if first is not None else 0.0,
            reasoning_tokens=seq.guards.thinking_tokens if seq.guards is not None else 0,
            thinking_guard=seq.guards.thinking_guard if seq.guards is not None else None,
            queue_time_s=(seq.first_scheduled_time or now) - arrival,  # never scheduled: it waited throughout
        )
        return RequestOutput(seq.request_id, emitted, stats)

    # -- convenience for tests and benchmarks ------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; return each one's emitted tokens."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list, strict=False):
            self.add_request(EngineRequest(rid, list(prompt), p))
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._seqs for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]


def _note_first_scheduled(plan: SchedulerOutput, now: float) -> None:
    """A sequence's queue time ends with its first step; a preempted one keeps its first."""
    for item in plan.scheduled:
        if item.seq.first_scheduled_time is None:
            item.seq.first_scheduled_time = now


def _attach_logprobs(out: RequestOutput, seq: Sequence, token_lp: TokenLogprobs | None) -> None:
    """Logprobs ride with the tokens they describe (none for a stopping token, which is
    not emitted); prompt logprobs ride once, with the first output."""
    if token_lp is not None:
        emitted = bool(out.new_token_ids)
        out.logprobs = [token_lp.logprob] if emitted else []
        out.top_logprobs = [(token_lp.top_ids, token_lp.top_values)] if emitted else []
    if seq.prompt_logprobs is not None:
        out.prompt_logprobs = [None, *seq.prompt_logprobs]
        if seq.prompt_top_logprobs is not None:
            out.prompt_top_logprobs = [([], []), *seq.prompt_top_logprobs]
        # sent: a later recompute (preemption) may use the prefix cache
        seq.prompt_logprobs = seq.prompt_top_logprobs = None
