"""The Prometheus text exposition format, by hand: counters, gauges, histograms with labels."""

from __future__ import annotations

import math
from dataclasses import dataclass


def token_buckets(max_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_len:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


# -- families ------------------------------------------------------------------


class Family:
    """One metric: its series, keyed by their label values in the order of `labels`."""

    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.help_text, self.labels = name, help_text, labels

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}"]

    def _labels(self, values: tuple[str, ...], extra: str = "") -> str:
        pairs = [f'{k}="{_escape(v)}"' for k, v in zip(self.labels, values, strict=True)]
        if extra:
            pairs.append(extra)
        return "{" + ",".join(pairs) + "}" if pairs else ""


class Counter(Family):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        super().__init__(name, help_text, labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *label_values: str, amount: float = 1) -> None:
        self.values[label_values] = self.values.get(label_values, 0) + amount

    def get(self, *label_values: str) -> float:
        return self.values.get(label_values, 0)

    def render(self) -> list[str]:
        lines = self.header()
        lines += [f"{self.name}{self._labels(k)} {_number(v)}" for k, v in sorted(self.values.items())]
        return lines


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, *label_values: str) -> None:
        self.values[label_values] = value


@dataclass(slots=True)
class _Series:
    counts: list[int]  # per bucket, not cumulative; the last is +Inf
    total: float = 0.0
    count: int = 0


class Histogram(Family):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()):
        super().__init__(name, help_text, labels)
        self.buckets = tuple(buckets)
        self.series: dict[tuple[str, ...], _Series] = {}

    def observe(self, value: float, *label_values: str, times: int = 1) -> None:
        """Record `value` `times` times: a request's mean inter-token latency stands for
        each of its intervals, so the sum stays its whole decode time."""
        series = self.series.get(label_values)
        if series is None:
            series = self.series[label_values] = _Series([0] * (len(self.buckets) + 1))
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        series.counts[index] += times
        series.total += value * times
        series.count += times

    def render(self) -> list[str]:
        lines = self.header()
        for key, series in sorted(self.series.items()):
            cumulative = 0
            for bound, count in zip((*self.buckets, math.inf), series.counts, strict=True):
                cumulative += count
                le = 'le="+Inf"' if bound == math.inf else f'le="{float(bound)!r}"'
                lines.append(f"{self.name}_bucket{self._labels(key, le)} {cumulative}")
            lines.append(f"{self.name}_sum{self._labels(key)} {_number(series.total)}")
            lines.append(f"{self.name}_count{self._labels(key)} {series.count}")
        return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
