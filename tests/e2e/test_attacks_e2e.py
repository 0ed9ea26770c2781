"""The attacks of issue 42 on a real server with API keys (tritonserver + the frontend),
each refused as it should be while another tenant's request meanwhile keeps its
latency: a ratio to the same request alone, measured in the same test.

Items covered here: request-supplied template code and a conversation that makes the
model's own template render too much (1); the token and Responses routes bounded as
the others (4); 400s, not 500s, for deep JSON text and integers past 64 bits (5);
integers past their tensor's 32 bits refused, never wrapped (6); what a key-less
caller, or any tenant, can read (9). The grammar (2) and prompt logprobs (3) attacks,
the HTTP server's (7, 8) and the adapter size cap (10) have test files of their own.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from launcher import Stack

pytestmark = pytest.mark.e2e

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b", "key-ops": "ops"}
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
OPS = {"Authorization": "Bearer key-ops"}
# the other tenant's request meanwhile may take at most this many times its time alone
# (noise and sharing two cores with the attack's own 400; before the fixes these
# attacks held it for seconds: ratios of 10 to 30)
MAX_SLOWDOWN = 5.0


@pytest.fixture(scope="module")
def keyed(triton_only, model_path):
    env = {
        "API_KEYS": ",".join(f"{k}:{t}" for k, t in KEYS.items()),
        "ALLOW_RUNTIME_LORA": "1",
        "ADMIN_TENANTS": "ops",
    }
    with Stack(model_path, triton=triton_only, env=env) as running:
        yield running


@pytest.fixture(scope="module")
def root(keyed) -> str:
    return keyed.base_url.removesuffix("/v1")


def _b_chat(root: str) -> float:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}
    started = time.monotonic()
    reply = httpx.post(f"{root}/v1/chat/completions", json=body, headers=B, timeout=120)
    assert reply.status_code == 200, reply.text
    return time.monotonic() - started


def _health(root: str) -> float:
    started = time.monotonic()
    assert httpx.get(f"{root}/health", timeout=120).status_code == 200
    return time.monotonic() - started


def _meanwhile(attack: Callable[[], httpx.Response], probe: Callable[[], float]) -> tuple[httpx.Response, float]:
    """The attack's response, and the probe's worst time while the attack ran (the probe
    runs again and again until the attack is answered)."""
    answer: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answer.append(attack()))
    thread.start()
    times = []
    while thread.is_alive() or not times:
        times.append(probe())
    thread.join()
    return answer[0], max(times)


def _assert_unharmed(root: str, attack: Callable[[], httpx.Response], probe=_b_chat) -> httpx.Response:
    alone = statistics.median(probe(root) for _ in range(3))
    response, worst = _meanwhile(attack, lambda: probe(root))
    assert worst <= max(MAX_SLOWDOWN * alone, alone + 0.5), f"{worst:.2f} s meanwhile against {alone:.2f} s alone"
    return response


def _post(root: str, path: str, body: dict, headers: dict = A, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{root}{path}", json=body, headers=headers, timeout=timeout)


def _param(response: httpx.Response, status: int = 400) -> str | None:
    assert response.status_code == status, response.text
    return response.json()["error"]["param"]


# -- 1: templates ---------------------------------------------------------------------


def test_template_code_in_chat_template_kwargs_is_refused_with_the_sdk(keyed):
    client = openai.OpenAI(base_url=keyed.base_url, api_key="key-a", max_retries=0)
    loops = "{% for i in range(100000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"chat_template_kwargs": {"chat_template": loops}},
        )  # fmt: skip
    assert refused.value.body["param"] == "chat_template_kwargs.chat_template"
    with pytest.raises(openai.BadRequestError):  # the top-level field too
        client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "hi"}], extra_body={"chat_template": loops}
        )


def test_a_conversation_the_template_renders_too_long_is_400_and_harms_nobody(root):
    messages = [{"role": "user", "content": "z" * 190_000} for _ in range(100)]  # 19 M characters rendered

    def attack() -> httpx.Response:
        return _post(root, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})

    response = _assert_unharmed(root, attack, _health)
    assert _param(response) == "messages" and "CHAT_TEMPLATE_MAX_CHARS" in response.json()["error"]["message"]
    _assert_unharmed(root, attack)


def test_template_variables_still_reach_the_template(root):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template_kwargs": {"x": 1}}
    assert _post(root, "/v1/chat/completions", body).status_code == 200


# -- 4: the token and Responses routes ---------------------------------------------------


def test_an_8m_character_tokenize_is_refused_before_the_tokenizer(root):
    response = _assert_unharmed(root, lambda: _post(root, "/tokenize", {"prompt": "word " * 1_600_000}), _health)
    assert _param(response) == "prompt" and "MAX_STRING_CHARS" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/input_tokens"])
def test_100000_responses_items_are_refused_before_any_work(root, path):
    items = [{"role": "user", "content": "hi"}] * 100_000
    response = _assert_unharmed(root, lambda: _post(root, path, {"model": "any", "input": items}), _health)
    assert response.status_code == 400 and "MAX_MESSAGES" in response.text


# -- 5 and 6: 400s, not 500s; no wrap-around ---------------------------------------------


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": DEEP}, "guided_json"),
        ({"structured_outputs": {"json": DEEP}}, "structured_outputs.json"),
        ({"structural_tag": DEEP}, "structural_tag"),
        ({"priority": 2**63}, "priority"),
        ({"top_k": 2**63}, "top_k"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids.0"),
        ({"thinking_budget": 2**63}, "thinking_budget"),
        ({"loop_min_count": 2**63}, "loop_min_count"),
        ({"adapter_slot": 2**63}, "adapter_slot"),
        ({"priority": 4294967296}, "priority"),  # under fcfs any priority is refused; this one wrapped to 0
        ({"adapter_slot": 4294967297}, "adapter_slot"),  # was read as slot 1
        ({"top_k": 2**31}, "top_k"),
    ],
)
def test_out_of_range_fields_are_400_naming_them(root, extra, param):
    response = _post(root, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **extra})
    assert _param(response) == param


def test_a_huge_lora_path_is_400(root):
    response = _post(root, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/" + "p" * 100_000}, OPS)
    assert response.status_code == 400, response.text


# -- 9: what others can read ---------------------------------------------------------------


def test_metrics_take_a_key_and_models_show_no_folder(root, model_path):
    assert httpx.get(f"{root}/metrics", timeout=30).status_code == 401
    page = httpx.get(f"{root}/metrics", headers=B, timeout=30)
    assert page.status_code == 200 and "vllm:" in page.text
    models = httpx.get(f"{root}/v1/models", headers=B, timeout=30).text
    assert str(model_path) not in models and "/root" not in models and "/home" not in models
