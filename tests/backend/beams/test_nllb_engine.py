"""NLLB in the engine: our encoder-decoder forward on the paged cache, greedy, sampled and
beam translations, against transformers' `generate` with forced_bos_token_id.

The tiny random NLLB of tests/helpers/nllb_models.py (its tokenizer's FLORES codes; EOS's
embedding scaled so that beams end at different steps), block size 4 so that decoder
blocks fill and forks copy partial ones. The source goes in as the text's tokens; the
engine adds the language code and EOS as NllbTokenizer does.
"""

from __future__ import annotations

import pytest
import torch

from backend.contract import EARLY_STOPPING, ContractError, FinishReason, GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from tests.helpers.beams import beam_request, run_outputs
from tests.helpers.nllb_models import write_tiny_nllb

EOS = 2
RULES = {"true": True, "false": False, "never": "never"}
SOURCES = [  # (text, source language, target language)
    ("I like green apples and red cherries.", "eng_Latn", "fra_Latn"),
    ("La maison est magnifique.", "fra_Latn", "deu_Latn"),
    ("Wir gehen morgen in die Stadt.", "deu_Latn", "spa_Latn"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_nllb(tmp_path_factory.mktemp("nllb"), seed=0, eos_gain=2.5)


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import M2M100ForConditionalGeneration

    return M2M100ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sources(tokenizer):
    """(text tokens, src id, tgt id) per source."""
    ids = tokenizer.convert_tokens_to_ids
    return [(tokenizer(t, add_special_tokens=False).input_ids, ids(s), ids(g)) for t, s, g in SOURCES]


def _engine(folder, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**dict(model_path=str(folder), block_size=4, num_blocks=300), **overrides}))


@pytest.fixture(scope="module")
def engine(folder):
    return _engine(folder)


def _theirs(hf, source, max_new, **kw):
    """transformers' translations: decoder sequences after the start token, cut after EOS (pads dropped)."""
    tokens, src, tgt = source
    with torch.inference_mode():
        out = hf.generate(torch.tensor([[src, *tokens, EOS]]), forced_bos_token_id=tgt, max_new_tokens=max_new,
                          do_sample=False, return_dict_in_generate=True, output_scores=True, **kw)  # fmt: skip
    scores = out.sequences_scores.tolist() if kw.get("num_beams", 1) > 1 else [0.0] * len(out.sequences)
    results = []
    for sequence, score in zip(out.sequences, scores, strict=True):
        seq = sequence[1:].tolist()
        end = next((i + 1 for i, t in enumerate(seq) if t == EOS), len(seq))
        results.append((seq[:end], score))
    return results


def _translate(source, **fields) -> GenerationRequest:
    tokens, src, tgt = source
    if "num_beams" in fields:
        request = beam_request(tokens, **fields)
    else:
        request = GenerationRequest(list(tokens), fields["sampling"])
    request.src_lang_id, request.tgt_lang_id = src, tgt
    return request


@pytest.mark.parametrize("num_beams", [2, 4, 5])
@pytest.mark.parametrize("length_penalty", [0.6, 1.0, 2.0])
@pytest.mark.parametrize("early_stopping", EARLY_STOPPING)
def test_beam_translations_equal_transformers(engine, hf, sources, num_beams, length_penalty, early_stopping):
    n, max_new = max(1, num_beams - 1), {0: 14, 1: 9, 2: 20}
    requests = {
        f"s{i}": _translate(
            source,
            num_beams=num_beams,
            n=n,
            max_tokens=max_new[i],
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )  # fmt: skip
        for i, source in enumerate(sources)
    }
    outputs = run_outputs(engine, requests)
    for i, source in enumerate(sources):
        theirs = _theirs(hf, source, max_new[i], num_beams=num_beams, num_return_sequences=n,
                         length_penalty=length_penalty, early_stopping=RULES[early_stopping])  # fmt: skip
        hyps = outputs[f"s{i}"].hypotheses
        assert len(hyps) == n
        for hyp, (tokens, score) in zip(hyps, theirs, strict=True):
            ours = hyp.token_ids + ([EOS] if hyp.finish_reason is FinishReason.STOP else [])
            assert ours == tokens and abs(hyp.score - score) < 1e-4
            assert ours[0] == source[2]  # the forced target language
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_the_early_stopping_rules_part_ways_on_this_model(engine, sources):
    found = set()
    for rule in EARLY_STOPPING:
        request = _translate(sources[0], num_beams=3, n=1, max_tokens=20, length_penalty=2.0, early_stopping=rule)
        found.add(tuple(run_outputs(engine, {"a": request})["a"].hypotheses[0].token_ids))
    assert len(found) >= 2


def test_greedy_translation_is_num_beams_1(engine, hf, sources):
    requests = {f"g{i}": _translate(s, sampling=SamplingParams(temperature=0.0, max_tokens=12))
                for i, s in enumerate(sources)}  # fmt: skip
    outputs = run_outputs(engine, requests)
    for i, source in enumerate(sources):
        ((theirs, _),) = _theirs(hf, source, 12, num_beams=1)
        out = outputs[f"g{i}"]
        ours = out.token_ids + ([EOS] if out.final.finish_reason is FinishReason.STOP else [])
        assert ours == theirs
        assert out.final.num_prompt_tokens == len(source[0]) + 2  # the source as the encoder read it


