"""Pure logic of the OpenAI frontend: detokenizer, stop strings, protocol, app plumbing.

No servers: the app is driven in-process with a fake engine in place of Triton.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from backend import contract
from openai_frontend.app import Settings, create_app
from openai_frontend.detokenizer import IncrementalDetokenizer, make_decode
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from openai_frontend.stop import StopMatcher
from openai_frontend.tokenization import Tokenization
from openai_frontend.triton_client import EngineError, Finish, TokenLogprob, TokenPack, engine_error

TEXTS = [
    "Hello, world! How are you today?",
    " leading spaces and  double  spaces",
    "Emoji: 🎉🚀 👩‍👩‍👧 and flags 🇫🇷!",
    "CJK: 你好，世界。日本語のテキスト。한국어",
    "Accents: café naïve résumé Ångström Łódź",
    "mixed 🎉 你好 é\n\nnew lines\tand tabs",
]


@pytest.fixture(scope="module")
def tokenization() -> Tokenization:
    from backend.convert import ensure_default_model

    return Tokenization(ensure_default_model())


# ---------------------------------------------------------------------------
# detokenizer


def _detokenize(decode, token_ids, pack_size, context=()):
    detok = IncrementalDetokenizer(decode, context=context)
    deltas = [detok.feed(token_ids[i : i + pack_size]) for i in range(0, len(token_ids), pack_size)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("pack_size", [1, 2, 3, 7])
def test_detokenizer_matches_full_decode(tokenization, text, pack_size):
    tok = tokenization.tokenizer
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    deltas = _detokenize(make_decode(tok), ids, pack_size)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas), "half of a multi-byte character was emitted"


def test_detokenizer_splits_multibyte_characters(tokenization):
    tok = tokenization.tokenizer
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character spread over tokens"
    deltas = _detokenize(make_decode(tok), ids, 1)
    assert deltas[:-1] == [""] * (len(ids) - 1) + ["🎉"]


def test_detokenizer_drops_a_character_cut_by_the_end(tokenization):
    tok = tokenization.tokenizer
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    assert "".join(_detokenize(make_decode(tok), ids[:-1], 1)) == "ok "


def test_detokenizer_keeps_the_space_after_the_prompt(tokenization):
    tok = tokenization.tokenizer
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    answer = tok.encode(" Paris, a city", add_special_tokens=False)
    assert "".join(_detokenize(make_decode(tok), answer, 1, context=prompt)) == " Paris, a city"


def _sentencepiece_like_tokenizer() -> Tokenizer:
    """A tiny Llama-style tokenizer: '▁' for spaces, byte fallback, leading space stripped."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    base.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog. café"] * 10, trainer)
    with tempfile.TemporaryDirectory() as folder:
        vocab_file, merges_file = base.model.save(folder)
        vocab = json.loads(Path(vocab_file).read_text())
        lines = Path(merges_file).read_text().splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#")]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("pack_size", [1, 4])
def test_detokenizer_on_sentencepiece_style_tokens(text, pack_size):
    tok = _sentencepiece_like_tokenizer()
    decode = partial(tok.decode, skip_special_tokens=True)
    ids = tok.encode(text).ids + [tok.token_to_id("</s>")]
    deltas = _detokenize(decode, ids, pack_size)
    assert "".join(deltas) == decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # after a prompt, the first token's '▁' is a space, as in decoding prompt + answer
    prompt = tok.encode("the quick brown").ids
    continued = "".join(_detokenize(decode, ids, pack_size, context=prompt))
    assert continued == decode(prompt + ids)[len(decode(prompt)) :]


def test_detokenizer_cost_does_not_grow_with_length(tokenization):
    tok = tokenization.tokenizer
    ids = tok.encode(" ".join(TEXTS) * 40, add_special_tokens=False)
    decode = make_decode(tok)

    def per_token_us(n):
        detok = IncrementalDetokenizer(decode)
        start = time.perf_counter()
        for token in ids[:n]:
            detok.feed([token])
        return (time.perf_counter() - start) / n * 1e6

    short, long = per_token_us(200), per_token_us(len(ids))
    assert len(ids) > 2000
    assert long < 3 * short + 20, (short, long)


