"""The figures of one `python -m bench` run (bench.throughput measures them) and the report it prints."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from backend.kernels import cpu_flags
from bench import llamacpp

# The instructions our kernels and llama.cpp's choose between, named in the report: the same
# code's ratios moved by more than the noise from one host to another (docs/speed.md)
CPU_FLAGS = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")


@dataclass(slots=True)
class FormatFigures:
    weight_bytes: int = 0
    engine: dict[int, float] = field(default_factory=dict)  # streams -> tokens/s, in-process
    http: llamacpp.Figures | None = None


def describe_cpu() -> str:
    """This machine's CPU as /proc/cpuinfo names it: model, family / model numbers, cores,
    and which of CPU_FLAGS it has ("unknown" where there is no /proc/cpuinfo)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return "unknown"
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    has = ", ".join(f for f in CPU_FLAGS if f in cpu_flags()) or "none of " + ", ".join(CPU_FLAGS)
    return (
        f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}), "
        f"{len(os.sched_getaffinity(0))} cores to this process; {has}"
    )


@dataclass(slots=True)
class Figures:
    cpu: str = ""  # describe_cpu()
    bandwidth_gbs: float = 0.0
    gemm_gflops: float = 0.0
    linear_params: int = 0  # the decoder's linear weights: 2 flops each per prefilled token
    hf_single: float = 0.0
    formats: dict[str, FormatFigures] = field(default_factory=dict)  # QUANT -> figures
    llama: llamacpp.Figures | None = None  # llama-server on the Q4_1 GGUF
    llama_bytes: int = 0  # the GGUF's weight bytes read per token

    def bound(self, weight_bytes: int) -> float:
        return self.bandwidth_gbs * 1e9 / weight_bytes


def split_format(fmt: str) -> tuple[str, str, str]:
    """A --formats entry, QUANT[+QUANT_ACTIVATIONS][/KV_CACHE_DTYPE] -> (QUANT, KV_CACHE_DTYPE,
    QUANT_ACTIVATIONS): `int4` -> (int4, auto, auto), `int4+float32`, `int4/float32`."""
    head, _, kv_cache_dtype = fmt.partition("/")
    quant, _, activations = head.partition("+")
    if activations not in ("", "float32", "int8"):
        raise ValueError(f"{fmt!r}: QUANT[+float32|+int8][/KV_CACHE_DTYPE]")
    return quant, kv_cache_dtype or "auto", activations or "auto"


def _row(name: str, weight_bytes: int, bound: float, engine: list[float], http: list[float], ttft: float) -> str:
    def cells(rates):
        return "".join(f"{r:>9.1f}" if r else f"{'-':>9}" for r in rates)

    mb = f"{weight_bytes / 1e6:>9.0f}{bound:>8.1f}" if weight_bytes else f"{'':>17}"
    return f"{name:26}{mb} |{cells(engine)} |{cells(http)} | {f'{ttft:.2f}' if ttft else '-':>8}"


def _prefill_lines(fig: Figures) -> list[str]:
    """A 2k prompt's prefill rate against the GEMM bound (linear layers only; attention excluded)."""
    bound = fig.gemm_gflops * 1e9 / (2 * fig.linear_params)
    lines = [f"prefill: float32 GEMM measured at {fig.gemm_gflops:.0f} GFLOP/s = {bound:.0f} tokens/s for the linears"]
    for fmt, ff in fig.formats.items():
        rate = llamacpp.PROMPT_TOKENS / ff.http.ttft_2k
        lines.append(f"  {format_name(fmt)}: 2k prompt at {rate:.0f} tokens/s, {rate / bound:.0%} of that bound")
    if fig.llama is not None:
        lines.append(f"  llama.cpp: {llamacpp.PROMPT_TOKENS / fig.llama.ttft_2k:.0f} tokens/s")
    return lines


