"""MODEL=file.gguf, end to end in the engine (issue "Any model a user brings"): small GGUF files
written with the `gguf` package (tests/helpers/gguf_files.py), a layer in each block format
llama.cpp files use, are served from their own blocks; the exact mode (QUANT_ACTIVATIONS=float32)
gives transformers' greedy tokens on the model transformers loads from the same file; the
default mode (int8 activations) runs the same blocks. Files we cannot serve are refused with
one line saying what."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner import gguf_model
from backend.runner.gguf_model import gguf_file, model_folder
from backend.runner.quant.formats import QuantizedWeight, dequantize, quantize
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.gguf_files import write_model

PROMPT = [504, 3458, 282, 260, 1345, 7055, 30, 378, 314, 1564, 1148, 47, 216, 1085, 5345, 28]
NEW_TOKENS = 12
# a Q4_K_M file's layer
MIXED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
         "ffn_up": "Q4_K", "ffn_down": "Q6_K"}  # fmt: skip
FILES = {
    "legacy": dict(layer_types=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16"], embed="Q8_0"),
    "k_quants": dict(layer_types=["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", MIXED], embed="Q4_K", output="Q6_K"),
    "qwen2": dict(layer_types=["Q8_0", "Q4_K", "BF16"], arch="qwen2", embed="F16", output="Q8_0"),
}
# what each layer's fused q|k|v must be served as: (kind, group)
SERVED = {"Q4_0": ("int4", 32), "Q4_1": ("int4", 32), "Q5_0": ("int5", 32), "Q5_1": ("int5", 32),
          "Q8_0": ("int8", 32), "Q2_K": ("int8", 16), "Q3_K": ("int8", 16), "Q4_K": ("int4", 32),
          "Q5_K": ("int5", 32), "Q6_K": ("int8", 16)}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def prepared_in_tmp(tmp_path_factory):
    """Prepared folders in a temporary cache (the kernels' build stays in the real one)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_model, "cache_dir", lambda: cache)
        yield


@pytest.fixture(scope="module", params=list(FILES))
def gguf(request, tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.Q4_K_M.gguf",
                       **FILES[request.param])  # fmt: skip
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    return request.param, path, out.sequences[0, len(PROMPT) :].tolist(), torch.cat(out.logits).float()


def _run(path: Path, activations: str) -> tuple[LLMEngine, list[int]]:
    eng = LLMEngine(EngineConfig(model_path=str(path), quant="auto", quant_activations=activations, max_loras=0,
                                 speculative="off"))  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens, _ = run_to_completion(eng, {"r": GenerationRequest(prompt_tokens=PROMPT, sampling=sampling)})
    return eng, tokens["r"]


def test_exact_mode_gives_transformers_greedy_tokens_from_the_files_own_blocks(gguf):
    name, path, ref, logits = gguf
    eng, tokens = _run(path, "float32")
    for i, (a, b) in enumerate(zip(tokens, ref, strict=True)):
        if a != b:  # only where the reference's top two logits nearly tie
            top = logits[i].topk(2).values
            assert float(top[0] - top[1]) < 1e-3 * max(1.0, float(top[0].abs())), (name, i, tokens, ref)
            break
    layers = eng.runner.model.layers
    for layer, types in zip(layers, FILES[name]["layer_types"], strict=True):
        qkv = layer.qkv_t
        if isinstance(types, dict):  # q, k in Q4_K and v in Q6_K: their common format
            assert (qkv.kind, qkv.group) == ("int8", 16)
        elif types in SERVED:
            assert isinstance(qkv, QuantizedWeight) and (qkv.kind, qkv.group) == SERVED[types], (name, types)
        else:  # F16 / BF16 linears stay float
            assert isinstance(qkv, torch.Tensor)


def test_default_mode_runs_the_same_blocks_with_int8_activations(gguf):
    name, path, ref, _ = gguf
    eng, tokens = _run(path, "int8")
    assert len(tokens) == NEW_TOKENS
    assert eng.runner.model.lm_head_q is not None and eng.runner.model.lm_head_q.tiles.activations == "int8"
    assert tokens[:2] == ref[:2], name  # random weights: the first tokens' margins are wide


def test_prepared_folder_holds_config_tokenizer_and_chat_template(gguf):
    _, path, _, _ = gguf
    folder = model_folder(path)
    assert model_folder(path) == folder and gguf_file(path) == path.resolve()
    assert (folder / "config.json").exists() and not list(folder.glob("*.safetensors"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in text


def test_a_file_of_iq_types_is_served_as_int8_groups_of_its_weights(tmp_path):
    """IQ4_NL, IQ4_XS, IQ3_S and IQ2_XXS layers (no kernel of ours) are re-quantized to int8
    groups of 32 at load: the exact mode gives the tokens and logprobs of transformers on the
    same file with each layer's linears rounded that way."""
    path = write_model(tmp_path / "tiny-iq.IQ4_XS.gguf", ["IQ4_NL", "IQ4_XS", "IQ3_S", "IQ2_XXS"])
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in reference.model.layers:
            for linear in (m for m in layer.modules() if isinstance(m, torch.nn.Linear)):
                linear.weight.copy_(dequantize(quantize(linear.weight, "int8", 32, symmetric=True)))
    eng = LLMEngine(EngineConfig(model_path=str(path), quant="auto", quant_activations="float32", max_loras=0,
                                 speculative="off", kv_cache_dtype="float32"))  # fmt: skip
    for layer in eng.runner.model.layers:
        assert (layer.qkv_t.kind, layer.qkv_t.group) == ("int8", 32)
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=1)
    eng.add_request("r", GenerationRequest(prompt_tokens=PROMPT, sampling=sampling), None)
    tokens, logprobs = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += out.token_ids
            logprobs += [lp.logprob for lp in out.logprobs or []]
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()
    assert tokens == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-3), (logprobs, expected)


def test_a_truncated_file_is_refused_in_one_line(tmp_path):
    path = write_model(tmp_path / "whole.gguf", ["Q8_0"])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 5000])
    with pytest.raises(ValueError, match="truncated"):
        model_folder(cut)


