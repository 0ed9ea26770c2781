"""What prompt logprobs cost a long prompt, and what a long prompt costs everyone else.

For a 1,000- and a 4,000-token prompt of random tokens (a new one per run, so no prefix
hit): the time to its first token (max_tokens 1) without and with prompt logprobs (1
alternative: what `/v1/completions` with echo and logprobs 1 asks), and the latency of a
short request (24 tokens, 2 generated) added while the long one is being prefilled, over
the same request alone. In-process, on LLMEngine (EngineConfig.from_env: the server's
settings); with --url, also through a running server: `/v1/completions` with echo,
logprobs 1 and max_tokens 0 on the same token ids, and a 2-token chat sent meanwhile.

    python -m bench.prompt_logprobs [--lengths 1000 4000] [--url http://127.0.0.1:9000/v1 --api-key KEY]
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import httpx
import torch

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from bench.figures import describe_cpu
from launcher.layout import default_model_path

SHORT_PROMPT = 24
CHAT = [{"role": "user", "content": "Say hi."}]


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(length)]


def run_until_done(engine: LLMEngine, request_id: str, start: float, first_token: bool = False) -> float:
    """Step until `request_id` has its first token (`first_token`) or its final; seconds since `start`."""
    while True:
        for out in engine.step():
            if out.request_id == request_id and (out.final is not None or (first_token and out.token_ids)):
                return time.perf_counter() - start


def ttft(engine: LLMEngine, prompt: list[int], prompt_logprobs: int | None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=prompt_logprobs)
    rid = f"long-{random.random()}"
    engine.add_request(rid, GenerationRequest(prompt, params))
    seconds = run_until_done(engine, rid, time.perf_counter(), first_token=True)
    drain(engine)
    return seconds


def short_latency(engine: LLMEngine, rng: random.Random, vocab: int, behind: list[int] | None) -> float:
    """Seconds from adding a short request to its last token; `behind`: a long prompt (with
    prompt logprobs) added first and stepped once, so the short one arrives mid-prefill."""
    if behind is not None:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        engine.add_request(f"long-{random.random()}", GenerationRequest(behind, params))
        engine.step()
    short = GenerationRequest(random_prompt(rng, SHORT_PROMPT, vocab), SamplingParams(max_tokens=2, ignore_eos=True))
    rid = f"short-{random.random()}"
    engine.add_request(rid, short)
    seconds = run_until_done(engine, rid, time.perf_counter())
    drain(engine)
    return seconds


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def in_process(model_path: str, lengths: list[int]) -> None:
    engine = LLMEngine(EngineConfig.from_env(model_path))
    vocab, rng = engine.runner.model_config.vocab_size, random.Random(0)
    ttft(engine, random_prompt(rng, 64, vocab), 1)  # warm up
    print(f"in-process (LLMEngine, {torch.get_num_threads()} torch threads):")
    for n in lengths:
        plain = ttft(engine, random_prompt(rng, n, vocab), None)
        scored = ttft(engine, random_prompt(rng, n, vocab), 1)
        alone = short_latency(engine, rng, vocab, None)
        meanwhile = short_latency(engine, rng, vocab, random_prompt(rng, n, vocab))
        print(f"  {n:5d} tokens: TTFT {plain:6.2f} s, with prompt logprobs {scored:6.2f} s; a short request "
              f"meanwhile {meanwhile:5.2f} s, alone {alone:5.2f} s ({meanwhile / alone:.1f}x)")  # fmt: skip


def post(client: httpx.Client, path: str, body: dict) -> float:
    start = time.perf_counter()
    client.post(path, json=body).raise_for_status()
    return time.perf_counter() - start


def through_server(url: str, api_key: str, lengths: list[int]) -> None:
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=600)
    model = client.get("/models").json()["data"][0]["id"]
    rng = random.Random(1)
    chat = {"model": model, "messages": CHAT, "max_tokens": 2, "temperature": 0}
    post(client, "/chat/completions", chat)  # warm up
    print(f"through {url} (/v1/completions, echo, max_tokens 0):")
    for n in lengths:
        body = {"model": model, "max_tokens": 0, "echo": True, "temperature": 0}
        plain = post(client, "/completions", {**body, "prompt": random_prompt(rng, n, 32000)})
        scored = post(client, "/completions", {**body, "logprobs": 1, "prompt": random_prompt(rng, n, 32000)})
        alone = post(client, "/chat/completions", chat)
        scoring = {**body, "logprobs": 1, "prompt": random_prompt(rng, n, 32000)}
        long = threading.Thread(target=post, args=(client, "/completions", scoring))
        long.start()
        time.sleep(0.3)  # the long prompt is being prefilled
        meanwhile = post(client, "/chat/completions", chat)
        long.join()
        print(f"  {n:5d} tokens: {plain:6.2f} s, with logprobs 1 {scored:6.2f} s; a 2-token chat "
              f"meanwhile {meanwhile:5.2f} s, alone {alone:5.2f} s ({meanwhile / alone:.1f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Hugging Face folder (default: the converted default model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--url", help="a running server's /v1 base URL, measured too")
    parser.add_argument("--api-key", default="x")
    parser.add_argument("--skip-in-process", action="store_true")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, {describe_cpu()}")
    if not args.skip_in_process:
        in_process(str(default_model_path(args.model)), args.lengths)
    if args.url:
        through_server(args.url, args.api_key, args.lengths)


if __name__ == "__main__":
    main()
