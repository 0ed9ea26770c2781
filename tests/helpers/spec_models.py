"""Checkpoints for speculative decoding's drafters, written here since none can be downloaded.

- `build_truncated_model`: the default model's first N layers (with its final norm,
  head and tokenizer): a real smaller model with the same tokenizer, a draft model.
- `build_mimo_model`: a tiny random MiMo checkpoint (`MiMoForCausalLM`: a Qwen2 decoder
  plus `model.mtp_layers.0.*`, the layout of XiaomiMiMo/MiMo-7B). With `mtp="copy"`
  its MTP layer is made to compute what the one-layer trunk computes for the next
  token: input_proj passes the token embedding through and ignores the hidden state,
  the block is the trunk's layer, the final norm the trunk's norm, and embedding rows
  have unit RMS so token_layernorm leaves them as the trunk sees them. At position p,
  fed token p + 1, it then predicts token p + 2 as the trunk would (RoPE is relative;
  only the first token is missing from its context), so acceptance is high, and falls
  to nothing if the wiring is off by a position. `mtp="random"`: random MTP weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json", "vocab.json", "merges.txt")  # fmt: skip


def build_truncated_model(source: Path, dest: Path, num_layers: int) -> Path:
    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((Path(source) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for file in sorted(Path(source).glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers:
                kept[name] = tensor
    save_file(kept, tmp / "model.safetensors")
    for name in _TOKENIZER_FILES:
        if (Path(source) / name).exists():
            shutil.copy(Path(source) / name, tmp / name)
    tmp.rename(dest)
    return dest


def build_mimo_model(dest: Path, mtp: str = "copy", seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """`tokenizer_from`: a model folder whose tokenizer (and chat template) the checkpoint
    takes, with a vocabulary to match, so that a server can run it; else 512 tokens, no tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    vocab_size = json.loads((Path(tokenizer_from) / "config.json").read_text())["vocab_size"] if tokenizer_from else 512
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, tensor in state.items():  # random norms too, so a mixed-up norm shows
        if name.endswith("norm.weight"):
            tensor.uniform_(0.5, 1.5)
    embed = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
    state["lm_head.weight"] *= 8.0  # confident predictions: a clear argmax
    state |= _mtp_weights(state, config.hidden_size, mtp)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, dest / "model.safetensors")
    raw = config.to_dict()
    raw |= {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "num_nextn_predict_layers": 1}
    (dest / "config.json").write_text(json.dumps(raw, indent=2))
    for name in _TOKENIZER_FILES if tokenizer_from else ():
        if name != "generation_config.json" and (Path(tokenizer_from) / name).exists():
            shutil.copy(Path(tokenizer_from) / name, dest / name)
    return dest


def _mtp_weights(state: dict[str, torch.Tensor], hidden: int, mtp: str) -> dict[str, torch.Tensor]:
    prefix, layer = "model.mtp_layers.0.", "model.layers.0."
    block = {name[len(layer) :]: tensor.clone() for name, tensor in state.items() if name.startswith(layer)}
    if mtp == "copy":
        own = {
            "token_layernorm.weight": torch.ones(hidden),
            "hidden_layernorm.weight": torch.ones(hidden),
            # cat[hidden, embedding] -> the embedding
            "input_proj.weight": torch.cat((torch.zeros(hidden, hidden), torch.eye(hidden)), dim=1),
            "final_layernorm.weight": state["model.norm.weight"].clone(),
        }
    else:
        own = {
            "token_layernorm.weight": torch.rand(hidden) + 0.5,
            "hidden_layernorm.weight": torch.rand(hidden) + 0.5,
            "input_proj.weight": torch.randn(hidden, 2 * hidden) * 0.1,
            "final_layernorm.weight": torch.rand(hidden) + 0.5,
        }
        block = {name: torch.randn_like(tensor) * 0.1 for name, tensor in block.items()}
    return {prefix + name: tensor for name, tensor in (own | block).items()}
