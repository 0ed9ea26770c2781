"""The frontend's settings: read once from the environment (Settings.from_env), passed
down; the app made from them reads no environment."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from openai_frontend.api.lora import LoraAdmin
from openai_frontend.app import create_app
from openai_frontend.generation.chat_template import TemplateBudget
from openai_frontend.generation.dynamo_view import DynamoSettings
from openai_frontend.http_server import HttpSettings
from openai_frontend.media.settings import MediaSettings
from openai_frontend.operations.limits import LimitSettings
from openai_frontend.settings import Settings
from tests.helpers.fake_engine import FakeEngine


def _comparable(settings: Settings) -> dict:
    fields = {name: getattr(settings, name) for name in Settings.__dataclass_fields__ if name != "keys"}
    return fields | {"keys_open": settings.keys.open}


def test_an_empty_environment_gives_the_defaults():
    assert _comparable(Settings.from_env({}, "m", "smol")) == _comparable(Settings("m", "smol"))


def test_each_variable_reaches_its_field():
    env = {
        "HTTP_MAX_CONNECTIONS": "10", "CHAT_TEMPLATE_TIMEOUT_S": "0.5", "SSE_KEEPALIVE_S": "0.25",
        "VIDEO_FPS": "1", "API_KEYS": "k:alice", "TENANT_MAX_CONCURRENT": "3", "ALLOW_RUNTIME_LORA": "1",
        "ADMIN_TENANTS": "alice", "METRICS_PUBLIC": " Yes ", "UI": "0", "DYN_DISCOVERY_BACKEND": "etcd",
        "DYN_REQUEST_PLANE": "nats", "RESPONSES_STORE_MAX": "7", "DUMP_DIR": "/tmp/dumps",
    }  # fmt: skip
    settings = Settings.from_env(env, "m", "smol", triton_url="h:1")
    assert settings.triton_url == "h:1" and settings.dump_dir == "/tmp/dumps"
    assert settings.http == HttpSettings(max_connections=10)
    assert settings.template_budget == TemplateBudget(max_seconds=0.5)
    assert settings.keepalive_s == 0.25
    assert settings.media == MediaSettings(video_fps=1.0)
    assert settings.keys.tenant("Bearer k") == "alice"
    assert settings.limits == LimitSettings(tenant_max_concurrent=3)
    assert settings.lora_admin == LoraAdmin(True, True, frozenset({"alice"}))
    assert settings.metrics_public and not settings.ui
    assert settings.dynamo == DynamoSettings("etcd", "nats")
    assert settings.responses_store_max == 7


def test_the_command_line_dump_folder_wins_over_dump_dir():
    assert Settings.from_env({"DUMP_DIR": "/a"}, "m", "smol", dump_dir="/b").dump_dir == "/b"
    assert Settings.from_env({"DUMP_DIR": "/a"}, "m", "smol", dump_dir="").dump_dir == ""
    assert Settings.from_env({"DUMP_DIR": ""}, "m", "smol").dump_dir is None


@pytest.mark.parametrize(
    "env, message",
    [
        ({"HTTP_MAX_CONNECTIONS": "0"}, "HTTP_MAX_CONNECTIONS must be positive"),
        ({"CHAT_TEMPLATE_MAX_CHARS": "0"}, "CHAT_TEMPLATE_TIMEOUT_S and CHAT_TEMPLATE_MAX_CHARS must be positive"),
        ({"SSE_KEEPALIVE_S": "soon"}, "could not convert string to float"),
        ({"VIDEO_FPS": "-1"}, "VIDEO_FPS must be greater than 0"),
        ({"API_KEYS": "nokey"}, "API_KEYS: expected `key:tenant` pairs"),
        ({"MAX_INFLIGHT_REQUESTS": "0"}, "MAX_INFLIGHT_REQUESTS must be at least 1"),
        ({"UI": "maybe"}, "UI must be 0 or 1"),
        ({"RESPONSES_STORE_MAX": "many"}, "invalid literal for int()"),
    ],
)
def test_a_malformed_variable_is_refused_when_the_settings_are_read(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env, "m", "smol")


def test_the_app_reads_no_environment(tokenization, monkeypatch):
    for name, value in {"API_KEYS": "k:alice", "UI": "0", "RESPONSES_STORE_MAX": "0"}.items():
        monkeypatch.setenv(name, value)
    app = create_app(Settings("unused", "smol"), tokenization=tokenization)
    app.state.serving.engine = FakeEngine([1])
    assert app.state.responses_store.max_entries == 1000
    client = TestClient(app)
    assert client.get("/").status_code == 200  # the page served
    assert client.post("/tokenize", json={"prompt": "a"}).status_code == 200  # no API key needed
