"""Our mixture-of-experts forward (backend/runner/models/moe.py) beyond test_architectures'
qwen3_moe and mixtral cases: Qwen3-MoE's dense layers and both top-k weightings against
transformers, transformers 5's fused expert tensors, QUANT=int8 on the experts, the block's
batch invariance and its routing ties, and LoRA adapters refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backend.contract.errors import ContractError
from backend.core.engine import LLMEngine
from backend.lora.peft_format import read_adapter
from backend.runner.hf_config import load_model_config
from backend.runner.models.moe import MoeDecoderLayer, SparseMoeBlock, route
from backend.runner.quant.formats import QuantizedWeight
from backend.settings.engine import EngineConfig
from backend.types.model_config import MoeConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.tiny_checkpoints import GQA, PROMPT, assert_matches, build, engine, greedy, reference

QWEN3_MOE = {**GQA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


@pytest.mark.parametrize(
    ("dense", "routed"),
    [
        ({"decoder_sparse_step": 2, "norm_topk_prob": False}, [False, True, False, True]),
        ({"mlp_only_layers": [0, 3], "norm_topk_prob": True}, [False, True, True, False]),
    ],
    ids=["sparse_step_2", "mlp_only_layers_renormalized"],
)
def test_qwen3_moe_with_dense_layers_matches_transformers(tmp_path, dense, routed):
    model = build("qwen3_moe", tmp_path, {**QWEN3_MOE, **dense})
    ref, logits = reference(model, PROMPT)
    eng = engine(tmp_path)
    assert [isinstance(layer, MoeDecoderLayer) for layer in eng.runner.model.layers] == routed
    tokens, _ = run_to_completion(eng, {"t": greedy()})
    assert_matches(tokens["t"], ref, logits, f"qwen3_moe {dense}")


def test_a_folder_of_fused_expert_tensors_loads(tmp_path):
    """transformers 5 holds experts as [E, 2I, H] / [E, H, I] tensors (and Mixtral's block under
    mlp.); save_pretrained writes them per expert, a state_dict as it is: both load."""
    built = tmp_path / "built"
    model = build("mixtral", built, {**GQA, "num_local_experts": 4, "num_experts_per_tok": 2})
    ref, logits = reference(model, PROMPT)
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # the in-memory form
    save_file(state, fused / "model.safetensors")
    for name in ("config.json", "generation_config.json"):
        (fused / name).write_text((built / name).read_text())
    tokens, _ = run_to_completion(engine(fused), {"t": greedy()})
    assert_matches(tokens["t"], ref, logits, "mixtral from fused experts")


def test_quant_int8_quantizes_each_expert_and_serves(tmp_path):
    build("qwen3_moe", tmp_path, {**QWEN3_MOE, "mlp_only_layers": [0]})
    eng = LLMEngine(EngineConfig(model_path=str(tmp_path), max_loras=0, speculative="off", quant="int8",
                                 quant_activations="float32"))  # fmt: skip
    dense, routed = eng.runner.model.layers[0], eng.runner.model.layers[1]
    assert isinstance(dense.gate_up_t, QuantizedWeight) and isinstance(routed.qkv_t, QuantizedWeight)
    for expert in routed.moe.experts:
        assert isinstance(expert.gate_up_t, QuantizedWeight) and isinstance(expert.down_t, QuantizedWeight)
        assert expert.gate_up_t.kind == "int8" and not list(expert.parameters())  # the float copies are gone
    assert routed.moe.router_t.dtype == torch.float32  # the router stays float
    tokens, _ = run_to_completion(eng, {"a": greedy(), "b": greedy(prompt=PROMPT[:9])})
    assert len(tokens["a"]) == len(tokens["b"]) == 16


def _block(num_experts: int = 8, top_k: int = 3, hidden: int = 64) -> SparseMoeBlock:
    block = SparseMoeBlock(hidden, MoeConfig(num_experts, top_k, 96, True, (0,)), torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    for param in block.parameters():
        param.data.normal_(0, 0.2)
    return block


def test_a_rows_output_is_bit_identical_alone_and_in_any_batch():
    block = _block()
    torch.manual_seed(1)
    rows = torch.randn(37, 64)
    with torch.inference_mode():
        batched = block(rows)
        alone = torch.cat([block(rows[i : i + 1]) for i in range(rows.shape[0])])
        shuffled = torch.randperm(rows.shape[0])
        reordered = block(rows[shuffled])
    assert torch.equal(batched, alone)
    assert torch.equal(reordered, batched[shuffled])


def test_routing_ties_go_to_the_lower_expert_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, experts = route(logits, 2, renormalize=True)
    assert experts.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(weights, torch.full((2, 2), 0.5))
    _, unnormalized = route(logits, 3, renormalize=False)
    assert unnormalized.tolist() == [[1, 2, 3], [0, 1, 2]]


def test_lora_adapters_are_refused_on_a_moe_model(tmp_path):
    build("qwen3_moe", tmp_path, QWEN3_MOE)
    cfg = load_model_config(tmp_path)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(ContractError, match="mixture-of-experts"):
        read_adapter(Path(tmp_path / "adapter"), cfg, max_rank=8)
