"""One row of a step's batch as the sampler sees it: the request's sampling parameters and
what the engine adds this step (tokens so far, masks, the grammar's state, a forced token)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backend.contract import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams
    num_output_tokens: int  # tokens the request has produced before this draw
    banned_until_min: tuple[int, ...]  # EOS + stop tokens, masked while below min_tokens
    # prompt + output tokens so far (the last num_output_tokens are output); read only
    # when params.uses_penalties, so penalty-free rows may leave it empty
    token_ids: Sequence[int] = ()
    # tokens the engine's guards mask this step (a required tool call not yet opened
    # masks EOS; a suppressed call masks the token completing its trigger)
    masked: tuple[int, ...] = ()
    # the row's grammar state (backend.sampling.grammar.GrammarState): only tokens it accepts
    grammar: Any = None
    # a token the engine forces (a thinking marker): drawn whatever the logits say
    forced: int | None = None
    # DRY's sequence breakers as token ids (the tokens whose text holds a breaker string)
    dry_breaker_ids: tuple[int, ...] = ()