# ---------------------------------------------------------------------------
# stop strings


def _run_stops(stops, chunks):
    matcher = StopMatcher(stops)
    out = [matcher.feed(c) for c in chunks]
    if not matcher.stopped:
        out.append(matcher.flush())
    return "".join(out), matcher.stopped, out


def test_stop_string_split_across_chunks():
    text, stopped, out = _run_stops(["STOP"], ["Hello S", "T", "OP and more"])
    assert (text, stopped) == ("Hello ", True)
    assert out == ["Hello ", "", ""]  # "S", "ST" held back until decided


def test_held_prefix_is_released_when_it_cannot_be_a_stop():
    text, stopped, out = _run_stops(["STOP"], ["Hello S", "TAR", "s"])
    assert (text, stopped) == ("Hello STARs", False)
    assert out[:2] == ["Hello ", "STAR"]


def test_earliest_stop_wins_and_is_not_included():
    text, stopped, _ = _run_stops(["world", "lo"], ["Hello wor", "ld"])
    assert (text, stopped) == ("Hel", True)


def test_stop_inside_one_chunk_and_at_the_start():
    assert _run_stops(["\n\n"], ["a\n\nb"])[:2] == ("a", True)
    assert _run_stops(["abc"], ["abc"])[:2] == ("", True)


def test_held_tail_released_at_the_end():
    assert _run_stops(["</end>"], ["text </e"])[:2] == ("text </e", False)


def test_no_stops_passes_text_through():
    assert _run_stops([], ["a", "b"]) == ("ab", False, ["a", "b", ""])


# ---------------------------------------------------------------------------
# protocol: validation and request -> contract fields


def test_chat_request_maps_to_contract_fields():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=7,
        max_tokens=99,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        top_k=5,
        min_tokens=2,
        stop_token_ids=[4],
        ignore_eos=True,
        presence_penalty=0.5,
        num_beams=2,  # an unbuilt contract field, forwarded for the model to refuse
        lookup_tenant="other",  # never settable by a client
        unknown_field=1,
    )
    fields = body.contract_fields([1, 2, 3], stream=True)
    arrays = contract.encode_request(fields)
    assert set(arrays) == {
        "prompt_tokens",
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_k",
        "top_p",
        "presence_penalty",
        "seed",
        "stop_tokens",
        "ignore_eos",
        "num_beams",
        "stream",
    }
    assert arrays["max_tokens"].tolist() == [7]
    assert arrays["seed"].dtype.name == "int64"
    assert body.param_of("max_tokens") == "max_completion_tokens"


def test_defaults_send_only_the_prompt_and_stream_flag():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=-1)
    assert set(contract.encode_request(body.contract_fields([1], stream=False))) == {"prompt_tokens", "stream"}


def test_chat_features_map_to_their_inputs_and_back():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        response_format={"type": "json_object"},
        logit_bias={"5": 1.0},
    )
    fields = body.contract_fields([1], stream=False)
    assert fields["grammar_kind"] == "json_object"
    assert fields["logit_bias_ids"] == [5] and fields["logit_bias_values"] == [1.0]
    assert body.param_of("grammar_kind") == "response_format"
    assert body.param_of("tools_present") == "tools"
    # with tools (and a tool_choice other than none) the grammar is the tools'
    with_tools = body.model_copy(update={"tools": [{"type": "function", "function": {"name": "f"}}]})
    assert with_tools.param_of("grammar_spec") == "tools"
    assert body.param_of("prompt_tokens") == "messages"
    assert body.messages[0].template_dict() == {"role": "user", "content": "a\nb"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"n": 9}, "n"),
        ({"n": 0}, "n"),
        ({"top_p": 0}, "top_p"),
        ({"messages": []}, "messages"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
    ],
)
def test_chat_validation_names_the_field(extra, param):
    with pytest.raises(ValueError) as info:
        ChatCompletionRequest(**{"messages": [{"role": "user", "content": "x"}], **extra})
    assert info.value.errors()[0]["loc"][0] == param


