"""Our server against llama.cpp's, both up at once, measured in turns.

`make bench` starts one server after the other, so a change in the machine's load between
them shows as a difference between the servers. Here both serve at the same time (ours
with QUANT, llama-server on the default model's Q4_1 GGUF, `bench/llamacpp.py`'s flags)
and each measurement runs on one, then on the other, `--rounds` times: one stream's
decode rate, then N streams' aggregate rate, with the same prompts and client code.
`--context N`: one stream's prompt is N tokens (the chat prompts run together, a different
window each round), so its decode steps attend over N positions and more.

    LLAMA_SERVER=/path/to/llama-server python -m bench.llamacpp_ab [--rounds 3] [--streams 32] [--quant int4]
        [--kv-cache-dtype auto | float16 | float32] [--context 1500] [--activations float32 | int8]
        [--gguf FILE [--repack]]

`--gguf FILE`: both servers on that GGUF file (ours: MODEL=FILE, QUANT=auto, the file's own
blocks; `--quant` is ignored), e.g. a Q4_K_M or Q6_K file made by llama-quantize; `--repack`
lets llama-server repack the weights for its CPU kernels (off by default: see llamacpp.py).
"""

from __future__ import annotations

import argparse
import statistics

from bench import llamacpp
from bench.figures import describe_cpu
from bench.throughput import prompts_for


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV_CACHE_DTYPE of our server")
    parser.add_argument("--context", type=int, default=0, help="one stream's prompt in tokens (0: a chat prompt)")
    parser.add_argument("--activations", default="auto", help="QUANT_ACTIVATIONS of our server")
    parser.add_argument("--gguf", help="a GGUF file both servers serve (default: the default model's Q4_1)")
    parser.add_argument("--repack", action="store_true", help="llama-server repacks weights (no --no-repack)")
    args = parser.parse_args(argv)
    binary = llamacpp.server_binary()
    if binary is None:
        raise SystemExit("LLAMA_SERVER must name a llama-server binary")
    from transformers import AutoTokenizer

    from backend.runner.convert import ensure_default_model, gguf_path
    from backend.runner.gguf_model import model_folder
    from launcher.stack import Stack

    print(f"CPU: {describe_cpu()}", flush=True)
    model_path = str(model_folder(args.gguf) if args.gguf else ensure_default_model())
    gguf = args.gguf or str(gguf_path())
    print(f"GGUF: {gguf}", flush=True)
    prompts = prompts_for(AutoTokenizer.from_pretrained(model_path), max(args.streams, args.rounds))
    singles = long_prompts(prompts, args.context, args.rounds) if args.context else prompts
    slot = llamacpp.PROMPT_TOKENS + llamacpp.GEN_TOKENS
    ctx = 32 * max(slot, args.context + args.tokens + 16)  # llama-server's 32 slots share it
    env = {"ENABLE_PREFIX_CACHING": "0", "QUANT": "auto" if args.gguf else args.quant,
           "KV_CACHE_DTYPE": args.kv_cache_dtype, "QUANT_ACTIVATIONS": args.activations}  # fmt: skip
    serve = llamacpp.llama_server(binary, gguf, ctx=ctx, repack=args.repack)
    with Stack(model_path, env=env) as stack, serve as llama_url:
        ours = (stack.base_url.removesuffix("/v1"), stack.served_model_name)
        theirs = (llama_url, "llama")
        for url, name in (ours, theirs):
            llamacpp.decode_rate(url, prompts[0], 8, name)  # warm up
        one = {"ours": [], "llama.cpp": []}
        many = {"ours": [], "llama.cpp": []}
        for i in range(args.rounds):
            for label, (url, name) in (("ours", ours), ("llama.cpp", theirs)):
                one[label].append(llamacpp.decode_rate(url, singles[i], args.tokens, name))
            for label, (url, name) in (("ours", ours), ("llama.cpp", theirs)):
                many[label].append(llamacpp.aggregate_rate(url, prompts[: args.streams], args.tokens, name))
            line = f"round {i + 1}: one stream {one['ours'][-1]:.1f} against {one['llama.cpp'][-1]:.1f}, "
            line += f"{args.streams} streams {many['ours'][-1]:.1f} against {many['llama.cpp'][-1]:.1f}"
            print(line, flush=True)
    for what, rates, goal in (("one stream", one, 1.2), (f"{args.streams} streams", many, 2.0)):
        ratios = [a / b for a, b in zip(rates["ours"], rates["llama.cpp"], strict=True)]
        print(f"{what}: ours / llama.cpp {', '.join(f'{r:.2f}x' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f}x; goal >= {goal}x)")  # fmt: skip


def long_prompts(prompts: list[list[int]], length: int, n: int) -> list[list[int]]:
    """n prompts of `length` tokens: `prompts` run together (repeated as needed), windows 97 apart."""
    joined = [t for p in prompts for t in p]
    joined *= -(-(length + 97 * n) // len(joined))
    return [joined[97 * i : 97 * i + length] for i in range(n)]


if __name__ == "__main__":
    main()
