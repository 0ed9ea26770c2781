"""Architectures on both paths against transformers, in the real engine (issue "Any model a user
brings"): tiny random-weight checkpoints built with transformers, greedy tokens equal to
transformers' generate() (up to a near-tie of the reference's top two logits), alone and
inside a busy batch with its prompt cut into prefill chunks, and each token's logprob within
1e-3 of transformers' log-softmax. Our own forward takes Llama, Qwen3, Phi-3 (partial rotary),
Qwen3-MoE, Mixtral and Gemma 2 / 3 (sliding windows interleaved with global layers,
soft-capping, Gemma 3's two RoPEs); the rest run on the generic path
(backend/runner/models/transformers_lm.py): QK norm, attention sinks, NoPE layers, partial
rotary, parallel residuals, Granite's multipliers, gpt-oss' experts, DeepSeek-V3's multi-head
latent attention, Gemma 4's layers of two head sizes and KV head counts and its KV-shared
layers, Gemma 3n's AltUp and Laurel (and its multimodal folder's language model, served alone), and the
hybrids whose other layers keep state (linear attention, convolutions, Mamba 2),
Mamba and Jamba (whose state transformers continues over one new token, not a chunk: each prompt
is computed in one step). Models the engine cannot serve, and encoders, are refused with the
reason.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from backend.contract import GenerationRequest
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.tiny_checkpoints import (
    DIMS,
    GQA,
    NEW_TOKENS,
    PROMPT,
    VOCAB,
    assert_matches,
    build,
    engine,
    greedy,
    reference,
    sharpen,
)

WINDOW = 8
JAMBA = dict(num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
             expert_layer_offset=1)  # fmt: skip
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
SLIDING = ["sliding_attention", "full_attention"] * 2
GEMMA3_ROPE = {  # Gemma 3 4B and larger: the global layers' RoPE linearly scaled, the sliding layers' not
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}
GEMMA3N = {**GQA, "layer_types": SLIDING, "sliding_window": WINDOW, "num_kv_shared_layers": 2,
           "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0], "laurel_rank": 8,
           "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16}  # fmt: skip
# model_type[:variant] -> (config overrides, the path the engine must take)
ARCHITECTURES = {
    "llama": (GQA, "native"),
    "qwen3": (GQA, "native"),
    "gemma2": (
        {
            **GQA,
            "sliding_window": WINDOW,
            "final_logit_softcapping": 5.0,
            "attn_logit_softcapping": 8.0,  # sharpened scores reach past it: capping bends them
            "query_pre_attn_scalar": 24,
            "layer_types": SLIDING,
        },
        "native",
    ),
    "gemma3_text": (
        {**GQA, "sliding_window": WINDOW, "layer_types": SLIDING, "rope_local_base_freq": 1000.0},
        "native",
    ),
    "gemma3_text:linear_rope": (
        {**GQA, "sliding_window": WINDOW, "layer_types": SLIDING, "rope_parameters": GEMMA3_ROPE},
        "native",
    ),
    "phi3": ({"num_key_value_heads": 2, "partial_rotary_factor": 0.5}, "native"),
    "granite": (
        {
            **GQA,
            "embedding_multiplier": 6.0,
            "logits_scaling": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.05,
        },
        "transformers",
    ),
    "olmo2": (GQA, "transformers"),
    "smollm3": ({**GQA, "no_rope_layer_interval": 2}, "transformers"),
    "gpt_neox": ({"rotary_pct": 0.25, "use_parallel_residual": True}, "transformers"),
    "starcoder2": ({**GQA, "sliding_window": WINDOW}, "transformers"),
    "qwen3_moe": ({**GQA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}, "native"),
    "mixtral": ({**GQA, **MOE, "sliding_window": WINDOW}, "native"),
    "gpt_oss": ({**GQA, **MOE, "sliding_window": WINDOW, "layer_types": SLIDING}, "transformers"),
    # Gemma 4 (26B-A4B's shape): global layers with heads of 64 over 1 KV head (keys as values),
    # sliding ones of 32 over 2; experts beside the MLP; a capped head
    "gemma4_text": (
        {
            **GQA,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "global_head_dim": 64,
            "sliding_window": WINDOW,
            "layer_types": SLIDING,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 64,
            "final_logit_softcapping": 5.0,
        },
        "transformers",
    ),  # fmt: skip
    # Gemma 4 E2B / E4B's shape: the last two layers take the keys and values of the last ones
    # of their type before them (KV sharing); per-layer inputs
    "gemma4_text:kv_shared": (
        {
            **GQA,
            "num_kv_shared_layers": 2,
            "global_head_dim": 64,
            "sliding_window": WINDOW,
            "layer_types": SLIDING,
            "hidden_size_per_layer_input": 32,
        },
        "transformers",
    ),  # fmt: skip
    # Gemma 3n E2B / E4B: KV sharing as Gemma 4's, AltUp's four streams, Laurel's low-rank
    # residual, per-layer inputs, a sparse first MLP (top 5% of its gate, by a Gaussian's quantile)
    "gemma3n_text": (GEMMA3N, "transformers"),
    "opt": ({"word_embed_proj_dim": 64}, "transformers"),
    # layers keeping state besides attention's KV (backend/runner/models/layer_state.py): Qwen3.5's
    # gated delta net (3 linear-attention layers, then a global one), LFM2's short convolutions,
    # Granite 4.0-H's Mamba 2 mixers
    "qwen3_5_text": (GQA, "transformers"),
    "lfm2": ({**GQA, "layer_types": ["conv", "full_attention"] * 2}, "transformers"),
    "granitemoehybrid": ({**GQA, "layer_types": ["mamba", "attention"] * 2}, "transformers"),
    # Mamba's mixers and Jamba's (attention, Mamba and expert layers): transformers continues their
    # state over one new token but not several, so each prompt is computed in one step
    "mamba": ({}, "transformers"),
    "jamba": ({**GQA, **JAMBA}, "transformers"),
    # transformers builds it as LlamaForCausalLM, renaming transformer.h.N.* at load: its path
    "exaone": (GQA, "transformers"),  # its head calls model.decoder; projected embeddings
    # multi-head latent attention (keys of 48, values of 24: the cache holds both padded to 48),
    # a shared expert and grouped top-k routing after a dense first layer
    "deepseek_v3": (
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 24,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
        },
        "transformers",
    ),  # fmt: skip
}


# the hybrids' layers that never attend: their KV caches hold no blocks
KV_FREE_LAYERS = {"qwen3_5_text": (0, 1, 2), "lfm2": (0, 2), "granitemoehybrid": (0, 2), "mamba": (0, 1, 2, 3),
                  "jamba": (0, 2)}  # fmt: skip


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    model_type = request.param
    overrides, path = ARCHITECTURES[model_type]
    folder = tmp_path_factory.mktemp(model_type.replace(":", "-"))
    model = build(model_type.split(":")[0], folder, overrides)
    return model_type, folder, path, reference(model, PROMPT)


def test_greedy_tokens_and_logprobs_match_transformers_alone(checkpoint):
    model_type, folder, path, (ref, logits) = checkpoint
    eng = engine(folder)
    assert eng.runner.native == (path == "native")
    assert eng.scheduler.whole_prompts == (model_type in ("mamba", "jamba"))  # the others' prompts in chunks
    free = KV_FREE_LAYERS.get(model_type, ())  # a state layer never attends: no KV blocks
    assert eng.runner.model_config.kv_free_layers == free
    assert [cache.shape[1] == 0 for cache in eng.runner.kv_caches] == [i in free for i in range(4)]
    tokens, finals = run_to_completion(eng, {"alone": greedy()})
    assert_matches(tokens["alone"], ref, logits, model_type)
    expected = torch.log_softmax(logits, dim=-1)
    ours = [lp.logprob for lp in _logprobs(eng, greedy())]
    agree = next((i for i, (a, b) in enumerate(zip(tokens["alone"], ref, strict=True)) if a != b), NEW_TOKENS)
    for i in range(agree):
        assert abs(ours[i] - float(expected[i, ref[i]])) < 1e-3, (model_type, i)


def test_greedy_tokens_inside_a_busy_batch_with_chunked_prefill(checkpoint):
    model_type, folder, _, (ref, logits) = checkpoint
    rng = random.Random(7)
    others = {f"other{i}": greedy(rng.randrange(4, 24), [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 60))])
              for i in range(6)}  # fmt: skip
    tokens, _ = run_to_completion(engine(folder, budget=24), {**others, "target": greedy()})
    assert_matches(tokens["target"], ref, logits, f"{model_type} in a batch")


def _logprobs(eng: LLMEngine, request: GenerationRequest) -> list:
    eng.add_request("logprobs", request, None)
    logprobs = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            logprobs += out.logprobs or []
    return logprobs


@pytest.mark.parametrize(
    ("model_type", "overrides", "reason"),
    [
        ("rwkv", {"attention_hidden_size": 128}, "no layer attends"),  # nor keeps state through the cache's interface
        ("bert", {"is_decoder": True}, "not a decoder-only model"),
        ("falcon", {}, "attention of its own"),  # picks its attention class by name
        ("bloom", {}, "no layer attends"),  # ALiBi, in its own attention code
        ("llama4_text", {}, "chunked_attention layers"),  # config.json says so: a mask ours is not
    ],
)
def test_models_the_engine_cannot_serve_are_refused_with_the_reason(tmp_path, model_type, overrides, reason):
    dims = {k: v for k, v in DIMS.items() if k not in ("max_position_embeddings",)}
    config = AutoConfig.for_model(model_type, **{**dims, **overrides})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=reason):
        engine(tmp_path)


def test_a_gemma3n_folder_serves_its_language_model_without_the_vision_towers_package(tmp_path):
    """Gemma 3n ships as Gemma3nForConditionalGeneration, whose vision tower transformers builds
    on timm (not installed here): its language model (model.language_model.*) is served alone,
    as transformers' Gemma3nForCausalLM, the towers' weights unread."""
    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is installed here: the full model builds")
    text = build("gemma3n_text", tmp_path / "text", GEMMA3N)
    ref, logits = reference(text, PROMPT)
    folder = tmp_path / "gemma3n"
    AutoConfig.for_model("gemma3n", text_config=text.config.to_dict()).save_pretrained(folder)
    weights = {f"model.language_model.{name.removeprefix('model.')}": tensor.contiguous()
               for name, tensor in text.state_dict().items() if name != "lm_head.weight"}  # fmt: skip
    weights["model.vision_tower.timm_model.conv_stem.conv.weight"] = torch.zeros(8, 3, 3, 3)
    save_file(weights, folder / "model.safetensors")
    eng = engine(folder)
    assert not eng.runner.native and eng.runner.model_config.architecture == "Gemma3nForConditionalGeneration"
    tokens, _ = run_to_completion(eng, {"t": greedy()})
    assert_matches(tokens["t"], ref, logits, "gemma3n (its language model)")


def test_a_gemma3_vision_language_checkpoint_runs_its_language_model_on_our_forward(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: its language model's weights
    (language_model.model.*) on our Gemma forward, the vision tower's unread (no images here)."""
    text = {**DIMS, **GQA, "sliding_window": WINDOW, "layer_types": SLIDING, "rope_local_base_freq": 1000.0}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    sharpen(model, "gemma3")
    model.save_pretrained(tmp_path)
    ref, logits = reference(model, PROMPT)
    eng = engine(tmp_path)
    assert eng.runner.native and eng.runner.model_config.vision is None
    tokens, _ = run_to_completion(eng, {"t": greedy()})
    assert_matches(tokens["t"], ref, logits, "gemma3 (vision-language checkpoint)")


