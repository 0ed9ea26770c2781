"""Our own forward against the transformers path on the families it took last (Gemma 2,
Gemma 3, Phi-3 with partial rotary and longrope, Qwen3-MoE): a random-weight checkpoint of
each, of a small deployed model's shape (hidden 576, 8 layers, head 64), made once under
build/bench_families/; then bench.generic_path's comparison on each, in one process.

    python -m bench.families [--rounds 3] [--streams 8] [--tokens 32] [--only gemma2,qwen3_moe]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from bench.figures import describe_cpu
from bench.generic_path import compare

OUT = Path("build/bench_families")
VOCAB = 32000
SHAPE = dict(vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
SLIDING = ["sliding_attention"] * 3 + ["full_attention"]
FAMILIES = {
    "gemma2": dict(sliding_window=512, layer_types=SLIDING * 2, query_pre_attn_scalar=64),
    "gemma3_text": dict(sliding_window=512, layer_types=SLIDING * 2, query_pre_attn_scalar=64),
    "phi3": dict(partial_rotary_factor=0.75, original_max_position_embeddings=1024,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 24, "long_factor": [4.0] * 24}),
    "qwen3": dict(),  # the fused decode layer's q / k norms (docs/speed.md)
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True),
}  # fmt: skip


def checkpoint(model_type: str) -> Path:
    """The family's random checkpoint (made once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = OUT / model_type
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **{**SHAPE, **FAMILIES[model_type]})
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--only", default=",".join(FAMILIES))
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(100, 200))] for _ in range(args.streams)]
    print(f"CPU: {describe_cpu()}", flush=True)
    for model_type in args.only.split(","):
        print(f"\n{model_type}: {checkpoint(model_type)}", flush=True)
        compare(str(checkpoint(model_type)), prompts, args.rounds, args.tokens)


if __name__ == "__main__":
    main()
