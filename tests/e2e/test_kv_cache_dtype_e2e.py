"""KV_CACHE_DTYPE=float16 through the real stack, as a user sets it: the pool holds twice the
blocks of the same KV_CACHE_MB, answers stream and finish as usual (the openai SDK), and a
value we do not implement stops the server at start, naming the setting."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e


def _blocks_total(base_url: str) -> float:
    page = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    return float(re.search(r"^llm_kv_blocks_total\{[^}]*\} (\S+)$", page, re.MULTILINE).group(1))


def test_a_float16_cache_serves_twice_the_blocks(model_path):
    from transformers import AutoConfig

    from launcher import Stack

    config = AutoConfig.from_pretrained(model_path)
    head_dim = config.hidden_size // config.num_attention_heads
    block_bytes = 2 * 16 * config.num_key_value_heads * head_dim * 2 * config.num_hidden_layers  # float16: 2 bytes
    with Stack(model_path, env={"KV_CACHE_DTYPE": "float16", "KV_CACHE_MB": "32"}) as running:
        assert _blocks_total(running.base_url) == (32 << 20) // block_bytes
        client = openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Name two planets and their moons."}]
        whole = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=40)
        assert whole.choices[0].finish_reason in ("stop", "length") and whole.choices[0].message.content
        pieces = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=40,
                                                stream=True)  # fmt: skip
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
        assert streamed == whole.choices[0].message.content  # the prefix cache's blocks read back alike


def test_an_unknown_kv_cache_dtype_stops_the_server_at_start(model_path):
    from launcher import TritonServer
    from launcher.procs import StartupError

    with pytest.raises(StartupError, match="KV_CACHE_DTYPE must be one of auto, float16, got 'fp8'"):
        with TritonServer(model_path, env={"KV_CACHE_DTYPE": "fp8"}):
            pass
