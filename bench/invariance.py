"""Batch invariance, measured: does a request get the same numbers whatever else the engine does?

One greedy target request (a chat prompt of about 200 tokens, 24 tokens generated, its top-5
logprobs at every token) is run in-process in each weight / activation / KV format of
`--formats` (bench.figures.split_format), and compared bit for bit with itself run alone:

- beside N other requests (random prompts of 8-300 tokens, started two steps before it, so
  prefills and decodes share its steps), for N in `--others`;
- with its prompt cut into prefill chunks by a smaller token budget (MAX_NUM_BATCHED_TOKENS
  in `--budgets`);
- after a prefix-cache hit on its own prompt (a second run on an engine that cached the first).

A row says whether the tokens are the same, whether every logprob (the sampled token's and
the top 5) is the same float, and the largest difference of those logprobs up to the first
differing token. It asserts nothing: it is the map of where invariance holds today
(issue "Same request, same answer"), to be run again as kernels change.

    python -m bench.invariance [--formats int4,int4+float32,none] [--others 1,7,31,63] [--budgets 64,37]
"""

from __future__ import annotations

import argparse
import gc
import random

from bench.figures import describe_cpu, split_format

TOKENS = 24
TOP = 5
QUESTION = (
    "You are reviewing a pull request that changes how a scheduler admits requests. Explain, step by step, "
    "what could go wrong when two requests share a prefix, the cache evicts a block while one of them is "
    "being admitted, and the pool runs out of blocks; then propose three tests that would catch each failure, "
    "and say which of them you would write first and why. Keep the answer practical and concrete."
)


def _engine(model_path: str, fmt: str, budget: int = 512, caching: bool = False):
    from backend.core.engine import LLMEngine
    from backend.settings.engine import EngineConfig

    quant, kv_cache_dtype, activations = split_format(fmt)
    config = EngineConfig(model_path=model_path, quant=quant, kv_cache_dtype=kv_cache_dtype,
                          quant_activations=activations, max_num_batched_tokens=budget,
                          enable_prefix_caching=caching)  # fmt: skip
    return LLMEngine(config)


def _request(prompt: list[int], tokens: int = TOKENS, logprobs: bool = True):
    from backend.contract import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, top_logprobs=TOP if logprobs else 0)
    return GenerationRequest(prompt, params, disable_mtp=True)


def _run(engine, target: list[int], others: list[list[int]] = ()) -> list:
    """The target's (token, logprob, top) per generated token, with `others` started two steps before it."""
    for i, prompt in enumerate(others):
        engine.add_request(f"other-{i}", _request(prompt, tokens=random.Random(i).randint(4, 40), logprobs=False))
    for _ in range(2 if others else 0):
        engine.step()
    engine.add_request("target", _request(target))
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "target":
                got += [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in out.logprobs or []]
    return got


def compare(alone: list, other: list) -> tuple[bool, bool, float]:
    """(same tokens, same floats, the largest logprob difference up to the first other token)."""
    same_tokens = [t for t, _, _ in alone] == [t for t, _, _ in other]
    worst = 0.0
    for (ta, la, topa), (tb, lb, topb) in zip(alone, other, strict=False):
        worst = max(worst, abs(la - lb))
        for (ia, va), (ib, vb) in zip(topa, topb, strict=True):
            if ia == ib:
                worst = max(worst, abs(va - vb))
        if ta != tb:
            break
    return same_tokens, alone == other, worst


def _others(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, 300))] for _ in range(n)]


def _rows(model_path: str, fmt: str, target: list[int], tokenizer, args) -> list[tuple[str, tuple]]:
    engine = _engine(model_path, fmt)
    alone = _run(engine, target)
    rows = [("alone, again", compare(alone, _run(engine, target)))]
    for n in args.others:
        rows.append((f"beside {n} others", compare(alone, _run(engine, target, _others(tokenizer, n, n)))))
    del engine
    for budget in args.budgets:
        rows.append((f"chunks of {budget} tokens", compare(alone, _run(_engine(model_path, fmt, budget), target))))
    cached = _engine(model_path, fmt, caching=True)
    first = _run(cached, target)
    rows.append(("after a prefix-cache hit", compare(first, _run(cached, target))))
    del cached
    gc.collect()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.invariance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face folder (default: the converted default model)")
    parser.add_argument("--formats", default="int4,int4+float32,none")
    parser.add_argument("--others", default="1,7,31,63", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--budgets", default="64,37", type=lambda s: [int(x) for x in s.split(",")])
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from backend.runner.convert import ensure_default_model

    model_path = args.model or str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    target = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    target = list(target["input_ids"] if hasattr(target, "keys") else target)
    print(describe_cpu())
    print(f"target: {len(target)} prompt tokens, {TOKENS} greedy tokens, top-{TOP} logprobs")
    for fmt in args.formats.split(","):
        print(f"\n{fmt:<34}{'tokens':>8}{'floats':>8}{'max |d logprob|':>17}")
        for name, (same_tokens, same_floats, worst) in _rows(model_path, fmt, target, tokenizer, args):
            tokens, floats = ("same" if same else "DIFF" for same in (same_tokens, same_floats))
            print(f"  {name:<32}{tokens:>8}{floats:>8}{worst:>17.3g}")


if __name__ == "__main__":
    main()
