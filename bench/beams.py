"""Beam search throughput: 8 concurrent num_beams=4 requests in our engine against
transformers' `generate` on the same inputs one by one, same process, same run (CPU).

Two models: the tiny random NLLB the tests build (no NLLB can be downloaded here; its
sources are the same sentences in four languages) translating to French, and the default
SmolLM2 continuing prompts. Every request runs to its token limit (EOS is ignored by
both), so both sides compute the same number of beam steps. Figures: generated tokens/s
of the best hypotheses (n = 1 each) and the ratio (goal >= 3x).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

NUM_BEAMS, STREAMS, ROUNDS = 4, 8, 2
SENTENCES = [
    "The house is wonderful.", "I like green apples and red cherries.", "We read a book in the garden today.",
    "Where is the train station?", "La maison est magnifique.", "Il fait beau ce matin.",
    "Das Haus ist wunderbar.", "Wir gehen morgen in die Stadt.",
]  # fmt: skip


def _ours(engine, requests) -> float:
    from tests.helpers.beams import run_outputs

    start = time.perf_counter()
    outs = run_outputs(engine, {f"beam-bench-{time.monotonic_ns()}-{i}": r for i, r in enumerate(requests)})
    seconds = time.perf_counter() - start
    return sum(len(o.hypotheses[0].token_ids) for o in outs.values()) / seconds


def _theirs(hf, inputs: list[dict], max_new: int) -> float:
    start, produced = time.perf_counter(), 0
    for kw in inputs:
        with torch.inference_mode():
            out = hf.generate(**kw, num_beams=NUM_BEAMS, max_new_tokens=max_new, min_new_tokens=max_new,
                              do_sample=False, early_stopping=True)  # fmt: skip
        produced += out.shape[1] - (kw["input_ids"].shape[1] if "forced_bos_token_id" not in kw else 1)
    return produced / (time.perf_counter() - start)


def _best(run) -> float:
    return max(run() for _ in range(ROUNDS))


def nllb(max_new: int = 32) -> tuple[float, float]:
    from transformers import AutoTokenizer, M2M100ForConditionalGeneration

    from backend.core.engine import LLMEngine
    from backend.settings.engine import EngineConfig
    from tests.helpers.beams import beam_request
    from tests.helpers.nllb_models import write_tiny_nllb

    folder = write_tiny_nllb(Path("build") / "bench_nllb")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = M2M100ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    src, tgt = tokenizer.convert_tokens_to_ids("eng_Latn"), tokenizer.convert_tokens_to_ids("fra_Latn")
    texts = [tokenizer(s, add_special_tokens=False).input_ids for s in SENTENCES[:STREAMS]]
    requests = []
    for tokens in texts:
        request = beam_request(tokens, NUM_BEAMS, 1, max_new, 1.0, "true", ignore_eos=True)
        request.src_lang_id, request.tgt_lang_id = src, tgt
        requests.append(request)
    inputs = [dict(input_ids=torch.tensor([[src, *t, 2]]), forced_bos_token_id=tgt) for t in texts]
    engine = LLMEngine(EngineConfig(model_path=str(folder)))
    return _best(lambda: _ours(engine, requests)), _best(lambda: _theirs(hf, inputs, max_new))


def smollm2(model_path: str, prompts: list[list[int]], max_new: int = 32) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    from backend.core.engine import LLMEngine
    from backend.settings.engine import EngineConfig
    from tests.helpers.beams import beam_request

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    chosen = prompts[:STREAMS]
    requests = [beam_request(p, NUM_BEAMS, 1, max_new, 1.0, "true", ignore_eos=True) for p in chosen]
    inputs = [dict(input_ids=torch.tensor([p])) for p in chosen]
    engine = LLMEngine(EngineConfig(model_path=model_path, enable_prefix_caching=False))
    return _best(lambda: _ours(engine, requests)), _best(lambda: _theirs(hf, inputs, max_new))


def main(model_path: str, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
    print(f"beam search: {STREAMS} concurrent num_beams={NUM_BEAMS} requests vs transformers one by one ...",
          flush=True)  # fmt: skip
    figures = {"tiny NLLB (translation)": nllb(), "SmolLM2 (decoder-only)": smollm2(model_path, prompts)}
    print(f"{'':>26} {'ours t/s':>9} {'HF t/s':>8} {'ratio':>7}")
    for name, (ours, theirs) in figures.items():
        print(f"{name:>26} {ours:>9.1f} {theirs:>8.1f} {ours / theirs:>6.2f}x  (goal >= 3x)")
    return figures


if __name__ == "__main__":
    from transformers import AutoTokenizer

    from backend.runner.convert import ensure_default_model
    from bench.throughput import prompts_for

    path = str(ensure_default_model())
    main(path, prompts_for(AutoTokenizer.from_pretrained(path), STREAMS))
