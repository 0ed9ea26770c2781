"""An OpenAI body -> the contract's GenerationRequest: shapes (pydantic), values (validated),
the fields it sets and the tensors that go out (backend.contract.encode_request)."""

from __future__ import annotations

import pytest

from backend import contract
from backend.contract.routing import session_hash
from openai_frontend.api.chat_protocol import ChatCompletionRequest
from openai_frontend.api.errors import OpenAIError
from openai_frontend.api.protocol import CompletionRequest
from openai_frontend.api.request_builder import build_request, for_choice, validated
from tests.helpers.fake_engine import DEFAULT_INFO as INFO

USER_X = [{"role": "user", "content": "x"}]


def _build(body, prompt=(1,), stream=False, **kwargs):
    return build_request(body, list(prompt), INFO, tenant=kwargs.pop("tenant", ""), stream=stream, **kwargs)


def test_chat_request_maps_to_the_generation_request():
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
        num_beams=1,  # a contract field, set by its contract name
        lookup_tenant="other",  # never settable by a client
        unknown_field=1,
    )
    request = _build(body, [1, 2, 3], stream=True)
    sampling = request.sampling
    assert request.prompt_tokens == [1, 2, 3] and request.stream is True and request.lookup_tenant == ""
    assert (sampling.max_tokens, sampling.min_tokens, sampling.temperature, sampling.top_p) == (7, 2, 0.5, 0.9)
    assert (sampling.seed, sampling.top_k, sampling.stop_token_ids, sampling.ignore_eos) == (3, 5, (4,), True)
    assert sampling.presence_penalty == 0.5
    arrays = contract.encode_request(request)
    assert set(arrays) == {
        "prompt_tokens",
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_k",
        "top_p",
        "presence_penalty",
        "seed",
        "stop_token_ids",
        "ignore_eos",
        "session_hash",
        "stream",
    }
    assert arrays["max_tokens"].tolist() == [7]
    assert arrays["seed"].dtype.name == "int64"
    assert body.param_of("max_tokens") == "max_completion_tokens"
    # the tenant is the API key's, whatever the body says
    assert _build(body, tenant="alice").lookup_tenant == "alice"
    validated(body, request, INFO)
    # the session: the prompt's (and the tenant's), or the one the client names
    assert request.session_hash == session_hash("", [1, 2, 3])
    assert _build(body, [1, 2, 3], tenant="alice").session_hash == session_hash("alice", [1, 2, 3])
    named = body.model_copy(update={"prompt_cache_key": "conv-7"})
    assert _build(named, [1, 2, 3]).session_hash == session_hash("", [9], "conv-7")
    assert _build(ChatCompletionRequest(messages=USER_X, session_id="conv-7"), [4]).session_hash == session_hash(
        "", [], "conv-7"
    )


def test_defaults_send_only_the_prompt_its_session_and_the_stream_flag_when_streaming():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_k=-1)
    request = _build(body)
    assert request.sampling.top_k == 0  # vLLM's -1: off
    assert set(contract.encode_request(request)) == {"prompt_tokens", "session_hash"}  # stream=False: the default
    assert set(contract.encode_request(_build(body, stream=True))) == {"prompt_tokens", "session_hash", "stream"}


def test_chat_features_map_to_their_fields_and_back():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        response_format={"type": "json_object"},
        logit_bias={"5": 1.0},
    )
    request = _build(body)
    assert (request.grammar_kind, request.grammar_spec) == ("json_object", "")
    assert request.sampling.logit_bias_ids == (5,) and request.sampling.logit_bias_values == (1.0,)
    assert body.param_of("grammar_kind") == "response_format"
    assert body.param_of("tools_present") == "tools"
    # with tools (and a tool_choice other than none) the grammar is the tools'
    with_tools = body.model_copy(update={"tools": [{"type": "function", "function": {"name": "f"}}]})
    assert with_tools.param_of("grammar_spec") == "tools"
    assert body.param_of("prompt_tokens") == "messages"
    assert body.messages[0].template_dict() == {"role": "user", "content": "a\nb"}


def test_presets_apply_only_to_fields_the_body_leaves_unset():
    presets = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 50}
    body = ChatCompletionRequest(messages=USER_X, temperature=0.7, top_k=-1)
    sampling = _build(body, presets=presets).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == (0.7, 0.9, 0, 50)
    # max_completion_tokens sets max_tokens; a temperature of 0 is set, not absent
    body = ChatCompletionRequest(messages=USER_X, temperature=0, max_completion_tokens=5)
    sampling = _build(body, presets=presets).sampling
    assert (sampling.temperature, sampling.max_tokens) == (0.0, 5)
    assert _build(body).sampling.top_p == 1.0  # no presets: the contract's defaults


