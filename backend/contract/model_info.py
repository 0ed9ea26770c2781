"""The running model's facts, as the engine knows them: what the frontend must not work out again.

The frontend asks for them with a model-info query (`backend.contract.wire`); the model
answers from its engine, so the two processes cannot disagree about the context length,
the markers or the defaults.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from backend.contract.vision import VisionInfo


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
    max_beams: int = 8  # num_beams a request may ask for (MAX_BEAMS)
    # the deployment's beam search defaults (MODEL.toml [beams]) by contract name:
    # num_beams, length_penalty, early_stopping; applied to a request that leaves them out
    beam_defaults: dict[str, float | int | str] = field(default_factory=dict)
    # a translation model's languages: FLORES-200 code -> its id (src_lang_id / tgt_lang_id);
    # empty for a model that does not translate
    languages: dict[str, int] = field(default_factory=dict)
    src_lang: str = ""  # the deployment's default source and target languages (MODEL.toml [translation])
    tgt_lang: str = ""
    vision: VisionInfo | None = None  # a vision-language model's facts; None: text only

    @property
    def takes_vision(self) -> bool:
        return self.vision is not None

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> ModelInfo:
        values = json.loads(text)
        vision = values.pop("vision", None)
        return cls(**values, vision=VisionInfo(**vision) if vision is not None else None)
