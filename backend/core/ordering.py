"""The waiting queue and the order it serves sequences in: `WaitingQueue`, a part the
Scheduler creates and owns (backend.core.scheduler). SCHEDULING_POLICY:

- `fcfs` (the default): arrival order. A new sequence joins the back of the queue; a
  preempted one goes back to its front; the running batch keeps admission order, so
  preemption takes the most recently admitted.
- `priority`: by the request's `priority` (vLLM's: lower is sooner), then arrival. The
  queue is kept in that order (a preempted sequence included), so a high-priority request
  is admitted before a queue of low ones; the running batch is kept in it too, so a step
  serves the highest priority first and preemption takes the lowest priority, most recent
  first. A beam request's rows share one key, and the sort is stable: they stay together.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from backend.types.sequence import Sequence

POLICIES = ("fcfs", "priority")


def order_key(seq: Sequence) -> tuple[int, float]:
    return seq.request.priority, seq.arrival_time


class WaitingQueue:
    """The sequences waiting for admission (a beam request's lead stands for its group),
    in the policy's order; first is next to be admitted."""

    def __init__(self, policy: str = "fcfs"):
        if policy not in POLICIES:
            raise ValueError(f"SCHEDULING_POLICY must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._seqs: collections.deque[Sequence] = collections.deque()

    def push(self, seq: Sequence, front: bool = False) -> None:
        """Put `seq` where the policy says (`front`: it was preempted)."""
        if self.policy == "fcfs":
            if front:
                self._seqs.appendleft(seq)
            else:
                self._seqs.append(seq)
            return
        key = order_key(seq)
        at = next((i for i, other in enumerate(self._seqs) if order_key(other) > key), len(self._seqs))
        self._seqs.insert(at, seq)

    def first(self) -> Sequence:
        return self._seqs[0]

    def pop_first(self) -> Sequence:
        return self._seqs.popleft()

    def put_back(self, passed: list[Sequence]) -> None:
        """Return to the front, in their order, the sequences an admission round passed."""
        self._seqs.extendleft(reversed(passed))

    def remove(self, seq: Sequence) -> None:
        self._seqs.remove(seq)

    def order_running(self, running: list[Sequence]) -> None:
        """Keep the running batch in the policy's order (in place)."""
        if self.policy == "priority":
            running.sort(key=order_key)

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs
