"""Incremental detokenization: token packs in, text deltas out.

The prefix-offset / read-offset technique: decode a small window of recent tokens
twice, once without and once with the new tokens, and emit only the suffix. The
window gives the decoder the context it needs for tokenizers that carry spaces inside
tokens (ByteLevel 'Ġ', SentencePiece '▁'), and a window whose text ends in U+FFFD is
held back, because its last bytes are half of a multi-byte UTF-8 character that the
next token completes. Each call decodes two short windows, so the cost per pack does
not grow with the length of the text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context before the first generated token.
CONTEXT_TOKENS = 5

Decode = Callable[[Sequence[int]], str]


def make_decode(tokenizer) -> Decode:
    """A decode function skipping special tokens; the Rust backend's when equivalent.

    The backend tokenizer's decode is ~3x cheaper than transformers' wrapper, which
    only adds clean-up of tokenization spaces on top of it.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return partial(backend.decode, skip_special_tokens=True)
    return partial(tokenizer.decode, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text, a pack at a time.

    `context` is the tail of the prompt: decoding starts after it, so the first
    generated token decodes as a continuation (its leading space is kept).
    """

    def __init__(self, decode: Decode, context: Sequence[int] = ()):
        self._decode = decode
        self._tokens: list[int] = list(context[-CONTEXT_TOKENS:]) if context else []
        self._prefix_offset = 0  # start of the window decoded as context
        self._read_offset = len(self._tokens)  # tokens before this have been emitted

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the new text that is certain."""
        if not token_ids:
            return ""
        self._tokens.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the sequence: what was held back, less a character left
        incomplete (the sequence stopped inside its bytes), which is dropped."""
        return self._advance(final=True).rstrip(REPLACEMENT_CHAR)

    def _advance(self, final: bool) -> str:
        window = self._tokens[self._prefix_offset :]
        held = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:held]) if held else ""
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # the last bytes are half of a character: wait for the rest
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text) :]
