"""Parity of our Llama-family forward (backend/runner/models/llama.py) with Hugging Face transformers.

The default model must match transformers' greedy generate() token for token, alone and
batched (mixed lengths, one chunked prefill); tiny random models of every supported
architecture must match transformers' logits through the paged KV cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from backend.runner import convert
from backend.runner.convert import COMPLETE_MARKER, default_model_path, ensure_default_model
from backend.runner.forward_batch import ForwardBatch
from backend.runner.hf_config import load_model_config
from backend.runner.loader import load_model
from backend.runner.models.llama import LlamaForCausalLM

CPU = torch.device("cpu")
NEW_TOKENS = 64

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [
        {"role": "system", "content": "You are a pirate. Answer like one."},
        {"role": "user", "content": "Tell me about your ship and your crew."},
    ],
    [
        {
            "role": "user",
            "content": "Summarize this text in two sentences. "
            + "The history of computing spans centuries, from the abacus and mechanical calculators "
            "to Charles Babbage's analytical engine, Ada Lovelace's first algorithms, the vacuum tube "
            "machines of the 1940s, transistors, integrated circuits and finally the microprocessor. "
            "Each step made machines smaller, cheaper and faster, and brought computing from military "
            "and research labs into offices, homes and eventually pockets. Networks then connected "
            "these machines, first in universities and later worldwide through the internet, which "
            "changed how people work, learn, shop and talk to each other. Today, cloud data centers "
            "and mobile devices together form a global computer that billions of people use daily.",
        }
    ],
]
RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "Here is a list of the planets of the solar system, in order from the sun: Mercury,",
]


# ---------------------------------------------------------------- a tiny paged runner


@dataclass
class Seq:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class KVPool:
    """KV caches plus a block allocator whose free list is shuffled, so block tables are
    scattered over the pool."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int):
        cfg, dtype = model.config, model.norm.dtype
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()

    def slots(self, seq: Seq, start: int, end: int) -> list[int]:
        while len(seq.blocks) * self.block_size < end:
            seq.blocks.append(self.free.pop())
        return [seq.blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]


def forward_step(
    model: LlamaForCausalLM, pool: KVPool, work: list[tuple[Seq, int]], all_logits: bool = False
) -> torch.Tensor:
    """Compute the next `n` tokens of each (seq, n); logits of each seq's last new token
    [B, vocab] (or of every new token [T, vocab] with all_logits)."""
    ids, positions, slots, query_lens, context_lens = [], [], [], [], []
    for seq, n in work:
        start, end = seq.num_computed, seq.num_computed + n
        ids += seq.tokens[start:end]
        positions += range(start, end)
        slots += pool.slots(seq, start, end)
        query_lens.append(n)
        context_lens.append(end)
        seq.num_computed = end
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    width = max(len(seq.blocks) for seq, _ in work)
    tables = [seq.blocks + [0] * (width - len(seq.blocks)) for seq, _ in work]
    rows = range(query_start[-1]) if all_logits else [s - 1 for s in query_start[1:]]
    batch = ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        query_lens=query_lens,
        context_lens=context_lens,
        query_start=query_start,
        block_tables=torch.tensor(tables),
        logits_indices=torch.tensor(list(rows)),
    )
    hidden = model(batch, pool.caches)
    return model.compute_logits(hidden[batch.logits_indices])


def greedy(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new: int, chunk: dict[int, int] | None = None
) -> list[list[int]]:
    """Greedy decoding of all prompts together; chunk[i] caps prompt i's prefill chunk."""
    pool = KVPool(model, num_blocks=256, block_size=16)
    seqs = [Seq(list(p)) for p in prompts]
    limits = [(chunk or {}).get(i, 1 << 30) for i in range(len(seqs))]
    while True:
        active = [i for i, p in enumerate(prompts) if len(seqs[i].tokens) - len(p) < max_new]
        if not active:
            return [seq.tokens[len(p) :] for seq, p in zip(seqs, prompts, strict=True)]
        work = [(seqs[i], min(len(seqs[i].tokens) - seqs[i].num_computed, limits[i])) for i in active]
        logits = forward_step(model, pool, work)
        for (seq, _), row in zip(work, logits, strict=True):
            if seq.num_computed == len(seq.tokens):  # a whole prompt (or last token) is in
                seq.tokens.append(int(row.argmax()))


# ---------------------------------------------------------------- the default model


def test_default_model_path_honors_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_CACHE_DIR", str(tmp_path))
    assert default_model_path() == tmp_path / "models" / "SmolLM2-135M-Instruct"


