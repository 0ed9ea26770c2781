"""A translation model's requests (one whose ModelInfo.languages is not empty: NLLB).

Its languages are FLORES-200 codes (`eng_Latn`, `fra_Latn`): the body's `src_lang` and
`tgt_lang`, else the deployment's defaults (ModelInfo.src_lang / tgt_lang), become the
request's src_lang_id / tgt_lang_id. The source is a completions prompt, or a chat's last
user message (no chat template), tokenized without special tokens: the engine adds the
language code and </s> itself. A model that does not translate refuses both fields.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from backend.contract import GenerationRequest, ModelInfo
from openai_frontend.api.chat_protocol import ChatMessage
from openai_frontend.api.errors import bad_request
from openai_frontend.api.protocol import GenerationBody

LANGUAGE_FIELDS = ("src_lang", "tgt_lang")
_COMMON = ("eng_Latn", "fra_Latn", "deu_Latn", "spa_Latn", "zho_Hans", "arb_Arab", "hin_Deva", "rus_Cyrl")
_EXAMPLES = 5


def translates(info: ModelInfo) -> bool:
    return bool(info.languages)


def apply_languages(body: GenerationBody, info: ModelInfo, request: GenerationRequest) -> None:
    """The request's language ids (a translation model), or a 400 naming a language field
    the body sets for a model that does not translate."""
    if not translates(info):
        for name in LANGUAGE_FIELDS:
            if getattr(body, name) is not None:
                raise bad_request(name, f"{name}: this model does not translate; leave it out")
        return
    request.src_lang_id = _language_id(body.src_lang, info.src_lang, "src_lang", info)
    request.tgt_lang_id = _language_id(body.tgt_lang, info.tgt_lang, "tgt_lang", info)


def source_text(messages: Sequence[ChatMessage]) -> str:
    """What a chat asks a translation model to translate: its last user message's text."""
    users = [message for message in messages if message.role == "user"]
    if not users:
        raise bad_request("messages", "messages: a translation model translates the last user message; there is none")
    return users[-1].template_dict()["content"]


def _language_id(code: str | None, default: str, name: str, info: ModelInfo) -> int:
    code = code if code is not None else default
    if not code:
        message = f"{name}: required, since this deployment sets no default; for example {_examples('', info)}"
        raise bad_request(name, message)
    language_id = info.languages.get(code)
    if language_id is None:
        known = len(info.languages)
        message = f"{name}: {code!r} is not one of this model's {known} languages (FLORES-200 codes such as "
        raise bad_request(name, f"{message}{_examples(code, info)})")
    return language_id


def _examples(code: str, info: ModelInfo) -> str:
    """A few valid codes: those closest to `code`, then common ones, then any."""
    codes = sorted(info.languages)
    close = difflib.get_close_matches(code, codes, n=3, cutoff=0.6) if code else []
    picked = close + [c for c in (*_COMMON, *codes) if c in info.languages and c not in close]
    return ", ".join(list(dict.fromkeys(picked))[:_EXAMPLES])
