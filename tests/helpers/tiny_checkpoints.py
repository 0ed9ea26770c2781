"""Tiny random-weight checkpoints of any transformers architecture, and what comparing our
engine with transformers on them takes: the architectures test (tests/backend/runner/
test_architectures.py), the MoE tests and the sweep over transformers' model types
(`python -m bench.architectures`)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig

VOCAB, NEW_TOKENS = 512, 16
DIMS = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
GQA = dict(num_key_value_heads=2, head_dim=32)
PROMPT = [random.Random(1).randrange(3, VOCAB) for _ in range(40)]  # longer than the tests' windows


def build(model_type: str, folder: Path, overrides: dict) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **{**DIMS, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    sharpen(model, model_type)
    model.save_pretrained(folder)
    return model.eval()


def sharpen(model: torch.nn.Module, model_type: str, by: float = 8.0) -> None:
    """Scale every q and k by `by` (their projections, or the q / k norms that follow them):
    with 0.02-std random weights scores are near 0 and attention near uniform, so RoPE,
    windows, caps and sinks would barely move the logits; with scores 64 x larger they do.
    And give state-space mixers a long memory (`_lengthen_memory`)."""
    with torch.no_grad():
        norms = {name for name, _ in model.named_parameters() if name.endswith(("q_norm.weight", "k_norm.weight"))}
        for name, param in model.named_parameters():
            if name in norms and model_type.startswith("gemma"):  # (1 + w): scale 1 + w
                param.mul_(by).add_(by - 1)
            elif name in norms or (not norms and name.endswith(_QK_PROJECTIONS)):
                param.mul_(by)
        for module in model.modules():
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter) and hasattr(module, "D"):
                _lengthen_memory(module)


def _lengthen_memory(mixer: torch.nn.Module) -> None:
    """A state-space mixer with a long memory (A near 0, small steps), no skip term (D) and
    larger projections: with random weights its state barely moves the logits, and a state
    lost or computed wrongly would pass unseen; so it does."""
    a_log = mixer.A_log
    a_log.copy_(torch.linspace(0.01, 0.1, a_log.shape[-1]).log().expand_as(a_log))
    mixer.D.zero_()
    bias = getattr(mixer, "dt_bias", None)
    bias = bias if bias is not None else getattr(getattr(mixer, "dt_proj", None), "bias", None)
    if bias is not None:
        bias.fill_(-2.0)
    mixer.in_proj.weight.mul_(5)
    mixer.out_proj.weight.mul_(30)


# q, k (or fused q|k|v, whose v scaled along does no harm) projections of the families above
_QK_PROJECTIONS = ("q_proj.weight", "k_proj.weight", "qkv_proj.weight", "query_key_value.weight", "q_b_proj.weight")


def reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's logits [NEW_TOKENS, vocab] (float32), EOS
    allowed as ignore_eos allows it (min_new_tokens would mask it out)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def engine(folder: Path, budget: int = 512) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(folder), max_loras=0, speculative="off", quant="none",
                                  max_num_batched_tokens=budget))  # fmt: skip


def greedy(max_tokens: int = NEW_TOKENS, prompt: list[int] = PROMPT) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=list(prompt), sampling=SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True, top_logprobs=1))  # fmt: skip


def assert_matches(ours: list[int], ref: list[int], logits: torch.Tensor, what: str) -> None:
    """Equal tokens, or a divergence where the reference's top two logits nearly tie."""
    divergence = first_divergence(ours, ref, logits)
    assert divergence is None or divergence[1], f"{what}: step {divergence[0]}: {ours} != {ref}"


def first_divergence(ours: list[int], ref: list[int], logits: torch.Tensor) -> tuple[int, bool] | None:
    """None where the tokens are equal, else (the first step they differ, whether the
    reference's top two logits nearly tie there)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            top = logits[i].topk(2).values
            return i, float(top[0] - top[1]) < 1e-4 * max(1.0, float(top[0].abs()))
    return None
