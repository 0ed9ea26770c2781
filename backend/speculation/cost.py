"""When a draft pays: a cost model fed by measured step times and each sequence's acceptance.

A step's time is fit online as T(n) = a + b n over its n query tokens (exponentially
weighted least squares over every step the engine runs: prefill chunks and decodes give
the spread of n a fit needs). A step of B sequences makes B tokens in T(n): T(n) / B a
token. Drafting k more tokens costs about b k; the m-th draft of a sequence whose drafts
are accepted at rate r adds r^m tokens on average. So a sequence drafts the largest k
whose k-th draft still earns its cost: r^k >= b B / T(n). On this CPU one stream's step
is bound by reading the weights, so b is small against T and even modest acceptance
pays; at 32 busy streams b approaches T / n and only drafts that are nearly always
accepted do. Until the fit has seen enough steps, b is taken as T / n: no drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.98  # per observed step: the fit follows the machine as it warms up or gets busy
_MIN_WEIGHT = 8.0  # steps' worth of evidence before the fit is trusted


@dataclass(slots=True)
class StepCost:
    _w: float = 0.0
    _n: float = 0.0
    _nn: float = 0.0
    _t: float = 0.0
    _nt: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = _DECAY
        self._w = self._w * d + 1.0
        self._n = self._n * d + num_tokens
        self._nn = self._nn * d + num_tokens * num_tokens
        self._t = self._t * d + seconds
        self._nt = self._nt * d + num_tokens * seconds

    def per_token(self, num_tokens: int) -> tuple[float, float]:
        """(the time one more query token adds, the step's time) at `num_tokens`."""
        mean_t = self._t / self._w if self._w else 0.0
        mean_n = self._n / self._w if self._w else 1.0
        spread = self._nn / self._w - mean_n * mean_n if self._w else 0.0
        if self._w < _MIN_WEIGHT or spread <= 1e-9:
            step = mean_t or 1.0
            return step / max(num_tokens, 1), step  # no evidence of cheap extra tokens yet
        slope = (self._nt / self._w - mean_n * mean_t) / spread
        step = max(mean_t + slope * (num_tokens - mean_n), 1e-6)
        return min(max(slope, 0.0), step / max(num_tokens, 1)), step

    def drafts_worth(self, acceptance: float, batch_size: int, num_tokens: int, max_k: int) -> int:
        """How many drafts a sequence accepting at `acceptance` should make this step."""
        extra, step = self.per_token(num_tokens)
        threshold = extra * max(batch_size, 1) / step
        k, earned = 0, 1.0
        while k < max_k:
            earned *= acceptance
            if earned < threshold:
                break
            k += 1
        return k
