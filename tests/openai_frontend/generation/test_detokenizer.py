"""The incremental detokenizer: deltas that add up to the full decode, whatever the packing."""

from __future__ import annotations

import json
import tempfile
import time
from functools import partial
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from openai_frontend.generation.detokenizer import IncrementalDetokenizer, make_decode

TEXTS = [
    "Hello, world! How are you today?",
    " leading spaces and  double  spaces",
    "Emoji: 🎉🚀 👩‍👩‍👧 and flags 🇫🇷!",
    "CJK: 你好，世界。日本語のテキスト。한국어",
    "Accents: café naïve résumé Ångström Łódź",
    "mixed 🎉 你好 é\n\nnew lines\tand tabs",
]


def _detokenize(decode, token_ids, pack_size, context=()):
    detok = IncrementalDetokenizer(decode, context=context)
    deltas = [detok.feed(token_ids[i : i + pack_size]) for i in range(0, len(token_ids), pack_size)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("pack_size", [1, 2, 3, 7])
def test_detokenizer_matches_full_decode(tokenization, text, pack_size):
    tok = tokenization.tokenizer
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    deltas = _detokenize(make_decode(tok), ids, pack_size)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas), "half of a multi-byte character was emitted"


def test_detokenizer_splits_multibyte_characters(tokenization):
    tok = tokenization.tokenizer
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character spread over tokens"
    deltas = _detokenize(make_decode(tok), ids, 1)
    assert deltas[:-1] == [""] * (len(ids) - 1) + ["🎉"]


def test_detokenizer_drops_a_character_cut_by_the_end(tokenization):
    tok = tokenization.tokenizer
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    assert "".join(_detokenize(make_decode(tok), ids[:-1], 1)) == "ok "


def test_detokenizer_keeps_the_space_after_the_prompt(tokenization):
    tok = tokenization.tokenizer
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    answer = tok.encode(" Paris, a city", add_special_tokens=False)
    assert "".join(_detokenize(make_decode(tok), answer, 1, context=prompt)) == " Paris, a city"


def _sentencepiece_like_tokenizer() -> Tokenizer:
    """A tiny Llama-style tokenizer: '▁' for spaces, byte fallback, leading space stripped."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    base.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog. café"] * 10, trainer)
    with tempfile.TemporaryDirectory() as folder:
        vocab_file, merges_file = base.model.save(folder)
        vocab = json.loads(Path(vocab_file).read_text())
        lines = Path(merges_file).read_text().splitlines()
    merges = [tuple(line.split()) for line in lines if line and not line.startswith("#")]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("pack_size", [1, 4])
def test_detokenizer_on_sentencepiece_style_tokens(text, pack_size):
    tok = _sentencepiece_like_tokenizer()
    decode = partial(tok.decode, skip_special_tokens=True)
    ids = tok.encode(text).ids + [tok.token_to_id("</s>")]
    deltas = _detokenize(decode, ids, pack_size)
    assert "".join(deltas) == decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # after a prompt, the first token's '▁' is a space, as in decoding prompt + answer
    prompt = tok.encode("the quick brown").ids
    continued = "".join(_detokenize(decode, ids, pack_size, context=prompt))
    assert continued == decode(prompt + ids)[len(decode(prompt)) :]


def test_detokenizer_cost_does_not_grow_with_length(tokenization):
    tok = tokenization.tokenizer
    ids = tok.encode(" ".join(TEXTS) * 40, add_special_tokens=False)
    decode = make_decode(tok)

    def per_token_us(n):
        detok = IncrementalDetokenizer(decode)
        start = time.perf_counter()
        for token in ids[:n]:
            detok.feed([token])
        return (time.perf_counter() - start) / n * 1e6

    short, long = per_token_us(200), per_token_us(len(ids))
    assert len(ids) > 2000
    assert long < 3 * short + 20, (short, long)
