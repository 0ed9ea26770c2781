"""Our NLLB (M2M100) against transformers' on a tiny random NLLB with its tokenizer
(tests/helpers/nllb_models.py): the encoder's hidden states, for sources in several
languages; the whole model's logits with the decoder on the paged KV cache (block size 4,
encoder states in their own blocks of every layer's cache), as one prefill, token by
token and in mixed steps."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from backend.runner.drafters import allocate_kv, kv_block_bytes
from backend.runner.forward_batch import Span, build_forward_batch
from backend.runner.loader import load_model
from backend.runner.models.m2m100 import M2M100Encoder, sinusoidal_table
from backend.runner.models.m2m100_cross import build_cross_plan, cross_slots
from backend.runner.models.m2m100_decoder import M2M100ForTranslation
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


# --- The whole model: our encoder + decoder on the paged cache against transformers' logits.

BLOCK = 4
SELF_TABLES = ([3, 0, 9, 5, 7, 11], [2, 8, 1, 6, 10, 4])  # 24 decoder positions each, scrambled
CROSS_TABLES = ([40, 33, 37, 35], [50, 45, 47, 49])  # encoder states: blocks apart from the decoder's


@pytest.fixture(scope="module")
def model(folder):
    return M2M100ForTranslation.load(folder)


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def texts(folder):
    """Two sources of different lengths, and for each a decoder prefix [</s>, tgt lang, tokens...]
    (short: 7 and 6 tokens; long: the first one 22)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    sources, targets = [], []
    pairs = (("eng_Latn", "fra_Latn", "The house is wonderful.", "La maison est magnifique."),
             ("fra_Latn", "deu_Latn", "Il fait beau ce matin.", "Das Haus ist wunderbar."))  # fmt: skip
    for src, tgt, text, target in pairs:
        tokenizer.src_lang = src
        sources.append(tokenizer(text)["input_ids"])
        tokenizer.src_lang = tgt
        targets.append([2, tokenizer.convert_tokens_to_ids(tgt)] + tokenizer(target)["input_ids"][1:-1])
    assert len(sources[0]) != len(sources[1]) and all(ids[-1] == 2 for ids in sources)
    short = [targets[0][:7], targets[1][:6]]
    long = [(targets[0] * 4)[:22], targets[1][:6]]
    return sources, {"short": short, "long": long}


def reference_logits(reference, sources, decoder_ids) -> list[torch.Tensor]:
    """transformers' logits of each decoder sequence, run as one right-padded batch."""

    def padded(rows):
        width = max(map(len, rows))
        ids = torch.tensor([row + [1] * (width - len(row)) for row in rows])
        return ids, torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])

    (src, src_mask), (dec, dec_mask) = padded(sources), padded(decoder_ids)
    with torch.inference_mode():
        logits = reference(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec,
                           decoder_attention_mask=dec_mask).logits  # fmt: skip
    return [logits[i, : len(row)] for i, row in enumerate(decoder_ids)]


def run_steps(model, sources, cross_tables, decoder_ids, steps) -> list[torch.Tensor]:
    """Our logits of every decoder token: encode each sequence's source into its cross blocks
    (sources[i] and cross_tables[i] are sequence i's), then each step runs, for every
    (sequence, end) in it, that sequence's next tokens up to `end`."""
    caches = allocate_kv(model.config, model.config.num_layers, 64, BLOCK, torch.float32, torch.device("cpu"))
    for table in sorted(set(map(tuple, cross_tables))):  # once per source, however many sequences read it
        src = sources[cross_tables.index(list(table))]
        model.encode(src, cross_slots(table, len(src), BLOCK), caches)
    done, logits = [0] * len(decoder_ids), [[] for _ in decoder_ids]
    for step in steps:
        spans = [Span(decoder_ids[i][done[i] : end], done[i], SELF_TABLES[i], end - done[i]) for i, end in step]
        batch = build_forward_batch(spans, BLOCK, torch.device("cpu"))
        cross = build_cross_plan(batch, [cross_tables[i] for i, _ in step], [len(sources[i]) for i, _ in step],
                                 BLOCK, torch.float32)  # fmt: skip
        rows = model.compute_logits(model(batch, caches, cross)[batch.logits_indices])
        for (i, end), part in zip(step, rows.split([end - done[i] for i, end in step]), strict=True):
            logits[i].append(part)
            done[i] = end
    assert done == [len(ids) for ids in decoder_ids]
    return [torch.cat(parts) for parts in logits]


