"""The tokenizer and chat template of the served model folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from openai_frontend.detokenizer import IncrementalDetokenizer, make_decode
from openai_frontend.errors import bad_request


class Tokenization:
    """Text -> prompt tokens (chat template or plain prompt), tokens -> text."""

    def __init__(self, model_path: str | Path, max_model_len: int | None = None):
        """`max_model_len` caps the model's context, as the engine's MAX_MODEL_LEN does."""
        self.model_path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self._decode = make_decode(self.tokenizer)
        self._token_texts: dict[int, str] = {}
        config = _model_config(self.model_path)
        lengths = [n for n in (config.get("max_position_embeddings"), max_model_len) if n]
        self.max_model_len: int | None = min(lengths) if lengths else None
        self.vocab_size: int = config.get("vocab_size") or len(self.tokenizer)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation through the model's chat template, ready for the reply."""
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # jinja raises for conversations it refuses
            raise bad_request("messages", f"the chat template failed: {exc}") from exc
        # transformers 5 returns a BatchEncoding; older versions a plain list
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return list(ids)

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (else the frontend prompts for them)."""
        template = self.tokenizer.chat_template
        texts = template.values() if isinstance(template, dict) else [template or ""]
        return any("tools" in text for text in texts)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt: token ids as given, text with the tokenizer's BOS policy."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
        self._check_ids(ids)
        return ids

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs (the decode of its id alone, special tokens kept)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A completions prompt as text (echo)."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def text_offsets(self, token_ids: list[int]) -> list[int]:
        """Where each token's text begins in the decode of all of them (a token that
        completes a multi-byte character begins where the character does)."""
        detokenizer = IncrementalDetokenizer(self._decode)
        offsets, produced = [], 0
        for token in token_ids:
            offsets.append(produced)
            produced += len(detokenizer.feed([token]))
        return offsets

    def detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._decode, context=prompt_ids)

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise bad_request("prompt", "prompt: must not be empty")
        vocab = self.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise bad_request("prompt", f"prompt: token id {bad} is outside the vocabulary (0..{vocab - 1})")


def _model_config(model_path: Path) -> dict[str, Any]:
    try:
        return json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
