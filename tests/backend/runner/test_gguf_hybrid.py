"""A GGUF file of a hybrid (layers keeping state besides attention's KV) read by transformers'
newer GGUF reader (transformers.integrations.gguf: Qwen3.5, LFM2), which lacks some of the block
formats llama.cpp's files mix in: an LFM2 file, written as llama.cpp's converter writes it
(its per-layer KV head counts, the convolution's kernel squeezed to 2-D), its linears in Q5_0
(a Q4_K_M file's format for rows K-quants do not divide), served on the transformers path with
each sequence's convolution state kept, its tokens and logprobs transformers' on the same numbers."""

from __future__ import annotations

from gguf import GGUFValueType

from backend.runner import gguf_model
from backend.runner.quant.formats import QuantizedWeight
from tests.backend.runner.test_transformers_quant import assert_close, build, greedy_reference, linears, serve
from tests.helpers.gguf_files import file_numbers, write_from_hf


def _lfm2_layout(name: str, data):
    if name.endswith("conv.conv.weight"):  # [channels, 1, kernel] -> [channels, kernel]
        layer = name.split(".")[2]
        return [(f"blk.{layer}.shortconv.conv.weight", data[:, 0, :])]
    return None


def test_an_lfm2_file_in_q5_0_gives_its_checkpoints_tokens_with_its_convolution_state(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_model, "cache_dir", lambda: tmp_path / "cache")
    model = build("lfm2", layer_types=["conv", "full_attention"], num_key_value_heads=2, block_auto_adjust_ff_dim=False)
    settings = {"block_count": 2, "context_length": 1024, "embedding_length": 128, "feed_forward_length": 256,
                "head_count": 4, "head_count_kv": [0, 2], "layer_norm_rms_eps": model.config.norm_eps,
                "rope_freq_base": model.config.rope_parameters["rope_theta"]}  # fmt: skip
    extra = [("lfm2.shortconv.l_cache", model.config.conv_L_cache, GGUFValueType.UINT32)]
    file_numbers(model, "Q5_0")
    source = write_from_hf(tmp_path / "lfm2.Q5_0.gguf", model, "lfm2", "Q5_0", settings, extra=extra,
                           layout=_lfm2_layout)  # fmt: skip
    eng, tokens, logprobs = serve(source, quant="auto")
    assert eng.runner.model.config.architecture == "Lfm2ForCausalLM" and eng.runner.keeps_state
    assert all(isinstance(row.weight_t, QuantizedWeight) for row in linears(eng).values())  # the file's blocks
    assert_close(tokens, logprobs, *greedy_reference(model))
