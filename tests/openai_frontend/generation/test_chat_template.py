"""The chat template renderer (generation/chat_template.py): the same text as transformers'
apply_chat_template on the same templates and conversations, and the budgets that stop a
render (time, output size, giant values) with a message that shows no internals."""

from __future__ import annotations

import copy
import time

import pytest

from openai_frontend.api.errors import OpenAIError
from openai_frontend.generation.chat_template import (
    BudgetExceeded,
    ChatTemplate,
    TemplateBudget,
    template_failure,
    template_variables,
)
from tests.helpers.thinking_model import CHAT_TEMPLATE as THINKING_TEMPLATE
from tests.helpers.tools import WEATHER
from tests.helpers.vlm_models import QWEN2_VL_CHAT_TEMPLATE

# What real templates do, in few lines: a namespace carried across a loop, loop controls,
# tojson with an indent, raise_exception, strftime_now, dict(), a generation block, tools,
# the reasoning of earlier turns, and the special tokens as variables.
FEATURES_TEMPLATE = """{{ bos_token }}{% set ns = namespace(system=none, turns=0) %}
{%- for message in messages %}{% if message.role == 'system' %}{% set ns.system = message.content %}{% continue %}{% endif %}
{%- set ns.turns = ns.turns + 1 %}
{%- if message.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' ~ message.role) }}{% endif %}
[{{ message.role | upper }} {{ ns.turns }}]{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
{%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% else %}{{ message.content }}{% endif %}
{%- if message.tool_calls %}{{ message.tool_calls | tojson(indent=2) }}{% endif %}
{% endfor %}{% if ns.system %}(system: {{ ns.system }}){% endif %}
{%- if tools %}TOOLS {{ tools | tojson }} {{ dict(n=tools | length) | tojson }}{% endif %}
{%- if mood is defined %}mood={{ mood }}{% endif %}
{%- if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token if date_string is defined else '' }}"""  # noqa: E501

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "Hello there"}],
    "system and turns": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2? Say <|im_end|> too."},
    ],
    "reasoning and tool calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "I should call the tool.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"},
    ],
    "unicode and empty content": [
        {"role": "user", "content": "naïve café 日本 🍰"},
        {"role": "assistant", "content": None},
    ],
}


@pytest.fixture(scope="module")
def tokenizer(tokenization):
    return copy.deepcopy(tokenization.tokenizer)  # its chat template is swapped per case


def _both(tokenizer, template, messages, tools=None, variables=None, **options):
    """Our render and transformers', each the text or the name of what it raised."""
    tokenizer.chat_template = template
    ours = _outcome(ChatTemplate(tokenizer, TemplateBudget()).render, messages, tools, variables or {}, **options)
    theirs = _outcome(tokenizer.apply_chat_template, messages, tools=tools, tokenize=False, **options,
                      **(variables or {}))  # fmt: skip
    return ours, theirs


def _outcome(render, *args, **kwargs) -> str:
    try:
        return render(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared by kind
        return f"raised {type(exc).__name__}"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", ["default model", "thinking", "qwen2-vl", "features"])
def test_the_render_equals_transformers(tokenizer, tokenization, name, conversation):
    template = {
        "default model": tokenization.tokenizer.chat_template,
        "thinking": THINKING_TEMPLATE,
        "qwen2-vl": QWEN2_VL_CHAT_TEMPLATE,
        "features": FEATURES_TEMPLATE,
    }[name]
    messages = CONVERSATIONS[conversation]
    for options in ({"add_generation_prompt": True}, {"add_generation_prompt": False}):
        for tools, variables in ((None, None), ([WEATHER], {"mood": "calm", "enable_thinking": False})):
            ours, theirs = _both(tokenizer, template, messages, tools, variables, **options)
            assert ours == theirs


def test_continue_final_message_equals_transformers(tokenizer, tokenization):
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    for template in (tokenization.tokenizer.chat_template, FEATURES_TEMPLATE):
        ours, theirs = _both(tokenizer, template, messages, **options)
        assert ours == theirs and ours.endswith("1, 2,"), ours


def test_the_templates_own_refusal_is_its_message(tokenizer):
    tokenizer.chat_template = FEATURES_TEMPLATE
    with pytest.raises(Exception) as refused:
        ChatTemplate(tokenizer, TemplateBudget()).render([{"role": "wizard", "content": "x"}], None, {})
    assert template_failure(refused.value) == "the chat template refused this conversation: unknown role wizard"


def _render(tokenizer, template: str, budget: TemplateBudget, messages=None) -> str:
    tokenizer.chat_template = template
    return ChatTemplate(tokenizer, budget).render(messages or [{"role": "user", "content": "hi"}], None, {})


def test_a_render_past_its_time_stops_there(tokenizer):
    loops = "{% for i in range(100000) %}{% for j in range(2000) %}{{ '' }}{% endfor %}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(BudgetExceeded, match="longer than 0.3 s") as stopped:
        _render(tokenizer, loops, TemplateBudget(max_seconds=0.3))
    assert time.monotonic() - started < 3  # not the hours the loops would take
    assert "CHAT_TEMPLATE_TIMEOUT_S" in template_failure(stopped.value)


def test_a_loop_without_output_still_meets_the_clock(tokenizer):
    silent = "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = j %}{% endfor %}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(BudgetExceeded):
        _render(tokenizer, silent, TemplateBudget(max_seconds=0.3))
    assert time.monotonic() - started < 3


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'a' * 300000000 }}",  # refused before the string exists
        "{{ [1] * 300000000 }}",
        "{% for m in messages %}{% for i in range(100000) %}{{ m.content }}{% endfor %}{% endfor %}",
    ],
)
def test_output_past_its_size_stops_there(tokenizer, template):
    with pytest.raises(BudgetExceeded, match="100000 characters"):
        _render(tokenizer, template, TemplateBudget(max_chars=100_000), [{"role": "user", "content": "x" * 50}])


def test_a_giant_power_is_refused_before_it_is_computed(tokenizer):
    started = time.monotonic()
    with pytest.raises(BudgetExceeded, match="power"):
        _render(tokenizer, "{{ 10 ** 100000000 }}", TemplateBudget())
    assert time.monotonic() - started < 1


def test_failures_show_no_object_addresses(tokenizer):
    with pytest.raises(Exception) as refused:
        _render(tokenizer, "{{ raise_exception('bad: ' ~ raise_exception) }}", TemplateBudget())
    reason = template_failure(refused.value)
    assert "refused this conversation: bad: <function" in reason and " at 0x..." in reason
    assert not any(ch.isdigit() for ch in reason.split("0x")[1][:3])  # the address is gone
    with pytest.raises(Exception) as failed:
        _render(tokenizer, "{{ messages[0].content + 1 }}", TemplateBudget())
    assert template_failure(failed.value) == "the chat template failed on this conversation (TypeError)"


def test_the_sandbox_holds(tokenizer):
    with pytest.raises(Exception) as escaped:
        _render(tokenizer, "{{ ''.__class__.__mro__[1].__subclasses__() }}", TemplateBudget())
    assert "refused this conversation" in template_failure(escaped.value)


@pytest.mark.parametrize("key", ["chat_template", "messages", "tools", "raise_exception", "add_generation_prompt"])
def test_variables_may_not_replace_the_template_or_the_renderers_names(key):
    with pytest.raises(OpenAIError) as refused:
        template_variables({key: "{{ 1 }}", "enable_thinking": True})
    assert refused.value.status == 400 and refused.value.param == f"chat_template_kwargs.{key}"
    assert template_variables({"enable_thinking": True, "mood": "x"}) == {"enable_thinking": True, "mood": "x"}
