"""Beam search in an OpenAI body: its settings, what a search cannot honour, and what it
sets in the request.

A search (num_beams > 1) is one model request whose n best hypotheses, best first, are
the response's choices: `n` is the contract's num_return_sequences, at most num_beams.
The body's num_beams, length_penalty and early_stopping, else the model's defaults
(ModelInfo.beam_defaults, MODEL.toml [beams]); num_beams 1 turns a default search off.

A search is deterministic and scores the model's raw distribution: temperature is 0
(sent as 0 when the body leaves it out), and no sampler, penalty, seed, grammar, stop
string, forced tool call or prediction applies, so any of them is a 400 naming the
body's field; the model's sampling presets do not apply either, bar its bounds
(max_tokens, min_tokens). What the contract alone checks (dry_multiplier, thinking, ...)
comes back as its 400 (api/request_builder.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from backend.contract import GenerationRequest, ModelInfo
from openai_frontend.api.errors import bad_request
from openai_frontend.api.protocol import GenerationBody

# the body's early_stopping -> the contract's (backend.contract.EARLY_STOPPING)
EARLY_STOPPING_OF = {False: "false", True: "true", "never": "never"}
# the sampling presets a search keeps: bounds, not ways of drawing
SEARCH_PRESETS = frozenset({"max_tokens", "min_tokens"})
# the body's sampler fields, and the values that leave each one off
_SAMPLERS_OFF: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,),
    "top_k": (0, -1),
    "min_p": (0.0,),
    "seed": (),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
}


@dataclass(frozen=True, slots=True)
class BeamSettings:
    """A request's search (num_beams 1: none), by the contract's names and values."""

    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: str = "false"

    @property
    def searching(self) -> bool:
        return self.num_beams > 1

    def presets(self, presets: Mapping[str, Any]) -> dict[str, Any]:
        """The model's sampling presets that apply: with a search, its bounds alone."""
        return {k: v for k, v in presets.items() if not self.searching or k in SEARCH_PRESETS}

    def apply(self, request: GenerationRequest, n: int) -> None:
        """The search's fields, its `n` best, and the temperature a search runs at."""
        if not self.searching:
            return
        request.num_beams, request.num_return_sequences = self.num_beams, n
        request.length_penalty, request.early_stopping = self.length_penalty, self.early_stopping
        request.sampling.temperature = 0.0


def beam_settings(body: GenerationBody, info: ModelInfo) -> BeamSettings:
    """The body's search, checked: a 400 naming the body's field it cannot be."""
    defaults = info.beam_defaults
    num_beams = body.num_beams if body.num_beams is not None else int(defaults.get("num_beams", 1))
    if not 1 <= num_beams <= info.max_beams:
        message = f"num_beams: must be in [1, {info.max_beams}] (1: no beam search), got {num_beams}"
        raise bad_request("num_beams", message)
    if num_beams == 1:
        for name in ("length_penalty", "early_stopping"):
            if getattr(body, name) is not None:
                raise bad_request(name, f"{name}: applies to beam search only: set num_beams above 1, or leave it out")
        return BeamSettings()
    conflict = next(_conflicts(body, num_beams), None)
    if conflict is not None:
        param, why = conflict
        origin = "" if body.num_beams is not None else f" (num_beams {num_beams} is this model's default: send 1)"
        raise bad_request(param, f"{param}: {why}{origin}")
    penalty = body.length_penalty if body.length_penalty is not None else defaults.get("length_penalty", 1.0)
    early = body.early_stopping
    rule = EARLY_STOPPING_OF[early] if early is not None else str(defaults.get("early_stopping", "false"))
    return BeamSettings(num_beams, float(penalty), rule)


def _conflicts(body: GenerationBody, num_beams: int) -> Iterator[tuple[str, str]]:
    """(the body's field, why) for each thing the body asks that a search cannot honour."""
    if body.n > num_beams:
        yield "n", f"with beam search, n is how many of its best hypotheses come back: at most num_beams ({num_beams})"
    if body.temperature is not None and body.temperature != 0:
        yield "temperature", "beam search is deterministic: leave temperature out or send 0"
    for name, off in _SAMPLERS_OFF.items():
        value = getattr(body, name)
        if value is not None and value not in off:
            yield name, "beam search scores the model's raw distribution: no sampler, penalty or seed applies"
    if body.stop_strings():
        yield "stop", "stop strings cannot end a beam search (its beams are scored as they grow); use stop_token_ids"
    if body.grammar() is not None:
        yield "response_format", "beam search follows no grammar: leave response_format out, or send type text"
    forced = body.forced_tool_param()
    if forced is not None:
        yield forced, "beam search cannot force a tool call: leave it out, or send auto or none"
    if body.prediction is not None:
        yield "prediction", "beam search drafts no tokens: leave prediction out"
