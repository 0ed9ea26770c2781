"""A reasoning model's chat output: thinking apart from the answer, whole or streamed.

The markers come from the model settings (`[reasoning]` of MODEL.toml). Whether the
output starts inside thinking is read from the prompt itself (a template that honours
enable_thinking opens the block at the end of the prompt), as the engine reads it, so
the two agree whatever the template and its kwargs did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from backend.model_settings import ReasoningSettings
from openai_frontend.generation import Delta
from openai_frontend.reasoning import ReasoningParser

PROMPT_TAIL = 16  # tokens of the prompt's end decoded to see whether it opened thinking


class ChatReasoning:
    def __init__(self, settings: ReasoningSettings, prompt_tail_text: str):
        opened = _opens(prompt_tail_text, settings.think_start, settings.think_end)
        self.parser = ReasoningParser(settings.think_start, settings.think_end, starts_in_thinking=opened)

    @classmethod
    def of(cls, settings: ReasoningSettings, tokenizer, prompt: list[int]) -> ChatReasoning | None:
        """None for a model that does not reason."""
        if not settings.think_start:
            return None
        return cls(settings, tokenizer.decode(prompt[-PROMPT_TAIL:]))

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole output."""
        reasoning, content = self.parser.split(text)
        return reasoning, content or ""

    async def stream(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """The deltas with their text split: `reasoning` the thinking, `text` the answer."""
        split = self.parser.stream()
        async with aclosing(deltas):
            async for delta in deltas:
                reasoning, content = split.feed(delta.text)
                if delta.outcome is not None:
                    more_reasoning, more_content = split.finish()
                    reasoning, content = reasoning + more_reasoning, content + more_content
                delta.reasoning, delta.text = reasoning, content
                yield delta


def _opens(tail: str, start: str, end: str) -> bool:
    """Whether `tail` (the prompt's end) leaves a thinking block open."""
    opened = tail.rfind(start)
    return opened >= 0 and tail.rfind(end) < opened