def report(fig: Figures, concurrency: list[int]) -> str:
    width = 9 * len(concurrency)
    streams = "".join(f"{f'{n} str':>9}" for n in concurrency)
    lines = [
        f"CPU: {fig.cpu}",
        f"memory read bandwidth: {fig.bandwidth_gbs:.1f} GB/s; tokens/s (bound: weights read per token over it)",
        "",
        f"{'':26}{'MB/token':>9}{'bound':>8} |{'in-process':^{width}} |{'Triton + HTTP':^{width}} | {'TTFT 2k':>8}",
        f"{'':26}{'':>9}{'':>8} |{streams} |{streams} | {'seconds':>8}",
        _row("transformers float32", 0, 0, [fig.hf_single] + [0] * (len(concurrency) - 1), [0] * len(concurrency), 0),
    ]
    for fmt, ff in fig.formats.items():
        engine = [ff.engine.get(n, 0) for n in concurrency]
        http = [_streams_rate(ff.http, n) for n in concurrency]
        lines.append(_row(format_name(fmt), ff.weight_bytes, fig.bound(ff.weight_bytes), engine, http, ff.http.ttft_2k))
    if fig.llama is not None:
        rates = [_streams_rate(fig.llama, n) for n in concurrency]
        bound = fig.bound(fig.llama_bytes)
        lines.append(
            _row("llama.cpp Q4_1 (server)", fig.llama_bytes, bound, [0] * len(concurrency), rates, fig.llama.ttft_2k)
        )
    top = max(concurrency)
    lines += ["", "1 stream = decode rate after the first token (HTTP: median of 3 requests); "
              "N streams = aggregate, prefill included"]  # fmt: skip
    f32 = fig.formats.get("none")  # absent when --formats leaves float32 out
    if f32 is not None:
        one_vs_hf = _streams_rate(f32.http, 1) / fig.hf_single
        lines += [
            f"float32, one stream through HTTP / transformers: {one_vs_hf:.2f}x (target >= 1.2x)",
            f"float32, HTTP / in-process at {top} streams: {_streams_rate(f32.http, top) / f32.engine.get(top, 1):.0%}"
            " (target >= 85%)",
        ]
    for fmt, ff in fig.formats.items():
        share = _streams_rate(ff.http, 1) / fig.bound(ff.weight_bytes)
        lines.append(f"{format_name(fmt)}: one stream (HTTP) / bandwidth bound: {share:.0%}")
    lines += _prefill_lines(fig)
    if fig.llama is not None:
        lines += _against_llama(fig, top)
    return "\n".join(lines)


def _against_llama(fig: Figures, top: int) -> list[str]:
    out = []
    for fmt, ff in fig.formats.items():
        one = _streams_rate(ff.http, 1) / _streams_rate(fig.llama, 1)
        many = _streams_rate(ff.http, top) / _streams_rate(fig.llama, top)
        ttft = ff.http.ttft_2k / fig.llama.ttft_2k
        out.append(f"{format_name(fmt)} / llama.cpp: one stream {one:.2f}x (goal >= 1.2x), {top} streams {many:.2f}x"
                   f" (goal >= 2x), TTFT 2k {ttft:.2f}x (goal <= 1)")  # fmt: skip
    return out


def _streams_rate(figs: llamacpp.Figures, streams: int) -> float:
    return {1: figs.one_stream, 8: figs.streams_8, 32: figs.streams_32}[streams]


def format_name(fmt: str) -> str:
    quant, kv_cache_dtype, activations = split_format(fmt)
    name = {"none": "ours float32", "int8": "ours int8 (g32)", "int4": "ours int4 (Q4_1 blocks)"}.get(quant, quant)
    if activations != "auto":
        name = f"{name.removesuffix(' (Q4_1 blocks)')}, {activations} act."
    return name if kv_cache_dtype == "auto" else f"{name.removesuffix(' (Q4_1 blocks)')}, KV {kv_cache_dtype}"
