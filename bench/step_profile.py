"""One decode step of the in-process engine, split into matmul and everything else.

For each stream count, the default model decodes greedy streams (plain decoding, no
prefix cache) until every prompt is computed; then `--steps` steady decode steps are
timed without the profiler (the per-step total: the median wall time), and as many
again under the torch profiler, whose self time of the matmul ops (aten::mm / addmm:
the linear layers and lm_head; with QUANT, a fused decode step's layers, `decode_layer`, whole)
is the matmul share. Non-matmul = total - matmul:
scheduling, batch building, attention, rope, norms, sampling, outputs. Under the
profiler, that splits into the other ops' self time and the rest (Python between ops).
Wall figures move with the machine's load: compare runs made back to back.

    python -m bench.step_profile [--streams 1 32] [--steps 30] [--top 12] [--quant int4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from backend.contract import GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig

DEFAULT_MODEL = Path.home() / ".cache/tritonllm/models/SmolLM2-135M-Instruct"
# quant_linear: QUANT's matmuls; decode_layer: a fused decode step's whole layer (its matmuls and
# the attention, RoPE and norms between them: one call of our kernel), both labelled here
MATMUL_OPS = ("aten::mm", "aten::addmm", "quant_linear", "decode_layer")


def start_streams(engine: LLMEngine, streams: int, prompt_len: int, tokens: int) -> None:
    """`streams` greedy requests, stepped until each has its first token (all decoding)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i in range(streams):
        prompt = [(17 * i + 31 * j) % 1000 + 100 for j in range(prompt_len)]
        engine.add_request(f"profile-{streams}-{i}", GenerationRequest(prompt, params, disable_mtp=True))
    while any(seq.num_output_tokens == 0 for seq in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(3):  # warm up the decode path
        engine.step()


def timed_steps(engine: LLMEngine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def profile_streams(engine: LLMEngine, streams: int, steps: int, top: int) -> None:
    start_streams(engine, streams, prompt_len=64, tokens=3 * steps + 8)
    total = statistics.median(timed_steps(engine, steps)) * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = sum(timed_steps(engine, steps)) * 1e3 / steps
    averages = prof.key_averages()
    matmul = sum(e.self_cpu_time_total for e in averages if e.key in MATMUL_OPS) / 1e3 / steps
    ops = sum(e.self_cpu_time_total for e in averages if e.key not in MATMUL_OPS) / 1e3 / steps
    print(
        f"streams={streams:3d}  total {total:7.2f} ms/step  matmul {matmul:7.2f}  "
        f"non-matmul {total - matmul:6.2f}  (under the profiler: {profiled:.2f} ms/step, of which "
        f"other ops {ops:.2f}, Python and gaps {profiled - matmul - ops:.2f})"
    )
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    for e in rows:
        print(f"    {e.key:42s} {e.self_cpu_time_total / 1e3 / steps:7.3f} ms  x{e.count / steps:6.1f}")
    while engine.has_unfinished_requests():  # finish them, so the next count starts clean
        for rid in engine.request_ids():
            engine.abort_request(rid)
        engine.step()


def _label_quant_matmuls() -> None:
    """Make QUANT's matmuls (our kernels, no aten op) show in the profile as `quant_linear`."""
    from torch.profiler import record_function

    from backend.runner.models import llama

    plain = llama.quant_linear

    def labelled(x, weight, bias=None, gemv_rows=None):
        with record_function("quant_linear"):
            return plain(x, weight, bias, gemv_rows)

    llama.quant_linear = labelled
    fused = llama.DecoderLayer.decode

    def labelled_layer(self, *args):
        with record_function("decode_layer"):
            return fused(self, *args)

    llama.DecoderLayer.decode = labelled_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=12, help="ops listed by self time (0: none)")
    parser.add_argument("--quant", default="none", help="QUANT: none | int8 | int4")
    args = parser.parse_args()
    _label_quant_matmuls()
    engine = LLMEngine(EngineConfig(model_path=args.model, enable_prefix_caching=False, quant=args.quant))
    for streams in args.streams:
        profile_streams(engine, streams, args.steps, args.top)


if __name__ == "__main__":
    main()
