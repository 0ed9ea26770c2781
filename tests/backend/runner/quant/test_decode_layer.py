"""The fused layer (decode_layer.cpp): a step of a quantized model (prefill or decode rows) in
one kernel call a layer, against the same model's layer-by-layer path (llama.py `DecoderLayer.forward`),
on tiny random checkpoints of the architectures it serves: GQA, q/k/v biases, a sliding
window, Qwen3's q / k norms, Gemma 2 / 3's sandwich norms, GELU, soft-capped scores and two
RoPE tables; sequences of mixed lengths over scattered blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from backend import kernels
from backend.runner.forward_batch import Span, build_forward_batch
from backend.runner.loader import load_model
from backend.runner.models.llama import DecoderLayer, LlamaForCausalLM
from backend.runner.quant.apply import QuantSpec, quantize_model

needs_kernels = pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU")
CPU = torch.device("cpu")
BLOCK = 4
TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,  # head_dim 32: a size the paged kernel takes
    num_key_value_heads=2,
    max_position_embeddings=128,
)
GEMMA_LAYERS = dict(head_dim=32, sliding_window=6, layer_types=["sliding_attention", "full_attention"])
CONFIGS = {
    "llama-gqa": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "qwen2-bias": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    "mistral-window": lambda: MistralConfig(**TINY, sliding_window=6, tie_word_embeddings=False),
    "qwen3-qk-norm": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
    # sandwich norms, GELU, soft-capped scores, a sliding layer beside a global one
    "gemma2": lambda: Gemma2Config(
        **TINY, **GEMMA_LAYERS, attn_logit_softcapping=3.0, final_logit_softcapping=20.0, query_pre_attn_scalar=32
    ),  # fmt: skip
    # and q / k norms, two RoPE tables
    "gemma3": lambda: Gemma3TextConfig(**TINY, **GEMMA_LAYERS, rope_local_base_freq=1000.0),
}


def _quantized(config, folder, kind: str, activations: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms and biases too, so each reaches the kernel
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    hf.save_pretrained(folder)
    model = load_model(folder, torch.float32, CPU)
    quantize_model(model, QuantSpec(kind, activations=activations))
    return model


def _decode_logits(
    model: LlamaForCausalLM, prompts: list[list[int]], steps: int, caches: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Prefill the prompts together, then `steps` greedy decode steps of all of them; the
    logits [B, vocab] of each decode step. Blocks are handed out from a shuffled pool;
    `caches`: the layers' caches (default: float32 ones)."""
    cfg = model.config
    caches = caches or [torch.zeros(2, 64, BLOCK, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    pool = torch.randperm(64, generator=torch.Generator().manual_seed(5)).tolist()
    tokens = [list(p) for p in prompts]
    tables: list[list[int]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    out = []
    for step in range(steps + 1):
        spans = []
        for i, seq in enumerate(tokens):
            while len(tables[i]) * BLOCK < len(seq):
                tables[i].append(pool.pop())
            spans.append(Span(seq[computed[i] :], computed[i], list(tables[i]), num_logits=1))
            computed[i] = len(seq)
        batch = build_forward_batch(spans, BLOCK, CPU)
        logits = model.compute_logits(model(batch, caches)[batch.logits_indices])
        if step:
            out.append(logits)
        for seq, row in zip(tokens, logits.argmax(-1).tolist(), strict=True):
            seq.append(row)
    return out


@needs_kernels
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_the_fused_decode_layer_matches_the_layer_by_layer_path(name, kind, activations, tmp_path, monkeypatch):
    """QUANT_ACTIVATIONS=int8: both paths take tiles_a8.cpp's GEMV (checked: other numbers)."""
    if activations == "int8" and "avx512_vnni" not in kernels.cpu_flags():
        pytest.skip("no AVX-512 VNNI on this CPU")
    model = _quantized(CONFIGS[name](), tmp_path, kind, activations)
    prompts = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate([9, 20, 3])]
    calls = []
    fused_decode = DecoderLayer.decode
    monkeypatch.setattr(DecoderLayer, "decode", lambda self, *a: calls.append(1) or fused_decode(self, *a))
    fused = _decode_logits(model, prompts, steps=12)
    assert len(calls) == 13 * model.config.num_layers  # the prefill and every decode step, every layer
    monkeypatch.setattr(LlamaForCausalLM, "_fused_decode", lambda *a: False)
    plain = _decode_logits(model, prompts, steps=12)
    # the same kernels either way (batch invariance): bit for bit
    assert all(torch.equal(got, want) for got, want in zip(fused, plain, strict=True))
    other_activations = "int8" if activations == "float32" else "float32"
    other_model = _quantized(CONFIGS[name](), tmp_path / "other", kind, other_activations)
    other = _decode_logits(other_model, prompts, steps=1)[0]
    assert (other - plain[0]).abs().max().item() > 1e-4


@needs_kernels
@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_a_float16_cache_is_written_and_read_alike_fused_and_layer_by_layer(name, activations, tmp_path, monkeypatch):
    """KV_CACHE_DTYPE=float16: the fused layer rounds k / v into the cache as torch's
    .to(float16) does and attends over them as the layer-by-layer path does."""
    model = _quantized(CONFIGS[name](), tmp_path, "int4", activations)
    cfg = model.config
    prompts = [[(5 * i + 11 * j) % 256 for j in range(n)] for i, n in enumerate([7, 18, 2])]

    def caches(dtype=torch.float16):
        return [torch.zeros(2, 64, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype=dtype) for _ in range(2)]

    # one decode step: layer 0 sees the same x either way, so its new rows are the float32
    # cache's rows rounded, bit for bit (later layers read rounded keys: their x differs)
    half, full = caches(), caches(torch.float32)
    _decode_logits(model, prompts, steps=1, caches=half)
    _decode_logits(model, prompts, steps=1, caches=full)
    assert torch.equal(half[0], full[0].half())
    fused_caches, plain_caches = caches(), caches()
    fused = _decode_logits(model, prompts, steps=8, caches=fused_caches)
    monkeypatch.setattr(LlamaForCausalLM, "_fused_decode", lambda *a: False)
    plain = _decode_logits(model, prompts, steps=8, caches=plain_caches)
    # one arithmetic: the same logits and the same cache, bit for bit
    assert all(torch.equal(got, want) for got, want in zip(fused, plain, strict=True))
    assert all(torch.equal(got, want) for got, want in zip(fused_caches, plain_caches, strict=True))


@needs_kernels
def test_layers_the_fused_call_does_not_cover_keep_their_path(activations, tmp_path):
    qwen3 = Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    model = _quantized(qwen3, tmp_path / "qwen3", "int4", activations)
    assert model.layers[0].decode_operands() is not None  # q/k norms: fused
    unquantized = load_model(tmp_path / "qwen3", torch.float32, CPU)
    assert unquantized.layers[0].decode_operands() is None  # float32 linears


@needs_kernels
@pytest.mark.parametrize("name", ["llama-gqa", "gemma2"])
def test_a_busy_step_cut_into_one_run_a_thread_keeps_every_rows_numbers(name, activations, tmp_path, monkeypatch):
    """18 sequences: from 16 rows on, decode_layer cuts a step's rows into one run a thread,
    at sequences' starts (a prefill's rows read the keys their sequence's earlier rows write in
    the same layer). The logits and the caches are the layer-by-layer path's and a one-thread
    run's (the loops split instead), bit for bit."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: no runs to cut")
    model = _quantized(CONFIGS[name](), tmp_path, "int4", activations)
    cfg = model.config
    prompts = [[(3 * i + 5 * j) % 256 for j in range(2 + i % 5)] for i in range(18)]

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        caches = [torch.zeros(2, 64, BLOCK, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        return _decode_logits(model, prompts, steps=4, caches=caches), caches

    runs, runs_caches = run()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one, one_caches = run()
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(LlamaForCausalLM, "_fused_decode", lambda *a: False)
    plain, plain_caches = run()
    for other, other_caches in ((one, one_caches), (plain, plain_caches)):
        assert all(torch.equal(got, want) for got, want in zip(runs, other, strict=True))
        assert all(torch.equal(got, want) for got, want in zip(runs_caches, other_caches, strict=True))
