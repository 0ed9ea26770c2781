"""Before / after: this checkout against an earlier commit, alternated, in one run.

    python -m bench.ab --before REV [--rounds 3]

REV is checked out in a git worktree under build/ab/ (its kernels built there once); each
round runs each tree's engine in its own process, in alternating order, with the server's
default settings (EngineConfig.from_env with a clean environment: int4 weights, int8
activations, float16 KV; prefix caching off) on the default model, and measures:

- one stream's decode tokens/s (the best of 3 runs) and 32 streams' aggregate tokens/s (128
  greedy tokens each, bench.throughput's prompts and arithmetic);
- TTFT 2k: seconds to the first token of a 2048-token prompt, best of 3 distinct prompts;
- bench.speculative's one-stream workloads (a code edit with its prediction, n-gram quoting,
  open-ended), speculating against `disable_mtp` in the same process: their ratios.

It prints each figure's rounds, the medians, and after / before. The measuring code is sent
to both trees as a script, so it uses only what both have (bench.throughput, bench.speculative,
EngineConfig.from_env).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MEASURE = r"""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
from transformers import AutoTokenizer
from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.runner.convert import ensure_default_model
from backend.settings.engine import EngineConfig
from bench import speculative
from bench.throughput import _decode, long_prompts, prompts_for

path = str(ensure_default_model())
tokenizer = AutoTokenizer.from_pretrained(path)
os.environ["ENABLE_PREFIX_CACHING"] = "0"
engine = LLMEngine(EngineConfig.from_env(path))
prompts = prompts_for(tokenizer, 32)
out = {}
for n in (1, 32):  # one stream: the best of 3 runs (a run is ~1 s, and the machine is noisy)
    rates = [_decode(engine, prompts, n, 128) for _ in range(3 if n == 1 else 1)]
    out[f"{n} stream{'s' if n > 1 else ''} t/s"] = max(produced / seconds for produced, seconds in rates)
ttft = []
for prompt in long_prompts(tokenizer):
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    ttft.append(time.perf_counter() - start)
out["TTFT 2k s"] = min(ttft)
def sort_list(tokenizer):  # bench.speculative's n-gram workload today, the same in both trees
    items = speculative.ITEMS[3:] + speculative.ITEMS[:3]
    ask = "Sort this list alphabetically and print it again, one per line:\n" + "\n".join(f"- {x}" for x in items)
    return speculative._chat(tokenizer, ask), (), 200
for workload in speculative.WORKLOADS:
    request = sort_list(tokenizer) if workload == "ngram" else speculative.requests_for(tokenizer, workload, 0)
    requests = [request]
    speculative.run(engine, requests, disable_mtp=False)  # the cost model's first evidence
    plain = speculative.run(engine, requests, disable_mtp=True).tokens_per_s
    spec = speculative.run(engine, requests, disable_mtp=False).tokens_per_s
    out[f"speculative {workload}, ratio"] = spec / plain
print("RESULT" + json.dumps(out))
"""


def worktree(rev: str) -> Path:
    """REV checked out under build/ab/ (once), its kernels built."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = Path("build/ab") / sha
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], check=True)
    subprocess.run([sys.executable, "-m", "backend.kernels"], cwd=tree, check=True)
    return tree.resolve()


def measure(tree: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k.startswith(("PATH", "HOME", "LANG", "TMPDIR", "HF_"))}
    done = subprocess.run([sys.executable, "-c", MEASURE], cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if not lines:
        raise SystemExit(f"{tree}: no result\n{done.stderr[-3000:]}")
    return json.loads(lines[0].removeprefix("RESULT"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from bench.figures import describe_cpu

    print(describe_cpu())
    trees = {"before": worktree(args.before), "after": Path.cwd().resolve()}
    rounds: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for i in range(args.rounds):
        for name in list(trees) if i % 2 == 0 else list(trees)[::-1]:
            for key, value in measure(trees[name]).items():
                rounds[name].setdefault(key, []).append(value)
            print(
                f"round {i + 1}, {name}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in rounds[name].items()), flush=True
            )
    print(f"\n{'':34}{'before':>10}{'after':>10}{'after/before':>14}   rounds (before | after)")
    for key in rounds["after"]:
        before, after = (statistics.median(rounds[name][key]) for name in ("before", "after"))
        cells = (
            " ".join(f"{v:.3g}" for v in rounds["before"][key])
            + " | "
            + " ".join(f"{v:.3g}" for v in rounds["after"][key])
        )
        print(f"{key:34}{before:>10.3g}{after:>10.3g}{after / before:>13.3f}x   {cells}")


if __name__ == "__main__":
    main()