def test_a_file_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    path = write_model(tmp_path / "bare.gguf", ["Q8_0"], tokenizer=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        model_folder(path)


def test_a_file_split_into_parts_is_served_from_all_of_them(tmp_path):
    """llama.cpp's gguf-split spreads a model's tensors over several files
    (`name-00001-of-00003.gguf`, the metadata in the first): MODEL names the first, and the
    engine reads every part's tensors, giving the tokens of the same model in one file."""
    layers = ["Q8_0", "Q4_K", "Q5_0"]
    (tmp_path / "whole").mkdir(), (tmp_path / "split").mkdir()
    whole = write_model(tmp_path / "whole" / "tiny.gguf", layers, embed="Q8_0", output="Q6_K")
    first = write_model(tmp_path / "split" / "tiny.gguf", layers, embed="Q8_0", output="Q6_K", split_tensors=10)
    assert first.name == "tiny-00001-of-00003.gguf" and len(list(first.parent.glob("*.gguf"))) == 3
    assert gguf_file(first.parent) == first.resolve()  # a folder of the parts: its first
    _, want = _run(whole, "int8")
    _, got = _run(first, "int8")
    assert got == want and len(got) == NEW_TOKENS


def test_a_later_part_or_a_missing_one_is_refused_in_one_line(tmp_path):
    first = write_model(tmp_path / "big.gguf", ["Q8_0", "Q8_0"], split_tensors=8)
    second = first.with_name("big-00002-of-00003.gguf")
    with pytest.raises(ValueError, match=r"big-00002-of-00003\.gguf is part 2 of a GGUF split into 3 files: "
                                         r"name the first, the one named \*-00001-of-00003\.gguf"):  # fmt: skip
        model_folder(second)
    second.unlink()
    with pytest.raises(ValueError, match=r"big-00001-of-00003\.gguf is part 1 of a GGUF split into 3 files, "
                                         r"and big-00002-of-00003\.gguf is not beside it"):  # fmt: skip
        model_folder(first)


def test_an_architecture_transformers_cannot_read_is_refused_with_the_list(tmp_path):
    path = write_model(tmp_path / "odd.gguf", ["Q8_0"], arch="rwkv6")
    with pytest.raises(ValueError, match="not supported.*GGUF architectures read: .*llama"):
        model_folder(path)


def test_the_served_name_is_the_files_and_its_preset_the_models(tmp_path):
    from backend.settings.model_settings import PRESETS_DIR, ModelSettings
    from backend.settings.paths import model_name

    folder = model_folder(write_model(tmp_path / "SmolLM2-135M-Instruct.Q5_K_M.gguf", ["Q8_0"]))
    assert model_name(folder) == "SmolLM2-135M-Instruct.Q5_K_M"
    assert ModelSettings.load(folder).source == PRESETS_DIR / "SmolLM2-135M-Instruct.toml"
    (tmp_path / "MODEL.toml").write_text("[sampling]\ntemperature = 0.3\n")  # beside the file: its own
    assert ModelSettings.load(folder).source == tmp_path / "MODEL.toml"
