"""LoRA adapters written here with PEFT (none can be downloaded), and PEFT references.

`write_adapter` saves a PEFT folder (adapter_config.json + adapter_model.safetensors)
for a base model folder, with random non-zero A and B (`init_lora_weights=False`;
PEFT's default B = 0 would be a no-op adapter): any rank, target set, rsLoRA, and
per-module rank/alpha patterns. `peft_model` loads the base model in transformers with
adapters on it, the reference our engine's tokens and logits are compared with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(
    base: Path,
    dest: Path,
    *,
    r: int = 4,
    alpha: float = 8,
    targets: tuple[str, ...] = ALL_TARGETS,
    rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    gain: float = 1.0,
    **config,
) -> Path:
    """A PEFT adapter for `base` in `dest` (kept if already written). `gain` scales
    the random B, to make the adapter's change of the logits larger or smaller."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dest = Path(dest)
    if (dest / "adapter_config.json").exists():
        return dest
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, init_lora_weights=False,
        rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {}, **config,
    )  # fmt: skip
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.normal_(0, 1.0 / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.normal_(0, gain / param.shape[1] ** 0.5)
    peft_model.save_pretrained(dest)
    return dest


def edit_config(adapter: Path, **changes) -> Path:
    """Change keys of an adapter's adapter_config.json in place (to make bad adapters)."""
    path = Path(adapter) / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return Path(adapter)


def peft_model(base: Path, adapters: dict[str, Path]):
    """transformers' model with PEFT adapters loaded under their names (eval, float32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    names = list(adapters)
    wrapped = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        wrapped.load_adapter(adapters[name], adapter_name=name)
    return wrapped.eval()


@torch.inference_mode()
def peft_greedy(model, adapter: str | None, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens under `adapter` (None: the base model), and each step's logits [n, vocab]."""
    ids, tokens, logits = list(prompt), [], []
    name = adapter or "__base__"
    for _ in range(max_tokens):
        out = model(torch.tensor([ids]), adapter_names=[name]).logits[0, -1]
        logits.append(out)
        token = int(out.argmax())
        tokens.append(token)
        ids.append(token)
    return tokens, torch.stack(logits)


def write_tiny_llama(dest: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Llama checkpoint (no tokenizer): 256 tokens, 2 layers, 4 heads, 2 KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    dims = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**dims, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    model.save_pretrained(dest)
    return dest


def engine_logits_with_adapter(engine, name: str, adapter: Path, prompt: list[int]) -> torch.Tensor:
    """The engine's model's logits [len(prompt), vocab] over `prompt` in one prefill, with
    adapter `adapter` loaded as `name` on every row (its lanes' weights, a scratch cache)."""
    from backend.lora.batch import LoraBatch
    from backend.lora.lanes import lane_weights
    from backend.runner.drafters import allocate_kv
    from backend.runner.forward_batch import Span, build_forward_batch

    runner = engine.runner
    loaded = engine.adapters.load(name, str(adapter))
    weights = lane_weights(engine.adapters.weights(loaded), runner.model_config, torch.float32, runner.device)
    kv = allocate_kv(runner.model_config, runner.model_config.num_layers, 8, 16, torch.float32, runner.device)
    batch = build_forward_batch([Span(prompt, 0, [0, 1], len(prompt))], 16, runner.device)
    batch.lora = LoraBatch(whole=weights)
    return runner.model.compute_logits(runner.model(batch, kv))
