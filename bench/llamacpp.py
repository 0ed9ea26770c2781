"""llama.cpp's llama-server as a CPU peer for our benchmarks ("Faster than llama.cpp on the CPU").

`llama_server` starts the binary named by ``LLAMA_SERVER`` on the Q4_1 GGUF our float32 model is
dequantized from. The measurement helpers only speak the OpenAI ``/v1/completions`` protocol with
streaming, token-id prompts and ``ignore_eos``, so the same functions measure our own frontend:
only the base URL (and the ``model`` name in the body) differ.

- `decode_rate`: one stream, tokens/s after the first streamed token;
- `aggregate_rate`: N streams started together, total tokens over the wall time from the first
  request to the last token (prefill included);
- `ttft`: seconds to the first streamed token, best of 3 distinct prompts, prompt cache off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx

from launcher.procs import free_port

PROMPT_TOKENS = 2048
GEN_TOKENS = 256
TIMEOUT = httpx.Timeout(600.0, connect=10.0)


def server_binary() -> str | None:
    """The llama-server binary named by ``LLAMA_SERVER``, if it is set and executable."""
    path = os.environ.get("LLAMA_SERVER")
    return path if path and os.access(path, os.X_OK) else None


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError("llama-server did not become healthy")


@contextlib.contextmanager
def llama_server(
    binary: str, gguf: str, parallel: int = 32, threads: int = 2, ctx: int | None = None, repack: bool = False
) -> Iterator[str]:
    """Run llama-server on `gguf` on a free loopback port; yield its base URL, kill it on exit.

    The context holds `parallel` slots of PROMPT_TOKENS + GEN_TOKENS each. The prompt cache
    (``--cache-ram 0``, ``--no-cache-idle-slots``, ``cache_prompt: false`` per request) is off, so
    repeated runs gain nothing from earlier ones. ``--no-repack`` turns off the AMX weight layout
    (this build's only repack for Q4_1), whose tile instructions the host may refuse (SIGILL);
    `repack` leaves it on (K-quant files: its AVX2 / AVX-512 layouts).
    """
    port = free_port()
    size = ctx or parallel * (PROMPT_TOKENS + GEN_TOKENS)
    flags = f"-np {parallel} -t {threads} -tb {threads} -c {size} --host 127.0.0.1 --port {port}"
    flags += " --cache-ram 0 --no-cache-idle-slots --no-webui" + ("" if repack else " --no-repack")
    cmd = [binary, "-m", gguf, *flags.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# Fields of each server's own that keep a measurement honest: llama-server's prompt cache off;
# ours without speculation (text repeated past EOS would flatter it; bench.speculative measures it).
LLAMA_FIELDS = {"cache_prompt": False}
OUR_FIELDS = {"disable_mtp": True}


def _body(model: str, prompt_ids: Sequence[int], tokens: int) -> dict[str, object]:
    return {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        **(LLAMA_FIELDS if model == "llama" else OUR_FIELDS),
    }


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> list[float]:
    """POST a streaming completion; return the arrival time of every chunk carrying text."""
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
    return times


async def _streams(
    url: str, model: str, prompts: Sequence[Sequence[int]], tokens: int
) -> tuple[float, list[list[float]]]:
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        start = time.perf_counter()
        runs = await asyncio.gather(*(_stream(client, url, _body(model, p, tokens)) for p in prompts))
    return start, list(runs)


def decode_rate(url: str, prompt_ids: Sequence[int], tokens: int, model: str = "llama") -> float:
    """One stream: tokens/s after the first streamed token."""
    _, (times,) = asyncio.run(_streams(url, model, [prompt_ids], tokens))
    if len(times) < 2:
        raise RuntimeError(f"only {len(times)} chunks streamed")
    return (len(times) - 1) / (times[-1] - times[0])


def aggregate_rate(url: str, prompts: Sequence[Sequence[int]], tokens: int, model: str = "llama") -> float:
    """N concurrent streams: total streamed tokens over the wall time from first request to last token."""
    start, runs = asyncio.run(_streams(url, model, prompts, tokens))
    return sum(len(t) for t in runs) / (max(t[-1] for t in runs) - start)


def ttft(url: str, prompts: Sequence[Sequence[int]], model: str = "llama") -> float:
    """Best of up to 3 requests (distinct prompts): seconds from request to first streamed token."""
    best = float("inf")
    for prompt in prompts[:3]:
        start, (times,) = asyncio.run(_streams(url, model, [prompt], 1))
        best = min(best, times[0] - start)
    return best


def completion_count(url: str, prompt_ids: Sequence[int], tokens: int, model: str = "llama") -> int:
    """Non-streamed check that ``ignore_eos`` holds: the completion token count the server reports."""
    body = {**_body(model, prompt_ids, tokens), "stream": False}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    resp.raise_for_status()
    return int(resp.json()["usage"]["completion_tokens"])


@dataclass
class Figures:
    """Throughputs in tokens/s, TTFT in seconds."""

    one_stream: float
    streams_8: float
    streams_32: float
    ttft_2k: float


def measure(
    url: str,
    prompts: Sequence[Sequence[int]],
    prompts_2k: Sequence[Sequence[int]],
    tokens: int = 128,
    model: str = "llama",
) -> Figures:
    """Figures for any server at `url`: `prompts` are 32 distinct (short, chat-templated) prompts, `prompts_2k`
    3 distinct PROMPT_TOKENS-token prompts. One stream is the median of 3 requests (the first 3 prompts): a
    single one swung with the host's load by a fifth between runs."""
    figs = Figures(
        one_stream=statistics.median(decode_rate(url, p, tokens, model) for p in prompts[:3]),
        streams_8=aggregate_rate(url, prompts[:8], tokens, model),
        streams_32=aggregate_rate(url, prompts[:32], tokens, model),
        ttft_2k=ttft(url, prompts_2k, model),
    )
    return figs


def main(
    gguf: str,
    prompts: Sequence[Sequence[int]],
    prompts_2k: Sequence[Sequence[int]],
    tokens: int = 128,
    threads: int = 2,
) -> Figures | None:
    """Measure llama-server on `gguf`; None when ``LLAMA_SERVER`` names no binary."""
    binary = server_binary()
    if binary is None:
        print("LLAMA_SERVER not set: skipping llama.cpp")
        return None
    with llama_server(binary, gguf, parallel=32, threads=threads) as url:
        return measure(url, prompts, prompts_2k, tokens)
