"""End to end with LoRA adapters: a stack of its own started with LORA_MODULES (adapters
written here with PEFT), runtime management on and API keys (one admin tenant), driven by
the official openai client; the management endpoints over plain HTTP."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest

from launcher import Stack
from tests.helpers.lora_models import write_adapter

pytestmark = pytest.mark.e2e

KEYS = {"key-ops": "ops", "key-app": "app"}
ADMIN = {"Authorization": "Bearer key-ops"}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(model_path, tmp_path_factory) -> dict:
    """Four random adapters of the default model: two served from the start, two loaded later."""
    root = tmp_path_factory.mktemp("adapters")
    ranks = {"sql": (4, 1), "chat": (8, 2), "late": (4, 3), "late-v2": (4, 4)}
    return {name: write_adapter(model_path, root / name, r=r, seed=seed) for name, (r, seed) in ranks.items()}


@pytest.fixture(scope="module")
def lora_stack(model_path, adapters):
    env = {
        "LORA_MODULES": f"sql={adapters['sql']},chat={adapters['chat']}",
        "ALLOW_RUNTIME_LORA": "1",
        "API_KEYS": ",".join(f"{key}:{tenant}" for key, tenant in KEYS.items()),
        "ADMIN_TENANTS": "ops",
    }
    with Stack(model_path, env=env) as running:
        yield running


@pytest.fixture(scope="module")
def client(lora_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=lora_stack.base_url, api_key="key-app", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def base(lora_stack) -> str:
    return lora_stack.served_model_name


def _greedy(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert answer.model == model
    return answer.choices[0].text


def _manage(stack, path: str, body: dict, headers: dict = ADMIN) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/{path}", json=body, headers=headers, timeout=300)


def test_models_list_each_adapter_under_the_base_model(client, base, adapters):
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {base, "sql", "chat"}
    assert cards[base].parent is None
    assert {(cards[n].parent, cards[n].root) for n in ("sql", "chat")} == {(base, "sql"), (base, "chat")}
    assert all(str(adapters[n]) not in str(cards[n]) for n in ("sql", "chat"))  # no server folder shown
    assert client.models.retrieve("chat").parent == base


def test_an_adapter_answers_otherwise_than_the_base_model_and_alike_each_time(client, base, lora_stack):
    plain, sql, chat = _greedy(client, base), _greedy(client, "sql"), _greedy(client, "chat")
    assert sql != plain and chat != plain and sql != chat
    assert _greedy(client, "sql") == sql
    metrics = httpx.get(lora_stack.base_url.removesuffix("/v1") + "/metrics", headers=ADMIN).text
    requests = re.search(
        rf'^llm_lora_requests_total\{{model_name="{base}",lora_name="sql",[^}}]*\}} (\S+)$', metrics, re.M
    )
    assert requests is not None and float(requests.group(1)) >= 2, metrics
    assert re.search(r'^vllm:lora_requests_info\{max_lora="\d+",', metrics, re.M), metrics


def test_load_reload_and_unload_an_adapter_at_run_time(client, base, lora_stack, adapters):
    loaded = _manage(lora_stack, "load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'late' added successfully."
    first = _greedy(client, "late")
    assert first != _greedy(client, base)
    reloaded = _manage(lora_stack, "load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late-v2"])})
    assert reloaded.status_code == 200, reloaded.text
    assert _greedy(client, "late") != first  # the new version answers
    unloaded = _manage(lora_stack, "unload_lora_adapter", {"lora_name": "late"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'late' removed successfully."
    with pytest.raises(openai.NotFoundError) as gone:
        _greedy(client, "late")
    assert gone.value.response.json()["error"]["code"] == "model_not_found"
    assert "late" not in {card.id for card in client.models.list().data}


def test_management_is_for_admin_tenants_and_names_what_is_wrong(lora_stack, adapters):
    body = {"lora_name": "x", "lora_path": str(adapters["late"])}
    refused = _manage(lora_stack, "load_lora_adapter", body, headers={"Authorization": "Bearer key-app"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_permissions"
    missing = _manage(lora_stack, "unload_lora_adapter", {"lora_name": "never-loaded"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name", missing.text
    bad_path = _manage(lora_stack, "load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"})
    assert bad_path.status_code == 400 and bad_path.json()["error"]["param"] == "lora_path", bad_path.text


def test_served_tokens_equal_peft_and_minus_one_follows_the_active_adapter(client, base, lora_stack, adapters,
                                                                          model_path):  # fmt: skip
    from transformers import AutoTokenizer

    from tests.helpers.lora_models import peft_greedy, peft_model

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt = tokenizer(PROMPT)["input_ids"]
    reference = peft_model(model_path, {"sql": adapters["sql"]})
    expected = tokenizer.decode(peft_greedy(reference, "sql", prompt, 8)[0])

    def served(model: str, **extra) -> str:
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra)
        return answer.choices[0].text

    assert served("sql") == expected
    assert _manage(lora_stack, "active_lora_adapter", {"lora_name": "sql"}).status_code == 200
    assert served(base, adapter_slot=-1) == expected  # -1: the active adapter
    assert _manage(lora_stack, "active_lora_adapter", {"lora_name": None}).status_code == 200
    assert served(base, adapter_slot=-1) == tokenizer.decode(peft_greedy(reference, None, prompt, 8)[0])


def test_an_adapter_with_n_logprobs_and_a_schema(client):
    answer = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Give me a JSON object with a name."}], n=2,
        max_tokens=24, temperature=0.8, seed=7, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": {
            "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    )  # fmt: skip
    assert answer.model == "chat" and len(answer.choices) == 2
    for choice in answer.choices:
        assert choice.logprobs.content and len(choice.logprobs.content[0].top_logprobs) == 2
        if choice.finish_reason == "stop":
            assert "name" in json.loads(choice.message.content)


def test_an_adapter_that_cannot_load_stops_the_server_at_start(model_path, adapters, tmp_path):
    from launcher import TritonServer
    from launcher.procs import StartupError
    from tests.helpers.lora_models import edit_config

    dora = tmp_path / "dora"
    shutil.copytree(adapters["sql"], dora)
    edit_config(dora, use_dora=True)
    with pytest.raises(StartupError, match="LORA_MODULES: adapter 'dora'.*use_dora = True: DoRA adapters"):
        with TritonServer(model_path, env={"LORA_MODULES": f"dora={dora}"}):
            pass
