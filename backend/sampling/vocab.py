"""The model's tokenizer, for the engine's features that work on text: DRY's sequence
breakers (strings, as llama.cpp takes them) and grammars (xgrammar needs the vocabulary).

The engine works on token ids; this is the one place where it reads the tokenizer.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


def load_tokenizer(model_path: str | Path):
    """The model folder's Hugging Face tokenizer, or None when the folder has none
    (the tiny random models of the tests)."""
    path = Path(model_path)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class Vocabulary:
    """Each token id's text (the decode of the id alone), up to the model's logits width."""

    def __init__(self, tokenizer, vocab_size: int):
        count = min(len(tokenizer), vocab_size)
        self.texts: tuple[str, ...] = tuple(tokenizer.decode([i]) for i in range(count))

    @lru_cache(maxsize=64)  # noqa: B019 - one Vocabulary per engine, lives as long as it
    def ids_containing(self, strings: tuple[str, ...]) -> tuple[int, ...]:
        """The tokens whose text contains any of `strings`: a DRY breaker string breaks a
        repeat wherever a token carries it, alone or inside a longer token (llama.cpp's
        matching, to the token)."""
        wanted = tuple(s for s in strings if s)
        return tuple(i for i, text in enumerate(self.texts) if any(s in text for s in wanted))