def test_completion_prompt_forms():
    assert CompletionRequest(prompt="hi").prompt == "hi"
    assert CompletionRequest(prompt=["hi"]).prompt == "hi"
    assert CompletionRequest(prompt=[1, 2]).prompt == [1, 2]
    assert CompletionRequest(prompt=[[1, 2]]).prompt == [1, 2]
    for bad in (["a", "b"], "", [], {"suffix": "x"}, {"logprobs": 21}):
        kwargs = bad if isinstance(bad, dict) else {}
        with pytest.raises(ValueError):
            CompletionRequest(**{"prompt": "x" if kwargs else bad, **kwargs})


def test_engine_error_names_a_contract_field():
    assert engine_error("dry_multiplier: not supported").field == "dry_multiplier"
    assert engine_error("CUDA out of memory").field is None
    assert engine_error("Error: something").field is None


# ---------------------------------------------------------------------------
# the app, with a fake engine in place of Triton


class FakeEngine:
    """Replays a token list in packs; records what it was asked and whether it was cut."""

    def __init__(self, token_ids, pack_size=2, reason="length", error=None):
        self.token_ids, self.pack_size, self.reason, self.error = token_ids, pack_size, reason, error
        self.requests: list[dict] = []
        self.cancelled = 0

    async def is_ready(self):
        return True

    async def generate(self, fields):
        self.requests.append(fields)
        if self.error is not None:
            raise self.error
        finished = False
        try:
            ids, size = self.token_ids, self.pack_size
            for i in range(0, len(ids), size):
                await asyncio.sleep(0)
                last = i + size >= len(ids)
                finish = Finish(self.reason, prompt_tokens=len(fields["prompt_tokens"]), completion_tokens=len(ids))
                finished = last
                yield TokenPack(ids[i : i + size], finish if last else None, *_fake_logprobs(fields, ids, i, size))
        finally:
            if not finished:
                self.cancelled += 1


@pytest.fixture(scope="module")
def app(tokenization):
    return create_app(Settings("unused", "smol"), tokenization=tokenization)


def _client(app, engine):
    app.state.serving.engine = engine
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def _answer_ids(tokenization, text):
    tok = tokenization.tokenizer
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


async def _post(app, engine, path, body):
    async with _client(app, engine) as client:
        return await client.post(path, json=body)


def _sse_payloads(text):
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_non_streaming(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "Paris is 🎉 nice."), reason="stop")
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "Paris is 🎉 nice."}
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == len(engine.token_ids)
    assert engine.requests[0]["stream"] is False and engine.requests[0]["temperature"] == 0


