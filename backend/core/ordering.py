"""The order the scheduler serves sequences in (mixed into Scheduler): SCHEDULING_POLICY.

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

from backend.core.sequence import Sequence

POLICIES = ("fcfs", "priority")


def order_key(seq: Sequence) -> tuple[int, float]:
    return seq.request.priority, seq.arrival_time


class Ordering:
    """Mixed into the Scheduler: `policy` is set at construction."""

    policy: str = "fcfs"

    def _queue(self, seq: Sequence, front: bool = False) -> None:
        """Put `seq` in the waiting queue where the policy says (`front`: it was preempted)."""
        if self.policy == "fcfs":
            if front:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
            return
        key = order_key(seq)
        at = next((i for i, other in enumerate(self.waiting) if order_key(other) > key), len(self.waiting))
        self.waiting.insert(at, seq)

    def _order_running(self) -> None:
        if self.policy == "priority":
            self.running.sort(key=order_key)