def schedule(kind: str, lengths: list[int]) -> list[list[tuple[int, int]]]:
    first, second = lengths
    if kind == "one_chunk":  # both whole prefixes in one batch
        return [[(0, first), (1, second)]]
    if kind == "decode":  # a prefill of 2 tokens, then token by token, both sequences in each step
        return [[(0, 2), (1, 2)]] + [[(i, t) for i in (0, 1) if t <= lengths[i]] for t in range(3, max(lengths) + 1)]
    # mixed: the first sequence prefills the rest of its prefix while the second decodes
    return [[(0, 2), (1, 3)], [(0, first), (1, 4)]] + [[(1, t)] for t in range(5, second + 1)]


CASES = [("one_chunk", "short"), ("one_chunk", "long"), ("decode", "short"), ("mixed", "short"), ("mixed", "long")]


@pytest.mark.parametrize("kind, size", CASES)
def test_the_logits_equal_transformers(model, reference, texts, kind, size):
    sources, prefixes = texts
    decoder_ids = prefixes[size]
    ours = run_steps(model, sources, CROSS_TABLES, decoder_ids, schedule(kind, [len(ids) for ids in decoder_ids]))
    for i, theirs in enumerate(reference_logits(reference, sources, decoder_ids)):
        assert ours[i].shape == theirs.shape
        assert (ours[i] - theirs).abs().max().item() < 1e-4, (kind, size, i)


def test_beams_share_one_source(model, reference, texts):
    # Two decoder sequences over the same cross blocks (as beams of one request would be).
    sources, prefixes = texts
    decoder_ids = [prefixes["short"][0], prefixes["short"][0][:2] + prefixes["short"][1][2:]]
    steps = schedule("decode", [len(ids) for ids in decoder_ids])
    ours = run_steps(model, sources[:1] * 2, [CROSS_TABLES[0]] * 2, decoder_ids, steps)
    for i, theirs in enumerate(reference_logits(reference, sources[:1] * 2, decoder_ids)):
        assert (ours[i] - theirs).abs().max().item() < 1e-4, i


def test_load_model_serves_nllb(folder):
    loaded = load_model(folder, torch.float32, torch.device("cpu"))
    assert isinstance(loaded, M2M100ForTranslation) and loaded.mtp is None
    cfg = loaded.config
    assert (cfg.architecture, cfg.is_encoder_decoder, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        "M2M100ForConditionalGeneration", True, 2, 4, 4)  # fmt: skip
    assert (cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings) == (32, 8, 125, 128)
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.decoder_start_token_id, cfg.pad_token_id) == ((2,), 0, 2, 1)
    assert cfg.num_mtp_layers == 0 and cfg.sliding_windows == ()
    assert kv_block_bytes(cfg, cfg.num_layers, BLOCK, torch.float32) == 2 * BLOCK * 4 * 8 * 4 * 2


def test_an_untied_lm_head_and_final_logits_bias(folder, model, tmp_path):
    from safetensors.torch import load_file, save_file

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    weights = load_file(folder / "model.safetensors")
    lm_head, bias = torch.randn(config["vocab_size"], config["d_model"]), torch.randn(1, config["vocab_size"])
    save_file({**weights, "lm_head.weight": lm_head, "final_logits_bias": bias}, tmp_path / "model.safetensors")
    untied = M2M100ForTranslation.load(tmp_path)
    hidden = torch.randn(3, config["d_model"])
    assert torch.allclose(untied.compute_logits(hidden), hidden @ lm_head.t() + bias, atol=1e-5)
    assert torch.equal(untied.embedding(), model.embedding())  # the decoder still embeds with model.shared
