"""What QUANT costs in quality, on text no test or prompt of ours contains (bench/data/heldout.txt).

- perplexity by llama.cpp's own method (`llama-perplexity -c 512`): the text's tokens cut
  into 512-token chunks, each run from an empty cache, only each chunk's second half scored
  (every scored token sees at least 256 of context), so the figure compares with the one
  llama.cpp's tool prints for the Q4_1 GGUF on the same file;
- greedy agreement with float32: 20 chat prompts, 64 greedy tokens each, through the engine
  (prefill and decode as served): how many prompts give float32's exact tokens, and the mean
  share of the 64 tokens before the first difference.

`python -m bench.quality` prints them for QUANT=none, int8 and int4 (and any
`--formats int4:64:sym,...`: kind:group[:sym][:a8]; a8: QUANT_ACTIVATIONS=int8, on every
row, the perplexity's 512-token chunks and their logits too; without it, float32).
"""

from __future__ import annotations

import argparse
import gc
import math
from dataclasses import dataclass
from pathlib import Path

import torch

HELDOUT = Path(__file__).with_name("data") / "heldout.txt"
N_CTX = 512
AGREEMENT_PROMPTS = [
    "Name three rivers in South America and one fact about each.",
    "What is the difference between weather and climate?",
    "Write a haiku about a train station at night.",
    "How does a bicycle gear system make pedaling easier?",
    "Give two tips for keeping houseplants alive in winter.",
    "Explain what a prime number is with an example.",
    "Why is the sky darker at the top of a mountain?",
    "Suggest a name for a bakery and explain the choice.",
    "What does a librarian do on a typical day?",
    "Describe how bread rises, in simple words.",
    "List four things to pack for a rainy hiking trip.",
    "What makes a good password?",
    "Tell me a short fable about a fox and a well.",
    "How do bees find their way back to the hive?",
    "Explain the rules of tic-tac-toe.",
    "Why do we have leap years?",
    "Write a polite email declining a meeting invitation.",
    "What is the main job of the kidneys?",
    "Describe the smell of the sea to someone who has never been there.",
    "How would you explain a shadow to a four-year-old?",
]


@dataclass(slots=True)
class Quality:
    quant: str
    perplexity: float
    scored_tokens: int
    identical_prompts: int = 0  # of len(AGREEMENT_PROMPTS): all 64 greedy tokens equal float32's
    prefix_agreement: float = 1.0  # mean share of tokens before the first difference


def load(
    model_path: str, quant: str, group: int = 32, symmetric: bool = False, activations: str = "float32"
) -> torch.nn.Module:
    """The model with QUANT=quant (groups of `group`, `symmetric`), its tiles multiplying
    `activations` (QUANT_ACTIVATIONS)."""
    from backend.runner.loader import load_model
    from backend.runner.quant.apply import QuantSpec

    spec = QuantSpec(quant, group, symmetric, activations=activations)
    return load_model(model_path, torch.float32, torch.device("cpu"), spec)


