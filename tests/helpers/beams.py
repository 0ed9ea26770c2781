"""Beam requests for the engine's tests, and transformers' `generate` beams to compare with."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from backend.contract import GenerationRequest, RequestOutput, SamplingParams
from backend.core.engine import LLMEngine


def beam_request(prompt, num_beams, n, max_tokens, length_penalty, early_stopping, **sampling) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling)
    return GenerationRequest(list(prompt), params, num_beams=num_beams, num_return_sequences=n,
                             length_penalty=length_penalty, early_stopping=early_stopping)  # fmt: skip


def run_outputs(engine: LLMEngine, requests: Mapping[str, GenerationRequest]) -> dict[str, RequestOutput]:
    """Add the requests, step until idle: each request's outputs merged into one."""
    for request_id, request in requests.items():
        engine.add_request(request_id, request)
    merged: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in merged:
                merged[out.request_id].absorb(out)
            else:
                merged[out.request_id] = out
    return merged


def generate_beams(hf, prompt, num_beams, n, max_new, length_penalty, early_stopping, eos, decoder_only=True, **kw):
    """transformers' n best: (generated tokens up to and with the EOS they ended on, score).
    `generate` pads shorter hypotheses (with EOS here, since `pad_token_id or eos` skips a
    pad of 0); the padding is cut."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), num_beams=num_beams, num_return_sequences=n,
                          length_penalty=length_penalty, early_stopping=early_stopping, max_new_tokens=max_new,
                          do_sample=False, return_dict_in_generate=True, output_scores=True, **kw)  # fmt: skip
    eos_ids = set(eos) if isinstance(eos, list | tuple) else {eos}
    start = len(prompt) if decoder_only else 1
    results = []
    for sequence, score in zip(out.sequences, out.sequences_scores, strict=True):
        tokens = sequence[start:].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
        results.append((tokens[:end], float(score)))
    return results
