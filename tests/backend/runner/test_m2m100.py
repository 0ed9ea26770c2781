"""Our NLLB (M2M100) encoder against transformers' on a tiny random NLLB with its tokenizer
(tests/helpers/nllb_models.py): the same hidden states, for sources in several languages."""

from __future__ import annotations

import pytest
import torch

from backend.runner.models.m2m100 import M2M100Encoder, sinusoidal_table
from tests.helpers.nllb_models import write_tiny_nllb


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_nllb(tmp_path_factory.mktemp("nllb") / "tiny")


def test_the_encoder_equals_transformers(folder):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = M2M100Encoder.load(folder)
    for lang, text in (("eng_Latn", "The house is wonderful."), ("fra_Latn", "Il fait beau ce matin."),
                       ("deu_Latn", "Wir gehen morgen in die Stadt, wo das Haus ist.")):  # fmt: skip
        tokenizer.src_lang = lang
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.convert_tokens_to_ids(lang) and ids[-1] == 2  # [lang] tokens </s>
        with torch.inference_mode():
            theirs = reference.get_encoder()(input_ids=torch.tensor([ids])).last_hidden_state[0]
        assert (ours(ids) - theirs).abs().max().item() < 1e-5, lang


def test_sinusoidal_positions_match_transformers():
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding

    for dim in (32, 33):
        assert torch.equal(sinusoidal_table(40, dim, 1), M2M100SinusoidalPositionalEmbedding.get_embedding(40, dim, 1))
