"""How far int8 activations move single logprobs, against how far llama.cpp's arithmetic does.

The same 20 short prompts go to our server with QUANT_ACTIVATIONS=float32 (float32's numbers
on the default model's Q4_1 blocks), to ours with int8 activations (the default) and, when
LLAMA_SERVER names a binary, to llama-server on the same GGUF: `/v1/completions`, one greedy
token, its top 5 logprobs. Per prompt, the largest difference over the tokens both top 5s
hold; printed: the median and the largest over the prompts, each against float32.

    [LLAMA_SERVER=/path/to/llama-server] python -m bench.logprob_drift
"""

from __future__ import annotations

import contextlib
import statistics

import httpx

from bench import llamacpp

PROMPTS = [
    "The three primary colors are", "Water boils at a temperature of", "The largest planet in our solar system is",
    "My favorite thing about autumn is", "To make a cup of tea, first", "The capital of Germany is",
    "In 1969, humans first", "A healthy breakfast might include", "The quick brown fox",
    "Photosynthesis is the process by which", "The best way to learn a language is",
    "Once upon a time, in a small village,", "def fibonacci(n):", "The stock market today",
    "Elephants are known for their", "The recipe calls for two cups of", "Mount Everest is located in",
    "Shakespeare wrote many plays, including", "A triangle has three", "The moon orbits",
]  # fmt: skip


def top_logprobs(url: str, model: str, prompt: str) -> dict[str, float]:
    """The first greedy token's top 5 logprobs, token text -> logprob (either server's shape)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5}
    logprobs = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
    if "content" in logprobs:  # llama-server answers in the chat shape
        return {t["token"]: t["logprob"] for t in logprobs["content"][0]["top_logprobs"]}
    return logprobs["top_logprobs"][0]


def drift(mine: list[dict[str, float]], reference: list[dict[str, float]]) -> list[float]:
    return [max(abs(a[t] - b[t]) for t in a.keys() & b.keys()) for a, b in zip(mine, reference, strict=True)]


def ours(activations: str) -> list[dict[str, float]]:
    from launcher import Stack
    from launcher.layout import default_model_path

    env = {"QUANT_ACTIVATIONS": activations, "ENABLE_PREFIX_CACHING": "0"}
    with Stack(str(default_model_path()), env=env) as stack:
        url = stack.base_url.removesuffix("/v1")
        return [top_logprobs(url, stack.served_model_name, p) for p in PROMPTS]


def main() -> None:
    from backend.runner.convert import gguf_path

    results = {"ours, float32 activations": ours("float32"), "ours, int8 activations": ours("int8")}
    binary = llamacpp.server_binary()
    with llamacpp.llama_server(binary, str(gguf_path())) if binary else contextlib.nullcontext() as url:
        if url:
            results["llama-server, same GGUF"] = [top_logprobs(url, "llama", p) for p in PROMPTS]
    reference = results.pop("ours, float32 activations")
    print(f"largest |logprob difference| in the top 5 of the first token, against float32 ({len(PROMPTS)} prompts)")
    for name, got in results.items():
        apart = drift(got, reference)
        print(f"{name:>26}: median {statistics.median(apart):.3f}, max {max(apart):.3f}")


if __name__ == "__main__":
    main()
