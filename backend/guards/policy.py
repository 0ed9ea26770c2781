"""The guards as the scheduler sees them: what each sequence may draw, and when it ends.

`Guards` (one per engine, from the model's facts and settings) starts each sequence's
`GuardState` at admission, tells the sampler each step what a row must not or must
draw (`sampling_row`), and after each appended token says which guard, if any,
finishes the sequence (`after_token`): the grammar, the tool-call guards, the
thinking phase and its loop and budget guards, EOS and stop tokens (masked below
min_tokens), max_tokens, the context length. Deadlines are checked apart
(`expired`), over waiting sequences too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.contract import FinishGuard, FinishReason, GenerationRequest, SamplingParams
from backend.guards.thinking import LoopLimits, Markers, PhaseGuard
from backend.guards.tools import ToolGuards
from backend.settings.model_settings import ModelSettings
from backend.types.sampling_row import SamplingRow

if TYPE_CHECKING:
    from backend.sampling.grammar import CompiledGrammar, GrammarState
    from backend.types.sequence import Sequence

_STOPPING = (FinishGuard.EOS, FinishGuard.STOP_TOKEN)


def finish_reason(guard: FinishGuard) -> FinishReason:
    """EOS and stop tokens end a sequence as "stop"; every other guard cuts it: "length"."""
    return FinishReason.STOP if guard in _STOPPING else FinishReason.LENGTH


@dataclass(slots=True)
class GuardState:
    """One sequence's guard state; written by the guards only."""

    phase: PhaseGuard  # thinking or answering, and the loop / budget guards of each
    grammar: GrammarState | None = None  # the output's grammar, once it applies
    pending_grammar: CompiledGrammar | None = None  # the answer's grammar, waiting for thinking to end
    tool_call_opened: bool = False  # the output has written the tool-call trigger
    deadline: float | None = None  # time.monotonic() past which the sequence is finished


class Guards:
    def __init__(
        self,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        settings: ModelSettings,
        markers: Markers,
        tools: ToolGuards,
    ):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.settings = settings
        self.markers = markers
        self.tools = tools

    def admit(self, request: GenerationRequest, arrival_time: float, grammar: CompiledGrammar | None) -> GuardState:
        """A new sequence's state; raises ContractError for loop settings that, with the
        model's defaults filled in, make no detector."""
        params = request.guards
        budget = params.thinking_budget
        if budget is None:
            budget = self.settings.reasoning.thinking_budget or None
        loops = LoopLimits.of(params, self.settings.guards, request.sampling.ignore_eos)
        phase = PhaseGuard(self.markers, budget, loops)
        phase.start(request.prompt_tokens, params.enable_thinking)
        state = GuardState(phase)
        if grammar is not None:  # a sequence that thinks first gets it when thinking ends
            if phase.thinking or phase.forced:
                state.pending_grammar = grammar
            else:
                state.grammar = grammar.new_state()
        timeout_s = params.timeout_s if params.timeout_s is not None else self.settings.guards.timeout_s
        if timeout_s:
            state.deadline = arrival_time + timeout_s
        return state

    def stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        eos = () if params.ignore_eos else self.eos_token_ids
        return eos + params.stop_token_ids

    def sampling_row(self, seq: Sequence) -> SamplingRow:
        params, state = seq.sampling, seq.guard_state
        stop_ids = self.stop_ids(params)
        banned = () if params.min_tokens == 0 else stop_ids
        # The live list, not a copy: the sampler reads it before this step appends.
        history = seq.token_ids if params.uses_penalties else ()
        masked = self.tools.masked(seq, stop_ids)
        return SamplingRow(
            params, seq.num_output_tokens, banned, history, masked, state.grammar, self._forced(seq),
            seq.dry_breaker_ids,
        )  # fmt: skip

    @staticmethod
    def _forced(seq: Sequence) -> int | None:
        """A translation's first token is its target language; then what thinking forces."""
        if seq.encoder is not None and seq.num_output_tokens == 0:
            return seq.encoder.tgt_lang_id
        return seq.guard_state.phase.next_forced()

    def valid_drafts(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the sequence's grammar would refuse; the grammar
        is checked, not advanced (only verified tokens advance it, in `after_token`)."""
        grammar = seq.guard_state.grammar
        if grammar is None or not drafts:
            return drafts
        return [] if grammar.is_terminated else drafts[: grammar.valid_prefix(drafts)]

    def after_token(self, seq: Sequence, token: int) -> FinishGuard | None:
        """Advance the guards past `token`, just appended; the guard that finishes the
        sequence, if one does."""
        state = seq.guard_state
        if state.grammar is not None and not state.grammar.accept(token):
            # only a token the grammar's mask let through is drawn, so this is a bug
            raise RuntimeError(f"request {seq.request_id}: the grammar refused token {token} it had allowed")
        self.tools.observe(seq)
        guard, thinking_ended = state.phase.observe(token)
        if thinking_ended and state.pending_grammar is not None:
            state.grammar, state.pending_grammar = state.pending_grammar.new_state(), None
        return guard or self._stop_guard(seq, token)

    def _stop_guard(self, seq: Sequence, token: int) -> FinishGuard | None:
        params, state = seq.sampling, seq.guard_state
        if state.grammar is not None and state.grammar.is_terminated:
            return FinishGuard.EOS  # the grammar is complete: it accepted a stop token
        if seq.num_output_tokens > params.min_tokens:  # the sampler masks them before that
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishGuard.EOS
            if token in params.stop_token_ids and not self.tools.continues_turn(seq.request.guards, token):
                return FinishGuard.STOP_TOKEN
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return FinishGuard.MAX_TOKENS
        if seq.num_tokens >= self.max_model_len:
            return FinishGuard.CONTEXT_LENGTH
        return None

    @staticmethod
    def expired(seq: Sequence, now: float) -> bool:
        deadline = seq.guard_state.deadline
        return deadline is not None and now >= deadline
