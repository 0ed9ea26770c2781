"""The running model's facts, as the engine knows them: what the frontend must not work out again.

The frontend asks for them with a model-info query (`backend.contract.wire`); the model
answers from its engine, so the two processes cannot disagree about the context length,
the markers or the defaults.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class ModelInfo:
    # the context a request may use: the model's, capped by MAX_MODEL_LEN and by what the KV pool holds
    max_model_len: int
    vocab_size: int  # the logits' width: every token id is below it
    # the chat requests' sampling defaults (MODEL.toml [sampling]), by SamplingParams field name
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    think_start: str = ""  # the thinking markers; "": the model does not reason
    think_end: str = ""
    tool_parser: str = "hermes"  # the tool-call format (openai_frontend.parsing.tools)
    tool_call_start: str = ""  # the text that opens tool calls, and the one that closes a call
    tool_call_end: str = ""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> ModelInfo:
        return cls(**json.loads(text))