@torch.inference_mode()
def perplexity(model: torch.nn.Module, ids: list[int], n_ctx: int = N_CTX) -> tuple[float, int]:
    """(perplexity, tokens scored) over `ids`, llama-perplexity's way (module docstring)."""
    from backend.runner.drafters import allocate_kv
    from backend.runner.forward_batch import Span, build_forward_batch

    block_size = 16
    cfg = model.config
    caches = allocate_kv(cfg, cfg.num_layers, n_ctx // block_size, block_size, torch.float32, torch.device("cpu"))
    first, nll, count = n_ctx // 2, 0.0, 0
    for start in range(0, len(ids) - n_ctx + 1, n_ctx):
        chunk = ids[start : start + n_ctx]
        span = Span(chunk, 0, list(range(n_ctx // block_size)), num_logits=n_ctx - first)
        batch = build_forward_batch([span], block_size, torch.device("cpu"))
        hidden = model(batch, caches)
        logits = model.compute_logits(hidden[first:-1])  # predicts chunk[first + 1 :]
        targets = torch.tensor(chunk[first + 1 :])
        nll += torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum").item()
        count += len(targets)
    return math.exp(nll / count), count


def greedy_tokens(
    model_path: str,
    quant: str,
    prompts: list[list[int]],
    tokens: int = 64,
    together: bool = False,
    kv_cache_dtype: str = "float32",
    activations: str = "float32",
    **quant_kw,
) -> list[list[int]]:
    """Greedy tokens through the engine; a float32 KV cache unless asked (the weights' format
    alone: bench.kv_quality measures the cache's), quantized weights times `activations`
    (QUANT_ACTIVATIONS)."""
    from backend.contract import SamplingParams
    from backend.core.engine import LLMEngine
    from backend.settings.engine import EngineConfig

    config = EngineConfig(
        model_path=model_path,
        quant=quant,
        enable_prefix_caching=False,
        speculative="off",
        kv_cache_dtype=kv_cache_dtype,
        quant_activations=activations,
        **quant_kw,
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    if together:  # one batch: the many-row matmuls
        out = [list(t) for t in engine.generate(prompts, params)]
    else:  # one stream at a time, as a single user is served
        out = [list(engine.generate([p], params)[0]) for p in prompts]
    del engine
    gc.collect()
    return out


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """(prompts with identical tokens, mean share of tokens before the first difference)."""
    shares = []
    for want, got in zip(reference, other, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want))
        shares.append(same / len(want))
    return sum(s == 1.0 for s in shares), sum(shares) / len(shares)


def chat_prompts(tokenizer) -> list[list[int]]:
    out = []
    for question in AGREEMENT_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def measure(model_path: str, formats: list[tuple[str, int, bool, bool]]) -> list[Quality]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer(HELDOUT.read_text()).input_ids
    prompts = chat_prompts(tokenizer)
    results, reference = [], None
    for kind, group, symmetric, int8_activations in [("none", 32, False, False), *formats]:
        activations = "int8" if int8_activations else "float32"
        model = load(model_path, kind, group, symmetric, activations)
        ppl, count = perplexity(model, ids)
        del model
        gc.collect()
        tokens = greedy_tokens(
            model_path, kind, prompts, activations=activations, quant_group=group, quant_symmetric=symmetric
        )
        reference = reference or tokens
        same, share = agreement(reference, tokens)
        results.append(Quality(_label(kind, group, symmetric, int8_activations), ppl, count, same, share))
    return results


def _label(kind: str, group: int, symmetric: bool, int8_activations: bool = False) -> str:
    if kind == "none":
        return "float32"
    return f"{kind} g{group}" + (" sym" if symmetric else " asym") + (" a8" if int8_activations else "")


def report(results: list[Quality]) -> str:
    base = results[0].perplexity
    lines = [
        f"perplexity of {HELDOUT.name} ({results[0].scored_tokens} tokens scored, llama-perplexity's method, c={N_CTX})"
        f" and greedy agreement with float32 ({len(AGREEMENT_PROMPTS)} prompts x 64 tokens)",
        f"{'format':>14} {'perplexity':>11} {'vs float32':>11} {'identical':>10} {'prefix kept':>12}",
    ]
    for r in results:
        lines.append(f"{r.quant:>14} {r.perplexity:>11.4f} {r.perplexity / base - 1:>+10.2%} "
                     f"{r.identical_prompts:>4}/{len(AGREEMENT_PROMPTS):<5} {r.prefix_agreement:>11.1%}")  # fmt: skip
    return "\n".join(lines)


def _format(text: str) -> tuple[str, int, bool, bool]:
    kind, group, *rest = text.split(":") + ["32"] * (text.count(":") == 0)
    return kind, int(group), "sym" in rest, "a8" in rest


def main(model_path: str | None = None, formats: list[tuple[str, int, bool, bool]] | None = None) -> list[Quality]:
    from backend.runner.convert import ensure_default_model

    # int4 a8: what QUANT=auto serves the default model with (QUANT_ACTIVATIONS=auto)
    formats = formats or [("int8", 32, True, False), ("int4", 32, False, False), ("int4", 32, False, True)]
    results = measure(model_path or str(ensure_default_model()), formats)
    print(report(results))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face folder (default: the converted default model)")
    parser.add_argument("--formats", default="int8:32,int4:32,int4:32:a8", help="kind:group[:sym][:a8], ...")
    args = parser.parse_args()
    main(args.model, [_format(f) for f in args.formats.split(",")])
