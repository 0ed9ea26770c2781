"""The soak's report: the client-side count (soak_locustfile.py's samples), latency and
throughput over time, RSS over time, as summary.md and PNG plots (matplotlib, no display)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

if TYPE_CHECKING:
    from loadtest.soak import SoakResult

WINDOWS = 40  # points per plot line, whatever the soak's length


@dataclass(slots=True)
class Samples:
    """One load run as the clients saw it: a dict per finished request, and how many
    started but never finished."""

    rows: list[dict]
    unfinished: int
    cut: list[dict] = field(default_factory=list)  # in flight at the stop: kind, start, how far, age

    @classmethod
    def load(cls, path: Path) -> Samples:
        lines = path.read_text().splitlines() if path.exists() else []
        if not lines:
            return cls([], 0)
        header = json.loads(lines[0])
        rows = [json.loads(line) for line in lines[1:]]
        return cls(rows, sum(header.get("unfinished", {}).values()), header.get("cut", []))

    def lost_details(self) -> list[str]:
        """One line per lost request: what the client saw."""
        lost = [f"{row['kind']}, {row['latency_s']:.1f} s: {row.get('detail') or 'no detail'}"
                for row in self.rows if row["outcome"] == "lost"]  # fmt: skip
        cut = [f"{entry['kind']}: still in flight at the stop ({entry['at']}, {entry['age_s']} s old)"
               for entry in self.cut]  # fmt: skip
        return lost + cut

    def count(self, outcome: str) -> int:
        return sum(1 for row in self.rows if row["outcome"] == outcome)

    def answered(self) -> list[dict]:
        return [row for row in self.rows if row["outcome"] == "ok"]


def _windows(rows: list[dict], start: float, end: float) -> tuple[np.ndarray, float, list[list[dict]]]:
    """Rows by request end time in WINDOWS equal windows: (window mid-points in s since
    `start`, window width, rows per window)."""
    width = max((end - start) / WINDOWS, 1.0)
    count = max(1, int(np.ceil((end - start) / width)))
    buckets: list[list[dict]] = [[] for _ in range(count)]
    for row in rows:
        buckets[min(count - 1, max(0, int((row["end"] - start) / width)))].append(row)
    return (np.arange(count) + 0.5) * width, width, buckets


def _percentile(rows: list[dict], q: float) -> float:
    return float(np.percentile([r["latency_s"] for r in rows], q)) if rows else float("nan")


def plot_latency(samples: Samples, start: float, end: float, path: Path) -> None:
    mids, _, buckets = _windows(samples.answered(), start, end)
    fig, ax = plt.subplots(figsize=(9, 4))
    for q in (50, 95):
        ax.plot(mids, [_percentile(b, q) for b in buckets], marker=".", label=f"p{q}")
    ax.set(xlabel="time (s)", ylabel="latency (s)", title="Answered requests: end-to-end latency")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def plot_throughput(samples: Samples, start: float, end: float, path: Path) -> None:
    mids, width, buckets = _windows(samples.answered(), start, end)
    fig, requests_ax = plt.subplots(figsize=(9, 4))
    requests_ax.plot(mids, [len(b) / width for b in buckets], color="tab:blue", marker=".")
    requests_ax.set(xlabel="time (s)", ylabel="answered requests/s", title="Throughput")
    tokens_ax = requests_ax.twinx()
    tokens_ax.plot(mids, [sum(r["tokens"] for r in b) / width for b in buckets], color="tab:orange", marker=".")
    tokens_ax.set_ylabel("generated tokens/s", color="tab:orange")
    requests_ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def plot_rss(result: SoakResult, path: Path) -> None:
    points = [result.baseline, *result.rss_trace, result.after]
    seconds = [p.at - result.baseline.at for p in points]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(seconds, [p.stub_rss_mb for p in points], label="model stub")
    ax.plot(seconds, [p.frontend_rss_mb for p in points], label="frontend")
    ax.set(xlabel="time since baseline (s)", ylabel="RSS (MB)", title="Resident memory")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def summary(result: SoakResult) -> str:
    """summary.md: the figures, and PASS or what failed."""
    samples = result.samples
    lines = [
        f"# Soak: {result.config.minutes:g} min, {result.config.users} users, 2 tenants",
        "",
        f"**{'PASS' if not result.problems else 'FAIL'}**",
        *[f"- {problem}" for problem in result.problems],
        *[f"  - {line}" for line in samples.lost_details()],
        "",
        "| figure | value |",
        "|---|---|",
        *_figures(result),
        "",
        "Plots: latency.png (p50/p95 over time), throughput.png, rss.png.",
        "",
    ]
    return "\n".join(lines)


def _figures(result: SoakResult) -> list[str]:
    """The summary table's rows."""
    from loadtest.soak import rss_limit

    samples, base, after = result.samples, result.baseline, result.after
    outcomes = Counter(row["outcome"] for row in samples.rows)
    answered = samples.answered()
    tokens = sum(row["tokens"] for row in answered)
    kinds = Counter(row["kind"] for row in samples.rows)
    statuses = Counter(row["status"] for row in samples.rows)
    return [
        f"| requests ended | {len(samples.rows)} ({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))}) |",
        f"| answered / explicit errors / left by the client | "
        f"{outcomes['ok']} / {outcomes['error']} / {outcomes['left']} |",
        f"| lost (incl. started, never ended) | {outcomes['lost'] + samples.unfinished} |",
        f"| HTTP statuses | {', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))} |",
        f"| throughput | {len(answered) / result.load_s:.2f} answered req/s, {tokens / result.load_s:.1f} tokens/s |",
        f"| latency of answered (p50 / p95 / max) | {_percentile(answered, 50):.2f} / "
        f"{_percentile(answered, 95):.2f} / {max((r['latency_s'] for r in answered), default=0):.2f} s |",
        f"| llm_kv_blocks_used (baseline -> at rest) | {base.kv_blocks_used:g} -> {after.kv_blocks_used:g} |",
        f"| llm_requests_in_flight (baseline -> at rest) | "
        f"{base.requests_in_flight:g} -> {after.requests_in_flight:g} |",
        f"| model stub RSS (baseline -> at rest; limit) | {base.stub_rss_mb:.0f} -> {after.stub_rss_mb:.0f} MB; "
        f"{rss_limit(base.stub_rss_mb):.0f} MB |",
        f"| frontend RSS (baseline -> at rest; limit) | {base.frontend_rss_mb:.0f} -> {after.frontend_rss_mb:.0f} MB; "
        f"{rss_limit(base.frontend_rss_mb):.0f} MB |",
        f"| peak RSS during load (stub / frontend) | {max(p.stub_rss_mb for p in [base, *result.rss_trace]):.0f} / "
        f"{max(p.frontend_rss_mb for p in [base, *result.rss_trace]):.0f} MB |",
    ]


def write_report(result: SoakResult, out_dir: Path) -> Path:
    start, end = result.baseline.at, result.after.at
    plot_latency(result.samples, start, end, out_dir / "latency.png")
    plot_throughput(result.samples, start, end, out_dir / "throughput.png")
    plot_rss(result, out_dir / "rss.png")
    path = out_dir / "summary.md"
    path.write_text(summary(result))
    return path