def test_interrupted_conversion_leaves_no_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_CACHE_DIR", str(tmp_path))

    def interrupted(gguf_file, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    def finished(gguf_file, out):
        (out / "config.json").write_text("{}")
        (out / COMPLETE_MARKER).write_text("")

    monkeypatch.setattr(convert, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_default_model()
    assert list((tmp_path / "models").iterdir()) == []
    monkeypatch.setattr(convert, "convert_gguf", finished)
    assert ensure_default_model() == default_model_path()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["SmolLM2-135M-Instruct"]
    monkeypatch.setattr(convert, "convert_gguf", interrupted)
    assert ensure_default_model() == default_model_path()  # finished: not converted again


@pytest.fixture(scope="module")
def default_dir():
    return ensure_default_model()


@pytest.fixture(scope="module")
def ours(default_dir):
    return load_model(default_dir, torch.float32, CPU)


@pytest.fixture(scope="module")
def prompts(default_dir) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(default_dir)
    chats = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for c in CHAT_PROMPTS
    ]
    return chats + [tokenizer(p)["input_ids"] for p in RAW_PROMPTS]


@pytest.fixture(scope="module")
def hf(default_dir):
    return AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        # An explicit mask: without one generate() masks every pad token (here <|im_end|>,
        # present in each chat prompt) as padding. eos_token_id=None keeps generating past
        # <|im_end|>, as our loop does.
        ids = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


def test_prompts_cover_lengths(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[0] <= 5 and lengths[-1] >= 150, lengths


def test_config_of_default_model(default_dir):
    assert (default_dir / COMPLETE_MARKER).exists() and (default_dir / "tokenizer.json").exists()
    cfg = load_model_config(default_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


def test_greedy_matches_transformers_alone(ours, prompts, hf_greedy):
    for i, p in enumerate(prompts):
        assert len(hf_greedy[i]) == NEW_TOKENS
        assert greedy(ours, [p], NEW_TOKENS)[0] == hf_greedy[i], f"prompt {i} diverged"


def test_prompt_logits_close_to_transformers(ours, hf, prompts):
    for p in prompts:
        pool = KVPool(ours, num_blocks=64, block_size=16)
        got = forward_step(ours, pool, [(Seq(list(p)), len(p))], all_logits=True)
        with torch.no_grad():
            expected = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-4)


def test_greedy_batched_matches_alone(ours, prompts, hf_greedy):
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    # The longest prompt is prefilled in two chunks; the second one shares a step with
    # the other sequences' first decodes (a mixed batch).
    out = greedy(ours, prompts, NEW_TOKENS, chunk={longest: len(prompts[longest]) // 2 + 1})
    assert out == hf_greedy


# ---------------------------------------------------------------- tiny random models

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=50000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
TINY_CONFIGS = {
    "llama3-untied": lambda: LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    "llama-tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "qwen2-bias": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3-qk-norm": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
    "mistral-window": lambda: MistralConfig(**TINY, sliding_window=6, tie_word_embeddings=False),
}


def save_tiny(config, folder) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    # Random norms and biases too, so loading them into the right place matters.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    hf.save_pretrained(folder)
    return hf.float()


def paged_logits(model: LlamaForCausalLM, tokens: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every position of two sequences (20 and 17 tokens) run through the paged
    cache together: sequence 0 prefilled in two chunks (7 then 5 tokens) while sequence 1
    prefills 10 tokens and decodes; then both decode one token per step; then sequence 0
    decodes alone."""
    pool = KVPool(model, num_blocks=32, block_size=4)
    a, b = Seq(tokens[0]), Seq(tokens[1])
    first = forward_step(model, pool, [(a, 7), (b, 10)], all_logits=True)
    second = forward_step(model, pool, [(a, 5), (b, 1)], all_logits=True)
    out_a, out_b = [first[:7], second[:5]], [first[7:], second[5:]]
    while b.num_computed < len(b.tokens):
        step = forward_step(model, pool, [(a, 1), (b, 1)])
        out_a.append(step[:1])
        out_b.append(step[1:])
    while a.num_computed < len(a.tokens):
        out_a.append(forward_step(model, pool, [(a, 1)]))
    return [torch.cat(out_a), torch.cat(out_b)]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_tiny_model_logits_match_transformers(name, tmp_path):
    hf = save_tiny(TINY_CONFIGS[name](), tmp_path)
    ours = load_model(tmp_path, torch.float32, CPU)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    got = paged_logits(ours, [tokens[0].tolist(), tokens[1, :17].tolist()])
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], expected[1, :17], atol=1e-4, rtol=1e-4)


def test_tiny_model_bfloat16_smoke(tmp_path):
    hf = save_tiny(TINY_CONFIGS["qwen3-qk-norm"](), tmp_path)
    ours = load_model(tmp_path, torch.bfloat16, CPU)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    got = paged_logits(ours, [tokens[0].tolist(), tokens[1, :17].tolist()])
    assert got[0].dtype == torch.float32
    scale = expected.abs().max().item()
    assert (got[0] - expected[0]).abs().max().item() < 0.05 * scale
    assert (got[1] - expected[1, :17]).abs().max().item() < 0.05 * scale


def test_legacy_rope_config_and_unsupported_architecture(tmp_path):
    raw = LlamaConfig(**TINY).to_dict()
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=[7, 8])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_model_config(tmp_path)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (5e5, "linear", 2.0)
    assert cfg.eos_token_ids == (7, 8)
    raw["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model_config(tmp_path)
