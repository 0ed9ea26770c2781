"""Structured output, what xgrammar is given: a (kind, spec) pair checked, bounded and
adjusted into the text it compiles, and the one xgrammar call that compiles it.

Runs in the Triton process (`checked_spec`, before any compilation starts, so a spec
past a limit is refused in milliseconds) and in the grammar compiler's worker processes
(`compile_spec`, which both they and the Triton process call, so both compile alike).
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from backend.contract import ContractError

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")

# Most whitespace characters allowed between two JSON tokens of a structural tag (tool
# calls). Unbounded whitespace (xgrammar's default) lets a weak model, or a sampler with
# a flat distribution, emit newlines forever inside an otherwise valid document; a bound
# of 24 still let SmolLM2 at temperature 1 write 16+ single-newline tokens in one gap,
# which the content-loop guard (rightly) took for a loop and cut the call short (seen
# once in CI). One character keeps ", ", ": " and a newline; as with response_format,
# the layout of arguments carries no information.
JSON_MAX_WHITESPACE = 1
# response_format output is one line, laid out as json.dumps lays it out: ", " and ": "
# and no other whitespace. With free whitespace (xgrammar's default), the default model
# sampling at 0.7 wrote newlines between most tokens and ran out of max_tokens before
# closing the object; the layout carries no information, so it is not left to chance.
_CANONICAL_JSON = {"any_whitespace": False, "separators": (", ", ": ")}
# Deepest JSON nesting a json_schema or structural_tag spec may have. xgrammar's
# compile time grows steeply with depth (schema depth 400: 3 s, 1000: 44 s); real
# schemas stay far below this.
MAX_SPEC_NESTING = 100

_OBJECT_SCHEMA = '{"type": "object"}'
# any characters but the control ones, low to high of them (high empty: no upper bound)
_LENGTH_PATTERN = r"^[^\x00-\x1f]{{{low},{high}}}$"
_XGRAMMAR_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")
_MAX_REASON_CHARS = 400


def checked_spec(kind: str, spec: str, max_nodes: int, max_chars: int) -> str:
    """The text xgrammar compiles for a known `kind`: a JSON spec within `max_nodes` JSON
    values (GRAMMAR_MAX_SPEC_NODES) and MAX_SPEC_NESTING levels, adjusted; a regex or
    EBNF spec within `max_chars` characters (GRAMMAR_MAX_SPEC_CHARS). ContractError
    naming grammar_spec otherwise."""
    if kind in ("regex", "ebnf"):
        if len(spec) > max_chars:
            raise ContractError(
                "grammar_spec",
                f"the {kind} spec has {len(spec)} characters, more than the {max_chars} this server "
                "compiles (GRAMMAR_MAX_SPEC_CHARS)",
            )
        return spec
    if kind == "json_object":
        return _OBJECT_SCHEMA
    value = _parse_json(kind, spec, max_nodes)
    if kind == "json_schema":
        _bound_string_lengths_by_pattern(value)
    else:
        _patch_structural_tag(value)
    return json.dumps(value)


def compile_spec(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
    """xgrammar's compilation of `checked_spec`'s text; raises what xgrammar raises."""
    if kind == "json_object":  # an object, any keys; not xgrammar's builtin, which allows arrays
        return compiler.compile_json_schema(text, strict_mode=False, **_CANONICAL_JSON)
    if kind == "json_schema":
        # strict mode (the default) refuses properties the schema does not name
        return compiler.compile_json_schema(text, **_CANONICAL_JSON)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    return compiler.compile_structural_tag(text)


def xgrammar_reason(exc: Exception) -> str:
    """xgrammar's message without its timestamp, C++ source location and check expression."""
    reason = " ".join(_XGRAMMAR_NOISE.sub("", str(exc)).split())
    return reason if len(reason) <= _MAX_REASON_CHARS else reason[:_MAX_REASON_CHARS] + "..."


def _parse_json(kind: str, spec: str, max_nodes: int) -> Any:
    """Parse errors from Python's json name line and column; xgrammar's do not."""
    try:
        value = json.loads(spec)
    except (ValueError, RecursionError) as exc:
        raise ContractError("grammar_spec", f"the {kind} spec is not valid JSON: {exc}") from None
    depth, nodes = _json_shape(value)
    if depth > MAX_SPEC_NESTING:
        raise ContractError("grammar_spec", f"the {kind} spec nests deeper than {MAX_SPEC_NESTING} levels")
    if nodes > max_nodes:
        raise ContractError(
            "grammar_spec",
            f"the {kind} spec has {nodes} JSON values, more than the {max_nodes} this server compiles "
            "(GRAMMAR_MAX_SPEC_NODES); simplify it (fewer anyOf/oneOf branches or properties)",
        )
    return value


def _json_shape(value: Any) -> tuple[int, int]:
    """(deepest nesting, number of values: objects, arrays and scalars, keys not counted)."""
    deepest, count, stack = 0, 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest, count = max(deepest, depth), count + 1
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest, count


def _bound_string_lengths_by_pattern(schema: Any) -> None:
    r"""In place: {"type": "string", "minLength": m, "maxLength": n} becomes the pattern
    ^[^\x00-\x1f]{m,n}$.

    xgrammar 0.2.9 compiles a length-bounded string to [^"\\\r\n]{m,n}, which lets raw
    control characters through (tab, \x15...): invalid JSON that json.loads refuses. A
    pattern is matched against the string's decoded characters and refuses them. Neither
    form allows an escape (\n, \"), so nothing valid is lost. (xgrammar ignores the
    lengths of a string that has a pattern; we leave those alone.)
    """
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "string" and "pattern" not in node and "format" not in node:
                low, high = node.get("minLength", 0), node.get("maxLength")
                if (
                    ("minLength" in node or "maxLength" in node)
                    and _is_count(low)
                    and (high is None or _is_count(high))
                ):
                    node.pop("minLength", None)
                    node.pop("maxLength", None)
                    node["pattern"] = _LENGTH_PATTERN.format(low=low, high="" if high is None else high)
            # constants are values, not schemas: a {"maxLength": 3} inside one stays as it is
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default", "examples"))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _patch_structural_tag(tag: Any) -> None:
    """In place: every JSON-schema part of a structural tag gets JSON_MAX_WHITESPACE (unless
    it sets its own bound) and the length-bounded string fix."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                node.setdefault("max_whitespace_cnt", JSON_MAX_WHITESPACE)
                _bound_string_lengths_by_pattern(node["json_schema"])
            # a JSON schema's own keywords are not tag formats: do not walk into it
            stack.extend(v for k, v in node.items() if k != "json_schema")
        elif isinstance(node, list):
            stack.extend(node)
