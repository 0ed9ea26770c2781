"""A sweep over transformers' decoder-only model types: for each, a tiny random-weight
checkpoint (tests/helpers/tiny_checkpoints.py: 4 layers, hidden 128, q / k sharpened) served
by the engine, its greedy tokens against transformers' generate() on the same weights. Each
type runs in a process of its own (a crash or a hang costs that type alone) and gets one of:

- match: the same 16 tokens (or a divergence where the reference's top two logits tie);
- MISMATCH: other tokens (a bug of ours, or of the checkpoint's defaults);
- refused: the engine's one-line reason (state outside the KV cache, attention of its own ...);
- no checkpoint: transformers could not build or run the tiny config (its defaults do not fit
  4 layers of 128; not a verdict on the engine);
- CRASH / DIED: anything else (a bug of ours).

With --gguf, each checkpoint (the default model's tokenizer and vocabulary, 49152) is first
written as an F32 GGUF file by llama.cpp's own converter (`convert_hf_to_gguf.py` of a source
tree, with its `gguf-py`; it needs `sentencepiece`), and the engine serves that file, as a user
with a downloaded GGUF runs it; the reference is still transformers on the folder. A type the
converter does not take is "no file" (not a verdict on the engine).

    python -m bench.architectures [--types llama gemma4_text ...] [--timeout 300]
    python -m bench.architectures --gguf LLAMA_CPP/convert_hf_to_gguf.py [--types ...]

Without --types: every model type transformers maps to a causal LM, but the encoders.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.figures import describe_cpu

_VERDICTS = ("match", "MISMATCH", "refused", "no checkpoint", "no file", "CRASH", "DIED")


def check(model_type: str, converter: str | None = None) -> dict[str, object]:
    """One model type's verdict (in this process); its checkpoint deleted after (a type's
    defaults can make one of gigabytes: vision towers)."""
    from backend.settings.paths import cache_dir

    try:
        with tempfile.TemporaryDirectory(prefix=f"sweep-{model_type}-") as folder:
            return _check(model_type, Path(folder), converter)
    finally:  # a GGUF file's prepared folder (config, tokenizer)
        for prepared in (cache_dir() / "models").glob(f"sweep-{model_type}-F32-gguf-*"):
            shutil.rmtree(prepared, ignore_errors=True)


def _check(model_type: str, folder: Path, converter: str | None) -> dict[str, object]:
    from tests.helpers.engine_runs import run_to_completion
    from tests.helpers.tiny_checkpoints import PROMPT, engine, first_divergence, greedy, reference

    model = _checkpoint(model_type, folder / "hf", converter)
    if isinstance(model, str):
        return {"verdict": "no checkpoint", "why": model}
    served, failure = _converted(folder / "hf", converter, model_type) if converter else (folder / "hf", "")
    if served is None:
        return {"verdict": "no file", "why": failure}
    try:
        eng = engine(served)
        tokens, _ = run_to_completion(eng, {"t": greedy()})
    except ValueError as e:
        reason = str(e).split(". Our own forward")[0].split(" is not served: ")[-1]
        return {"verdict": "refused", "why": " ".join(reason.split())[:220]}
    except Exception as e:
        return {"verdict": "CRASH", "why": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    rows = eng.runner.model.config.vocab_size
    if rows < model.config.vocab_size:  # a converter cut the rows past its tokenizer's: so does the reference
        model.resize_token_embeddings(rows)
    ref, logits = reference(model, PROMPT)
    path = "native" if eng.runner.native else "transformers"
    divergence = first_divergence(tokens["t"], ref, logits)
    if divergence is None or divergence[1]:
        return {"verdict": "match", "path": path}
    return {"verdict": "MISMATCH", "path": path, "why": f"step {divergence[0]}"}


def _checkpoint(model_type: str, folder: Path, converter: str | None):
    """A tiny random checkpoint of `model_type` saved in `folder` (grouped-query heads of 32
    where the config takes them), or why transformers could not build or run one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.tiny_checkpoints import DIMS, GQA, PROMPT, reference, sharpen

    vocab = {"vocab_size": len(_tokenizer())} if converter else {}
    dims = {**DIMS, **vocab, **_CONVERTER_ASSUMES.get(model_type, {})} if converter else DIMS
    dims = {**dims, **_HYBRID_LAYERS.get(model_type, {}), **_MULTIPLIERS.get(model_type, {})}
    failure = ""
    for extra in (GQA, {}) if model_type not in _NO_GQA else ({},):
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**dims, **extra})).eval()
            sharpen(model, model_type)
            model.save_pretrained(folder)
            reference(model, PROMPT[:4])  # it runs
            return model
        except Exception as e:
            failure = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return failure


# what a converter (or llama.cpp) takes for granted, as the real checkpoints have it (Phi-2: an
# MLP 4 x hidden wide, no grouped KV heads; its rotary share, 0.4, not transformers' default;
# Qwen3-MoE: top-k weights renormalized; the MLA models: as many KV heads as heads)
_CONVERTER_ASSUMES = {"phi": {"intermediate_size": 4 * 128, "partial_rotary_factor": 0.4},
                      "qwen3_moe": {"norm_topk_prob": True}}  # fmt: skip
