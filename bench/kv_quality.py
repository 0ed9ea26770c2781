"""What KV_CACHE_DTYPE=float16 costs in quality, on the same text and prompts as bench.quality.

A float16 cache changes only what attention reads back from the cache, so the measure must
read it: bench.quality's perplexity runs each 512-token chunk as one prefill, whose
attention takes the chunk's fresh float32 keys, and would show no difference. Here each
chunk's first half is a prefill and every scored token is then one decode step, which
attends over the cache as a served decode does (the paged kernel or the fused decode
layer), for a float32 cache and a float16 one on the same weights. Greedy agreement:
bench.quality's 20 chat prompts through the engine, one stream at a time, against the
float32 cache's tokens.

    python -m bench.kv_quality [--quant int4] [--activations float32 | int8 | auto]
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.quality import HELDOUT, N_CTX, agreement, chat_prompts, greedy_tokens, load

BLOCK_SIZE = 16


@torch.inference_mode()
def decode_perplexity(model: torch.nn.Module, ids: list[int], kv_dtype: torch.dtype) -> tuple[float, int]:
    """(perplexity, tokens scored): bench.quality's chunks and scored halves, each scored
    token's logits from a decode step over a cache of `kv_dtype`."""
    from backend.runner.drafters import allocate_kv
    from backend.runner.forward_batch import Span, build_forward_batch

    cfg, cpu, first = model.config, torch.device("cpu"), N_CTX // 2
    caches = allocate_kv(cfg, cfg.num_layers, N_CTX // BLOCK_SIZE, BLOCK_SIZE, kv_dtype, cpu)
    table = list(range(N_CTX // BLOCK_SIZE))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - N_CTX + 1, N_CTX):
        chunk = ids[start : start + N_CTX]
        model(build_forward_batch([Span(chunk[:first], 0, table)], BLOCK_SIZE, cpu), caches)
        for pos in range(first, N_CTX - 1):  # logits at pos predict chunk[pos + 1]
            batch = build_forward_batch([Span([chunk[pos]], pos, table, num_logits=1)], BLOCK_SIZE, cpu)
            logits = model.compute_logits(model(batch, caches)[batch.logits_indices])
            nll += torch.nn.functional.cross_entropy(logits.double(), torch.tensor([chunk[pos + 1]])).item()
            count += 1
    return math.exp(nll / count), count


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face folder (default: the converted default model)")
    parser.add_argument("--quant", default="int4", help="QUANT of both runs")
    parser.add_argument("--activations", default="float32", help="QUANT_ACTIVATIONS of both runs (float32: "
                        "the cache's cost alone; the default model's default, auto, rounds them to int8)")  # fmt: skip
    _measure(parser.parse_args())


def _measure(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from backend.runner.convert import ensure_default_model

    model_path = args.model or str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids, prompts = tokenizer(HELDOUT.read_text()).input_ids, chat_prompts(tokenizer)
    model = load(model_path, args.quant, activations=args.activations)
    rows, reference = [], None
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16)):
        ppl, count = decode_perplexity(model, ids, dtype)
        tokens = greedy_tokens(model_path, args.quant, prompts, kv_cache_dtype=name, activations=args.activations)
        reference = reference or tokens
        rows.append((name, ppl, count, *agreement(reference, tokens)))
    print(f"QUANT={args.quant}: perplexity of {HELDOUT.name} by decode steps ({rows[0][2]} tokens scored), "
          f"greedy agreement with the float32 cache ({len(prompts)} prompts x 64 tokens)")  # fmt: skip
    for name, ppl, _, same, share in rows:
        print(f"KV_CACHE_DTYPE={name:8s} perplexity {ppl:.4f} ({ppl / rows[0][1] - 1:+.3%})  "
              f"identical {same}/{len(prompts)}  prefix kept {share:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
