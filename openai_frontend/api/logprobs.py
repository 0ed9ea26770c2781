"""Logprobs in OpenAI's shapes: chat `choices[].logprobs.content` and the legacy
completions `choices[].logprobs` (tokens, token_logprobs, top_logprobs, text_offset).

A token's text is the decode of its single id (as vLLM shows it); `bytes` are its
UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backend.contract import Logprob

TokenText = Callable[[int], str]


def _chat_item(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(entries: list[Logprob], token_text: TokenText) -> dict[str, Any]:
    content = []
    for entry in entries:
        item = _chat_item(token_text(entry.token_id), entry.logprob)
        item["top_logprobs"] = [_chat_item(token_text(t), lp) for t, lp in entry.top]
        content.append(item)
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """Formats one completion's logprobs, a delta at a time.

    A token's text offset is where its text begins in the choice's text, as the
    frontend's detokenizer placed it (`Delta.text_offsets`); without them, the offsets
    run on by the length of each token's own text.
    """

    def __init__(self, token_text: TokenText):
        self._token_text = token_text
        self._offset = 0

    def format(self, entries: list[Logprob], text_offsets: list[int] | None = None) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for i, entry in enumerate(entries):
            text = self._token_text(entry.token_id)
            tokens.append(text)
            values.append(entry.logprob)
            if text_offsets is not None:
                self._offset = text_offsets[i]
            offsets.append(self._offset)
            self._offset += len(text)
            if entry.logprob is None:
                tops.append(None)
                continue
            # as vLLM: the alternatives and the chosen token
            top = {self._token_text(t): lp for t, lp in entry.top}
            top.setdefault(text, entry.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
