"""vLLM's /tokenize and /detokenize end to end: the running stack against the model
folder's own tokenizer (transformers AutoTokenizer), for text and for chat messages.

Uses the session-scoped `stack` and `model` fixtures (tests/conftest.py).
"""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.e2e

TEXTS = ["Hello world", "  spaces\tand\nnewlines ", "émoji 🙂 and 中文", "<|im_start|>special"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="module")
def http(stack):
    root = stack.base_url.removesuffix("/v1")
    with httpx.Client(base_url=root, headers={"Authorization": "Bearer x"}, timeout=60) as client:
        yield client


@pytest.mark.parametrize("text", TEXTS)
def test_a_text_round_trips_as_the_tokenizer_does(http, tokenizer, model, text):
    answer = http.post("/tokenize", json={"model": model, "prompt": text, "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["tokens"] == tokenizer(text)["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = http.post("/detokenize", json={"model": model, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": tokenizer.decode(body["tokens"])}


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_messages_tokenize_through_the_chat_template(http, tokenizer, messages, generation_prompt):
    body = {"messages": messages, "add_generation_prompt": generation_prompt}
    answer = http.post("/tokenize", json=body)
    assert answer.status_code == 200, answer.text
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    assert answer.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = http.post("/detokenize", json={"tokens": answer.json()["tokens"]}).json()["prompt"]
    assert back == text


def test_messages_tokenize_as_chat_completions_prompts_them(http, client, model):
    messages = CONVERSATIONS[1]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    response = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert response.usage.prompt_tokens == len(tokens)


@pytest.mark.parametrize(
    ("path", "body", "param", "status"),
    [
        ("/detokenize", {"tokens": [1, 999_999_999]}, "tokens", 400),
        ("/detokenize", {"tokens": [-5]}, "tokens", 400),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None, 400),
        ("/tokenize", {"prompt": "a", "unknown_field": 1}, "unknown_field", 400),
        ("/tokenize", {"prompt": "a", "model": "no-such-model"}, "model", 404),
    ],
)
def test_bad_input_is_an_openai_error_naming_the_field(http, path, body, param, status):
    answer = http.post(path, json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