def test_chat_streaming_with_usage(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "Hello 你好 world"))
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = _sse_payloads(asyncio.run(_post(app, engine, "/v1/chat/completions", body)).text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "Hello 你好 world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


def test_stop_string_cuts_and_cancels(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "one two three four five six"), pack_size=1)
    body = {"prompt": "count", "stop": [" three"], "stream": True}
    chunks = _sse_payloads(asyncio.run(_post(app, engine, "/v1/completions", body)).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "one two"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert engine.cancelled == 1 and engine.requests[0]["stream"] is True


def test_stop_string_inside_a_pack_drops_the_later_tokens_and_their_logprobs(app, tokenization):
    ids = _answer_ids(tokenization, "one two three four five six")
    engine = FakeEngine(ids, pack_size=len(ids))  # all in one pack: the cut falls inside it
    body = {"prompt": "count", "stop": [" thr"], "logprobs": 1, "max_tokens": 20}
    choice_and_usage = asyncio.run(_post(app, engine, "/v1/completions", body)).json()
    choice = choice_and_usage["choices"][0]
    assert choice["text"] == "one two" and choice["finish_reason"] == "stop"
    # the logprobs run to the token that completed the stop string (" three"), as vLLM's
    assert choice["logprobs"]["tokens"] == ["one", " two", " three"]
    assert choice_and_usage["usage"]["completion_tokens"] == 3


def test_model_refusal_becomes_400_naming_the_field(app):
    engine = FakeEngine([], error=engine_error("dry_multiplier: advanced samplers are not supported"))
    body = {"messages": [{"role": "user", "content": "hi"}], "dry_multiplier": 0.5, "stream": True}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "dry_multiplier"


USER_X = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {"model": "nope", "messages": USER_X}, 404, "model"),
        ("/v1/chat/completions", {"messages": USER_X, "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ],
)
def test_errors_have_the_openai_shape(app, path, body, status, param):
    response = asyncio.run(_post(app, FakeEngine([]), path, body))
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and "type" in error and "code" in error


@pytest.mark.parametrize(
    ("content", "content_type", "says"),
    [
        (b"{not json", "application/json", "not valid JSON"),
        (b'["a", "list"]', "application/json", "must be a JSON object"),
        (b'{"prompt": "hi"}', None, "Content-Type: application/json"),  # JSON, but not declared
        (b"", "application/json", "must be a JSON object"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_400_saying_so(app, content, content_type, says):
    async def run():
        async with _client(app, FakeEngine([])) as client:
            headers = {"content-type": content_type} if content_type else {}
            return await client.post("/v1/completions", content=content, headers=headers)

    response = asyncio.run(run())
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] is None and says in error["message"], error


def test_engine_failure_is_500(app):
    engine = FakeEngine([], error=EngineError("Triton request failed: connection refused"))
    response = asyncio.run(_post(app, engine, "/v1/completions", {"prompt": "hi"}))
    assert response.status_code == 500 and "connection refused" in response.json()["error"]["message"]


def test_models_and_metrics(app, tokenization):
    async def run():
        async with _client(app, FakeEngine([])) as client:
            return await client.get("/v1/models"), await client.get("/metrics"), await client.get("/health")

    models_response, metrics_response, health = asyncio.run(run())
    assert models_response.json()["data"][0]["id"] == "smol"
    assert "llm_frontend_completion_tokens_total" in metrics_response.text
    assert health.status_code == 200


def _fake_logprobs(fields, ids, i, size):
    """Made-up logprobs (token t: -t / 1000) for the fields that ask for them."""
    logprobs = prompt = None
    if fields.get("logprobs"):
        k = fields.get("top_logprobs") or 0
        logprobs = [TokenLogprob(t, -t / 1000, [(t + j, -(t + j) / 1000) for j in range(k)]) for t in ids[i : i + size]]
    if fields.get("echo") and i == 0:
        k = fields.get("prompt_logprobs") or 0
        prompt_ids = fields["prompt_tokens"]
        prompt = [TokenLogprob(prompt_ids[0], None, [])]
        prompt += [
            TokenLogprob(t, -t / 1000, [(t + 1 + j, -(t + 1 + j) / 1000) for j in range(k)]) for t in prompt_ids[1:]
        ]
    return logprobs, prompt


def test_chat_logprobs_map_to_the_openai_shape(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "Paris is nice."), reason="stop")
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    data = asyncio.run(_post(app, engine, "/v1/chat/completions", body)).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert engine.requests[0]["logprobs"] is True and engine.requests[0]["top_logprobs"] == 2
    assert len(content) == len(engine.token_ids)  # the fake sends EOS too
    first = engine.token_ids[0]
    token = tokenization.token_text(first)
    assert content[0]["token"] == token and content[0]["bytes"] == list(token.encode())
    assert content[0]["logprob"] == -first / 1000 and len(content[0]["top_logprobs"]) == 2


def test_completions_echo_streams_the_prompt_and_its_logprobs_first(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "one two three"), pack_size=1)
    body = {"prompt": "count:", "echo": True, "logprobs": 1, "stream": True}
    chunks = _sse_payloads(asyncio.run(_post(app, engine, "/v1/completions", body)).text)
    assert chunks[0]["choices"][0]["text"].startswith("count:")
    assert engine.requests[0]["echo"] is True
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    values = [v for lp in logprobs for v in lp["token_logprobs"]]
    offsets = [o for lp in logprobs for o in lp["text_offset"]]
    prompt_len = len(engine.requests[0]["prompt_tokens"])
    assert values[0] is None and len(values) == prompt_len + len(engine.token_ids)
    assert offsets == sorted(offsets) and logprobs[0]["top_logprobs"][0] is None
    # the prompt's positions carry as many alternatives as the generated tokens (and the token)
    assert engine.requests[0]["prompt_logprobs"] == 1
    tops = [top for lp in logprobs for top in lp["top_logprobs"]]
    assert all(len(top) == 2 for top in tops[1:prompt_len])
    # each token's text begins at its offset in the echoed text (but the fake's EOS,
    # which is sent as a token and has no text)
    tokens = [t for lp in logprobs for t in lp["tokens"]][:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert all(text.startswith(token, offset) for token, offset in zip(tokens, offsets, strict=False))


# ---------------------------------------------------------------------------
# n choices


def test_n_choices_non_streaming(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "Paris is nice."), reason="stop")
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 7, "logprobs": True}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Paris is nice." and c["finish_reason"] == "stop" for c in data["choices"])
    assert all(len(c["logprobs"]["content"]) == len(engine.token_ids) for c in data["choices"])
    assert sorted(r["seed"] for r in engine.requests) == [7, 8, 9]
    prompt_tokens = len(engine.requests[0]["prompt_tokens"])
    usage = data["usage"]
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 3 * len(engine.token_ids)
    assert usage["total_tokens"] == prompt_tokens + 3 * len(engine.token_ids)


