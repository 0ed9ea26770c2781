"""The drafters with weights, end to end in the engine: a draft model (SPEC_DRAFT_MODEL) on
the real default model, and MTP on tiny random MiMo checkpoints the tests write.

Whatever they propose, the tokens are plain decoding's (`disable_mtp`); what they are
measured on is acceptance, which is high only when the wiring (positions, hidden
states, caches) is right.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner.forward_batch import Span, build_forward_batch
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.spec_models import build_mimo_model, build_truncated_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=7, max_tokens=32,
                        ignore_eos=True)  # fmt: skip
BUILD = Path(__file__).resolve().parents[3] / "build" / "models"


def _engine(model_path, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(model_path), kv_cache_bytes=128 << 20, **config))


def _compare(engine, prompts, params):
    """(tokens of each prompt with and without speculation, drafted, accepted), run together."""
    requests = {}
    for i, p in enumerate(prompts):
        requests[f"spec{i}"] = GenerationRequest(p, params)
        requests[f"plain{i}"] = GenerationRequest(p, params, disable_mtp=True)
    before = engine.spec_stats()
    tokens, _ = run_to_completion(engine, requests)
    after = engine.spec_stats()
    pairs = [(tokens[f"spec{i}"], tokens[f"plain{i}"]) for i in range(len(prompts))]
    drafted = after.num_draft_tokens - before.num_draft_tokens
    return pairs, drafted, after.num_accepted_tokens - before.num_accepted_tokens


# -- draft model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_prompts(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    questions = ["List the first ten prime numbers.", "Write a limerick about a cat.", "What is a hash map?"]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
            for q in questions]  # fmt: skip


@pytest.fixture(scope="module")
def small_draft(model_path):
    """The default model's first 12 of 30 layers: a smaller model with its tokenizer."""
    return build_truncated_model(model_path, BUILD / "SmolLM2-first-12-layers", 12)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_draft_model_gives_plain_decodings_tokens(model_path, small_draft, chat_prompts, params):
    engine = _engine(model_path, speculative="draft", spec_draft_model=str(small_draft))
    pairs, drafted, accepted = _compare(engine, chat_prompts, params)
    for spec, plain in pairs:
        assert spec == plain
    assert drafted > 0 and accepted > 0


def test_the_target_as_its_own_draft_is_nearly_always_accepted(model_path, chat_prompts):
    """Same weights, same tokens: a draft the target rejects would mean the draft's cache
    or positions are off."""
    engine = _engine(model_path, speculative="draft", spec_draft_model=str(model_path))
    pairs, drafted, accepted = _compare(engine, chat_prompts, GREEDY)
    assert all(spec == plain for spec, plain in pairs)
    assert accepted >= 0.9 * drafted > 0
    seq_kv = _draft_kv_matches_target(engine, chat_prompts[0])
    assert seq_kv > 20


