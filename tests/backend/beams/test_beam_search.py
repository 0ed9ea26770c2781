"""Beam search's rules against transformers' `generate` (num_beams > 1), on the same model:
`BeamSearch` driven by the model's log-probs gives generate's sequences and scores.

A tiny random Llama; its EOS row of lm_head is scaled up so that beams end at different
steps and the three early-stopping rules part ways (they agree when nothing ends).
"""

from __future__ import annotations

import pytest
import torch

from backend.beams.search import BeamSearch
from backend.contract import EARLY_STOPPING, FinishReason

EOS = 2
RULE = {True: "true", False: "false", "never": "never"}  # transformers' values -> the contract's


def _generated(hyp) -> list[int]:
    """A hypothesis's generated tokens as transformers counts them: the EOS it ended on included."""
    return hyp.token_ids + ([EOS] if hyp.finish_reason is FinishReason.STOP else [])


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS, bos_token_id=1,
                         pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
        hf.lm_head.weight[EOS] *= 2.5
    return hf


def _ours(model, prompt: list[int], search: BeamSearch) -> BeamSearch:
    """Drive the search with the model's log-probs (no cache: every beam recomputed)."""
    while not search.done:
        rows = [prompt + beam for beam in search.running]
        with torch.inference_mode():
            logits = model(torch.tensor(rows)).logits[:, -1].float()
        if search.num_generated == 0:
            logits = logits[:1].expand(search.num_beams, -1)  # every beam is the prompt
        search.step(torch.log_softmax(logits, dim=-1))
    return search


@pytest.mark.parametrize("num_beams", [2, 4, 5])
@pytest.mark.parametrize("length_penalty", [0.6, 1.0, 2.0])
@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_sequences_and_scores_equal_transformers(model, num_beams, length_penalty, early_stopping):
    prompts = [[1, 5, 9, 13], [1, 40, 41, 42, 7, 7]]
    for prompt, max_new in zip(prompts, (12, 7), strict=True):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), num_beams=num_beams, num_return_sequences=num_beams,
                                 length_penalty=length_penalty, early_stopping=early_stopping,
                                 max_new_tokens=max_new, do_sample=False, return_dict_in_generate=True,
                                 output_scores=True, eos_token_id=EOS, pad_token_id=0)  # fmt: skip
        search = _ours(model, prompt, BeamSearch(num_beams, max_new, (EOS,), length_penalty, RULE[early_stopping]))
        best = search.best(num_beams)
        for hyp, sequence, score in zip(best, out.sequences, out.sequences_scores, strict=True):
            theirs = sequence[len(prompt) :].tolist()
            # generate pads the shorter hypotheses, here with EOS (`pad_token_id or eos`: pad 0 is falsy)
            ours = _generated(hyp)
            assert ours == theirs[: len(ours)] and set(theirs[len(ours) :]) <= {EOS}
            assert abs(hyp.score - float(score)) < 1e-4


def test_the_three_early_stopping_rules_part_ways_here(model):
    """The parity above means something: on this model the rules give different answers."""
    found = {}
    for rule in EARLY_STOPPING:
        found[rule] = tuple(_generated(_ours(model, [1, 5, 9, 13], BeamSearch(3, 20, (EOS,), 2.0, rule)).best(1)[0]))
    assert len(set(found.values())) >= 2, found