def test_n_choices_without_seed_send_none(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, "ok"))
    data = asyncio.run(_post(app, engine, "/v1/completions", {"prompt": "hi", "n": 2})).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert [r.get("seed") for r in engine.requests] == [None, None]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_choices_streaming(app, tokenization, path):
    engine = FakeEngine(_answer_ids(tokenization, "Hello 你好 world"), pack_size=1)
    body = {"n": 3, "stream": True, "stream_options": {"include_usage": True}, "stop": [" world"]}
    chat = path == "/v1/chat/completions"
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    chunks = _sse_payloads(asyncio.run(_post(app, engine, path, body)).text)
    assert chunks[-1]["choices"] == [] and all(c["choices"] for c in chunks[:-1])
    # each choice stopped at " world", its last token before EOS
    assert chunks[-1]["usage"]["completion_tokens"] == 3 * (len(engine.token_ids) - 1)
    texts, finishes, roles = {}, {}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        index = choice["index"]
        if chat and "role" in choice["delta"]:
            roles.append(index)
        piece = choice["delta"].get("content", "") if chat else choice["text"]
        texts[index] = texts.get(index, "") + piece
        if choice["finish_reason"]:
            finishes[index] = choice["finish_reason"]
    assert roles == ([0, 1, 2] if chat else [])
    assert texts == {i: "Hello 你好" for i in range(3)}  # the stop string cuts each choice
    assert finishes == {i: "stop" for i in range(3)}
    assert engine.cancelled == 3


def test_n_choices_refusal_is_400(app):
    engine = FakeEngine([], error=engine_error("dry_multiplier: advanced samplers are not supported"))
    body = {"prompt": "hi", "n": 2, "dry_multiplier": 0.5, "stream": True}
    response = asyncio.run(_post(app, engine, "/v1/completions", body))
    assert response.status_code == 400 and response.json()["error"]["param"] == "dry_multiplier"


@pytest.mark.parametrize("n", [0, 9])
def test_n_out_of_range_is_400(app, n):
    response = asyncio.run(_post(app, FakeEngine([]), "/v1/completions", {"prompt": "hi", "n": n}))
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_closing_the_interleaved_choices_cancels_every_request(tokenization):
    from openai_frontend.generation import generate_text, interleave

    engine = FakeEngine(_answer_ids(tokenization, "one two three four five"), pack_size=1)

    async def run():
        streams = [generate_text(engine, {"prompt_tokens": [1]}, tokenization.detokenizer([1]), []) for _ in range(3)]
        deltas = interleave(streams)
        seen = {(await anext(deltas))[0]}
        while len(seen) < 3:
            seen.add((await anext(deltas))[0])
        await deltas.aclose()  # as a client leaving mid-stream

    asyncio.run(run())
    assert len(engine.requests) == 3 and engine.cancelled == 3


