"""backend.sampling.grammar and its compiler with the default model's real tokenizer: matchers walked token by token,
masks alone steering random logits to valid JSON, bad specs, the cache and batched masking."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch
import xgrammar as xgr

from backend.contract import ContractError
from backend.runner.convert import default_model_path
from backend.sampling.grammar import GrammarState, allocate_bitmask, apply_grammar_masks
from backend.sampling.grammar_compiler import GrammarCompiler, GrammarLimits
from backend.sampling.grammar_specs import GRAMMAR_KINDS, JSON_MAX_WHITESPACE, MAX_SPEC_NESTING

MODEL_DIR = default_model_path()
if not (MODEL_DIR / "tokenizer.json").exists():
    pytest.skip(f"no converted model at {MODEL_DIR} (python -m backend.runner.convert)", allow_module_level=True)

VOCAB = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
EOS = 2  # <|im_end|>

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "address"],
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    "price": {"type": "number", "minimum": 0.5, "maximum": 100},
                },
                "required": ["sku", "qty", "price"],
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
}
NESTED = {
    "type": "object",
    "properties": {
        "a": {
            "type": "object",
            "properties": {
                "b": {
                    "type": "object",
                    "properties": {"c": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}}},
                    "required": ["c"],
                }
            },
            "required": ["b"],
        },
        "flag": {"enum": [True, False, None, "x", 1.5]},
        "ratio": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["a", "flag", "ratio"],
}
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
# Hermes tool calls: free text until "<tool_call>", then one call's JSON, then "</tool_call>"
HERMES_TAG = json.dumps(
    {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<tool_call>\n",
                    "content": {
                        "type": "json_schema",
                        "json_schema": {
                            "type": "object",
                            "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_ARGS},
                            "required": ["name", "arguments"],
                        },
                    },
                    "end": "\n</tool_call>",
                }
            ],
        },
    }
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    made = GrammarCompiler(MODEL_DIR, VOCAB, [EOS])
    yield made
    made.close()


@pytest.fixture(scope="module")
def small_compiler() -> GrammarCompiler:
    made = GrammarCompiler(MODEL_DIR, VOCAB, [EOS], cache_size=2, limits=GrammarLimits(workers=1))
    yield made
    made.close()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def first_refused(state: GrammarState, ids: list[int]) -> int | None:
    """Accept ids in order; the index of the first one refused, or None."""
    for i, token_id in enumerate(ids):
        if not state.accept(token_id):
            return i
    return None


def allowed_ids(state: GrammarState, vocab: int = VOCAB) -> torch.Tensor:
    """Reference: the ids set in the state's own one-row bitmask, unpacked bit by bit."""
    bitmask = allocate_bitmask(1, vocab)
    state.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten()


def assert_walks_to_end(state: GrammarState, ids: list[int]) -> None:
    assert first_refused(state, ids) is None
    assert state.is_completed and not state.is_terminated
    assert state.accept(EOS)
    assert state.is_terminated


# ---------------------------------------------------------------------------
# json_schema, token by token


VALID_PERSON = {
    "name": "Ann",
    "age": 41,
    "role": "admin",
    "tags": ["a", "c"],
    "address": {"city": "Oslo", "zip": "01234"},
}


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(VALID_PERSON),  # the canonical layout: json.dumps's ", " and ": "
        json.dumps({k: v for k, v in VALID_PERSON.items() if k != "tags"}),  # an optional key left out
    ],
)
def test_json_schema_accepts_valid_documents_to_termination(compiler, tokenizer, text):
    state = compiler.new_state("json_schema", json.dumps(PERSON))
    assert_walks_to_end(state, encode(tokenizer, text))


@pytest.mark.parametrize("layout", [{"separators": (",", ":")}, {"indent": 2}])
def test_json_output_has_one_layout(compiler, tokenizer, layout):
    """response_format output is laid out as json.dumps does (", ", ": ", one line): free
    whitespace let the default model write newlines between tokens until max_tokens."""
    for kind, spec in (("json_schema", json.dumps(PERSON)), ("json_object", "")):
        state = compiler.new_state(kind, spec)
        assert first_refused(state, encode(tokenizer, json.dumps(VALID_PERSON, **layout))) is not None