def test_a_qwen3_vl_checkpoint_runs_its_language_model_on_our_qwen3_forward(tmp_path):
    """Qwen3-VL's language model is Qwen3's: its M-RoPE, every axis given the text's one position,
    is Qwen3's RoPE; transformers has no causal LM of it (`make serve` refused the folder). Its
    text weights (model.language_model.*) on our Qwen3 forward, the vision tower's (model.visual.*)
    unread, transformers' tokens from the full model on a text prompt."""
    from transformers import Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [8, 4, 4], "mrope_interleaved": True}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128,
              "deepstack_visual_indexes": [0]}  # fmt: skip
    text = {**DIMS, **GQA, "rope_parameters": rope}
    config = AutoConfig.for_model("qwen3_vl", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    sharpen(model, "qwen3_vl")
    model.save_pretrained(tmp_path)
    ref, logits = reference(model, PROMPT)
    eng = engine(tmp_path)
    assert eng.runner.native and eng.runner.model_config.architecture == "Qwen3ForCausalLM"
    assert eng.runner.model_config.vision is None
    tokens, _ = run_to_completion(eng, {"t": greedy()})
    assert_matches(tokens["t"], ref, logits, "qwen3_vl (its language model)")


def test_model_impl_transformers_runs_a_native_architecture_on_the_generic_path(tmp_path):
    model = build("llama", tmp_path, GQA)
    ref, logits = reference(model, PROMPT)
    config = EngineConfig(model_path=str(tmp_path), max_loras=0, speculative="off", quant="none",
                          model_impl="transformers")  # fmt: skip
    eng = LLMEngine(config)
    assert not eng.runner.native
    tokens, _ = run_to_completion(eng, {"t": greedy()})
    assert_matches(tokens["t"], ref, logits, "llama on the transformers path")


@pytest.mark.parametrize(
    ("model_type", "impl"), [("gemma2", "transformers"), ("gemma2", "native"), ("gpt_oss", "auto")]
)
def test_speculative_verify_steps_keep_transformers_tokens(tmp_path, model_type, impl):
    """n-gram drafts verified k + 1 rows a step (soft-capped and sink attention included), on
    the generic path and on our own forward."""
    model = build(model_type, tmp_path, ARCHITECTURES[model_type][0])
    prompt = (PROMPT[:10] * 5)[:48]  # repeats: the n-gram drafter proposes
    ref, logits = reference(model, prompt)
    eng = LLMEngine(EngineConfig(model_path=str(tmp_path), max_loras=0, speculative="ngram", quant="none",
                                 model_impl=impl))  # fmt: skip
    tokens, _ = run_to_completion(eng, {"s": greedy(prompt=prompt)})
    assert_matches(tokens["s"], ref, logits, f"{model_type} speculative")
    assert eng.speculator.stats.num_draft_tokens > 0  # verify steps ran
