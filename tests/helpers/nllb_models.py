"""A tiny random NLLB (M2M100 architecture) and its tokenizer, written here: no NLLB can be
downloaded. The recipe of ../shared/research/nllb_vision_scale.md A7: a small BPE trained
with `tokenizers` (Metaspace, as NLLB's), NllbTokenizer over it with a few FLORES codes,
and M2M100ForConditionalGeneration at d_model 32 with NLLB's defaults (scaled, tied
embeddings; pad 1, bos 0, eos 2, decoder start 2). Language ids differ from the real
NLLB's: look them up by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LANGUAGES = ("eng_Latn", "fra_Latn", "deu_Latn", "spa_Latn")
_CORPUS = [
    "The house is wonderful.", "La maison est magnifique.", "Das Haus ist wunderbar.",
    "La casa es maravillosa.", "I like green apples and red cherries.", "We read a book in the garden today.",
    "Where is the train station?", "Il fait beau ce matin.", "Wir gehen morgen in die Stadt.",
]  # fmt: skip


def write_tiny_nllb(dest: Path, seed: int = 0, eos_gain: float = 1.0) -> Path:
    """The tiny NLLB in `dest` (kept if written). `eos_gain` scales EOS's embedding row
    (tied to lm_head), so that beams end sooner."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import M2M100Config, M2M100ForConditionalGeneration, NllbTokenizer

    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    bpe.train_from_iterator(_CORPUS, trainer)
    state = json.loads(bpe.to_str())["model"]
    vocab, merges = state["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tokenizer = NllbTokenizer(vocab=vocab, merges=merges, extra_special_tokens=list(LANGUAGES),
                              src_lang="eng_Latn", tgt_lang="fra_Latn")  # fmt: skip
    config = M2M100Config(vocab_size=len(tokenizer), d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
                          activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)  # fmt: skip
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.shared.weight[config.eos_token_id] *= eos_gain
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest
