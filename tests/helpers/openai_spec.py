"""OpenAI's published OpenAPI spec, the part this server implements, as data for the tests.

tests/helpers/openai_spec.json holds the operations POST /chat/completions, POST
/completions, GET /models, GET /models/{model}, POST /responses, GET
/responses/{response_id} and POST /responses/input_tokens of github.com/openai/openai-openapi
(openapi.json at commit SPEC_COMMIT), with every component schema they reach. Re-vendor
with `python -m tests.helpers.openai_spec PATH/TO/openapi.json` (from the repository root).

`validator(name)` checks a body against one of its schemas. The spec mixes OpenAPI 3.0's
`nullable: true` into a 3.1 document; it is read as "or null", as the SDKs read it.
"""

from __future__ import annotations

import copy
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_COMMIT = "f85dbe223d40e1a31cba812ab2d755c7e98a92a3"  # 2026-08-21
SPEC_FILE = Path(__file__).with_name("openai_spec.json")
OPERATIONS = (
    ("/chat/completions", "post"), ("/completions", "post"), ("/models", "get"), ("/models/{model}", "get"),
    ("/responses", "post"), ("/responses/{response_id}", "get"), ("/responses/input_tokens", "post"),
)  # fmt: skip
_BASE = "urn:openai-spec"


@cache
def spec() -> dict[str, Any]:
    return json.loads(SPEC_FILE.read_text())


def schemas() -> dict[str, Any]:
    return spec()["components"]["schemas"]


def request_fields(name: str) -> dict[str, Any]:
    """A request schema's properties, its allOf parts' included."""
    return _properties(schemas()[name])


def _properties(schema: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        return _properties(schemas()[schema["$ref"].rsplit("/", 1)[-1]])
    fields: dict[str, Any] = {}
    for part in schema.get("allOf", []):
        fields.update(_properties(part))
    fields.update(schema.get("properties", {}))
    return fields


@cache
def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for components/schemas/<name>, $refs resolved within the spec."""
    document = _nullable_as_null(copy.deepcopy(spec()))
    registry = Registry().with_resource(_BASE, Resource.from_contents(document, default_specification=DRAFT202012))
    return jsonschema.Draft202012Validator({"$ref": f"{_BASE}#/components/schemas/{name}"}, registry=registry)


def _nullable_as_null(node: Any) -> Any:
    """`nullable: true` (OpenAPI 3.0) as JSON Schema's "or null", everywhere in the document."""
    if isinstance(node, list):
        return [_nullable_as_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable_as_null(value) for key, value in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


def vendor(full_spec_path: str) -> None:
    """Cut the operations above, and every schema they reach, out of the full openapi.json."""
    full = json.loads(Path(full_spec_path).read_text())
    paths = {path: {method: full["paths"][path][method]} for path, method in OPERATIONS}
    wanted: set[str] = set()
    _collect_refs(paths, full["components"]["schemas"], wanted)
    subset = {
        "openapi": full["openapi"],
        "info": {**full["info"], "x-vendored-from": f"github.com/openai/openai-openapi@{SPEC_COMMIT}"},
        "paths": paths,
        "components": {"schemas": {name: full["components"]["schemas"][name] for name in sorted(wanted)}},
    }
    SPEC_FILE.write_text(json.dumps(subset, indent=1, sort_keys=True) + "\n")


def _collect_refs(node: Any, all_schemas: dict[str, Any], wanted: set[str]) -> None:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
                name = ref.rsplit("/", 1)[-1]
                if name not in wanted:
                    wanted.add(name)
                    stack.append(all_schemas[name])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


if __name__ == "__main__":
    vendor(sys.argv[1])
