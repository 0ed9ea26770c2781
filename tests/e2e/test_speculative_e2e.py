"""Speculative decoding through the real stack (SPECULATIVE=auto, the default): OpenAI's
Predicted Outputs with the openai SDK on both endpoints, streamed and not; the usage
counts; vLLM's spec_decode counters on /metrics; what a bad prediction gets."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.e2e

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
'''
EDIT = [{"role": "user", "content": "Rename `averages` to `means` in this code. Reply with the code only.\n\n"
                                    f"```python\n{CODE}```"}]  # fmt: skip
PREDICTION = {"type": "content", "content": f"```python\n{CODE}```"}


def _spec_counters(stack) -> dict[str, float]:
    page = httpx.get(stack.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    found = re.findall(r"^vllm:spec_decode_(num_\w+?)_total\{([^}]*)\} (\S+)$", page, re.MULTILINE)
    return {f"{name}{{{labels}}}": float(value) for name, labels, value in found}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_a_predicted_edit_is_the_plain_answer_with_its_prediction_counted(client, model, stack, model_path):
    before = _spec_counters(stack)
    plain = client.chat.completions.create(model=model, messages=EDIT, temperature=0, max_completion_tokens=200,
                                           extra_body={"disable_mtp": True})  # fmt: skip
    predicted = client.chat.completions.create(model=model, messages=EDIT, temperature=0, max_completion_tokens=200,
                                               prediction=PREDICTION)  # fmt: skip
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    # the count follows the answer, drafted or not: at least the prediction's opening that it repeats
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    answer = tokenizer.encode(plain.choices[0].message.content, add_special_tokens=False)
    opening = _common_prefix(answer, tokenizer.encode(PREDICTION["content"], add_special_tokens=False))
    assert details.accepted_prediction_tokens >= max(opening - 1, 1)
    predicted_tokens = details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert 100 < predicted_tokens < 200  # the prediction's length in tokens, ~150
    plain_details = plain.usage.completion_tokens_details
    assert (plain_details.accepted_prediction_tokens, plain_details.rejected_prediction_tokens) == (0, 0)
    after = _spec_counters(stack)
    grew = lambda name: after.get(name, 0) - before.get(name, 0)  # noqa: E731
    model_label = f'model_name="{model}"'
    assert grew(f"num_drafts{{{model_label}}}") > 0
    accepted = grew(f"num_accepted_tokens{{{model_label}}}")
    assert 0 < accepted <= grew(f"num_draft_tokens{{{model_label}}}")
    per_pos = [grew(f'num_accepted_tokens_per_pos{{{model_label},position="{i}"}}') for i in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_a_streamed_completion_with_a_prediction_reports_it_in_the_usage_chunk(client, model):
    prompt = f"# The same function, unchanged:\n{CODE}\n# Again:\n"
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=120, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"prediction": {"type": "content", "content": CODE}})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=120, temperature=0,
                                      extra_body={"disable_mtp": True})  # fmt: skip
    assert text == whole.choices[0].text
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_n_choices_seeds_and_stop_strings_speculate_as_plain_decoding_does(client, model):
    """Seeded sampling in two choices, each cut by a stop string inside an accepted run."""
    kwargs = dict(model=model, messages=EDIT, max_completion_tokens=150, temperature=0.8, seed=11, n=2,
                  stop=["return"])  # fmt: skip
    plain = client.chat.completions.create(**kwargs, extra_body={"disable_mtp": True})
    spec = client.chat.completions.create(**kwargs, prediction=PREDICTION)
    assert [c.message.content for c in spec.choices] == [c.message.content for c in plain.choices]
    assert [c.finish_reason for c in spec.choices] == [c.finish_reason for c in plain.choices] == ["stop", "stop"]


@pytest.mark.parametrize(
    "prediction",
    [CODE, {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
    ids=["a-bare-string", "an-image-part"],
)
def test_a_bad_prediction_is_a_400_naming_it(client, model, prediction):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=EDIT, max_completion_tokens=5, prediction=prediction)
    assert caught.value.body["param"] == "prediction"


def test_a_draft_model_serves_through_the_stack(model_path):
    """SPEC_DRAFT_MODEL as a user sets it (here the model itself, the one draft with its
    tokenizer that guesses well): the same answers as without, drafts on /metrics."""
    env = {"SPECULATIVE": "draft", "SPEC_DRAFT_MODEL": str(model_path), "KV_CACHE_MB": "256"}
    content = "Name three rivers of Europe and say where each one flows."
    assert _accepted_by_a_stack_that_answers_as_plain_decoding(model_path, env, content, 48) > 10


def test_a_draft_model_with_another_vocabulary_stops_the_server_at_start(model_path, tmp_path):
    from launcher import TritonServer
    from launcher.procs import StartupError
    from tests.helpers.spec_models import build_mimo_model

    other = build_mimo_model(tmp_path / "tiny-draft", mtp="random")  # 512 tokens
    with pytest.raises(StartupError, match="SPEC_DRAFT_MODEL=tiny-draft: its vocabulary has 512 tokens"):
        with TritonServer(model_path, env={"SPECULATIVE": "draft", "SPEC_DRAFT_MODEL": str(other)}):
            pass


def test_a_checkpoint_with_mtp_layers_drafts_with_them_through_the_stack(model_path, tmp_path):
    """MODEL=<a MiMo folder> SPECULATIVE=mtp: a tiny random MiMo checkpoint with the
    default model's tokenizer, its MTP layer built to guess well (tests/helpers/spec_models.py).
    (auto drafts with MTP too, when its cost model says it pays: tests/backend/speculation.)"""
    from tests.helpers.spec_models import build_mimo_model

    mimo = build_mimo_model(tmp_path / "tiny-mimo", mtp="copy", tokenizer_from=model_path)
    env = {"SPECULATIVE": "mtp", "KV_CACHE_MB": "64"}
    assert _accepted_by_a_stack_that_answers_as_plain_decoding(mimo, env, "Say something.", 40) > 10


def _accepted_by_a_stack_that_answers_as_plain_decoding(model_path, env, content: str, max_tokens: int) -> float:
    """Start a stack on `model_path` with `env`; ask one chat question greedily with and
    without `disable_mtp`, assert the answers are equal, and return the accepted draft
    tokens on its /metrics."""
    from launcher import Stack

    with Stack(model_path, env=env) as running:
        client = openai.OpenAI(base_url=running.base_url, api_key="x", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": content}]
        answers = [client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=max_tokens,
                                                  extra_body=extra).choices[0].message.content
                   for extra in ({"disable_mtp": True}, {})]  # fmt: skip
        assert answers[0] == answers[1]
        return _spec_counters(running)[f'num_accepted_tokens{{model_name="{name}"}}']
