"""Reading PEFT folders: the scaling PEFT defines, and every configuration we do not compute
refused at load with the key that asks for it; the registry's slots, versions and host cache."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.contract import AdapterCommand, AdapterNotFound, ContractError
from backend.lora.peft_format import read_adapter
from backend.lora.registry import AdapterRegistry, LoraConfig, parse_modules
from backend.runner.hf_config import load_model_config
from backend.settings.engine import EngineConfig
from tests.helpers.lora_models import edit_config, write_adapter, write_tiny_llama


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("peft") / "base")


@pytest.fixture(scope="module")
def model(base):
    return load_model_config(base)


@pytest.fixture
def adapter(base, tmp_path):
    return write_adapter(base, tmp_path / "adapter", r=4, alpha=8, targets=("q_proj", "down_proj"))


def _raw(folder):
    return load_file(folder / "adapter_model.safetensors")


def test_scaling_folded_into_b_follows_rslora_and_the_patterns(base, model, tmp_path):
    plain = write_adapter(base, tmp_path / "plain", r=4, alpha=8, targets=("q_proj",))
    rs = write_adapter(base, tmp_path / "rs", r=4, alpha=8, targets=("q_proj",), rslora=True)
    patterns = {"rank_pattern": {"layers.1.self_attn.q_proj": 2}, "alpha_pattern": {"up_proj": 5.0}}
    patterned = write_adapter(base, tmp_path / "pat", r=4, alpha=8, targets=("q_proj", "up_proj"), **patterns)
    name = "base_model.model.model.layers.{}.{}.lora_B.weight"
    for folder, key, layer, proj, scaling in (
        (plain, ("q_proj",), 0, "self_attn.q_proj", 8 / 4),
        (rs, ("q_proj",), 0, "self_attn.q_proj", 8 / math.sqrt(4)),
        (patterned, ("q_proj",), 1, "self_attn.q_proj", 8 / 2),  # rank 2 from rank_pattern
        (patterned, ("up_proj",), 0, "mlp.up_proj", 5.0 / 4),  # alpha from alpha_pattern
    ):
        weights = read_adapter(folder, model, max_rank=64)
        _, b = weights.modules[(layer, key[0])]
        raw_b = _raw(folder)[name.format(layer, proj)]
        assert torch.allclose(b, raw_b * scaling), (folder.name, key)
    assert read_adapter(patterned, model, 64).modules[(1, "q_proj")][0].shape[0] == 2


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("bias", "all"),
        ("lora_bias", True),
        ("fan_in_fan_out", True),
        ("trainable_token_indices", [1, 2]),
        ("target_parameters", ["mlp.experts.down_proj"]),
        ("layer_replication", [[0, 1]]),
        ("alora_invocation_tokens", [5]),
    ],
)
def test_unsupported_configurations_are_refused_naming_the_key(adapter, model, key, value):
    edit_config(adapter, **{key: value})
    with pytest.raises(ContractError) as refused:
        read_adapter(adapter, model, max_rank=64)
    assert refused.value.field == "lora_path" and key in refused.value.message


def test_a_rank_above_max_lora_rank_is_refused(adapter, model):
    with pytest.raises(ContractError, match="MAX_LORA_RANK=2"):
        read_adapter(adapter, model, max_rank=2)


def test_embedding_and_lm_head_targets_are_refused(base, model, tmp_path):
    folder = write_adapter(base, tmp_path / "emb", r=4, targets=("q_proj", "embed_tokens"))
    with pytest.raises(ContractError, match="embed_tokens / lm_head.*target_modules"):
        read_adapter(folder, model, max_rank=64)


def test_an_adapter_for_another_model_or_a_broken_folder_is_refused(base, model, adapter, tmp_path):
    other = write_tiny_llama(tmp_path / "wide", hidden_size=32, intermediate_size=48)
    foreign = write_adapter(other, tmp_path / "foreign", r=4, targets=("q_proj",))
    with pytest.raises(ContractError, match="do not fit this model"):
        read_adapter(foreign, model, max_rank=64)
    with pytest.raises(ContractError, match="no adapter_config.json"):
        read_adapter(tmp_path / "missing", model, max_rank=64)
    half = tmp_path / "half"
    shutil.copytree(adapter, half)
    save_file({k: v for k, v in _raw(half).items() if "lora_A" in k}, half / "adapter_model.safetensors")
    with pytest.raises(ContractError, match="not both lora_A and lora_B"):
        read_adapter(half, model, max_rank=64)


def test_registry_slots_versions_and_the_active_adapter(base, model, tmp_path):
    registry = AdapterRegistry(model, LoraConfig(max_loras=2))
    one = write_adapter(base, tmp_path / "one", r=4, seed=1)
    two = write_adapter(base, tmp_path / "two", r=2, seed=2)
    first = registry.load("sql", str(one))
    chat = registry.load("chat", str(two))
    again = registry.load("sql", str(two))  # replaced: same slot, a new version
    assert (first.slot, chat.slot, again.slot) == (1, 2, 1)
    assert len({first.version, chat.version, again.version}) == 3
    assert registry.resolve(1) is again and registry.resolve(0) is None and registry.resolve(-1) is None
    table = registry.command(AdapterCommand("activate", "chat"))
    assert table.active == "chat" and registry.resolve(-1) is chat
    table = registry.command(AdapterCommand("unload", "chat"))
    assert table.active == "" and [a.name for a in table.adapters] == ["sql"]
    with pytest.raises(AdapterNotFound):
        registry.resolve(2)
    with pytest.raises(AdapterNotFound):
        registry.unload("chat")
    # a name loaded again after its unload gets its slot back; a slot is never another name's
    assert registry.load("chat", str(one)).slot == 2 and registry.load("docs", str(one)).slot == 3


def test_host_memory_keeps_max_cpu_loras_and_rereads_unchanged_folders_only(base, model, tmp_path):
    registry = AdapterRegistry(model, LoraConfig(max_loras=1, max_cpu_loras=1))
    one = registry.load("one", str(write_adapter(base, tmp_path / "one", r=4, seed=1)))
    first = registry.weights(one)
    two_folder = write_adapter(base, tmp_path / "two", r=4, seed=2)
    registry.load("two", str(two_folder))  # evicts one's weights from host memory
    again = registry.weights(one)  # read from its folder again
    assert again is not first and torch.equal(again.modules[(0, "q_proj")][1], first.modules[(0, "q_proj")][1])
    two = registry.resolve(2)
    registry.weights(one)  # now two is evicted
    edit_config(two_folder, lora_alpha=99)
    with pytest.raises(ContractError, match="changed since it was loaded"):
        registry.weights(two)


def test_lora_modules_at_start(base, model, tmp_path):
    folder = write_adapter(base, tmp_path / "sql", r=4)
    assert parse_modules(f" sql={folder} , chat = {folder}") == [("sql", str(folder)), ("chat", str(folder))]
    with pytest.raises(ValueError, match="name=path"):
        parse_modules("sql")
    config = EngineConfig(model_path=str(base), lora_modules=f"sql={folder}", active_lora="sql")
    registry = AdapterRegistry.for_engine(config, model)
    assert registry.table().active == "sql" and registry.table().adapters[0].rank == 4
    with pytest.raises(ValueError, match="LORA_MODULES: adapter 'bad'.*no adapter_config.json"):
        AdapterRegistry.for_engine(EngineConfig(model_path=str(base), lora_modules=f"bad={tmp_path}"), model)
    with pytest.raises(ValueError, match="ACTIVE_LORA"):
        AdapterRegistry.for_engine(EngineConfig(model_path=str(base), active_lora="nope"), model)
    assert AdapterRegistry.for_engine(EngineConfig(model_path=str(base), max_loras=0), model) is None