# ---------------------------------------------------------------------------
# tool calling and structured output through the app (fake engine)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _chat_body(**extra):
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], **extra}


def test_tool_call_comes_back_as_tool_calls(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, CALL_TEXT), reason="stop")
    data = asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body())).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    fields = engine.requests[0]
    assert fields["tools_present"] is True and fields["grammar_kind"] == "structural_tag"
    assert fields.get("require_tool_call") is None  # "auto": text may come instead
    # the default model's template has no tools section: the tools went into the system prompt
    prompt = tokenization.tokenizer.decode(fields["prompt_tokens"])
    assert "get_weather" in prompt and "<tool_call>" in prompt


@pytest.mark.parametrize("pack_size", [1, 3, 100])
def test_streamed_tool_call_deltas_add_up_to_the_whole_call(app, tokenization, pack_size):
    engine = FakeEngine(_answer_ids(tokenization, CALL_TEXT), pack_size=pack_size, reason="stop")
    chunks = _sse_payloads(asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body(stream=True))).text)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert content == "Let me look."
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert all(tc["index"] == 0 for tc in calls)
    assert "".join(tc["function"]["arguments"] for tc in calls) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_required_and_named_force_a_call(app, tokenization):
    engine = FakeEngine(_answer_ids(tokenization, CALL_TEXT), reason="stop")
    asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body(tool_choice="required")))
    named = {"type": "function", "function": {"name": "get_weather"}}
    asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body(tool_choice=named)))
    asyncio.run(_post(app, engine, "/v1/chat/completions", _chat_body(tool_choice="none")))
    required, forced, none = engine.requests
    assert required["require_tool_call"] is True and forced["require_tool_call"] is True
    assert required["grammar_spec"] != forced["grammar_spec"]
    assert "grammar_kind" not in none and "tools_present" not in none


def test_a_repeated_tool_call_is_suppressed(app, tokenization):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    for i in range(3):
        turns.append({"role": "assistant", "content": None, "tool_calls": [{**call, "id": f"call_{i}"}]})
        turns.append({"role": "tool", "tool_call_id": f"call_{i}", "content": "sunny"})
    engine = FakeEngine(_answer_ids(tokenization, "It is sunny."), reason="stop")
    body = {"messages": turns, "tools": [WEATHER]}
    data = asyncio.run(_post(app, engine, "/v1/chat/completions", body)).json()
    assert data["choices"][0]["message"]["content"] == "It is sunny."
    assert engine.requests[0]["suppress_tool_call"] is True
    # the earlier calls were written back into the assistant turns, in the call format
    prompt = tokenization.tokenizer.decode(engine.requests[0]["prompt_tokens"])
    assert prompt.count('"name": "get_weather", "arguments": {"city": "Paris"}') == 3


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_bad_tools_and_formats_are_400_naming_the_field(app, extra, param):
    engine = FakeEngine([])
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.requests == []


def test_response_format_travels_as_a_grammar(app, tokenization):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine = FakeEngine(_answer_ids(tokenization, '{"a": 1}'), reason="stop")
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    data = asyncio.run(_post(app, engine, "/v1/chat/completions", body)).json()
    assert data["choices"][0]["message"]["content"] == '{"a": 1}'
    fields = engine.requests[0]
    assert fields["grammar_kind"] == "json_schema" and json.loads(fields["grammar_spec"]) == schema
    asyncio.run(_post(app, engine, "/v1/chat/completions", {**body, "response_format": {"type": "json_object"}}))
    assert engine.requests[1]["grammar_kind"] == "json_object"


def test_a_grammar_the_model_refuses_is_400_naming_response_format(app):
    engine = FakeEngine([], error=engine_error("grammar_spec: xgrammar cannot compile this schema"))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": fmt}
    response = asyncio.run(_post(app, engine, "/v1/chat/completions", body))
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"
