"""The routing policy of several Triton instances (openai_frontend/generation/routing.py),
on its own: session stickiness, KV prefix affinity, bounded load, round robin; and the
keys a request is routed by (backend/contract/routing.py)."""

from __future__ import annotations

import json

import pytest

from backend.contract.routing import SESSION_TOKENS, routing_scope, session_hash
from openai_frontend.generation.routing import (
    Choice,
    InstanceLoad,
    RoutedPrefixes,
    RoutingPolicy,
    Sessions,
    block_keys,
    choose,
    least_loaded,
    least_routed,
    overloaded,
)

KV = RoutingPolicy()  # affinity 0.5, load_slack 8
RR = RoutingPolicy(mode="round-robin")


def loads(*in_flight: int) -> list[InstanceLoad]:
    """Instances a, b, c, ... with these requests in flight."""
    return [InstanceLoad(chr(ord("a") + i), in_flight=n) for i, n in enumerate(in_flight)]


def route(candidates: list[InstanceLoad], policy: RoutingPolicy, n: int, **kwargs) -> list[str]:
    """n requests routed in turn, each counted on the instance it went to, as replicas.py does."""
    by_name = {c.name: c for c in candidates}
    picked = []
    for _ in range(n):
        choice = choose(candidates, policy, **kwargs)
        by_name[choice.name].routed[choice.reason] += 1
        picked.append(choice.name)
    return picked


# -- overloaded -----------------------------------------------------------------------


def test_overloaded_is_more_than_slack_plus_twice_the_least_loaded():
    a, b = loads(3, 8 + 2 * 3)
    assert not overloaded(b, [a, b], KV)  # exactly at the bound
    b.in_flight += 1
    assert overloaded(b, [a, b], KV) and not overloaded(a, [a, b], KV)
    assert not overloaded(b, [a, b], RoutingPolicy(load_slack=9))
    c = InstanceLoad("c", in_flight=0)  # a new least loaded lowers the bound
    assert overloaded(InstanceLoad("d", in_flight=9), [a, b, c], KV)


# -- sessions -------------------------------------------------------------------------


def test_a_session_sticks_to_its_instance_while_it_is_not_overloaded():
    candidates = loads(0, 5, 0)
    assert choose(candidates, KV, session="b") == Choice("b", "session")
    # the session wins over a prefix held elsewhere, and over a less loaded instance
    assert choose(candidates, KV, session="b", prefix=("c", 10, 10)) == Choice("b", "session")
    candidates[1].in_flight = 8  # at the bound: still there
    assert choose(candidates, KV, session="b") == Choice("b", "session")


def test_a_session_on_an_overloaded_instance_falls_back():
    candidates = loads(1, 1 + 8 + 2 + 1, 2)
    assert choose(candidates, KV, session="b") == Choice("a", "load")
    assert choose(candidates, KV, session="b", prefix=("c", 9, 10)) == Choice("c", "kv")


def test_a_session_on_an_instance_not_among_the_candidates_falls_back():
    candidates = loads(3, 0)  # "z" is down (not a candidate)
    assert choose(candidates, KV, session="z") == Choice("b", "load")
    assert choose(candidates, KV, session="z", prefix=("a", 4, 4)) == Choice("a", "kv")
    assert choose(candidates, KV, session=None) == choose(candidates, KV, session="") == Choice("b", "load")


# -- KV prefix ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("matched", "blocks", "affinity", "reason"),
    [(6, 10, 0.5, "kv"), (5, 10, 0.5, "load"), (1, 2, 0.5, "load"), (2, 2, 0.5, "kv"),
     (0, 0, 0.5, "load"), (8, 10, 0.8, "load"), (9, 10, 0.8, "kv"), (1, 10, 0.0, "kv")],
)  # fmt: skip
def test_a_prefix_routes_only_when_more_than_affinity_of_its_blocks_are_held(matched, blocks, affinity, reason):
    candidates = loads(0, 4)  # the holder, b, is the busier one
    choice = choose(candidates, RoutingPolicy(affinity=affinity), prefix=("b", matched, blocks))
    assert choice == Choice("b" if reason == "kv" else "a", reason)


