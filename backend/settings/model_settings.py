"""Per-model settings: chat sampling defaults, reasoning markers, guards, tool parser.

Models differ in what they need: a small chat model wants a low temperature, a
reasoning model has thinking markers, a tool-calling model a parser. These live in a
TOML file next to the model so that serving a new model needs no code change.

Where the settings come from, the first that exists wins as a whole (files are not
merged; a key a file leaves out takes the built-in default):

1. `MODEL.toml` in the model folder: the operator's own choice.
2. `backend/presets/<model folder name>.toml`: a preset shipped for a known model.
3. The built-in defaults below (no reasoning, loop detectors off, no deadline).

Schema; every table and key is optional. An unknown table or key, or a value of the
wrong type, is a ValueError naming the key and the file, so a typo never goes unseen.

    [sampling]            # chat defaults; a request's own values override them
    temperature = 0.2     # float; also: top_p, min_p, repetition_penalty, presence_penalty,
    top_p = 0.9           #   frequency_penalty, dry_multiplier, dry_base, lz_penalty (floats)
    top_k = 40            # int; also: dry_allowed_length, max_tokens (ints)

    [reasoning]
    think_start = "<think>"     # thinking markers ("": the model does not reason)
    think_end = "</think>"
    thinking_budget = 0         # default budget in thinking tokens; 0 = none
                                # (whether a prompt opened the block is read from the prompt)

    [guards]
    loop_min_pattern_size = 1   # loop detector: periods from this many tokens...
    loop_max_pattern_size = 64  # ...up to this many,
    loop_min_count = 0          # repeated this many times in a row; 0 = detectors off
    timeout_s = 0               # default deadline in seconds; 0 = none

    [tools]
    parser = "hermes"           # tool-call parser name

    [beams]                     # beam search defaults for requests that leave them out
    num_beams = 4               # 1: no beam search
    length_penalty = 1.0
    early_stopping = "true"     # "true", "false" or "never" (transformers' three rules)

    [translation]               # a translation model's default languages (FLORES-200 codes)
    src_lang = "eng_Latn"
    tgt_lang = "fra_Latn"

`ModelSettings.sampling` is a plain dict of only the keys the file gives, by
SamplingParams field name; the frontend reads it from the running model (ModelInfo)
and applies each to a chat request that did not set it.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from backend.contract import EARLY_STOPPING, ContractError
from backend.settings.paths import base_model_name, gguf_source_file

MODEL_SETTINGS_FILE = "MODEL.toml"
PRESETS_DIR = Path(__file__).parent / "presets"

# [sampling] key -> its type (an int is accepted for a float)
SAMPLING_KEYS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "dry_multiplier": float,
    "dry_base": float,
    "dry_allowed_length": int,
    "lz_penalty": float,
    "max_tokens": int,
}


@dataclass(frozen=True, slots=True)
class ReasoningSettings:
    think_start: str = ""
    think_end: str = ""
    thinking_budget: int = 0  # 0: no budget


@dataclass(frozen=True, slots=True)
class GuardSettings:
    loop_min_pattern_size: int = 1
    loop_max_pattern_size: int = 64
    loop_min_count: int = 0  # 0: loop detectors off
    timeout_s: float = 0.0  # 0: no deadline


@dataclass(frozen=True, slots=True)
class ToolSettings:
    parser: str = "hermes"

    @property
    def call_tags(self) -> tuple[str, str]:
        """(the text that opens tool calls, the text that closes one) in the parser's
        format: the engine's tool guards use them, and the frontend's parser takes them
        from the running model (ModelInfo)."""
        return TOOL_CALL_TAGS.get(self.parser, ("", ""))


# tool parser name -> (opening trigger, closing tag); "" where the format has none
TOOL_CALL_TAGS: dict[str, tuple[str, str]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "qwen": ("<tool_call>", "</tool_call>"),
    "llama3_json": ('{"name": ', ""),
    "mistral": ("[TOOL_CALLS]", ""),
}


@dataclass(frozen=True, slots=True)
class BeamSettings:
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: str = "false"

    def defaults(self) -> dict[str, float | int | str]:
        """The request fields these set, by contract name (ModelInfo.beam_defaults)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


@dataclass(frozen=True, slots=True)
class TranslationSettings:
    src_lang: str = ""
    tgt_lang: str = ""


