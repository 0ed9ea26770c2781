"""What an encoder-decoder (translation) model adds to a request: its languages.

For such a model (NLLB / M2M100, `is_encoder_decoder` in its config) a request's
prompt_tokens are the source text's tokens, without special tokens; the encoder reads
[src_lang] + source + [EOS] (NLLB's tokenizer layout), and the decoder starts from the
decoder start token with the target language forced as its first generated token
(transformers' forced BOS). The languages are the tokenizer's FLORES-200 codes
(`eng_Latn`, `fra_Latn`, ...); src_lang_id / tgt_lang_id 0 take the deployment's
defaults (MODEL.toml [translation]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from backend.contract import ContractError, GenerationRequest
from backend.settings.model_settings import ModelSettings
from backend.types.sequence import EncoderState

FLORES_CODE = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")


@dataclass(frozen=True, slots=True)
class Translation:
    languages: dict[str, int]  # FLORES-200 code -> token id
    src_lang: str  # the defaults, codes of `languages`
    tgt_lang: str
    eos_token_id: int
    decoder_start_token_id: int
    max_source_len: int  # the encoder's positions

    @classmethod
    def for_model(cls, model_config, tokenizer, settings: ModelSettings) -> Translation | None:
        """None for a decoder-only model; ValueError for a translation model the settings do not fit."""
        if not getattr(model_config, "is_encoder_decoder", False):
            return None
        if tokenizer is None:
            raise ValueError("a translation model needs its tokenizer (its language codes) in the model folder")
        languages = {code: i for code, i in tokenizer.get_added_vocab().items() if FLORES_CODE.match(code)}
        if not languages:
            raise ValueError("the tokenizer has no FLORES-200 language codes (such as eng_Latn)")
        defaults = settings.translation
        for key, code in (("src_lang", defaults.src_lang), ("tgt_lang", defaults.tgt_lang)):
            if code and code not in languages:
                raise ValueError(f"{settings.source}: translation.{key} = {code!r} is not a language of this model")
        return cls(languages, defaults.src_lang, defaults.tgt_lang, model_config.eos_token_ids[0],
                   model_config.decoder_start_token_id, model_config.max_position_embeddings)  # fmt: skip

    def model_info(self) -> dict:
        return {"languages": dict(self.languages), "src_lang": self.src_lang, "tgt_lang": self.tgt_lang}

    def encoder_state(self, request: GenerationRequest) -> EncoderState:
        """The request's source for the encoder; ContractError naming a language id that is
        not one of the model's, or a source longer than the encoder's positions."""
        src = self._language(request.src_lang_id, self.src_lang, "src_lang_id")
        tgt = self._language(request.tgt_lang_id, self.tgt_lang, "tgt_lang_id")
        tokens = [src, *request.prompt_tokens, self.eos_token_id]
        if len(tokens) > self.max_source_len:
            raise ContractError("prompt_tokens", f"the source has {len(tokens)} tokens with its language code and "
                                f"EOS; this model's encoder reads at most {self.max_source_len}")  # fmt: skip
        return EncoderState(tokens, tgt, self.decoder_start_token_id)

    def _language(self, given: int, default: str, field: str) -> int:
        if not given:
            if not default:
                raise ContractError(field, "is required: this deployment sets no default language")
            return self.languages[default]
        if given not in self.languages.values():
            raise ContractError(field, f"token id {given} is not one of this model's {len(self.languages)} languages")
        return given