def test_a_prefix_holder_absent_or_overloaded_falls_to_load():
    candidates = loads(2, 0)
    assert choose(candidates, KV, prefix=("z", 10, 10)) == Choice("b", "load")
    assert choose(candidates, KV, prefix=(None, 10, 10)) == Choice("b", "load")
    candidates[0].in_flight = 9  # 9 > 8 + 2 x 0
    assert choose(candidates, KV, prefix=("a", 10, 10)) == Choice("b", "load")
    candidates[0].in_flight = 8
    assert choose(candidates, KV, prefix=("a", 10, 10)) == Choice("a", "kv")


# -- routed prefixes (the blocks routed before their KV events arrive) ------------------


def test_block_keys_chain_every_full_block_and_the_scope():
    tokens = list(range(40))
    keys = block_keys(tokens, 16, None)
    assert len(keys) == 2 and keys == block_keys(tokens[:32], 16, None)  # the tail of 8 is no block
    assert block_keys(tokens[:16], 16, None) == keys[:1]
    changed = block_keys([99, *tokens[1:]], 16, None)
    assert changed[0] != keys[0] and changed[1] != keys[1]  # a change in block 0 changes every later key
    late = block_keys([*tokens[:20], 99, *tokens[21:]], 16, None)
    assert late[0] == keys[0] and late[1] != keys[1]
    tenant = block_keys(tokens, 16, "tenant")
    assert tenant != keys and block_keys(tokens, 16, "other") != tenant
    assert block_keys(tokens[:15], 16, None) == []


def test_routed_prefixes_match_the_longest_prefix_routed_to_one_instance():
    routed = RoutedPrefixes(ttl_s=10, limit=100)
    family = block_keys(list(range(160)), 16, None)  # 10 blocks
    assert routed.match(family, now=0) == (None, 0)
    routed.record(family[:6], "a", now=0)
    assert routed.match(family, now=1) == ("a", 6)
    assert routed.match(family[:3], now=1) == ("a", 3)
    routed.record(family[:2], "b", now=2)  # another prompt shares only the first 2 blocks with it
    assert routed.match(family, now=3) == ("a", 6)
    assert routed.match(family[:2], now=3) == ("b", 2)  # both got them: the most recent wins
    other = block_keys([5, *range(1, 160)], 16, None)
    assert routed.match(other, now=3) == (None, 0)


def test_routed_prefixes_expire_and_stay_bounded():
    routed = RoutedPrefixes(ttl_s=10, limit=8)
    keys = block_keys(list(range(160)), 16, None)
    routed.record(keys[:6], "a", now=0)
    assert routed.match(keys, now=9.9) == ("a", 6)
    assert routed.match(keys, now=10) == (None, 0)
    routed.record(keys[:3], "a", now=10)  # routed again: refreshed for the blocks it sent
    assert routed.match(keys, now=15) == ("a", 3)
    routed.record(keys, "b", now=16)  # 10 keys over a limit of 8: the oldest go
    assert len(routed) == 8
    assert routed.match(keys, now=17) == (None, 0)  # block 0 forgotten: nothing matches from the start
    assert routed.match(keys[2:], now=17) == ("b", 8)


# -- load -----------------------------------------------------------------------------


def test_least_loaded_prefers_fewest_in_flight_then_fewest_routed():
    a, b, c = loads(2, 1, 1)
    b.routed["kv"] = 3
    c.routed["session"] = 2
    assert least_loaded([a, b, c]).name == "c"
    c.routed["load"] = 2  # c 4 routed, b 3
    assert least_loaded([a, b, c]).name == "b"
    a.in_flight = 0  # in flight first, whatever was routed
    a.routed["load"] = 100
    assert least_loaded([a, b, c]).name == "a"


def test_idle_instances_are_walked_in_turn():
    candidates = loads(0, 0, 0)
    assert route(candidates, KV, 6) == ["a", "b", "c", "a", "b", "c"]
    assert [c.routed["load"] for c in candidates] == [2, 2, 2]


