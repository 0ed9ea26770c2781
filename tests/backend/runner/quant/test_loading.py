"""QUANT at load: the default model's GGUF blocks served as they are, `auto`, and the settings."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from backend import kernels
from backend.runner.convert import source_gguf
from backend.runner.loader import load_model
from backend.runner.quant.apply import LINEARS, QuantSpec, quantize_model, resolve_auto, weight_bytes
from backend.runner.quant.formats import QuantizedWeight, dequantize
from backend.runner.quant.gguf_blocks import gguf_type, read_gguf_weights
from backend.settings.engine import EngineConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def float_model(model_path):
    return load_model(model_path, torch.float32, CPU)


@pytest.fixture(scope="module")
def gguf_blocks(model_path, float_model):
    cfg = float_model.config
    return read_gguf_weights(source_gguf(model_path), cfg.num_heads, cfg.num_kv_heads, "Q4_1")


def test_the_gguf_blocks_are_the_float32_weights_exactly(float_model, gguf_blocks):
    # the float32 folder is the GGUF dequantized by transformers (q / k rows un-permuted): every
    # Q4_1 linear and the Q8_0 table read back from the blocks equals it bit for bit
    assert len(gguf_blocks) == 4 * float_model.config.num_layers + 1
    for name, weight in gguf_blocks.items():
        assert torch.equal(dequantize(weight), float_model.get_parameter(name).t()), name
    assert gguf_blocks["lm_head_t"].kind == "int8" and gguf_blocks["layers.0.qkv_t"].kind == "int4"


def test_gguf_types_of_the_formats():
    assert gguf_type("int4", 32, False) == "Q4_1"
    assert gguf_type("int4", 32, True) == "Q4_0"
    assert gguf_type("int8", 32, True) == "Q8_0"
    assert gguf_type("int8", 32, False) is None and gguf_type("int4", 64, False) is None


@pytest.mark.parametrize(
    "spec,from_gguf", [(QuantSpec("int4"), 121), (QuantSpec("int4", 64), 1), (QuantSpec("int8"), 1)]
)
def test_the_linears_become_quantized_weights(model_path, spec, from_gguf, activations):
    model = load_model(model_path, torch.float32, CPU)
    used = quantize_model(model, replace(spec, activations=activations), source_gguf(model_path))
    assert used == from_gguf  # int4 g32 with zero points: every block from the GGUF; else only its Q8_0 lm_head
    for layer in model.layers:
        for attr in LINEARS:
            weight = getattr(layer, attr)
            assert isinstance(weight, QuantizedWeight) and weight.kind == spec.kind and weight.group == spec.group
            assert attr not in dict(layer.named_parameters())  # the float copy is gone
    assert model.lm_head_q.kind == "int8"
    assert weight_bytes(model) < 0.35 * 538e6


def test_auto_serves_the_ggufs_own_format_and_never_requantizes_a_float_checkpoint(float_model, model_path):
    auto, gguf_file = QuantSpec("auto"), source_gguf(model_path)
    expected = QuantSpec("int4", 32, False) if kernels.native() is not None else QuantSpec("none")
    assert resolve_auto(auto, float_model, CPU, gguf_file) == expected  # Q4_1 blocks as they are
    assert resolve_auto(auto, float_model, CPU, None).kind == "none"  # a float checkpoint: float32
    assert resolve_auto(auto, float_model, torch.device("cuda"), gguf_file).kind == "none"
    assert resolve_auto(QuantSpec("int8"), float_model, CPU, None).kind == "int8"  # only auto is resolved


def test_settings_from_the_environment(monkeypatch):
    for name in ("QUANT", "QUANT_GROUP_SIZE", "QUANT_SYMMETRIC"):
        monkeypatch.delenv(name, raising=False)
    cfg = EngineConfig.from_env("/m")
    assert (cfg.quant, cfg.quant_group, cfg.quant_symmetric) == ("auto", 32, False)  # a server's default
    assert EngineConfig(model_path="/m").quant == "none"  # in-process: float32 unless asked
    monkeypatch.setenv("QUANT", "int8")
    monkeypatch.setenv("QUANT_GROUP_SIZE", "64")
    monkeypatch.setenv("QUANT_SYMMETRIC", "1")
    cfg = EngineConfig.from_env("/m")
    assert (cfg.quant, cfg.quant_group, cfg.quant_symmetric) == ("int8", 64, True)


def test_the_matmul_settings_come_from_the_environment(monkeypatch):
    for name in ("QUANT_ACTIVATIONS", "QUANT_GEMM", "QUANT_GEMV_MAX_ROWS"):
        monkeypatch.delenv(name, raising=False)
    cfg = EngineConfig.from_env("/m")
    assert (cfg.quant_activations, cfg.quant_gemm, cfg.quant_gemv_max_rows) == ("auto", "float32", None)
    monkeypatch.setenv("QUANT_ACTIVATIONS", "float32")
    monkeypatch.setenv("QUANT_GEMM", "bf16")
    monkeypatch.setenv("QUANT_GEMV_MAX_ROWS", "24")
    cfg = EngineConfig.from_env("/m")
    assert (cfg.quant_activations, cfg.quant_gemm, cfg.quant_gemv_max_rows) == ("float32", "bf16", 24)


def test_every_weight_carries_the_matmul_settings(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for spec, want in [
        (QuantSpec("int4", activations="float32"), (None, torch.float32)),  # the defaults: GEMV_MAX_ROWS, float32
        (QuantSpec("int8", activations="float32", gemm="bf16", gemv_max_rows=24), (24, torch.bfloat16)),
    ]:
        model = load_model(tmp_path, torch.float32, CPU)
        quantize_model(model, spec)
        weights = [getattr(layer, a) for layer in model.layers for a in LINEARS] + [model.lm_head_q]
        assert {(w.gemv_max_rows, w.gemm_dtype) for w in weights} == {want}


def test_a_bad_quant_is_refused():
    with pytest.raises(ValueError, match="QUANT must be one of none, auto, int8, int4; got 'fp4'"):
        QuantSpec("fp4")


def test_our_tensor_table_reads_what_the_gguf_package_reads(model_path):
    import numpy as np
    from gguf import GGUFReader

    from backend.runner.quant.gguf_blocks import read_tensor_table

    path = source_gguf(model_path)
    theirs = {t.name: t for t in GGUFReader(path).tensors}
    ours = read_tensor_table(path)
    assert {t.name for t in ours} == set(theirs)
    for tensor in ours:
        assert tensor.type_name == theirs[tensor.name].tensor_type.name
        their_bytes = np.asarray(theirs[tensor.name].data).view(np.uint8).reshape(tensor.data.shape)
        assert np.array_equal(tensor.data, their_bytes), tensor.name


@pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU")
def test_logits_come_from_the_int8_lm_head_at_every_row_count(model_path, activations):
    """One path for one row or a prefill's prompt logprobs: a row's logits never depend on how
    many rows the step asks for (batch invariance), bit for bit."""
    model = load_model(model_path, torch.float32, CPU)
    quantize_model(model, QuantSpec("int4", activations=activations), source_gguf(model_path))
    int8_table = dequantize(model.lm_head_q).double()  # [vocab, hidden]
    hidden = torch.randn(97, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    every = model.compute_logits(hidden)
    for rows in (1, 13, 48, 49, 97):
        logits = model.compute_logits(hidden[:rows])
        assert torch.equal(logits, every[:rows]), rows
    want = hidden.double() @ int8_table.t()
    # int8 activations: x rounded per block of 32 first (their own reference is test_kernels')
    bound = 1e-5 if activations == "float32" else 2e-2
    assert float((every.double() - want).abs().max() / want.abs().max()) < bound
