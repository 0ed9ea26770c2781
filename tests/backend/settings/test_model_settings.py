"""ModelSettings: MODEL.toml, else the shipped preset, else defaults; strict about the schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.guards.loops import LoopDetector
from backend.runner.convert import MODEL_NAME
from backend.settings.model_settings import PRESETS_DIR, GuardSettings, ModelSettings, ReasoningSettings, ToolSettings


def write_settings(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "MODEL.toml"
    path.write_text(text)
    return path


def test_shipped_preset_is_found_by_folder_name(tmp_path):
    settings = ModelSettings.load(tmp_path / MODEL_NAME)  # no MODEL.toml there
    assert settings.source == PRESETS_DIR / f"{MODEL_NAME}.toml"
    assert settings.sampling == {"temperature": 0.2, "top_p": 0.9}
    assert settings.reasoning == ReasoningSettings()  # SmolLM2 does not think
    assert settings.tools.parser == "hermes"
    guards = settings.guards
    assert guards.loop_min_count > 0  # the loop detector is on
    LoopDetector(guards.loop_min_pattern_size, guards.loop_max_pattern_size, guards.loop_min_count)


def test_every_shipped_preset_loads():
    presets = sorted(PRESETS_DIR.glob("*.toml"))
    assert presets
    for path in presets:
        ModelSettings.from_file(path)


def test_model_toml_replaces_the_preset_as_a_whole(tmp_path):
    folder = tmp_path / MODEL_NAME
    path = write_settings(
        folder,
        """
        [sampling]
        temperature = 1   # an int is a fine float
        top_k = 40
        max_tokens = 256
        [reasoning]
        think_start = "<think>"
        think_end = "</think>"
        thinking_budget = 512
        [guards]
        timeout_s = 30
        [tools]
        parser = "qwen3"
        """,
    )
    settings = ModelSettings.load(folder)
    assert settings.source == path
    assert settings.sampling == {"temperature": 1.0, "top_k": 40, "max_tokens": 256}  # no top_p from the preset
    assert isinstance(settings.sampling["temperature"], float)
    assert settings.reasoning == ReasoningSettings("<think>", "</think>", 512)
    assert settings.guards == GuardSettings(timeout_s=30.0)  # loop keys left out: built-in defaults
    assert settings.tools == ToolSettings("qwen3")


def test_unknown_model_gets_the_defaults(tmp_path):
    settings = ModelSettings.load(tmp_path / "SomeOther-7B")
    assert settings == ModelSettings()
    assert settings.source is None
    assert settings.sampling == {}
    assert settings.guards.loop_min_count == 0  # detectors off
    assert settings.reasoning.think_start == ""


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        ModelSettings().guards.timeout_s = 5


@pytest.mark.parametrize(
    "text, names",
    [
        ("[sampling]\ntemprature = 0.5\n", ["sampling.temprature"]),
        ("[guards]\nloop_count = 3\n", ["guards.loop_count"]),
        ("[tools]\nparsers = 'x'\n", ["tools.parsers"]),
        ("[speculative]\nk = 3\n", ["[speculative]"]),
        # no longer a setting: the engine reads whether the prompt opened thinking from the prompt
        ("[reasoning]\nstarts_in_thinking = true\n", ["reasoning.starts_in_thinking"]),
        ("sampling = 3\n", ["sampling"]),
    ],
)
def test_unknown_keys_name_the_key_and_the_file(tmp_path, text, names):
    path = write_settings(tmp_path / "m", text)
    with pytest.raises(ValueError) as error:
        ModelSettings.load(path.parent)
    for name in names + [str(path)]:
        assert name in str(error.value)


@pytest.mark.parametrize(
    "text, key",
    [
        ("[sampling]\ntemperature = 'hot'\n", "sampling.temperature"),
        ("[sampling]\ntop_k = 4.5\n", "sampling.top_k"),
        ("[sampling]\ntop_p = true\n", "sampling.top_p"),
        ("[reasoning]\nthink_start = 1\n", "reasoning.think_start"),
        ("[reasoning]\nthink_end = 1\n", "reasoning.think_end"),
        ("[reasoning]\nthinking_budget = false\n", "reasoning.thinking_budget"),
        ("[guards]\nloop_min_count = 2.0\n", "guards.loop_min_count"),
        ("[tools]\nparser = ['hermes']\n", "tools.parser"),
    ],
)
def test_bad_types_name_the_key_and_the_file(tmp_path, text, key):
    path = write_settings(tmp_path / "m", text)
    with pytest.raises(ValueError) as error:
        ModelSettings.load(path.parent)
    assert key in str(error.value) and str(path) in str(error.value)


@pytest.mark.parametrize(
    "text, key",
    [
        ("[guards]\nloop_min_count = 1\n", "loop_min_count"),
        (
            "[guards]\nloop_min_count = 3\nloop_min_pattern_size = 8\nloop_max_pattern_size = 4\n",
            "loop_max_pattern_size",
        ),
        ("[guards]\ntimeout_s = -1\n", "guards.timeout_s"),
        ("[reasoning]\nthinking_budget = -5\n", "reasoning.thinking_budget"),
        ("[reasoning]\nthink_start = '<think>'\n", "reasoning.think_end"),
        ("[sampling\n", "not valid TOML"),
    ],
)
def test_bad_values_are_rejected(tmp_path, text, key):
    path = write_settings(tmp_path / "m", text)
    with pytest.raises(ValueError) as error:
        ModelSettings.load(path.parent)
    assert key in str(error.value) and str(path) in str(error.value)
