"""A reasoning model's chat output: thinking apart from the answer, whole or streamed.

The markers are the running model's (ModelInfo.think_start / think_end). Whether the
output starts inside thinking (the prompt opened the block) is the engine's to say: it
rides on the generation's first output, so the two processes cannot disagree.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from backend.contract import ModelInfo
from openai_frontend.generation.deltas import Delta
from openai_frontend.parsing.reasoning import ReasoningParser, ReasoningStream


class ChatReasoning:
    def __init__(self, think_start: str, think_end: str):
        self.think_start, self.think_end = think_start, think_end

    @classmethod
    def of(cls, info: ModelInfo) -> ChatReasoning | None:
        """None for a model that does not reason."""
        return cls(info.think_start, info.think_end) if info.think_start else None

    def parser(self, starts_in_thinking: bool | None) -> ReasoningParser:
        return ReasoningParser(self.think_start, self.think_end, starts_in_thinking=bool(starts_in_thinking))

    def split(self, whole: Delta) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole output."""
        reasoning, content = self.parser(whole.starts_in_thinking).split(whole.text)
        return reasoning, content or ""

    async def stream(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """The deltas with their text split: `reasoning` the thinking, `text` the answer."""
        split: ReasoningStream | None = None
        async with aclosing(deltas):
            async for delta in deltas:
                if split is None:  # the first delta says where the output starts
                    split = self.parser(delta.starts_in_thinking).stream()
                reasoning, content = split.feed(delta.text)
                if delta.final is not None:
                    more_reasoning, more_content = split.finish()
                    reasoning, content = reasoning + more_reasoning, content + more_content
                delta.reasoning, delta.text = reasoning, content
                yield delta