def _draft_kv_matches_target(engine, prompt) -> int:
    """Mid-generation, the draft's KV of every position it calls valid equals the target's
    (same weights); returns how many positions were compared."""
    engine.add_request("kv", GenerationRequest(prompt, dataclasses.replace(GREEDY, max_tokens=60)))
    seq = engine.scheduler.requests["kv"]
    while seq.num_output_tokens < 20:
        engine.step()
    valid = min(seq.spec.place.valid, seq.num_computed_tokens)
    pos = torch.arange(valid)
    table = torch.tensor(seq.block_table)
    blocks, offsets = table[pos // engine.config.block_size], pos % engine.config.block_size
    for target, draft in zip(engine.runner.kv_caches, engine.runner.draft.kv_caches, strict=True):
        torch.testing.assert_close(draft[:, blocks, offsets], target[:, blocks, offsets], atol=1e-4, rtol=1e-4)
    engine.abort_request("kv")
    engine.step()
    return valid


def test_a_draft_model_survives_preemption(model_path, small_draft, chat_prompts):
    tight = _engine(model_path, speculative="draft", spec_draft_model=str(small_draft), num_blocks=12,
                    max_num_batched_tokens=128)  # fmt: skip
    pairs, drafted, _ = _compare(tight, chat_prompts, GREEDY)
    assert tight.num_preemptions > 0 and drafted > 0
    assert all(spec == plain for spec, plain in pairs)


def test_a_draft_model_with_another_vocabulary_stops_the_engine_at_start(model_path, tmp_path):
    other = build_mimo_model(tmp_path / "tiny", mtp="random")  # 512 tokens, no tokenizer
    with pytest.raises(ValueError, match="SPEC_DRAFT_MODEL=tiny: its vocabulary has 512 tokens"):
        _engine(model_path, speculative="draft", spec_draft_model=str(other))
    with pytest.raises(ValueError, match="SPECULATIVE=draft needs SPEC_DRAFT_MODEL"):
        _engine(model_path, speculative="draft")
    with pytest.raises(ValueError, match="SPECULATIVE=ngram does not draft with it"):
        _engine(model_path, speculative="ngram", spec_draft_model=str(model_path))


# -- MTP ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return build_mimo_model(tmp_path_factory.mktemp("mimo") / "copy", mtp="copy")


@pytest.fixture(scope="module")
def mimo_random(tmp_path_factory):
    return build_mimo_model(tmp_path_factory.mktemp("mimo") / "random", mtp="random")


TOKEN_PROMPTS = [[5, 17, 99, 230, 7, 41, 300, 12], list(range(40, 90, 3)), [400, 2, 2, 9, 77] * 5]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_mtp_drafts_are_accepted_and_change_no_token(mimo, params):
    engine = _engine(mimo, speculative="mtp")  # always the most drafts: every chained step shows
    before = engine.spec_stats()
    pairs, drafted, accepted = _compare(engine, TOKEN_PROMPTS, params)
    assert all(spec == plain for spec, plain in pairs)
    if params is GREEDY:
        assert accepted >= 0.6 * drafted > 0
        per_pos = [a - b for a, b in zip(engine.spec_stats().accepted_per_pos, before.accepted_per_pos, strict=True)]
        assert all(n > 0 for n in per_pos), "chained steps (positions 2..k) are accepted too"


def test_random_mtp_weights_are_rejected_and_change_no_token(mimo_random):
    engine = _engine(mimo_random, speculative="mtp")
    pairs, drafted, accepted = _compare(engine, TOKEN_PROMPTS, GREEDY)
    assert all(spec == plain for spec, plain in pairs)
    assert drafted > 0 and accepted < 0.3 * drafted


def test_mtp_under_preemption_and_prefix_hits(mimo):
    tight = _engine(mimo, speculative="mtp", num_blocks=10, max_num_batched_tokens=64)
    prompts = [*TOKEN_PROMPTS, TOKEN_PROMPTS[1]]  # the repeat hits the prefix cache
    params = dataclasses.replace(GREEDY, max_tokens=48)
    pairs, drafted, accepted = _compare(tight, prompts, params)
    assert tight.num_preemptions > 0 and accepted > 0
    assert all(spec == plain for spec, plain in pairs)


def test_mtp_needs_a_checkpoint_that_has_it(model_path, mimo):
    engine = _engine(mimo)  # auto: a checkpoint with MTP layers drafts with them
    engine.add_request("r", GenerationRequest([1, 2, 3], GREEDY))
    assert engine.scheduler.requests["r"].spec.proposer.name == "mtp"
    with pytest.raises(ValueError, match="SPECULATIVE=mtp: this checkpoint ships no MTP layers"):
        _engine(model_path, speculative="mtp")


def test_the_mtp_layer_computes_mimos_formula(mimo_random):
    """Our MTP layer, through the paged cache, against MiMo's formula written out with
    transformers' Qwen2 decoder layer: hidden first in the concat, the embedding zeroed
    at position 0, the block's residual, the final norm."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

    engine = _engine(mimo_random, speculative="mtp")
    weights = load_file(mimo_random / "model.safetensors")
    raw = json.loads((mimo_random / "config.json").read_text())
    config = Qwen2Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    layer = Qwen2DecoderLayer(config, 0).eval()
    prefix = "model.mtp_layers.0."
    block_parts = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    layer.load_state_dict({k[len(prefix) :]: v for k, v in weights.items()
                           if k.startswith(prefix) and k[len(prefix) :].split(".")[0] in block_parts})  # fmt: skip
    tokens, hidden = torch.tensor([3, 50, 7, 7, 200, 11]), torch.randn(6, 64)

    def norm(name, x):
        rms = Qwen2RMSNorm(64, eps=1e-6)
        rms.weight.data = weights[prefix + name]
        return rms(x)

    embeds = F.embedding(tokens, weights["model.embed_tokens.weight"])
    embeds[0] = 0.0  # position 0
    u = torch.cat((norm("hidden_layernorm.weight", hidden), norm("token_layernorm.weight", embeds)), -1)
    u = u @ weights[prefix + "input_proj.weight"].t()
    positions = torch.arange(6)[None]
    with torch.no_grad():
        out = layer(u[None], position_embeddings=Qwen2RotaryEmbedding(config)(u[None], positions),
                    position_ids=positions)  # fmt: skip
        want = norm("final_layernorm.weight", out[0] if isinstance(out, tuple) else out)[0]
    seq_table = list(range(2))  # a fresh engine: blocks 0 and 1 are free to write
    batch = build_forward_batch([Span(tokens.tolist(), 0, seq_table, 6)], engine.config.block_size, torch.device("cpu"))
    got = engine.runner.model.mtp(engine.runner.model, batch, hidden, engine.runner.mtp.kv_caches, 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
