"""LORA_MODULES reaches tritonserver (which runs in the repository) with absolute paths."""

from __future__ import annotations

from launcher.stack import absolute_lora_modules


def test_relative_adapter_paths_are_made_absolute_from_the_callers_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = absolute_lora_modules("sql=adapters/sql, chat=/srv/chat,broken")
    assert text == f"sql={tmp_path}/adapters/sql, chat=/srv/chat,broken"
