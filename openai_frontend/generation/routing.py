"""Which instance serves a request, when several Triton instances serve one model
(generation/replicas.py): the policy alone, with no I/O, so it is tested on its own.

In KV mode, in order:

1. The session: a request whose session_hash (backend.contract.routing) was routed
   before goes where it went, while that instance is up and not overloaded.
2. The prefix: Dynamo's KV-aware router knows, from the engines' KV events, which
   instance holds most of the prompt's blocks; a match of more than `affinity` of them
   goes there, unless that instance is overloaded (a prompt that shares only a chat
   template's first block with others is routed by load). The events come only after a
   prefill, so the frontend also remembers, for `pending_s`, the blocks it routed where
   (RoutedPrefixes): a burst of requests on a prefix no engine has cached yet follows
   the first of them instead of spreading by load. The longer of the two matches wins.
3. The load: the instance with the fewest requests in flight (ties: the fewest routed
   so far, so an idle set of instances is walked in turn).

"Overloaded" is the bounded-load rule of consistent hashing (SGLang's router's
balance thresholds): more in flight than `load_slack` + 2 x the least loaded's, so a
hot prefix or a long conversation cannot pile everything on one instance.

Round-robin mode (the routing benchmark's peer) walks the instances that are up in
turn, and nothing else.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections import OrderedDict
from dataclasses import dataclass, field

ROUTER_MODES = ("kv", "round-robin")
REASONS = ("session", "kv", "load", "round_robin", "retry")  # why a request went where it went


@dataclass(slots=True, frozen=True)
class RoutingPolicy:
    mode: str = "kv"  # ROUTER_MODES
    affinity: float = 0.5  # the share of the prompt's blocks a cached prefix must exceed to route by it
    load_slack: int = 8  # in flight above 2 x the least loaded's that makes an instance overloaded
    down_s: float = 2.0  # out of rotation this long after it failed a request or a health check
    max_sessions: int = 65536  # sessions remembered, the least recently used forgotten first
    pending_s: float = 15.0  # how long a routed prompt's blocks count as cached where they went
    max_pending_blocks: int = 65536  # routed blocks remembered, the oldest forgotten first


@dataclass(slots=True)
class InstanceLoad:
    """What the policy knows of one instance."""

    name: str  # its Triton gRPC address
    up: bool = True
    in_flight: int = 0
    routed: Tally[str] = field(default_factory=Tally)  # requests sent here, by REASONS

    def total_routed(self) -> int:
        return sum(self.routed.values())


@dataclass(slots=True, frozen=True)
class Choice:
    name: str
    reason: str  # REASONS


class Sessions:
    """session_hash -> the instance its conversation is on (LRU-bounded)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._where: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str) -> str | None:
        name = self._where.get(session)
        if name is not None:
            self._where.move_to_end(session)
        return name

    def put(self, session: str, name: str) -> None:
        self._where[session] = name
        self._where.move_to_end(session)
        while len(self._where) > self.limit:
            self._where.popitem(last=False)

    def __len__(self) -> int:
        return len(self._where)


def block_keys(tokens: list[int], block_size: int, scope: str | None) -> list[int]:
    """One key per full block of `tokens`, chained: block i's key stands for the scope
    and every token up to the end of block i (Python's hash, local to this process)."""
    key, keys = hash(scope), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = hash((key, *tokens[start : start + block_size]))
        keys.append(key)
    return keys


class RoutedPrefixes:
    """The prompt blocks routed to each instance in the last `ttl_s` (block key ->
    instance -> until when), bounded to `limit` keys: what Dynamo's router cannot know
    until the engine's KV events arrive. SGLang's router keeps such a tree of routed
    text for good; here it only bridges the time to the events."""

    def __init__(self, ttl_s: float, limit: int):
        self.ttl_s, self.limit = ttl_s, limit
        self._where: OrderedDict[int, dict[str, float]] = OrderedDict()

    def record(self, keys: list[int], name: str, now: float) -> None:
        for key in keys:
            self._where.setdefault(key, {})[name] = now + self.ttl_s
            self._where.move_to_end(key)
        while len(self._where) > self.limit:
            self._where.popitem(last=False)

    def match(self, keys: list[int], now: float) -> tuple[str | None, int]:
        """(an instance that was routed the longest prefix of `keys`, its blocks): the
        instances that got every block so far, walked until none is left; of the last
        ones, the most recently routed."""
        holders: dict[str, float] = {}
        for depth, key in enumerate(keys):
            here = {name: until for name, until in self._where.get(key, {}).items() if until > now}
            if depth:
                here = {name: until for name, until in here.items() if name in holders}
            if not here:
                return (max(holders, key=holders.get) if holders else None), depth
            holders = here
        return (max(holders, key=holders.get) if holders else None), len(keys)

    def __len__(self) -> int:
        return len(self._where)


def overloaded(load: InstanceLoad, candidates: list[InstanceLoad], policy: RoutingPolicy) -> bool:
    least = min(c.in_flight for c in candidates)
    return load.in_flight > policy.load_slack + 2 * least


def least_loaded(candidates: list[InstanceLoad]) -> InstanceLoad:
    return min(candidates, key=lambda c: (c.in_flight, c.total_routed(), c.name))


def choose(
    candidates: list[InstanceLoad], policy: RoutingPolicy, *, session: str | None = None,
    prefix: tuple[str | None, int, int] = (None, 0, 0),
) -> Choice:  # fmt: skip
    """Where a request goes, among `candidates` (up, non-empty). `session`: the instance
    its session is on, if any; `prefix`: (the instance holding most of its prompt, the
    blocks it holds, the prompt's full blocks), from the KV-aware router."""
    by_name = {c.name: c for c in candidates}
    if policy.mode == "round-robin":
        return Choice(least_routed(candidates).name, "round_robin")
    held = by_name.get(session) if session else None
    if held is not None and not overloaded(held, candidates, policy):
        return Choice(held.name, "session")
    best, matched, blocks = prefix
    holder = by_name.get(best) if best else None
    if holder is not None and blocks and matched > policy.affinity * blocks:
        if not overloaded(holder, candidates, policy):
            return Choice(holder.name, "kv")
    return Choice(least_loaded(candidates).name, "load")


def least_routed(candidates: list[InstanceLoad]) -> InstanceLoad:
    """Round robin over a set that changes: the one sent the fewest requests so far."""
    return min(candidates, key=lambda c: (c.total_routed(), c.name))
