"""The tokenizer and chat template of the served model folder.

Only what text needs: the model's facts (its context length, its vocabulary's size)
come from the running engine (ModelInfo), not from this folder's files. Templates and
the tokenizer's encodes of request text run on a small pool of text threads
(`TEXT_THREADS`), never on the event loop: a long prompt or a slow render delays only
its own request, never /health or another request's stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from transformers import AutoTokenizer

from openai_frontend.api.errors import bad_request
from openai_frontend.generation.chat_template import ChatTemplate, TemplateBudget, template_failure
from openai_frontend.generation.detokenizer import IncrementalDetokenizer, make_decode

TEXT_THREADS = 2  # renders are pure Python (the GIL): more threads would not render faster
T = TypeVar("T")


class Tokenization:
    """Text -> prompt tokens (chat template or plain prompt), tokens -> text."""

    def __init__(self, model_path: str | Path, budget: TemplateBudget | None = None):
        self.model_path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.template = ChatTemplate(self.tokenizer, budget or TemplateBudget())
        self._decode = make_decode(self.tokenizer)
        self._token_texts: dict[int, str] = {}
        self.document_start_id = _document_start(self.tokenizer)
        self._threads = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="text")

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on a text thread."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, work, *args)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The conversation through the model's chat template (ready for the reply, unless
        it continues the final message), tokenized as the template wrote it (the
        tokenizer's own special tokens added only when asked: vLLM's /tokenize)."""
        render = (messages, tools, variables or {}, add_generation_prompt, continue_final_message)
        return await self.off_loop(self._encode_chat, render, add_special_tokens)

    def _encode_chat(self, render: tuple, add_special_tokens: bool) -> list[int]:
        try:
            text = self.template.render(*render)
        except Exception as exc:  # jinja's refusals, the budget's, or a template's own bug
            raise bad_request("messages", f"messages: {template_failure(exc)}") from None
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    @property
    def template_has_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (else the frontend prompts for them)."""
        template = self.tokenizer.chat_template
        texts = template.values() if isinstance(template, dict) else [template or ""]
        return any("tools" in text for text in texts)

    async def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt: token ids as given (the request's validation checks them
        against the model's vocabulary), text with the tokenizer's BOS policy; an empty
        text is the start of a document (OpenAI's "<|endoftext|>", else the BOS or EOS token)."""
        if not isinstance(prompt, str):
            return list(prompt)
        return await self.off_loop(self._encode_document, prompt)

    def _encode_document(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"] or [self.document_start_id]

    async def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """A text as the model would write it: no BOS or other special tokens added (unless asked)."""
        return await self.off_loop(self._encode_plain, text, add_special_tokens)

    def _encode_plain(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

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
