"""What layers keeping state cost on the transformers path: a decode step of random-weight
checkpoints of one shape (hidden 512, 8 layers, 8 heads over 2 KV heads of 64, vocabulary
32000), Qwen3 (every layer attends) against Qwen3.5 (gated delta net on 3 layers of 4) and
LFM2 (short convolutions on 5 of 8), all on the transformers path (MODEL_IMPL=transformers),
float32, in process; the median step of --steps steady decode steps at each stream count.
Qwen3.5's state layers run transformers' PyTorch fallbacks (no flash-linear-attention here).

    python -m bench.hybrids [--types qwen3 qwen3_5_text lfm2] [--streams 1 16] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.figures import describe_cpu

_DIMS = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)  # fmt: skip
_SHAPES = {
    "qwen3": {},
    "qwen3_5_text": dict(
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64
    ),  # fmt: skip
    "lfm2": dict(
        layer_types=["conv", "conv", "full_attention"] * 2 + ["conv", "full_attention"], block_auto_adjust_ff_dim=False
    ),  # fmt: skip
}


def step_times(model_type: str, streams: list[int], steps: int) -> dict[int, float]:
    """The median decode step (ms) of `model_type`'s checkpoint at each stream count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from backend.core.engine import LLMEngine
    from backend.settings.engine import EngineConfig
    from bench.step_profile import start_streams, timed_steps

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix=f"hybrid-{model_type}-") as folder:
        AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, **_DIMS, **_SHAPES[model_type])
        ).save_pretrained(folder)
        engine = LLMEngine(EngineConfig(model_path=str(Path(folder)), max_loras=0, quant="none", speculative="off",
                                        model_impl="transformers", enable_prefix_caching=False))  # fmt: skip
    times = {}
    for count in streams:
        start_streams(engine, count, prompt_len=64, tokens=steps + 40)
        times[count] = statistics.median(timed_steps(engine, steps)) * 1e3
        for request_id in engine.request_ids():
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(_SHAPES), choices=list(_SHAPES))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    print(f"# {describe_cpu()}")
    for model_type in args.types:
        times = step_times(model_type, args.streams, args.steps)
        print(f"{model_type:14s} " + "  ".join(f"{n} streams {ms:6.1f} ms/step" for n, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()
