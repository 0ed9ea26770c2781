"""The bound on an adapter's files (MAX_LORA_FILE_BYTES, peft_format.largest_adapter_bytes):
an oversized file is refused from its size alone, before it is opened (a sparse file of a
GiB takes no disk, and reading it would take a GiB of memory), naming lora_path, the limit
and the setting; real adapters, up to MAX_LORA_RANK on every projection, still load."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from backend.contract import AdapterCommand, ContractError
from backend.lora.peft_format import CONFIG_MAX_BYTES, TENSOR_HEADER_BYTES, largest_adapter_bytes, read_adapter
from backend.lora.registry import AdapterRegistry, LoraConfig
from backend.runner.hf_config import load_model_config
from backend.settings.engine import EngineConfig
from tests.helpers.lora_models import ALL_TARGETS, write_adapter, write_tiny_llama

GIB = 1 << 30
_opened: list[str] = []  # every path opened while the process runs (an audit hook cannot be removed)
sys.addaudithook(lambda event, args: _opened.append(str(args[0])) if event == "open" and args else None)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("cap") / "base")


@pytest.fixture(scope="module")
def model(base):
    return load_model_config(base)


@pytest.fixture
def adapter(base, tmp_path):
    return write_adapter(base, tmp_path / "adapter", r=4, alpha=8, targets=("q_proj", "down_proj"))


def _sparse(file, size: int = GIB):
    """`file` replaced by a sparse one of `size` bytes (no disk used)."""
    file.unlink(missing_ok=True)
    with open(file, "wb"):
        pass
    os.truncate(file, size)
    return str(file)


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_sparse_weights_file_past_the_bound_is_refused_before_it_is_opened(adapter, model):
    weights = _sparse(adapter / "adapter_model.safetensors")
    opened, rss = len(_opened), _rss()
    with pytest.raises(ContractError) as refused:
        read_adapter(adapter, model, max_rank=64)
    assert weights not in _opened[opened:] and _rss() - rss < 64 << 20
    limit = largest_adapter_bytes(model, 64)
    assert refused.value.field == "lora_path" and "MAX_LORA_FILE_BYTES" in refused.value.message
    assert f"{GIB:,} bytes, over the {limit:,} bytes" in refused.value.message
    registry = AdapterRegistry(model, LoraConfig(max_loras=1))
    with pytest.raises(ContractError, match="MAX_LORA_FILE_BYTES") as command:
        registry.command(AdapterCommand("load", "big", str(adapter)))
    assert command.value.field == "lora_path" and weights not in _opened[opened:]


def test_a_sparse_config_past_its_bound_is_refused_before_it_is_opened(adapter, model):
    config = _sparse(adapter / "adapter_config.json", 100 << 20)
    opened = len(_opened)
    with pytest.raises(ContractError, match=f"over the {CONFIG_MAX_BYTES:,} bytes") as refused:
        read_adapter(adapter, model, max_rank=64)
    assert refused.value.field == "lora_path" and config not in _opened[opened:]


def test_the_setting_bounds_real_adapters_and_is_checked_at_start(adapter, base, model):
    size = (adapter / "adapter_model.safetensors").stat().st_size
    assert read_adapter(adapter, model, 64, max_file_bytes=size).rank == 4
    with pytest.raises(ContractError, match=f"{size:,} bytes, over the {size - 1:,} bytes MAX_LORA_FILE_BYTES"):
        read_adapter(adapter, model, 64, max_file_bytes=size - 1)
    config = EngineConfig(model_path=str(base), lora_modules=f"sql={adapter}", max_lora_file_bytes=size - 1)
    with pytest.raises(ValueError, match="LORA_MODULES: adapter 'sql'.*MAX_LORA_FILE_BYTES"):
        AdapterRegistry.for_engine(config, model)
    with pytest.raises(ValueError, match="MAX_LORA_FILE_BYTES=0 must be positive"):
        AdapterRegistry.for_engine(replace(config, max_lora_file_bytes=0), model)


def test_the_env_variable_reaches_the_engine_config(monkeypatch):
    monkeypatch.setenv("MAX_LORA_FILE_BYTES", "123456")
    assert EngineConfig.from_env("unused").max_lora_file_bytes == 123456
    monkeypatch.delenv("MAX_LORA_FILE_BYTES")
    assert EngineConfig.from_env("unused").max_lora_file_bytes is None


def test_the_default_bound_fits_an_adapter_of_the_largest_rank_on_every_projection(base, model, tmp_path):
    largest = write_adapter(base, tmp_path / "largest", r=16, targets=ALL_TARGETS)
    size = (largest / "adapter_model.safetensors").stat().st_size
    bound = largest_adapter_bytes(model, 16)
    tensors = 2 * len(ALL_TARGETS) * model.num_layers
    assert bound - TENSOR_HEADER_BYTES * tensors < size <= bound  # tight: the float32 data itself
    assert read_adapter(largest, model, max_rank=16).rank == 16
    bin_folder = tmp_path / "bin"  # torch.save's format, read from the same bytes
    shutil.copytree(largest, bin_folder)
    torch.save(load_file(bin_folder / "adapter_model.safetensors"), bin_folder / "adapter_model.bin")
    (bin_folder / "adapter_model.safetensors").unlink()
    assert (bin_folder / "adapter_model.bin").stat().st_size <= bound
    assert read_adapter(bin_folder, model, max_rank=16).rank == 16


def test_the_default_bound_for_7b_and_70b_llamas_at_rank_64(model):
    llama_7b = replace(model, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                       num_kv_heads=32, head_dim=128)  # fmt: skip
    llama_70b = replace(llama_7b, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8)  # fmt: skip
    assert 0.63e9 < largest_adapter_bytes(llama_7b, 64) < 0.65e9
    assert 3.3e9 < largest_adapter_bytes(llama_70b, 64) < 3.4e9


def test_a_folder_grown_past_the_bound_is_refused_on_reread_before_it_is_opened(base, model, tmp_path):
    registry = AdapterRegistry(model, LoraConfig(max_loras=1, max_cpu_loras=1))
    folder = write_adapter(base, tmp_path / "one", r=4, seed=1)
    one = registry.load("one", str(folder))
    registry.load("two", str(write_adapter(base, tmp_path / "two", r=4, seed=2)))  # evicts one's weights
    weights = _sparse(folder / "adapter_model.safetensors")
    opened = len(_opened)
    with pytest.raises(ContractError, match="MAX_LORA_FILE_BYTES"):
        registry.weights(one)
    assert weights not in _opened[opened:]
