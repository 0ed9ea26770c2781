"""The tokenizer and chat template of the served model folder.

Only what text needs: the model's facts (its context length, its vocabulary's size)
come from the running engine (ModelInfo), not from this folder's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from openai_frontend.api.errors import bad_request
from openai_frontend.generation.detokenizer import IncrementalDetokenizer, make_decode


class Tokenization:
    """Text -> prompt tokens (chat template or plain prompt), tokens -> text."""

    def __init__(self, model_path: str | Path):
        self.model_path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self._decode = make_decode(self.tokenizer)
        self._token_texts: dict[int, str] = {}
        self.document_start_id = _document_start(self.tokenizer)

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
        """A completions prompt: token ids as given (the request's validation checks them
        against the model's vocabulary), text with the tokenizer's BOS policy; an empty
        text is the start of a document (OpenAI's "<|endoftext|>", else the BOS or EOS token)."""
        if not isinstance(prompt, str):
            return list(prompt)
        return self.tokenizer(prompt)["input_ids"] or [self.document_start_id]

    def encode_text(self, text: str) -> list[int]:
        """A text as the model would write it: no BOS or other special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

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


def _document_start(tokenizer) -> int:
    """The token a document starts after: "<|endoftext|>" where the vocabulary has it, else BOS, else EOS."""
    separator = tokenizer.get_vocab().get("<|endoftext|>")
    if separator is not None:
        return separator
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