@dataclass(frozen=True, slots=True)
class ModelSettings:
    sampling: dict[str, float | int] = field(default_factory=dict)
    reasoning: ReasoningSettings = ReasoningSettings()
    guards: GuardSettings = GuardSettings()
    tools: ToolSettings = ToolSettings()
    beams: BeamSettings = BeamSettings()
    translation: TranslationSettings = TranslationSettings()
    source: Path | None = None  # the file these came from; None: built-in defaults

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelSettings:
        """The settings for the model in `model_dir`: its MODEL.toml, else its preset, else defaults."""
        path = find_settings_file(Path(model_dir))
        return cls() if path is None else cls.from_file(path)

    @classmethod
    def from_file(cls, path: Path) -> ModelSettings:
        """Parse and check one settings file."""
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{path}: not valid TOML: {error}") from error
        tables = {"sampling", "reasoning", "guards", "tools", "beams", "translation"}
        for name, table in data.items():
            if name not in tables:
                raise ValueError(f"{path}: unknown table [{name}] (known: {', '.join(sorted(tables))})")
            if not isinstance(table, dict):
                raise ValueError(f"{path}: {name} must be a table, got {table!r}")
        settings = cls(
            sampling=_parse_sampling(data.get("sampling", {}), path),
            reasoning=_parse_table(ReasoningSettings, "reasoning", data.get("reasoning", {}), path),
            guards=_parse_table(GuardSettings, "guards", data.get("guards", {}), path),
            tools=_parse_table(ToolSettings, "tools", data.get("tools", {}), path),
            beams=_parse_table(BeamSettings, "beams", data.get("beams", {}), path),
            translation=_parse_table(TranslationSettings, "translation", data.get("translation", {}), path),
            source=path,
        )
        _check_values(settings, path)
        return settings


def find_settings_file(model_dir: Path) -> Path | None:
    """The model's own MODEL.toml (a GGUF file's: beside the file), else the shipped preset named
    after its folder (a GGUF file: its name without the quantization tag), else the one for its
    architecture (`presets/model_type/<config.json model_type>.toml`), else None."""
    source = gguf_source_file(model_dir)
    own = model_dir / MODEL_SETTINGS_FILE if source is None else source.parent / MODEL_SETTINGS_FILE
    candidates = [own, PRESETS_DIR / f"{base_model_name(model_dir)}.toml"]
    model_type = _model_type(model_dir)
    if model_type:
        candidates.append(PRESETS_DIR / "model_type" / f"{model_type}.toml")
    return next((c for c in candidates if c.is_file()), None)


def _model_type(model_dir: Path) -> str:
    try:
        return str(json.loads((model_dir / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""


def _check_type(value: Any, expected: type, key: str, path: Path) -> Any:
    """`value` as `expected` (an int widens to float); ValueError naming key and file otherwise."""
    if isinstance(value, bool) != (expected is bool):
        ok = False
    elif expected is float:
        ok = isinstance(value, int | float)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise ValueError(f"{path}: {key} must be {expected.__name__}, got {value!r}")
    return float(value) if expected is float else value


def _parse_sampling(table: dict[str, Any], path: Path) -> dict[str, float | int]:
    sampling = {}
    for key, value in table.items():
        if key not in SAMPLING_KEYS:
            raise ValueError(f"{path}: unknown key sampling.{key} (known: {', '.join(SAMPLING_KEYS)})")
        sampling[key] = _check_type(value, SAMPLING_KEYS[key], f"sampling.{key}", path)
    return sampling


def _parse_table(cls: type, name: str, table: dict[str, Any], path: Path):
    """One settings dataclass from its TOML table, every key known and of the field's type."""
    types = {f.name: type(f.default) for f in fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in types:
            raise ValueError(f"{path}: unknown key {name}.{key} (known: {', '.join(types)})")
        values[key] = _check_type(value, types[key], f"{name}.{key}", path)
    return cls(**values)


def _check_values(settings: ModelSettings, path: Path) -> None:
    """Ranges the types alone do not give."""
    reasoning, guards = settings.reasoning, settings.guards
    if reasoning.think_start and not reasoning.think_end:
        raise ValueError(f"{path}: reasoning.think_end must be set when reasoning.think_start is")
    if reasoning.thinking_budget < 0:
        raise ValueError(f"{path}: reasoning.thinking_budget must be >= 0")
    beams = settings.beams
    if beams.num_beams < 1 or beams.early_stopping not in EARLY_STOPPING:
        raise ValueError(f"{path}: beams.num_beams must be >= 1 and beams.early_stopping one of {EARLY_STOPPING}")
    if guards.timeout_s < 0:
        raise ValueError(f"{path}: guards.timeout_s must be >= 0")
    if guards.loop_min_count != 0:
        try:
            check_loop_settings(guards.loop_min_pattern_size, guards.loop_max_pattern_size, guards.loop_min_count)
        except ContractError as error:
            raise ValueError(f"{path}: guards.{error.field}: {error.message}") from error


def check_loop_settings(min_pattern_size: int, max_pattern_size: int, min_count: int) -> None:
    """Raise ContractError naming the first bad field (contract input names)."""
    for name, value in (
        ("loop_min_pattern_size", min_pattern_size),
        ("loop_max_pattern_size", max_pattern_size),
        ("loop_min_count", min_count),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ContractError(name, f"must be an integer, got {value!r}")
    if min_pattern_size < 1:
        raise ContractError("loop_min_pattern_size", f"must be >= 1, got {min_pattern_size}")
    if max_pattern_size < min_pattern_size:
        raise ContractError(
            "loop_max_pattern_size",
            f"must be >= loop_min_pattern_size ({min_pattern_size}), got {max_pattern_size}",
        )
    if min_count < 2:
        raise ContractError("loop_min_count", f"must be >= 2 (one occurrence is no loop), got {min_count}")