def _person_text(**changes) -> str:
    return json.dumps({**VALID_PERSON, **changes})


def _bad(text: str, part: str, skip: int = 0) -> tuple[str, int]:
    """(text, offset of its first character no valid document could have there)."""
    return text, text.index(part) + skip


def assert_refused_at(state: GrammarState, tokenizer, text: str, offset: int) -> None:
    """The first refused token is the one carrying text[offset]: all before it was accepted."""
    ids = encode(tokenizer, text)
    refused = first_refused(state, ids)
    assert refused is not None, f"accepted all of {text!r}"
    accepted_text = tokenizer.decode(ids[:refused])
    refused_text = tokenizer.decode(ids[: refused + 1])
    assert text.startswith(refused_text)
    assert len(accepted_text) <= offset < len(refused_text), (accepted_text, refused_text)


@pytest.mark.parametrize(
    "text, offset",
    [
        _bad(_person_text(age="41"), '"41"'),  # wrong type
        _bad(json.dumps({"name": "A", "age": 4, "address": {"city": "", "zip": "01234"}}), '"address', 1),  # no role
        _bad(_person_text(role="guest"), "guest"),  # enum
        _bad(_person_text(age=151), "151", 2),  # above maximum: "15" may go on, "151" may not
        _bad(_person_text(age=-1), "-1"),  # below minimum
        _bad(_person_text(tags=["a", "b", "c", "a"]), ', "a"]'),  # maxItems 3: no fourth item
        _bad(_person_text(address={"city": "Oslo", "zip": "1234x"}), "1234x", 4),  # pattern
        _bad(_person_text(name="A very long name"), "A very long name", 12),  # maxLength 12
    ],
)
def test_json_schema_refuses_invalid_documents_at_the_offending_token(compiler, tokenizer, text, offset):
    assert_refused_at(compiler.new_state("json_schema", json.dumps(PERSON)), tokenizer, text, offset)


def test_tool_call_json_whitespace_is_bounded(compiler, tokenizer):
    """JSON inside a structural tag (tool-call arguments) may have whitespace between tokens, up to
    JSON_MAX_WHITESPACE whitespace characters in a row."""
    spaced = "<tool_call>\n{" + " " * JSON_MAX_WHITESPACE + '"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert first_refused(compiler.new_state("structural_tag", HERMES_TAG), encode(tokenizer, spaced)) is None


