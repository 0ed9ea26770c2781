"""Bodies the schemathesis fuzz (tests/test_fuzz_e2e.py) found to give a 500, now a 400:
each must fail validation, never raise anything else."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest


def test_a_content_part_whose_type_is_not_a_string_is_a_validation_error():
    # was TypeError: unhashable type: 'dict' in the text-parts check
    with pytest.raises(ValidationError, match="content"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": {}, "text": ""}]}])


def test_a_non_text_part_is_still_named():
    with pytest.raises(ValidationError, match="not image_url"):
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])


def test_a_huge_timeout_is_a_validation_error():
    # was OverflowError: round(1e308 * 1000) when mapping timeout to deadline_ms
    with pytest.raises(ValidationError, match="timeout"):
        CompletionRequest(prompt="Hi", timeout=1e308)
    fields = CompletionRequest(prompt="Hi", timeout=3600).contract_fields([1], stream=False)
    assert fields["deadline_ms"] == 3_600_000
