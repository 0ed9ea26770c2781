"""The wire contract: config.pbtxt agrees with it; requests survive a round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backend import contract
from backend.contract import INPUTS, ContractError, decode_request, encode_request, render_config_pbtxt

CONFIG = Path(__file__).resolve().parent.parent / "model_repository" / "llm" / "config.pbtxt"


def test_config_pbtxt_is_generated_from_the_contract():
    assert CONFIG.read_text() == render_config_pbtxt(), (
        "model_repository/llm/config.pbtxt is stale: run "
        "`python -m backend.contract > model_repository/llm/config.pbtxt`"
    )


def test_only_prompt_tokens_is_required():
    required = [spec.name for spec in INPUTS if not spec.optional]
    assert required == ["prompt_tokens"]


def test_absent_inputs_take_their_defaults():
    values = decode_request({"prompt_tokens": np.array([5, 6], dtype=np.int32)})
    assert values["prompt_tokens"] == (5, 6)
    for spec in INPUTS[1:]:
        assert values[spec.name] == spec.default, spec.name


def test_round_trip_through_named_arrays():
    fields = {
        "prompt_tokens": [1, 2, 3],
        "lookup_tenant": "acme",
        "max_tokens": 16,
        "min_tokens": 2,
        "temperature": 0.5,
        "top_k": 40,
        "top_p": 0.9,
        "seed": 1234567890123,
        "stop_tokens": [7, 8],
        "disable_mtp": True,
        "stream": True,
    }
    arrays = encode_request(fields)
    for name, array in arrays.items():
        spec = contract.INPUTS_BY_NAME[name]
        assert array.dtype == spec.numpy_dtype, name
        assert array.ndim == 1, name
    values = decode_request(arrays)
    expected = dict(fields, prompt_tokens=(1, 2, 3), stop_tokens=(7, 8), lookup_tenant=b"acme")
    for name, value in expected.items():
        assert values[name] == pytest.approx(value), name


def test_none_fields_are_left_out():
    arrays = encode_request({"prompt_tokens": [1], "seed": None, "max_tokens": None})
    assert set(arrays) == {"prompt_tokens"}


@pytest.mark.parametrize(
    ("name", "value"),
    [("num_beams", 4), ("session_hash", b"abc"), ("images", [b"\x89PNG"]), ("adapter_slot", 2)],
)
def test_unimplemented_field_with_a_non_default_value_is_rejected(name, value):
    arrays = encode_request({"prompt_tokens": [1], name: value})
    with pytest.raises(ContractError) as info:
        decode_request(arrays)
    assert info.value.field == name
    assert "not supported" in info.value.message


def test_unimplemented_field_at_its_default_is_accepted():
    values = decode_request(encode_request({"prompt_tokens": [1], "num_beams": 1, "dry_multiplier": 0.0}))
    assert values["num_beams"] == 1


@pytest.mark.parametrize(
    ("arrays", "field"),
    [
        ({}, "prompt_tokens"),
        ({"prompt_tokens": np.array([1], np.int32), "bogus": np.array([1])}, "bogus"),
        ({"prompt_tokens": np.array([1], np.int32), "max_tokens": np.array([1, 2], np.int32)}, "max_tokens"),
        ({"prompt_tokens": np.array([1], np.int32), "temperature": np.array([np.nan], np.float32)}, "temperature"),
    ],
)
def test_malformed_requests_name_the_field(arrays, field):
    with pytest.raises(ContractError) as info:
        decode_request(arrays)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
