"""A translation model through the app (a fake engine whose ModelInfo has languages):
src_lang / tgt_lang -> the language ids, the source text (a prompt, or a chat's last user
message) without special tokens, the 400s, its beam defaults, and its text (the tiny
NLLB's tokenizer, tests/helpers/nllb_models.py: no prompt context before the output)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from openai_frontend.app import Settings, create_app
from openai_frontend.generation.tokenization import Tokenization
from tests.helpers.fake_engine import DEFAULT_INFO, FakeEngine
from tests.helpers.nllb_models import write_tiny_nllb
from tests.openai_frontend.fake_beams import STOP, BeamEngine

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LANGUAGES = {"eng_Latn": 10, "fra_Latn": 11, "deu_Latn": 12, "spa_Latn": 13}
TRANSLATION = replace(DEFAULT_INFO, languages=LANGUAGES, src_lang="eng_Latn", tgt_lang="fra_Latn")
SOURCE = "The house is wonderful."


def _post(app, path: str, body: dict) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(run())


def _base(path: str) -> dict:
    return {"messages": [{"role": "user", "content": SOURCE}]} if path == CHAT else {"prompt": SOURCE}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_the_languages_map_to_their_ids_and_default_to_the_deployments(make_app, path):
    engine = FakeEngine([5, 6], reason=STOP, info=TRANSLATION)
    app = make_app(engine)
    assert _post(app, path, _base(path)).status_code == 200
    assert _post(app, path, {**_base(path), "src_lang": "deu_Latn", "tgt_lang": "spa_Latn"}).status_code == 200
    defaults, chosen = engine.requests
    assert (defaults.src_lang_id, defaults.tgt_lang_id) == (10, 11)
    assert (chosen.src_lang_id, chosen.tgt_lang_id) == (12, 13)


def test_a_chat_translates_its_last_user_message_without_the_template(make_app, tokenization):
    engine = FakeEngine([5], reason=STOP, info=TRANSLATION)
    messages = [
        {"role": "system", "content": "You translate."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "premier"},
        {"role": "user", "content": [{"type": "text", "text": "The house"}, {"type": "text", "text": "is big."}]},
    ]
    assert _post(make_app(engine), CHAT, {"messages": messages}).status_code == 200
    assert engine.requests[0].prompt_tokens == tokenization.tokenizer.encode(
        "The house\nis big.", add_special_tokens=False
    )


@pytest.mark.parametrize(
    ("path", "extra", "param", "says"),
    [
        (CHAT, {"messages": [{"role": "system", "content": "x"}]}, "messages", "last user message"),
        (COMPLETIONS, {"src_lang": "fra_latn"}, "src_lang", "such as fra_Latn, "),  # the closest code first
        (CHAT, {"tgt_lang": "klingon"}, "tgt_lang", "4 languages"),
        (CHAT, {"src_lang_id": 12}, "src_lang_id", "not a field"),  # the ids are the frontend's to derive
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "does not call tools"),
    ],
)
def test_a_bad_translation_request_is_a_400_naming_the_field(make_app, path, extra, param, says):
    engine = FakeEngine([5], info=TRANSLATION)
    response = _post(make_app(engine), path, {**_base(path), **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and says in error["message"], error
    assert engine.requests == []


def test_a_language_is_required_where_the_deployment_sets_no_default(make_app):
    engine = FakeEngine([5], info=replace(TRANSLATION, tgt_lang=""))
    response = _post(make_app(engine), COMPLETIONS, {"prompt": SOURCE})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tgt_lang"
    assert "required" in response.json()["error"]["message"]
    assert _post(make_app(engine), COMPLETIONS, {"prompt": SOURCE, "tgt_lang": "deu_Latn"}).status_code == 200


@pytest.mark.parametrize("param", ["src_lang", "tgt_lang"])
def test_a_model_that_does_not_translate_refuses_the_languages(make_app, param):
    engine = FakeEngine([5])
    response = _post(make_app(engine), CHAT, {**_base(CHAT), param: "fra_Latn"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and "does not translate" in response.json()["error"]["message"]


def test_the_deployments_beam_defaults_make_a_translation_a_search(make_app, tokenization):
    info = replace(TRANSLATION, beam_defaults={"num_beams": 4, "early_stopping": "true"})
    engine = BeamEngine([(tokenization.tokenizer.encode("La maison.", add_special_tokens=False), STOP)], info=info)
    response = _post(make_app(engine), COMPLETIONS, {"prompt": SOURCE, "tgt_lang": "deu_Latn"})
    assert response.status_code == 200, response.text
    (request,) = engine.requests
    assert (request.num_beams, request.num_return_sequences, request.early_stopping) == (4, 1, "true")
    assert (request.src_lang_id, request.tgt_lang_id) == (10, 12) and request.sampling.temperature == 0
    assert response.json()["choices"][0]["text"] == "La maison."


# ---------------------------------------------------------------------------
# the tiny NLLB's tokenizer: SentencePiece-like spaces, language codes as special tokens


@pytest.fixture(scope="module")
def nllb(tmp_path_factory) -> Tokenization:
    return Tokenization(write_tiny_nllb(tmp_path_factory.mktemp("tiny-nllb")))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", [False, True])
def test_the_source_has_no_special_tokens_and_the_translation_no_leading_space(nllb, path, stream):
    tok = nllb.tokenizer
    languages = {code: tok.convert_tokens_to_ids(code) for code in ("eng_Latn", "fra_Latn")}
    answer = tok("La maison est magnifique.", add_special_tokens=False)["input_ids"]
    info = replace(TRANSLATION, languages=languages, vocab_size=len(tok))
    engine = FakeEngine([languages["fra_Latn"], *answer, tok.eos_token_id], reason=STOP, info=info)
    app = create_app(Settings("unused", "nllb"), tokenization=nllb)
    app.state.serving.engine = engine
    response = _post(app, path, {**_base(path), "stream": stream})
    assert response.status_code == 200, response.text
    assert engine.requests[0].prompt_tokens == tok(SOURCE, add_special_tokens=False)["input_ids"]
    assert _text(response, path, stream) == tok.decode(answer, skip_special_tokens=True) == "La maison est magnifique."


def _text(response: httpx.Response, path: str, stream: bool) -> str:
    if not stream:
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]
    events = [block.removeprefix("data: ") for block in response.text.split("\n\n") if block.startswith("data: ")]
    choices = [json.loads(event)["choices"][0] for event in events[:-1]]
    return "".join((c["delta"].get("content") or "") if path == CHAT else c["text"] for c in choices)
