"""When drafts pay: a cost model fed by measured step times and each sequence's acceptance.

The engine reports every step's query-token count n and its time (drafting included).
`StepCost` keeps, per n, a running mean of the time: T(n) as this machine, this model
and this load measure it. The table is not linear and is not assumed to be: on this
CPU one stream's step is bound by reading the weights, so T(1)..T(5) are nearly
equal, while at 16 streams GEMM blocking makes T jump at row counts such as 17 (one
draft costing a tenth of the step). Between measured counts T is interpolated, past the
largest extrapolated with the slope of the table's two largest counts; until two counts
are known, no draft is made.

A step's plan (`plan`): B sampling sequences make B tokens in T(n). The m-th draft of
a sequence that accepts drafts at rate r adds r^m tokens on average. Taking the most
promising drafts first, the plan adds the number d of drafts that maximises
(B + the drafts' expected tokens) / T(n + d), and drafts nothing unless that beats
B / T(n) by `_MARGIN`. So a busy batch, or answers the drafts rarely guess, get none.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

_DECAY = 0.95  # per observation of a count: the table follows the machine as it warms up or gets busy
_MARGIN = 1.02  # drafting must promise this much more throughput than not drafting


@dataclass(slots=True)
class StepCost:
    _counts: list[int] = field(default_factory=list)  # the measured n, sorted
    _weight: dict[int, float] = field(default_factory=dict)
    _mean: dict[int, float] = field(default_factory=dict)  # seconds

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` query tokens took `seconds`."""
        if num_tokens not in self._weight:
            bisect.insort(self._counts, num_tokens)
            self._weight[num_tokens], self._mean[num_tokens] = 0.0, 0.0
        weight = self._weight[num_tokens] * _DECAY + 1.0
        self._weight[num_tokens] = weight
        self._mean[num_tokens] += (seconds - self._mean[num_tokens]) / weight

    def time(self, num_tokens: int) -> float | None:
        """T(num_tokens), measured or interpolated; None until two counts are measured."""
        counts, mean = self._counts, self._mean
        if len(counts) < 2:
            return None
        i = bisect.bisect_left(counts, num_tokens)
        if i < len(counts) and counts[i] == num_tokens:
            return mean[num_tokens]
        if i == 0:
            return mean[counts[0]]  # below the smallest: no cheaper than it
        lo, hi = (counts[i - 1], counts[i]) if i < len(counts) else (counts[-2], counts[-1])
        slope = max((mean[hi] - mean[lo]) / (hi - lo), 0.0)
        return mean[lo] + slope * (num_tokens - lo)

    def plan(self, acceptances: list[float], limits: list[int], num_tokens: int, num_sampling: int) -> list[int]:
        """Drafts per sequence for a step of `num_tokens` query tokens and `num_sampling`
        sampling sequences; sequence i accepts at `acceptances[i]`, may draft `limits[i]`."""
        drafts = [0] * len(limits)
        base = self.time(num_tokens)
        if base is None or not num_sampling:
            return drafts
        pairs = enumerate(zip(acceptances, limits, strict=True))
        gains = sorted(((r**m, i) for i, (r, k) in pairs for m in range(1, k + 1)), reverse=True)
        best, best_rate, earned = 0, num_sampling / base * _MARGIN, 0.0
        for d, (gain, _) in enumerate(gains, 1):
            earned += gain
            rate = (num_sampling + earned) / max(self.time(num_tokens + d), 1e-9)
            if rate > best_rate:
                best, best_rate = d, rate
        for _, i in gains[:best]:
            drafts[i] += 1
        return drafts