def test_each_choice_gets_its_own_seed():
    request = _build(ChatCompletionRequest(messages=USER_X, seed=7))
    assert [for_choice(request, i).sampling.seed for i in range(3)] == [7, 8, 9]
    assert request.sampling.seed == 7  # the request itself is left as it was
    unseeded = _build(ChatCompletionRequest(messages=USER_X))
    assert for_choice(unseeded, 2).sampling.seed is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 9}, "n"),
        ({"n": 0}, "n"),
        ({"messages": []}, "messages"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"timeout": 0}, "timeout"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_chat_shape_errors_name_the_field(extra, param):
    with pytest.raises(ValueError) as info:
        ChatCompletionRequest(**{"messages": USER_X, **extra})
    assert info.value.errors()[0]["loc"][0] == param


def _refusal(body) -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        validated(body, _build(body), INFO)
    return refused.value


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {"49152": 1.0}}, "logit_bias"),  # past the model's vocabulary
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"dry_multiplier": -1}, "dry_multiplier"),  # an extension, set by its contract name
        ({"thinking_budget": -1}, "thinking_budget"),
    ],
)
def test_chat_values_the_contract_refuses_are_400_naming_the_field(extra, param):
    body = ChatCompletionRequest(**{"messages": USER_X, **extra})  # the shape is fine
    error = _refusal(body)
    assert error.status == 400 and error.param == param
    assert error.message.startswith(f"{param}: "), error.message


def test_a_contract_name_with_a_value_of_the_wrong_type_is_400_naming_it():
    body = ChatCompletionRequest(messages=USER_X, dry_multiplier="lots")
    with pytest.raises(OpenAIError) as refused:
        _build(body)
    assert refused.value.status == 400 and refused.value.param == "dry_multiplier"


def test_completion_prompt_forms():
    assert CompletionRequest(prompt="hi").prompts() == ["hi"]
    assert CompletionRequest(prompt=["hi"]).prompts() == ["hi"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]  # several prompts (LangChain's generate)
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert CompletionRequest(prompt="").prompts() == [""]  # spec-valid: the start of a document
    assert CompletionRequest(prompt=None).prompts() == [""]
    for bad in ([], [[1], []], {"prompt": ["p"] * 9, "n": 8}):
        kwargs = bad if isinstance(bad, dict) else {"prompt": bad}
        with pytest.raises(ValueError):
            CompletionRequest(**{"prompt": "x", **kwargs})


def test_spec_nulls_mean_the_defaults():
    body = CompletionRequest(prompt="x", n=None, stream=None, echo=None, max_tokens=None)
    assert (body.n, body.stream, body.echo, body.max_tokens) == (1, False, False, 16)  # the spec's max_tokens default
    chat = ChatCompletionRequest(messages=USER_X, n=None, stream=None)
    assert (chat.n, chat.stream) == (1, False)


def test_top_p_0_is_a_greedy_draw():
    sampling = _build(ChatCompletionRequest(messages=USER_X, top_p=0, temperature=0.9)).sampling
    assert (sampling.temperature, sampling.top_p) == (0.0, 1.0)


def test_max_tokens_0_computes_the_prompt_alone():
    sampling = validated(
        CompletionRequest(prompt="x", max_tokens=0, echo=True, logprobs=1),
        _build(CompletionRequest(prompt="x", max_tokens=0, echo=True, logprobs=1)),
        INFO,
    ).sampling
    assert (sampling.max_tokens, sampling.prompt_logprobs) == (0, 1)


def test_the_largest_seed_wraps_for_the_next_choices():
    request = _build(ChatCompletionRequest(messages=USER_X, seed=2**63 - 1, n=3))
    seeds = [for_choice(request, i).sampling.seed for i in range(3)]
    assert seeds == [2**63 - 1, -(2**63), -(2**63) + 1]
    for i in range(3):  # each encodes as the contract's int64 (seed + i once overflowed it)
        assert contract.encode_request(for_choice(request, i))["seed"].tolist() == [seeds[i]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 21, "echo": True}, "logprobs"),  # the prompt's logprobs are asked with logprobs too
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"prompt": [10**9]}, "prompt"),  # a token id outside the model's vocabulary
    ],
)
def test_completion_values_the_contract_refuses_are_400_naming_the_field(extra, param):
    body = CompletionRequest(**{"prompt": "x", **extra})
    prompt = body.prompt if isinstance(body.prompt, list) else [1]
    with pytest.raises(OpenAIError) as refused:
        validated(body, _build(body, prompt), INFO)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.message.startswith(f"{param}: "), refused.value.message


def test_completion_logprobs_and_echo_map_to_the_prompt_logprobs():
    sampling = _build(CompletionRequest(prompt="x", logprobs=2)).sampling
    assert (sampling.logprobs, sampling.top_logprobs, sampling.prompt_logprobs) == (True, 2, None)
    sampling = _build(CompletionRequest(prompt="x", logprobs=0, echo=True)).sampling
    assert (sampling.logprobs, sampling.top_logprobs, sampling.prompt_logprobs) == (True, 0, 0)
    assert _build(CompletionRequest(prompt="x", echo=True)).sampling.prompt_logprobs is None