def _solo(engine, rid, request):
    out = run_outputs(engine, {rid: request})[rid]
    return [h.token_ids for h in out.hypotheses] if out.hypotheses is not None else out.token_ids


def _results(engine, requests):
    outs = run_outputs(engine, requests)
    assert engine.num_free_blocks() == engine.num_total_blocks()  # decoder, fork and encoder blocks
    return {rid: [h.token_ids for h in o.hypotheses] if o.hypotheses is not None else o.token_ids
            for rid, o in outs.items()}  # fmt: skip


def test_mixed_translations_batched_give_solo_results(folder, sources):
    requests = {
        "beam": _translate(sources[0], num_beams=4, n=2, max_tokens=14, length_penalty=1.0, early_stopping="false"),
        "greedy": _translate(sources[1], sampling=SamplingParams(temperature=0.0, max_tokens=10)),
        "sampled": _translate(sources[2], sampling=SamplingParams(temperature=0.8, seed=5, max_tokens=10)),
        "beam5": _translate(sources[2], num_beams=5, n=5, max_tokens=20, length_penalty=0.6, early_stopping="never"),
    }
    engine = _engine(folder)
    solo = {rid: _solo(engine, rid, r) for rid, r in requests.items()}
    assert _results(engine, requests) == solo
    assert _results(_engine(folder, max_num_batched_tokens=12), requests) == solo  # sources wait for room


@pytest.mark.parametrize("num_blocks", [16, 20, 26])
def test_preempted_translations_are_encoded_again_and_give_solo_results(folder, sources, num_blocks):
    """Beam groups outgrow the pool and preempt each other (and the greedy one), whole;
    a readmitted request runs its encoder again into new blocks."""
    requests = {f"b{i}": _translate(s, num_beams=3, n=2, max_tokens=16, length_penalty=1.0, early_stopping="never")
                for i, s in enumerate(sources)}  # fmt: skip
    requests["g"] = _translate(sources[1], sampling=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    solo = {rid: _solo(_engine(folder), rid, r) for rid, r in requests.items()}
    squeezed = _engine(folder, num_blocks=num_blocks)
    assert _results(squeezed, requests) == solo
    assert squeezed.num_preemptions > 0


def test_a_translation_the_pool_cannot_hold_ends_at_its_length(folder, sources):
    """Alone, its source's blocks and its decoder's outgrow the pool: it ends (context_length)."""
    engine = _engine(folder, num_blocks=8)
    request = _translate(sources[0], sampling=SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    out = run_outputs(engine, {"a": request})["a"]
    assert out.final.finish_guard.value == "context_length" and out.token_ids
    assert engine.num_free_blocks() == engine.num_total_blocks()


def test_languages_come_from_the_tokenizer_and_bad_ids_are_refused(engine, sources, tokenizer):
    info = engine.model_info()
    codes = ("eng_Latn", "fra_Latn", "deu_Latn", "spa_Latn")
    assert info.languages == {c: tokenizer.convert_tokens_to_ids(c) for c in codes}
    assert (info.src_lang, info.tgt_lang) == ("eng_Latn", "fra_Latn")  # the m2m_100 preset
    assert info.beam_defaults == {"num_beams": 4, "early_stopping": "true"}
    tokens = sources[0][0]
    for field in ("src_lang_id", "tgt_lang_id"):
        bad = GenerationRequest(list(tokens), SamplingParams(temperature=0.0, max_tokens=4), **{field: 7})
        with pytest.raises(ContractError) as err:
            engine.add_request("bad", bad)
        assert err.value.field == field
    # omitted: the deployment's defaults (eng_Latn -> fra_Latn)
    out = run_outputs(engine, {"d": GenerationRequest(list(tokens), SamplingParams(temperature=0.0, max_tokens=6))})
    assert out["d"].token_ids[0] == info.languages["fra_Latn"]


def test_a_decoder_only_model_refuses_languages(folder):
    from backend.runner.convert import ensure_default_model

    engine = LLMEngine(EngineConfig(model_path=str(ensure_default_model()), num_blocks=64))
    assert engine.model_info().languages == {}
    with pytest.raises(ContractError) as err:
        engine.add_request("x", GenerationRequest([1, 2], SamplingParams(max_tokens=2), tgt_lang_id=5))
    assert err.value.field == "tgt_lang_id"


def test_a_source_the_pool_cannot_hold_at_all_ends_at_once(folder, sources):
    engine = _engine(folder, num_blocks=4)  # 16 slots: the source's 12 + 2 fit, its 4 blocks and a decoder block not
    long_source = (sources[0][0] * 2, sources[0][1], sources[0][2])
    request = _translate(long_source, sampling=SamplingParams(temperature=0.0, max_tokens=4))
    out = run_outputs(engine, {"a": request})["a"]
    assert out.final.finish_guard.value == "context_length" and out.token_ids == []
    assert engine.num_free_blocks() == engine.num_total_blocks()
