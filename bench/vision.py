"""Prefill with images: 8 chat-sized prompts, each holding one picture, through our engine
(batched, chunked prefill, the vision encoder inside the step) against transformers'
`Qwen2VLForConditionalGeneration` one by one, same process, same run (CPU).

The model is the tiny random Qwen2-VL the tests build (no Qwen2-VL can be downloaded here),
so the figures weigh the serving machinery (batching, the encoder's batching, the splice,
M-RoPE) more than the matmuls a real checkpoint would spend its time in. Each request
computes its prompt and one token; the prefix cache is off and every round sends new
pictures, so neither side reuses anything. A last line sends the same pictures again with
the prefix cache still off: only our encoder cache is left to help.
Figures: prompt tokens/s, and the ratio.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

STREAMS, ROUNDS, SIDE = 8, 2, 336  # 336x336: 144 image tokens each


def _pictures(seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8), "RGB") for _ in range(STREAMS)]


def _inputs(folder: Path, seed: int):
    """(our requests, transformers' kwargs), one per picture, the same prompt tokens."""
    from transformers import Qwen2VLImageProcessorPil

    from backend.contract import GenerationRequest, SamplingParams
    from backend.contract.vision import VisionItem
    from tests.helpers.vlm_models import vision_token_ids

    ids, processor = vision_token_ids(folder), Qwen2VLImageProcessorPil.from_pretrained(folder)
    ours, theirs = [], []
    for i, picture in enumerate(_pictures(seed)):
        out = processor(images=[picture], return_tensors="np")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        item = VisionItem("image", grid, out["pixel_values"].astype(np.float32))
        text = [3 + (7 * i + k) % 200 for k in range(24)]
        prompt = [*text[:12], ids["vision_start_token_id"], *[ids["image_token_id"]] * item.num_tokens(2),
                  ids["vision_end_token_id"], *text[12:]]  # fmt: skip
        ours.append(GenerationRequest(prompt, SamplingParams(max_tokens=1, temperature=0.0), vision=(item,)))
        types = torch.tensor([[1 if t == ids["image_token_id"] else 0 for t in prompt]])
        pixels, grids = torch.from_numpy(item.pixels), torch.tensor([grid])
        theirs.append(dict(input_ids=torch.tensor([prompt]), mm_token_type_ids=types, pixel_values=pixels,
                           image_grid_thw=grids))  # fmt: skip
    return ours, theirs


def _ours(engine, requests) -> float:
    from tests.helpers.engine_runs import run_to_completion

    start = time.perf_counter()
    run_to_completion(engine, {f"vision-bench-{time.monotonic_ns()}-{i}": r for i, r in enumerate(requests)})
    return sum(len(r.prompt_tokens) for r in requests) / (time.perf_counter() - start)


def _theirs(hf, inputs) -> float:
    start = time.perf_counter()
    for kw in inputs:
        with torch.inference_mode():
            hf.generate(**kw, max_new_tokens=1, do_sample=False)
    return sum(kw["input_ids"].shape[1] for kw in inputs) / (time.perf_counter() - start)


def main() -> dict[str, tuple[float, float]]:
    from transformers import Qwen2VLForConditionalGeneration

    from backend.core.engine import LLMEngine
    from backend.runner.convert import ensure_default_model
    from backend.settings.engine import EngineConfig
    from tests.helpers.vlm_models import write_tiny_qwen2_vl

    print(f"vision prefill: {STREAMS} prompts with a {SIDE}x{SIDE} picture each vs transformers one by one ...",
          flush=True)  # fmt: skip
    folder = write_tiny_qwen2_vl(Path("build") / "bench_qwen2_vl", seed=1, tokenizer_from=ensure_default_model())
    hf = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model_path=str(folder), enable_prefix_caching=False, speculative="off"))
    rounds = [_inputs(folder, seed) for seed in range(ROUNDS)]
    new = (max(_ours(engine, ours) for ours, _ in rounds), max(_theirs(hf, theirs) for _, theirs in rounds))
    again = (_ours(engine, rounds[-1][0]), _theirs(hf, rounds[-1][1]))
    figures = {"new pictures": new, "the same pictures again": again}
    print(f"{'':>24} {'ours t/s':>9} {'HF t/s':>8} {'ratio':>7}")
    for name, (ours, theirs) in figures.items():
        print(f"{name:>24} {ours:>9.0f} {theirs:>8.0f} {ours / theirs:>6.2f}x")
    return figures


if __name__ == "__main__":
    main()
