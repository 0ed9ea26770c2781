"""vLLM's structured outputs: `structured_outputs` and the older `guided_*` fields -> a grammar.

One form constrains a request at a time: `response_format` (OpenAI's, chat), vLLM's
`structured_outputs: {json | regex | choice | grammar | json_object | structural_tag}`
(one key), or its older top-level `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. Each becomes the contract's (grammar_kind, grammar_spec):

- json: a JSON schema (an object, or its JSON text) -> json_schema
- regex: a regular expression the whole output matches -> regex
- choice: a list of strings, the output exactly one of them -> an EBNF alternation
- grammar: an EBNF grammar (xgrammar's dialect, GBNF-like, `root` the start) -> ebnf
- json_object: true -> json_object
- structural_tag: xgrammar's structural tag (an object, or its JSON text) -> structural_tag

More than one form, a shape that is not one of these, or (here) a form with tools is a
400 naming the fields; a form the engine cannot compile is a 400 naming the body field
it came from (`structured_outputs.regex`, `guided_regex`), through `structured_param`.
"""

from __future__ import annotations

import json
from typing import Any

from openai_frontend.api.errors import bad_request
from openai_frontend.operations.bounds import checked_json_text

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# structured_outputs keys vLLM has that change nothing here (xgrammar is the one backend)
_IGNORABLE_KEYS = frozenset({"backend", "disable_fallback"})
_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "structural_tag": "structural_tag"}


def _given(body) -> dict[str, Any]:
    extra = body.model_extra or {}
    return {name: extra[name] for name in ("structured_outputs", *GUIDED_FIELDS) if extra.get(name) is not None}


def _forms(body) -> list[tuple[str, str, Any]]:
    """(body param, vLLM key, value) of each structured-output form the body gives."""
    forms = []
    for name, value in _given(body).items():
        if name != "structured_outputs":
            forms.append((name, GUIDED_FIELDS[name], value))
            continue
        if not isinstance(value, dict):
            raise bad_request(name, f"{name}: expected an object with one of {', '.join(STRUCTURED_KEYS)}")
        for key, item in value.items():
            if key in _IGNORABLE_KEYS or item is None or (key == "json_object" and item is False):
                continue
            if key not in STRUCTURED_KEYS:
                param = f"{name}.{key}"
                why = f"not supported here; use one of {', '.join(STRUCTURED_KEYS)}"
                raise bad_request(param, f"{param}: {why}")
            forms.append((f"{name}.{key}", key, item))
        if not any(param.startswith(name + ".") for param, _, _ in forms):
            raise bad_request(name, f"{name}: give one of {', '.join(STRUCTURED_KEYS)}")
    return forms


def structured_param(body) -> str | None:
    """The body field the request's grammar came from, if a vLLM form gave it."""
    try:
        forms = _forms(body)
    except Exception:  # noqa: BLE001 - a bad form was refused before any grammar was made
        return None
    return forms[0][0] if len(forms) == 1 else None


def grammar_of(body) -> tuple[str, str] | None:
    """The body's output constraint (kind, spec): response_format's or a vLLM form's;
    None for free text. A 400 naming the fields when more than one is given."""
    own = body.grammar()
    forms = _forms(body)
    if not forms:
        return own
    names = [param for param, _, _ in forms]
    if own is not None:  # response_format "text" constrains nothing
        names.insert(0, "response_format")
    if len(names) > 1:
        raise bad_request(names[1], f"{' and '.join(names)}: give one structured-output form, not {len(names)}")
    param, key, value = forms[0]
    if getattr(body, "tools", None) and getattr(body, "tool_choice", None) != "none":
        why = "cannot be combined with tools (their calls have a grammar of their own); use response_format"
        raise bad_request(param, f"{param}: {why}")
    return _grammar(param, key, value)


def _grammar(param: str, key: str, value: Any) -> tuple[str, str]:
    if key == "json_object":
        if value is not True:
            raise bad_request(param, f"{param}: expected true")
        return "json_object", ""
    if key == "choice":
        return "ebnf", choice_grammar(param, value)
    if key in ("json", "structural_tag"):
        if isinstance(value, str):
            value = checked_json_text(value, param)
        if not isinstance(value, dict):
            raise bad_request(param, f"{param}: expected a JSON object (or its JSON text)")
        return _KINDS[key], json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise bad_request(param, f"{param}: expected a non-empty string")
    return _KINDS[key], value


def choice_grammar(param: str, choices: Any) -> str:
    """An EBNF grammar whose only sentences are the choices, exactly."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise bad_request(param, f"{param}: expected a non-empty list of strings")
    unique = list(dict.fromkeys(choices))
    return "root ::= " + " | ".join(ebnf_string(choice) for choice in unique)


def ebnf_string(text: str) -> str:
    """`text` as an xgrammar EBNF string literal: quotes and backslashes escaped, control
    characters as \\uXXXX, everything else as itself (UTF-8)."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'