def test_a_busy_instance_is_skipped_by_load():
    candidates = loads(0, 3, 0)
    assert route(candidates, KV, 4) == ["a", "c", "a", "c"]


# -- round robin ----------------------------------------------------------------------


def test_round_robin_ignores_session_prefix_and_load():
    candidates = loads(0, 50, 0)
    assert route(candidates, RR, 6, session="a", prefix=("a", 10, 10)) == ["a", "b", "c", "a", "b", "c"]
    assert all(dict(c.routed) == {"round_robin": 2} for c in candidates)


def test_round_robin_catches_up_on_the_least_routed():
    a, b, c = loads(0, 0, 0)
    a.routed["retry"] = 2
    assert least_routed([a, b, c]).name == "b"
    assert route([a, b, c], RR, 4) == ["b", "c", "b", "c"]


# -- Sessions -------------------------------------------------------------------------


def test_sessions_forget_the_least_recently_used_at_their_limit():
    sessions = Sessions(2)
    sessions.put("s1", "a")
    sessions.put("s2", "b")
    sessions.put("s3", "c")
    assert len(sessions) == 2
    assert sessions.get("s1") is None and sessions.get("s2") == "b" and sessions.get("s3") == "c"
    assert sessions.get("s4") is None and len(sessions) == 2


def test_sessions_get_and_put_refresh_recency():
    sessions = Sessions(2)
    sessions.put("s1", "a")
    sessions.put("s2", "b")
    assert sessions.get("s1") == "a"  # s1 now the most recent
    sessions.put("s3", "c")
    assert sessions.get("s2") is None and sessions.get("s1") == "a"
    sessions.put("s3", "d")  # moved: refreshed, not duplicated
    sessions.put("s4", "e")
    assert len(sessions) == 2 and sessions.get("s1") is None and sessions.get("s3") == "d"


# -- session_hash, routing_scope ------------------------------------------------------


def test_session_hash_is_deterministic_and_per_tenant():
    prompt = list(range(50))
    first = session_hash("t1", prompt)
    assert first == session_hash("t1", list(prompt)) and len(first) == 32
    int(first, 16)  # hex
    assert session_hash("t2", prompt) != first
    assert session_hash("", prompt) != first
    assert session_hash("t1", prompt[:-1]) != first
    assert session_hash("t1", [], session="chat") != session_hash("t2", [], session="chat")


def test_session_hash_covers_only_the_first_session_tokens():
    prompt = [7] * SESSION_TOKENS
    assert session_hash("t", prompt + [1, 2]) == session_hash("t", prompt + [3]) == session_hash("t", prompt)
    assert session_hash("t", [8, *prompt[1:]]) != session_hash("t", prompt)
    assert session_hash("t", prompt[:-1] + [8]) != session_hash("t", prompt)


def test_a_named_session_overrides_the_prompt():
    named = session_hash("t", [1, 2, 3], session="conv-1")
    assert named == session_hash("t", [4, 5], session="conv-1") != session_hash("t", [1, 2, 3])
    assert session_hash("t", [1, 2], session="conv-2") != named
    assert session_hash("t", [1, 2], session="") == session_hash("t", [1, 2])  # empty: no name


@pytest.mark.parametrize("name", ["[1, 2, 3]", "[1,2,3]", '"prompt", [1, 2, 3]', 'prompt", [1, 2, 3', "prompt"])
def test_a_name_cannot_spell_a_prompts_hash(name):
    assert session_hash("t", [], session=name) != session_hash("t", [1, 2, 3])
    assert session_hash("t", [], session=name) != session_hash("t", json.loads(name) if name[0] == "[" else [])


def test_routing_scope():
    assert routing_scope("") is None and routing_scope("", "", "") is None
    scopes = {routing_scope("a"), routing_scope("", "a"), routing_scope("", "", "a"), routing_scope("a", "a", "a")}
    assert len(scopes) == 4 and None not in scopes
    assert routing_scope("t", "salt", "lora") == routing_scope("t", "salt", "lora")