def test_json_schema_keys_follow_the_schema_order_and_extra_keys_are_refused(compiler, tokenizer):
    """xgrammar 0.2.9 defaults: properties in declared order, no properties the schema
    does not name (strict mode). Documented behaviour, pinned here."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
    assert first_refused(compiler.new_state("json_schema", schema), encode(tokenizer, '{"b": 1, "a": 2}')) is not None
    assert first_refused(compiler.new_state("json_schema", schema), encode(tokenizer, '{"a": 1, "z": 2}')) is not None


def test_length_bounded_strings_refuse_raw_control_characters(compiler, tokenizer):
    """xgrammar 0.2.9 alone lets a raw \\x15 or tab into a string with maxLength (invalid
    JSON); backend.sampling.grammar_compiler rewrites the bounds as a pattern that refuses them."""
    schema = json.dumps({"type": "string", "minLength": 1, "maxLength": 5})
    for bad in ('"a\x15', '"a\t'):
        assert_refused_at(compiler.new_state("json_schema", schema), tokenizer, bad, 2)
    assert_walks_to_end(compiler.new_state("json_schema", schema), encode(tokenizer, '"abcde"'))
    assert_refused_at(compiler.new_state("json_schema", schema), tokenizer, '""', 1)  # minLength
    # a constant is a value, not a schema: its "maxLength" key is left alone (xgrammar
    # matches an object constant in compact form only)
    const = json.dumps({"const": {"type": "string", "maxLength": 3}})
    text = json.dumps({"type": "string", "maxLength": 3}, separators=(",", ":"))
    assert_walks_to_end(compiler.new_state("json_schema", const), encode(tokenizer, text))


# ---------------------------------------------------------------------------
# the mask alone: greedy decoding of random logits


def greedy_decode(states: list[GrammarState], seed: int, max_tokens: int = 300) -> list[list[int]]:
    """argmax of masked random logits, one row per state, until every row has terminated."""
    generator = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in states]
    for _ in range(max_tokens):
        logits = torch.randn(len(states), VOCAB, generator=generator)
        apply_grammar_masks(logits, states)
        for row, (state, token_id) in enumerate(zip(states, logits.argmax(dim=-1).tolist(), strict=True)):
            if state.is_terminated:
                assert token_id == EOS  # a finished grammar allows only its stop token
                continue
            assert state.accept(token_id), "the mask let through a token the grammar refuses"
            outputs[row].append(token_id)
        if all(state.is_terminated for state in states):
            return outputs
    raise AssertionError(f"not terminated within {max_tokens} tokens: {outputs}")


@pytest.mark.parametrize("schema", [PERSON, ORDER, NESTED], ids=["person", "order", "nested"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_masked_greedy_decode_validates(compiler, tokenizer, schema, seed):
    states = [compiler.new_state("json_schema", json.dumps(schema)) for _ in range(4)]
    for ids in greedy_decode(states, seed):
        assert ids[-1] == EOS
        text = tokenizer.decode(ids[:-1])
        jsonschema.validate(json.loads(text), schema)


# ---------------------------------------------------------------------------
# the other kinds


def test_json_object_accepts_any_object_and_only_objects(compiler, tokenizer):
    text = '{"anything": [1, {"nested": null}], "b": "c"}'
    assert_walks_to_end(compiler.new_state("json_object", ""), encode(tokenizer, text))
    assert isinstance(json.loads(text), dict)
    assert first_refused(compiler.new_state("json_object", ""), encode(tokenizer, "[1, 2]")) == 0
    first = [tokenizer.decode([t]) for t in allowed_ids(compiler.new_state("json_object", "")).tolist()]
    assert first and all(text.strip() in ("", "{") or text.lstrip().startswith("{") for text in first)


def test_regex(compiler, tokenizer):
    assert_walks_to_end(compiler.new_state("regex", r"\d{3}-[a-z]+"), encode(tokenizer, "123-abc"))
    assert first_refused(compiler.new_state("regex", r"\d{3}-[a-z]+"), encode(tokenizer, "12-")) is not None
    for seed in range(3):
        (ids,) = greedy_decode([compiler.new_state("regex", "(yes|no|maybe)")], seed)
        assert tokenizer.decode(ids[:-1]) in ("yes", "no", "maybe")


def test_ebnf(compiler, tokenizer):
    grammar = 'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= "bob" | "alice"'
    assert_walks_to_end(compiler.new_state("ebnf", grammar), encode(tokenizer, "hi alice"))
    assert first_refused(compiler.new_state("ebnf", grammar), encode(tokenizer, "hey bob")) is not None
    for seed in range(3):
        (ids,) = greedy_decode([compiler.new_state("ebnf", grammar)], seed)
        assert tokenizer.decode(ids[:-1]) in ("hello bob", "hello alice", "hi bob", "hi alice")


@pytest.mark.parametrize(
    "text",
    [
        "No tool needed, it is sunny.",
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}\n</tool_call>',
    ],
)
def test_structural_tag_accepts_free_text_and_valid_calls(compiler, tokenizer, text):
    assert_walks_to_end(compiler.new_state("structural_tag", HERMES_TAG), encode(tokenizer, text))


@pytest.mark.parametrize(
    "text, offset",
    [
        _bad('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "time"),
        _bad('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>', "town"),
        _bad('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\nthe end', "the end"),
        # JSON inside a tag gets the whitespace bound too
        _bad("<tool_call>\n{" + " " * (JSON_MAX_WHITESPACE + 1) + '"name"', "{", 1 + JSON_MAX_WHITESPACE),
    ],
)
def test_structural_tag_refuses_bad_calls(compiler, tokenizer, text, offset):
    assert_refused_at(compiler.new_state("structural_tag", HERMES_TAG), tokenizer, text, offset)


# ---------------------------------------------------------------------------
# bad specs


@pytest.mark.parametrize(
    "kind, spec, reason",
    [
        ("json_schema", '{"type": "object", "properties": ', "not valid JSON"),
        ("json_schema", '{"type": "objekt"}', 'Unsupported type "objekt"'),
        ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "minimum greater than maximum"),
        ("json_schema", '{"$ref": "#/$defs/missing"}', "Cannot find field '$defs'"),
        ("json_schema", '{"type": "string", "pattern": "(["}', "Unclosed '['"),
        ("json_schema", '{"items": ' * MAX_SPEC_NESTING + "{}" + "}" * MAX_SPEC_NESTING, "nests deeper than"),
        ("regex", "([", "Unclosed '['"),
        ("regex", "(?<=a)b", "Lookbehind is not supported"),
        ("ebnf", "root ::= foo", 'Rule "foo" is not defined'),
        ("ebnf", 'start ::= "a"', 'root rule with name "root" is not found'),
        ("structural_tag", "<tool_call>", "not valid JSON"),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "blah"}}', "Format type not recognized"),
    ],
    ids=lambda value: value[:24] if isinstance(value, str) else None,
)
def test_bad_specs_raise_contract_errors_with_xgrammars_reason(compiler, kind, spec, reason):
    with pytest.raises(ContractError) as caught:
        compiler.compile(kind, spec)
    assert caught.value.field == "grammar_spec"
    assert reason in caught.value.message
    assert "/project/cpp" not in caught.value.message and "Check failed" not in caught.value.message


def test_unknown_kind_names_grammar_kind(compiler):
    with pytest.raises(ContractError) as caught:
        compiler.compile("xml", "<a/>")
    assert caught.value.field == "grammar_kind"
    assert all(kind in caught.value.message for kind in GRAMMAR_KINDS)


def test_failures_are_not_cached(compiler):
    for _ in range(2):
        with pytest.raises(ContractError):
            compiler.compile("regex", "(unclosed")


# ---------------------------------------------------------------------------
# cache and time limit


def test_cache_returns_the_same_compiled_grammar(compiler):
    schema = json.dumps(PERSON)
    assert compiler.compile("json_schema", schema) is compiler.compile("json_schema", schema)
    assert compiler.compile("json_object", "") is compiler.compile("json_object", "ignored")


def test_cache_is_lru_bounded(small_compiler):
    a = small_compiler.compile("regex", "a+")
    b = small_compiler.compile("regex", "b+")
    assert small_compiler.compile("regex", "a+") is a  # a is now the most recent
    small_compiler.compile("regex", "c+")  # evicts b, the least recent
    assert small_compiler.compile("regex", "a+") is a
    assert small_compiler.compile("regex", "b+") is not b


def test_concurrent_compiles_of_one_spec_share_one_grammar(compiler):
    spec = json.dumps({"type": "array", "items": {"enum": ["concurrent", "compile"]}})
    with ThreadPoolExecutor(max_workers=8) as pool:
        compiled = list(pool.map(lambda _: compiler.compile("json_schema", spec), range(8)))
    assert all(c is compiled[0] for c in compiled)


# ---------------------------------------------------------------------------
# batched masking


def test_batched_apply_leaves_none_rows_untouched_and_masks_grammar_rows(compiler, tokenizer):
    terminated = compiler.new_state("regex", "ok")
    assert terminated.accept_many(encode(tokenizer, "ok") + [EOS]) and terminated.is_terminated
    midway = compiler.new_state("json_schema", json.dumps(PERSON))
    assert midway.accept_many(encode(tokenizer, '{"name": "Ann", "age": 4'))
    states = [None, compiler.new_state("json_schema", json.dumps(ORDER)), None, midway, terminated, None]
    logits = torch.randn(len(states), VOCAB, generator=torch.Generator().manual_seed(7))
    before = logits.clone()
    apply_grammar_masks(logits, states)
    for row, state in enumerate(states):
        if state is None:
            assert torch.equal(logits[row], before[row])
            continue
        allowed = allowed_ids(state)
        assert torch.equal(torch.isfinite(logits[row]).nonzero().flatten(), allowed)
        assert torch.equal(logits[row, allowed], before[row, allowed])
    assert allowed_ids(terminated).tolist() == [EOS]
    # the same as xgrammar's own kernel on the same bits
    reference = before.clone()
    bitmask = allocate_bitmask(len(states), VOCAB)
    grammar_rows = [row for row, state in enumerate(states) if state is not None]
    for row in grammar_rows:
        states[row].fill_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(reference, bitmask, indices=grammar_rows, backend="cpu")
    assert torch.equal(logits, reference)
    # the reused buffer: a smaller batch afterwards still masks the right rows
    logits = torch.zeros(2, VOCAB)
    apply_grammar_masks(logits, [None, terminated])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [EOS]
    assert torch.isfinite(logits[0]).all()


def test_tokens_past_the_tokenizer_and_past_the_grammar_vocab_are_refused():
    """config.json may pad the vocabulary past the tokenizer's tokens (49152 here), and
    logits may be wider still: a grammar row refuses every one of those columns."""
    padded = VOCAB + 64
    wide = GrammarCompiler(MODEL_DIR, padded, [EOS], limits=GrammarLimits(workers=1))
    states = [None, wide.new_state("json_object", ""), wide.new_state("regex", "[a-z]*")]
    wide.close()
    logits = torch.zeros(len(states), padded + 40)
    apply_grammar_masks(logits, states)
    assert torch.isfinite(logits[0]).all()
    special = [i for i in range(17) if i != EOS]  # <|endoftext|>, <|im_start|>, <repo_name>...
    for row in (1, 2):
        assert torch.isfinite(logits[row, :VOCAB]).any()
        assert torch.isinf(logits[row, VOCAB:]).all()
        assert torch.isinf(logits[row, special]).all()
    with pytest.raises(ValueError, match="fewer than the grammar's vocab_size"):
        apply_grammar_masks(torch.zeros(1, VOCAB), [states[1]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_masks_equal_cpu_masks(compiler, tokenizer):
    states = [None, compiler.new_state("json_schema", json.dumps(PERSON)), compiler.new_state("regex", "[0-9]+")]
    logits = torch.randn(len(states), VOCAB, generator=torch.Generator().manual_seed(3))
    on_cuda = logits.cuda()
    apply_grammar_masks(logits, states)
    apply_grammar_masks(on_cuda, states)
    assert torch.equal(on_cuda.cpu(), logits)


# ---------------------------------------------------------------------------
# rollback and all-or-nothing acceptance


def test_rollback_restores_the_earlier_state(compiler, tokenizer):
    ids = encode(tokenizer, json.dumps(VALID_PERSON))
    state = compiler.new_state("json_schema", json.dumps(PERSON))
    assert state.accept_many(ids[:10])
    mask_at_10 = allowed_ids(state)
    assert state.accept_many(ids[10:15])
    state.rollback(5)
    assert torch.equal(allowed_ids(state), mask_at_10)
    state.rollback(0)
    assert_walks_to_end(state, ids[10:])
    state.rollback(1)  # un-accept the stop token
    assert not state.is_terminated and state.is_completed


def test_accept_many_is_all_or_nothing(compiler, tokenizer):
    state = compiler.new_state("json_schema", json.dumps(PERSON))
    good = encode(tokenizer, '{"name": "Ann", "age": 4')
    assert state.accept_many(good[:3])
    mask = allowed_ids(state)
    assert not state.accept_many(good[3:] + encode(tokenizer, "x"))
    assert torch.equal(allowed_ids(state), mask)
    assert state.accept_many(good[3:])
