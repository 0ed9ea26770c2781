"""End to end with a translation model: a stack of its own serving the tiny random NLLB
(tests/helpers/nllb_models.py; no real NLLB can be downloaded here) as `MODEL=<folder>
make serve` would, driven by the official openai client, against transformers' `generate`
on the same folder (forced_bos_token_id = the target language).

The folder has no MODEL.toml, so the shipped m2m_100 preset applies: eng_Latn -> fra_Latn,
num_beams 4, early_stopping true, max_tokens 200.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
import torch

from launcher import Stack
from tests.helpers.nllb_models import write_tiny_nllb

pytestmark = pytest.mark.e2e

TEXTS = {
    "eng_Latn": "I like green apples and red cherries.",
    "fra_Latn": "La maison est magnifique.",
    "deu_Latn": "Wir gehen morgen in die Stadt.",
    "spa_Latn": "La casa es maravillosa.",
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_nllb(tmp_path_factory.mktemp("nllb-e2e") / "tiny-nllb", seed=1, eos_gain=2.5)


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoTokenizer, M2M100ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = M2M100ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()

    def translate(text, src, tgt, n=1, **kw):
        tokenizer.src_lang = src
        inputs = tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            out = hf.generate(**inputs, forced_bos_token_id=tokenizer.convert_tokens_to_ids(tgt),
                              num_return_sequences=n, do_sample=False, **kw)  # fmt: skip
        return [tokenizer.decode(seq, skip_special_tokens=True) for seq in out]

    return translate


@pytest.fixture(scope="module")
def nllb_stack(folder):
    with Stack(str(folder), env={"SSE_KEEPALIVE_S": "0.005"}) as running:
        yield running


@pytest.fixture(scope="module")
def client(nllb_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=nllb_stack.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _complete(client, model, text, **extra):
    fields = {k: extra.pop(k) for k in ("max_tokens", "n", "temperature") if k in extra}
    return client.completions.create(model=model, prompt=text, extra_body=extra, **fields)


@pytest.mark.parametrize(("src", "tgt"), [("fra_Latn", "deu_Latn"), ("deu_Latn", "spa_Latn"), ("eng_Latn", "fra_Latn")])
@pytest.mark.parametrize(("num_beams", "n", "rule"), [(4, 2, True), (5, 3, "never"), (2, 2, False)])
def test_beam_translations_equal_transformers(client, model, reference, src, tgt, num_beams, n, rule):
    answer = _complete(client, model, TEXTS[src], src_lang=src, tgt_lang=tgt, num_beams=num_beams, n=n,
                       early_stopping=rule, length_penalty=1.0, max_tokens=14)  # fmt: skip
    theirs = reference(TEXTS[src], src, tgt, n=n, num_beams=num_beams, early_stopping=rule, max_new_tokens=14)
    assert [c.text for c in answer.choices] == theirs
    assert all(c.finish_reason in ("stop", "length") for c in answer.choices)


def test_the_deployment_defaults_are_the_release_ones(client, model, reference, folder):
    """No extension field: eng_Latn -> fra_Latn with 4 beams, early_stopping true, up to 200
    tokens; this tiny model's 128 positions cut that to 127 after the decoder start token."""
    answer = client.completions.create(model=model, prompt=TEXTS["eng_Latn"])
    theirs = reference(TEXTS["eng_Latn"], "eng_Latn", "fra_Latn", num_beams=4, early_stopping=True, max_new_tokens=127)
    assert [c.text for c in answer.choices] == theirs
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 127
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(folder)(TEXTS["eng_Latn"]).input_ids  # [eng_Latn] ... </s>
    assert answer.usage.prompt_tokens == len(source)


def test_greedy_translation_with_num_beams_1(client, model, reference):
    answer = _complete(client, model, TEXTS["spa_Latn"], src_lang="spa_Latn", tgt_lang="eng_Latn", num_beams=1,
                       temperature=0, max_tokens=12)  # fmt: skip
    theirs = reference(TEXTS["spa_Latn"], "spa_Latn", "eng_Latn", num_beams=1, max_new_tokens=12)
    assert answer.choices[0].text == theirs[0]


def test_chat_translates_the_last_user_message(client, model):
    messages = [
        {"role": "system", "content": "Translate."},
        {"role": "user", "content": "Where is the train station?"},
        {"role": "assistant", "content": "..."},
        {"role": "user", "content": TEXTS["deu_Latn"]},
    ]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=14,
                                          extra_body={"src_lang": "deu_Latn", "tgt_lang": "fra_Latn"})  # fmt: skip
    plain = _complete(client, model, TEXTS["deu_Latn"], src_lang="deu_Latn", tgt_lang="fra_Latn", max_tokens=14)
    assert chat.choices[0].message.content == plain.choices[0].text


def test_streaming_a_search_sends_keep_alives_then_the_same_text(client, model, nllb_stack):
    body = {"model": model, "prompt": TEXTS["fra_Latn"], "src_lang": "fra_Latn", "tgt_lang": "spa_Latn",
            "num_beams": 5, "max_tokens": 120, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{nllb_stack.base_url}/completions", json=body, timeout=120) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {"))
    plain = _complete(client, model, TEXTS["fra_Latn"], src_lang="fra_Latn", tgt_lang="spa_Latn", num_beams=5,
                      max_tokens=120, ignore_eos=True)  # fmt: skip
    assert streamed == plain.choices[0].text
    keep_alives = sum(line.startswith(":") for line in lines)
    assert keep_alives >= 1, keep_alives  # every 5 ms here; the search of 120 steps takes ~100 ms


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tgt_lang": "xxx_Latn"}, "tgt_lang"),
        ({"src_lang": "english"}, "src_lang"),
        ({"num_beams": 9}, "num_beams"),
        ({"num_beams": 2, "n": 3}, "n"),
        ({"num_beams": 4, "temperature": 0.8}, "temperature"),
    ],
)
def test_bad_translation_fields_are_400s_naming_them(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        _complete(client, model, TEXTS["eng_Latn"], max_tokens=8, **extra)
    assert err.value.body["param"] == param, err.value.body
    assert _complete(client, model, TEXTS["eng_Latn"], max_tokens=4).choices  # still serving


def test_concurrent_translations_each_equal_their_solo_answer(client, model):
    jobs = [(src, tgt, beams) for src in TEXTS for tgt in ("fra_Latn", "deu_Latn") for beams in (1, 4) if src != tgt]

    def run(job):
        src, tgt, beams = job
        extra = {"src_lang": src, "tgt_lang": tgt, "num_beams": beams}
        if beams == 1:
            extra["temperature"] = 0
        return _complete(client, model, TEXTS[src], max_tokens=16, **extra).choices[0].text

    solo = [run(job) for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        assert list(pool.map(run, jobs)) == solo
