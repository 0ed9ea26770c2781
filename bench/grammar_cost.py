"""The grammar's cost per decode step at 32 constrained streams, as a share of the step.

32 sequences under JSON-schema grammars (4 schemas, 8 streams each), each walking a
valid document of its schema token by token: per step, what the engine adds for
grammars: the batched mask (every matcher fills its bitmask row, one masked apply
over the [32, vocab] logits) and every matcher accepting its token. Against one
32-row decode step of the real engine (bench.sampler_cost.forward_step_s). Target:
under 10% of the step.

    python -m bench.grammar_cost
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.sampler_cost import ROWS, forward_step_s

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
        },
        "required": ["name", "address"],
    },
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}, "required": ["tags"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0}},
        "required": ["color", "count"],
    },
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}, "ok": {"type": "boolean"}},
        "required": ["score", "ok"],
    },
]
DOCUMENTS = [
    {"name": "Ada Lovelace the analyst", "address": {"city": "London by the river Thames", "zip": "NW1 2AB and more"}},
    {"tags": ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]},
    {"color": "green", "count": 123456789},
    {"score": 7.25, "ok": True},
]


def grammar_step_s(model_path: str, vocab: int, steps: int = 40) -> float:
    """Median seconds, per step, of masking and advancing 32 grammar rows."""
    from transformers import AutoTokenizer

    from backend.sampling.grammar import apply_grammar_masks
    from backend.sampling.grammar_compiler import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    compiler = GrammarCompiler(model_path, vocab, [tokenizer.eos_token_id])
    compiled = [compiler.compile("json_schema", json.dumps(schema)) for schema in SCHEMAS]
    walks = [tokenizer.encode(json.dumps(doc), add_special_tokens=False) for doc in DOCUMENTS]
    logits = torch.randn(ROWS, vocab)
    times = []
    while len(times) < steps:
        states = [compiled[i % len(compiled)].new_state() for i in range(ROWS)]
        length = min(len(walk) for walk in walks)
        for position in range(length):
            x = logits.clone()
            t0 = time.perf_counter()
            apply_grammar_masks(x, states)
            for i, state in enumerate(states):
                if not state.accept(walks[i % len(walks)][position]):
                    raise AssertionError("the walk left its grammar")
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> str:
    from backend.runner.convert import ensure_default_model

    model_path = str(ensure_default_model())
    forward, vocab = forward_step_s(model_path)
    grammar = grammar_step_s(model_path, vocab)
    line = (
        f"grammar, {ROWS} JSON-schema rows: {grammar * 1e3:.2f} ms/step (mask + accept); "
        f"decode forward: {forward * 1e3:.1f} ms/step; share {grammar / forward:.1%} (target < 10%)"
    )
    print(line, flush=True)
    return line


if __name__ == "__main__":
    main()