# Mamba 1 / Falcon-Mamba: a mixer 2 x hidden wide (the converter asserts it)
_CONVERTER_ASSUMES |= dict.fromkeys(("mamba", "falcon_mamba"), {"intermediate_size": 2 * 128})
# Gemma 2 / 3: scores scaled by 1 / sqrt(head size), as llama.cpp does and the checkpoints but 27B say
_CONVERTER_ASSUMES |= dict.fromkeys(("gemma2", "gemma3", "gemma3_text"), {"query_pre_attn_scalar": 32})
_MLA = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa")
_CONVERTER_ASSUMES |= dict.fromkeys(_MLA, {"num_key_value_heads": 4})
_NO_GQA = ("phi", *_MLA)
# hybrids whose defaults on 4 layers would have no attention layer (or none of state): two of each
_MIX = ["linear_attention", "full_attention"] * 2
_HYBRID_LAYERS = dict.fromkeys(("granitemoehybrid", "kimi_linear", "zamba2"), {"layer_types": _MIX})
_HYBRID_LAYERS |= dict.fromkeys(("lfm2", "lfm2_moe"), {"layer_types": ["conv", "full_attention"] * 2})
_HYBRID_LAYERS |= {"jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
                   "bamba": {"attn_layer_indices": [1, 3], "mamba_n_heads": 8, "mamba_d_head": 32},
                   "mamba2": {"num_heads": 8, "head_dim": 32, "n_groups": 1}}  # fmt: skip
# Gemma 3n: its last two layers reuse the keys and values of the two before (one of each
# kind); per-layer inputs of a small vocabulary (the default's 262,144 x 1,024 would be most of it)
_HYBRID_LAYERS |= {"gemma3n_text": {"layer_types": ["sliding_attention", "full_attention"] * 2,
                                    "num_kv_shared_layers": 2, "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
                                    "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 16,
                                    "laurel_rank": 8, "sliding_window": 16}}  # fmt: skip
# multipliers other than 1, which llama.cpp's converter folds into the weights (Falcon-H1)
_MULTIPLIERS = {"falcon_h1": {"lm_head_multiplier": 0.8, "embedding_multiplier": 2.0, "key_multiplier": 0.5,
                              "attention_in_multiplier": 1.2, "attention_out_multiplier": 0.9, "ssm_in_multiplier": 1.3,
                              "ssm_out_multiplier": 0.6, "mlp_multipliers": [1.5, 0.7],
                              "ssm_multipliers": [0.9, 1.1, 1.2, 0.8, 1.4], "mamba_rms_norm": True}}  # fmt: skip
# converter flags a type needs: Qwen3.5's and Qwen3-Next's converter wants MTP layers (the real
# checkpoints have one) unless told to leave them out
_CONVERTER_FLAGS = dict.fromkeys(("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"), ("--no-mtp",))
# special tokens some converters look up by name (GLM's), added to the default model's
# tokenizer, which llama.cpp's converter knows
_CONVERTERS_LOOK_UP = ["<|endoftext|>", "<|startoftext|>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>",
                       "<|observation|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "sop", "eop"]  # fmt: skip
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _converted(folder: Path, converter: str, model_type: str) -> tuple[Path | None, str]:
    """The checkpoint in `folder` as an F32 GGUF file by llama.cpp's converter, or (None, why
    not): with the default model's BPE tokenizer, else (a converter that wants a SentencePiece
    model, or that transformers gives a tokenizer class of its type, whose hash the converter
    does not know) a small SentencePiece model trained here on the docs."""
    _tokenizer().save_pretrained(folder)
    out = folder.parent / f"sweep-{model_type}-F32.gguf"
    cmd = [sys.executable, converter, str(folder), "--outtype", "f32", "--outfile", str(out),
           *_CONVERTER_FLAGS.get(model_type, ())]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 and any(want in done.stderr for want in ("tokenizer.model", "pre-tokenizer", "Llama BPE")):
        _sentencepiece(folder)
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
        return None, " ".join((errors or done.stderr.splitlines() or ["failed"])[-1].split())[:200]
    return out, ""


def _tokenizer():
    from transformers import AutoTokenizer

    from backend.settings.paths import cache_dir

    tokenizer = AutoTokenizer.from_pretrained(cache_dir() / "models" / "SmolLM2-135M-Instruct")  # `make setup`
    tokenizer.add_special_tokens({"additional_special_tokens": _CONVERTERS_LOOK_UP})
    return tokenizer


def _sentencepiece(folder: Path) -> None:
    """A SentencePiece BPE model of 1000 pieces (byte fallback) in `folder`, in place of the BPE
    tokenizer's files."""
    import sentencepiece

    for name in _TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text().splitlines()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in text if line.strip()]), model_prefix=str(folder / "tokenizer"),
        vocab_size=1000, model_type="bpe", byte_fallback=True, minloglevel=2,
    )  # fmt: skip
    (folder / "tokenizer.vocab").unlink()


def decoder_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED

    return sorted(t for t in CAUSAL if t not in MASKED)


def run(model_type: str, timeout: float, converter: str | None) -> dict[str, object]:
    """`check(model_type)` in a process of its own."""
    cmd = [sys.executable, "-m", "bench.architectures", "--one", model_type]
    cmd += ["--gguf", converter] if converter else []
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"verdict": "DIED", "why": f"no answer in {timeout:g} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"verdict": "DIED", "why": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every decoder-only one)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--gguf", metavar="CONVERTER", help="llama.cpp's convert_hf_to_gguf.py: serve GGUF files")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(check(args.one, args.gguf)))
        return
    print(f"# {describe_cpu()}")
    counts = dict.fromkeys(_VERDICTS, 0)
    for model_type in args.types or decoder_types():
        result = run(model_type, args.timeout, args.gguf)
        counts[str(result["verdict"])] += 1
        where = f" ({result['path']} path)" if "path" in result else ""
        why = f": {result['why']}" if "why" in result else ""
        print(f"{model_type:28} {result['verdict']}{where}{why}", flush=True)
    print("# " + ", ".join(f"{verdict}: {n}" for verdict, n in counts.items() if n))


if __name__ == "__main__":
    main()
