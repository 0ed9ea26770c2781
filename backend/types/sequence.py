"""A sequence: one request's state while the engine works on it.

Who writes what: the scheduler owns the lifecycle (admission, scheduling, the tokens
of each step, finishing), the block manager the blocks; the guards keep their own
state in `guard_state` (backend.guards.policy), the speculator in `spec`. Everyone
else reads.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.contract import FinishGuard, FinishReason, GenerationRequest, Logprob, SamplingParams

if TYPE_CHECKING:
    from backend.beams.group import BeamGroup
    from backend.guards.policy import GuardState
    from backend.lora.peft_format import LoraWeights
    from backend.lora.registry import AdapterVersion
    from backend.speculation.speculator import SpecState
    from backend.vision.state import VisionState


@dataclass(slots=True, eq=False)
class EncoderState:
    """A translation request's source, for an encoder-decoder model: the encoder's input
    ([src_lang] + source + [EOS]), the target language forced as the first generated token,
    and the blocks holding the encoder's keys and values in every decoder layer (the block
    manager's), written by the runner the first step the request runs (`encoded`). A beam
    request's rows share one."""

    tokens: list[int]
    tgt_lang_id: int
    decoder_start_token_id: int
    blocks: list[int] = field(default_factory=list)
    encoded: bool = False


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and progress.

    There are no prefill and decode phases: `num_computed_tokens` (tokens whose KV is
    in the cache) chases `num_tokens` (prompt + output). A step schedules some of the
    difference; when it catches up, the step's logits yield the next token.
    """

    request_id: str
    request: GenerationRequest
    arrival_time: float  # time.monotonic()
    guard_state: GuardState
    token_ids: list[int]
    num_prompt_tokens: int
    dry_breaker_ids: tuple[int, ...] = ()  # the tokens holding a DRY sequence breaker string
    spec: SpecState | None = None  # its drafting state (the Speculator's); None: it never drafts
    adapter: AdapterVersion | None = None  # the LoRA version it was admitted with (None: the base model)
    adapter_weights: LoraWeights | None = None  # that version's weights, held while it lives
    lora_lane: int | None = None  # the lane holding its adapter while it runs (backend.lora.lanes)
    beam: BeamGroup | None = None  # a beam request's rows all point at their group (backend.beams.group)
    encoder: EncoderState | None = None  # an encoder-decoder model's source (None: a decoder-only model)
    vision: VisionState | None = None  # its images and videos (backend.vision.state; None: none)
    # a model whose layers keep state besides attention's KV: their states (the runner's; None: none yet)
    layer_states: dict | None = None
    # scheduling state (the scheduler's and the block manager's)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks
    num_registered_blocks: int = 0  # leading blocks of block_table already in the prefix cache
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # its queue time ends here
    first_token_time: float | None = None
    finish_reason: FinishReason | None = None
    finish_guard: FinishGuard | None = None
    # logprobs of prompt tokens 1.. as computed so far; None when not asked, or once sent
    prompt_logprobs: list[Logprob] | None = None

    @classmethod
    def of(cls, request_id: str, request: GenerationRequest, arrival_time: float, guard_state: GuardState,
           encoder: EncoderState | None = None) -> Sequence:  # fmt: skip
        """The request's sequence; a translation's (`encoder`) starts with the decoder's start token."""
        tokens = list(request.prompt_tokens) if encoder is None else [encoder.decoder_start_token_id]
        seq = cls(request_id, request, arrival_time, guard_state, tokens, len(tokens), encoder=encoder)
        if request.sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = []
        return seq

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
