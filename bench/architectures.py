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

    python -m bench.architectures [--types llama gemma4_text ...] [--timeout 300]

Without --types: every model type transformers maps to a causal LM, but the encoders.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.figures import describe_cpu

_VERDICTS = ("match", "MISMATCH", "refused", "no checkpoint", "CRASH", "DIED")


def check(model_type: str) -> dict[str, object]:
    """One model type's verdict (in this process); its checkpoint deleted after (a type's
    defaults can make one of gigabytes: vision towers)."""
    with tempfile.TemporaryDirectory(prefix=f"sweep-{model_type}-") as folder:
        return _check(model_type, Path(folder))


def _check(model_type: str, folder: Path) -> dict[str, object]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.engine_runs import run_to_completion
    from tests.helpers.tiny_checkpoints import DIMS, GQA, PROMPT, engine, first_divergence, greedy, reference, sharpen

    failure = ""
    for extra in (GQA, {}):  # grouped-query heads of 32 where the config takes them
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**DIMS, **extra})).eval()
            sharpen(model, model_type)
            model.save_pretrained(folder)
            ref, logits = reference(model, PROMPT)
            break
        except Exception as e:
            failure = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    else:
        return {"verdict": "no checkpoint", "why": failure}
    try:
        eng = engine(folder)
        tokens, _ = run_to_completion(eng, {"t": greedy()})
    except ValueError as e:
        reason = str(e).split(". Our own forward")[0].split(" is not served: ")[-1]
        return {"verdict": "refused", "why": " ".join(reason.split())[:220]}
    except Exception as e:
        return {"verdict": "CRASH", "why": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    path = "native" if eng.runner.native else "transformers"
    divergence = first_divergence(tokens["t"], ref, logits)
    if divergence is None or divergence[1]:
        return {"verdict": "match", "path": path}
    return {"verdict": "MISMATCH", "path": path, "why": f"step {divergence[0]}"}


def decoder_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED

    return sorted(t for t in CAUSAL if t not in MASKED)


def run(model_type: str, timeout: float) -> dict[str, object]:
    """`check(model_type)` in a process of its own."""
    cmd = [sys.executable, "-m", "bench.architectures", "--one", model_type]
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
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(check(args.one)))
        return
    print(f"# {describe_cpu()}")
    counts = dict.fromkeys(_VERDICTS, 0)
    for model_type in args.types or decoder_types():
        result = run(model_type, args.timeout)
        counts[str(result["verdict"])] += 1
        where = f" ({result['path']} path)" if "path" in result else ""
        why = f": {result['why']}" if "why" in result else ""
        print(f"{model_type:28} {result['verdict']}{where}{why}", flush=True)
    print("# " + ", ".join(f"{verdict}: {n}" for verdict, n in counts.items() if n))


if __name__ == "__main__":
    main()
