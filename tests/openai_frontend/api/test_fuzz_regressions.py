"""Bodies the schemathesis fuzz (tests/e2e/test_fuzz_e2e.py) found to give a 500, now a 400:
each must fail validation, never raise anything else."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from backend import contract
from openai_frontend.api.chat_protocol import ChatCompletionRequest
from openai_frontend.api.protocol import CompletionRequest
from openai_frontend.api.request_builder import build_request
from tests.helpers.fake_engine import DEFAULT_INFO


def test_a_content_part_whose_type_is_not_a_string_is_a_validation_error():
    # was TypeError: unhashable type: 'dict' in the text-parts check
    with pytest.raises(ValidationError, match="content"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": {}, "text": ""}]}])


def test_a_malformed_or_unknown_part_is_still_named():
    with pytest.raises(ValidationError, match="image_url"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValidationError, match="input_audio are not supported"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "input_audio"}]}])


def test_a_huge_timeout_is_a_validation_error():
    # was OverflowError: round(1e308 * 1000) when mapping timeout to the engine's deadline
    with pytest.raises(ValidationError, match="timeout"):
        CompletionRequest(prompt="Hi", timeout=1e308)
    body = CompletionRequest(prompt="Hi", timeout=3600)
    request = build_request(body, [1], DEFAULT_INFO, tenant="", stream=False)
    assert request.guards.timeout_s == 3600
    assert contract.encode_request(request)["timeout_s"].tolist() == [3600.0]
