"""Multi-LoRA in the engine, against transformers + PEFT on the same weights (CPU, float32).

A tiny random Llama and PEFT adapters written here with random non-zero A and B:
different ranks and target sets, rsLoRA, per-module rank and alpha patterns.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backend.contract import AdapterNotFound, GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.lora_models import (
    engine_logits_with_adapter,
    peft_greedy,
    peft_model,
    write_adapter,
    write_tiny_llama,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 7, 11], [200, 1, 1, 64, 90], [33] * 20 + [8, 9], [250, 128, 7]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_llama(root / "base")
    adapters = {
        "a": write_adapter(base, root / "a", r=4, alpha=8),
        "b": write_adapter(base, root / "b", r=8, alpha=16, rslora=True, targets=("q_proj", "v_proj", "down_proj"),
                           seed=1),
        "c": write_adapter(base, root / "c", r=4, alpha=8, targets=("o_proj", "gate_proj", "up_proj"), seed=2,
                           rank_pattern={"o_proj": 2, "model.layers.1.mlp.up_proj": 6},
                           alpha_pattern={"gate_proj": 3.0}),
        "a2": write_adapter(base, root / "a2", r=2, alpha=4, seed=3),
    }  # fmt: skip
    return base, adapters


@pytest.fixture(scope="module")
def reference(folders):
    base, adapters = folders
    return peft_model(base, adapters)


def _engine(base, **config) -> LLMEngine:
    config = {"num_blocks": 96, "max_loras": 4, **config}
    return LLMEngine(EngineConfig(model_path=str(base), device="cpu", dtype="float32", **config))


def _loaded(folders, names=("a", "b", "c"), **config) -> tuple[LLMEngine, dict[str, int]]:
    base, adapters = folders
    engine = _engine(base, **config)
    return engine, {name: engine.adapters.load(name, str(adapters[name])).slot for name in names}


def _request(prompt, slot=0, params=GREEDY, **fields) -> GenerationRequest:
    return GenerationRequest(list(prompt), params, adapter_slot=slot, **fields)


def test_logits_equal_peft_for_each_adapter_within_1e_4(folders, reference):
    base, adapters = folders
    engine = _engine(base)
    prompt = PROMPTS[0] + PROMPTS[1]
    for name in ("a", "b", "c"):
        ours = engine_logits_with_adapter(engine, name, adapters[name], prompt)
        with torch.inference_mode():
            theirs = reference(torch.tensor([prompt]), adapter_names=[name]).logits[0]
        assert (ours - theirs).abs().max().item() < 1e-4, name
        assert (theirs - reference(torch.tensor([prompt]), adapter_names=["__base__"]).logits[0]).abs().max() > 0.1


# how a step of several adapters is computed (backend.lora.batch): lanes masked (few rows), or gathered
PATHS = pytest.mark.parametrize("masked_max_rows", [128, 0], ids=["masked", "gathered"])


@PATHS
def test_greedy_tokens_equal_peft_alone_and_in_a_mixed_batch(folders, reference, masked_max_rows, monkeypatch):
    monkeypatch.setattr("backend.lora.lanes.MASKED_MAX_ROWS", masked_max_rows)
    engine, slots = _loaded(folders)
    names = [None, "a", "b", "c"]
    expected = {f"{n}-{i}": peft_greedy(reference, n, p, 12)[0] for n in names for i, p in enumerate(PROMPTS[:2])}
    solo = {}
    for key in expected:
        name, i = key.split("-")
        request = _request(PROMPTS[int(i)], slots.get(name, 0))
        solo.update(run_to_completion(engine, {key: request})[0])
    assert solo == expected
    # every adapter and the base model in one batch, rows interleaved: each row its solo tokens
    mixed = {k: _request(PROMPTS[int(k.split("-")[1])], slots.get(k.split("-")[0], 0)) for k in expected}
    tokens, _ = run_to_completion(engine, dict(sorted(mixed.items(), key=lambda kv: kv[0][::-1])))
    assert tokens == expected
    assert len({tuple(t) for t in expected.values()}) == len(expected)  # the adapters do change the tokens


@PATHS
def test_base_rows_are_bit_identical_next_to_adapter_rows(folders, masked_max_rows, monkeypatch):
    monkeypatch.setattr("backend.lora.lanes.MASKED_MAX_ROWS", masked_max_rows)
    # the same batch twice, once with two rows on adapters (no prefix cache: both runs compute
    # everything; no speculation: both runs' steps have the same shapes)
    engine, slots = _loaded(folders, enable_prefix_caching=False, speculative="off")
    params = dataclasses.replace(GREEDY, logprobs=True, top_logprobs=5)

    def run(adapter_slots):
        pairs = zip(PROMPTS, adapter_slots, strict=True)
        requests = {f"r{i}": _request(p, s, params) for i, (p, s) in enumerate(pairs)}
        for rid, request in requests.items():
            engine.add_request(rid, request)
        logprobs = {rid: [] for rid in requests}
        while engine.has_unfinished_requests():
            for out in engine.step():
                logprobs[out.request_id] += [(lp.logprob, lp.top) for lp in out.logprobs or []]
        return logprobs

    with_adapters = run([0, slots["a"], 0, slots["c"]])
    without = run([0, 0, 0, 0])
    assert with_adapters["r0"] == without["r0"] and with_adapters["r2"] == without["r2"]
    assert with_adapters["r1"] != without["r1"]


def test_a_lane_refilled_with_a_smaller_rank_keeps_nothing_of_the_former_adapter(folders, reference):
    # one lane: rank 8 (b), then rank 2 over all modules (a2), then rank 4 (a), in that lane
    engine, slots = _loaded(folders, names=("b", "a2", "a"), max_loras=1)
    for name in ("b", "a2", "a", "b"):
        tokens, _ = run_to_completion(engine, {name: _request(PROMPTS[0], slots[name])})
        assert tokens[name] == peft_greedy(reference, name, PROMPTS[0], 12)[0], name
    assert engine.runner.lora.num_loads == 4


def test_more_adapters_than_lanes_wait_for_a_lane_and_each_gets_its_own(folders, reference):
    engine, slots = _loaded(folders, max_loras=1)
    requests = {f"{n}-{i}": _request(PROMPTS[i], slots[n]) for n in ("a", "b", "c") for i in range(2)}
    requests["base"] = _request(PROMPTS[2])
    tokens, _ = run_to_completion(engine, requests)
    for key, got in tokens.items():
        name, _, i = key.partition("-")
        if key != "base":
            assert got == peft_greedy(reference, name, PROMPTS[int(i)], 12)[0], key
    assert tokens["base"] == peft_greedy(reference, None, PROMPTS[2], 12)[0]


def test_reload_under_load_never_mixes_versions(folders, reference):
    base, adapters = folders
    engine, slots = _loaded(folders, names=("a",))
    long = dataclasses.replace(GREEDY, max_tokens=20)
    tokens = {}
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"old-{i}", _request(prompt, slots["a"], long))
    _steps(engine, tokens, 4)
    reloaded = engine.adapters.load("a", str(adapters["b"]))  # same name, other weights: a new version
    assert reloaded.slot == slots["a"]
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"new-{i}", _request(prompt, slots["a"], long))
    _steps(engine, tokens)
    for i, prompt in enumerate(PROMPTS[:3]):
        assert tokens[f"old-{i}"] == peft_greedy(reference, "a", prompt, 20)[0]
        assert tokens[f"new-{i}"] == peft_greedy(reference, "b", prompt, 20)[0]


def _steps(engine, tokens: dict, count: int | None = None) -> None:
    """Step `count` times (None: until idle), adding what comes out to `tokens`."""
    while engine.has_unfinished_requests() and (count is None or count > 0):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        count = None if count is None else count - 1


def test_unload_lets_requests_in_flight_finish_then_refuses_new_ones(folders, reference):
    engine, slots = _loaded(folders, names=("a",))
    tokens = {}
    engine.add_request("running", _request(PROMPTS[1], slots["a"]))
    _steps(engine, tokens, 3)
    engine.adapters.unload("a")
    with pytest.raises(AdapterNotFound) as refused:
        engine.prepare(_request(PROMPTS[1], slots["a"]))
    assert refused.value.field == "adapter_slot"
    _steps(engine, tokens)
    assert tokens["running"] == peft_greedy(reference, "a", PROMPTS[1], 12)[0]
    assert engine.adapters.table().adapters == []


def test_slot_minus_one_follows_the_active_adapter_as_admitted(folders, reference):
    engine, slots = _loaded(folders, names=("a", "b"))
    tokens = {}
    engine.add_request("none active", _request(PROMPTS[0], -1))
    _steps(engine, tokens)
    engine.adapters.activate("a")
    engine.add_request("pinned to a", _request(PROMPTS[0], -1))
    _steps(engine, tokens, 3)
    engine.adapters.activate("b")  # after its admission: the running request keeps a
    engine.add_request("admitted under b", _request(PROMPTS[0], -1))
    _steps(engine, tokens)
    assert tokens == {
        "none active": peft_greedy(reference, None, PROMPTS[0], 12)[0],
        "pinned to a": peft_greedy(reference, "a", PROMPTS[0], 12)[0],
        "admitted under b": peft_greedy(reference, "b", PROMPTS[0], 12)[0],
    }


def test_prefix_cache_never_crosses_adapters_or_versions(folders):
    base, adapters = folders
    engine, slots = _loaded(folders, names=("a", "b"))
    prompt = list(range(1, 50))

    def cached(slot):
        _, finals = run_to_completion(engine, {"r": _request(prompt, slot, dataclasses.replace(GREEDY, max_tokens=1))})
        return finals["r"].num_cached_tokens

    assert [cached(0), cached(slots["a"]), cached(slots["b"])] == [0, 0, 0]
    assert [cached(0), cached(slots["a"]), cached(slots["b"])] == [48, 48, 48]
    engine.adapters.load("a", str(adapters["a"]))  # the same folder again: a new version, a cold cache
    assert cached(slots["a"]) == 0


def test_speculation_with_an_adapter_gives_plain_decoding_tokens(folders, reference):
    engine, slots = _loaded(folders, names=("a",), speculative="ngram")
    repeat = [9, 8, 7, 6, 5] * 4
    requests = {"spec": _request(repeat, slots["a"]), "plain": _request(repeat, slots["a"], disable_mtp=True)}
    tokens, _ = run_to_completion(engine, requests)
    assert tokens["spec"] == tokens["plain"] == peft_greedy(reference, "a", repeat, 12)[0]


def test_preempted_adapter_requests_resume_with_their_adapter(folders, reference):
    engine, slots = _loaded(folders, num_blocks=6, block_size=16, max_num_batched_tokens=64)
    long = dataclasses.replace(GREEDY, max_tokens=24)
    requests = {n: _request(PROMPTS[2], slots[n], long) for n in ("a", "b", "c")}
    tokens, _ = run_to_completion(engine, requests)
    assert engine.num_preemptions > 0
    for name, got in tokens.items():
        assert got == peft_greedy(reference, name, PROMPTS[2], 24)[0], name
