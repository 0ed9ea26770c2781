"""Outputs to named arrays and back (model -> frontend): one `RequestOutput` per response.

A beam search's last output carries its hypotheses: their tokens one after another in
token_ids (their logprobs aligned), split by hypothesis_lengths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import numpy as np

from backend.contract.errors import ContractError
from backend.contract.events import FinalEvent, FinishGuard, FinishReason, Hypothesis, Logprob, RequestOutput
from backend.contract.tensors import OUTPUTS_BY_NAME

Arrays = Mapping[str, np.ndarray | None]


def output_array(name: str, values: Any) -> np.ndarray:
    return np.array(values, dtype=OUTPUTS_BY_NAME[name].numpy_dtype)


def encode_output(out: RequestOutput) -> dict[str, np.ndarray]:
    """One response's arrays: the tokens, their logprobs when asked, and on the first
    and last output what rides there."""
    if out.hypotheses is not None:
        return _hypothesis_arrays(out)
    arrays = {"token_ids": output_array("token_ids", out.token_ids)}
    if out.logprobs is not None:
        arrays.update(_logprob_arrays("token_logprobs", "top_logprob", out.logprobs))
    if out.prompt_logprobs is not None:
        arrays.update(_logprob_arrays("prompt_logprobs", "prompt_top_logprob", out.prompt_logprobs))
    if out.starts_in_thinking is not None:
        arrays["starts_in_thinking"] = output_array("starts_in_thinking", [out.starts_in_thinking])
    if out.final is not None:
        arrays.update(_final_arrays(out.final))
    return arrays


def _hypothesis_arrays(out: RequestOutput) -> dict[str, np.ndarray]:
    """A beam search's last output: its hypotheses' tokens (and logprobs) one after
    another, with their lengths, scores and finish reasons."""
    hyps = out.hypotheses
    flat = RequestOutput(out.request_id, [t for h in hyps for t in h.token_ids], prompt_logprobs=out.prompt_logprobs,
                         starts_in_thinking=out.starts_in_thinking, final=out.final)  # fmt: skip
    if all(h.logprobs is not None for h in hyps):
        flat.logprobs = [e for h in hyps for e in h.logprobs]
    arrays = encode_output(flat)
    arrays["hypothesis_lengths"] = output_array("hypothesis_lengths", [len(h.token_ids) for h in hyps])
    arrays["hypothesis_scores"] = output_array("hypothesis_scores", [h.score for h in hyps])
    reasons = [h.finish_reason.value.encode() for h in hyps]
    arrays["hypothesis_finish_reasons"] = output_array("hypothesis_finish_reasons", reasons)
    return arrays


def _logprob_arrays(values_name: str, top_prefix: str, entries: list[Logprob]) -> dict[str, np.ndarray]:
    """[n] logprobs (None as NaN) and, when any entry has alternatives, [n, k] ids and
    values (a shorter row padded with -1 / NaN)."""
    arrays = {values_name: output_array(values_name, [math.nan if e.logprob is None else e.logprob for e in entries])}
    k = max((len(e.top) for e in entries), default=0)
    if k:
        pad = [(-1, math.nan)] * k
        rows = [(e.top + pad)[:k] for e in entries]
        arrays[f"{top_prefix}_ids"] = output_array(f"{top_prefix}_ids", [[t for t, _ in row] for row in rows])
        arrays[f"{top_prefix}_values"] = output_array(f"{top_prefix}_values", [[v for _, v in row] for row in rows])
    return arrays


def _final_arrays(final: FinalEvent) -> dict[str, np.ndarray]:
    arrays = {}
    for f in fields(FinalEvent):
        value = getattr(final, f.name)
        if value is None:
            continue
        if isinstance(value, FinishReason | FinishGuard):
            value = value.value.encode()
        arrays[f.name] = output_array(f.name, [value])
    return arrays


def decode_output(arrays: Arrays, prompt_tokens: list[int], final: bool) -> RequestOutput:
    """A response's arrays -> RequestOutput; `final`: the response carries Triton's final flag."""
    tokens = arrays.get("token_ids")
    token_ids = tokens.reshape(-1).tolist() if tokens is not None else []
    starts = arrays.get("starts_in_thinking")
    out = RequestOutput(
        request_id="",
        token_ids=token_ids,
        logprobs=_logprob_entries(arrays, token_ids, "token_logprobs", "top_logprob"),
        prompt_logprobs=_logprob_entries(arrays, prompt_tokens, "prompt_logprobs", "prompt_top_logprob"),
        starts_in_thinking=bool(starts.reshape(-1)[0]) if starts is not None else None,
        final=_final_event(arrays) if final else None,
    )
    if arrays.get("hypothesis_lengths") is not None:
        out.hypotheses = _hypotheses(arrays, out)
        out.token_ids, out.logprobs = [], None
    return out


def _hypotheses(arrays: Arrays, flat: RequestOutput) -> list[Hypothesis]:
    lengths = arrays["hypothesis_lengths"].reshape(-1).tolist()
    scores = arrays["hypothesis_scores"].reshape(-1).tolist()
    reasons = [r.decode() if isinstance(r, bytes) else str(r) for r in arrays["hypothesis_finish_reasons"].reshape(-1)]
    if not len(lengths) == len(scores) == len(reasons) or sum(lengths) != len(flat.token_ids):
        raise ContractError("hypothesis_lengths", "the hypotheses' lengths, scores and reasons do not match")
    hyps, start = [], 0
    for length, score, reason in zip(lengths, scores, reasons, strict=True):
        end = start + length
        logprobs = flat.logprobs[start:end] if flat.logprobs is not None else None
        hyps.append(Hypothesis(flat.token_ids[start:end], score, FinishReason(reason), logprobs))
        start = end
    return hyps


def _logprob_entries(arrays: Arrays, token_ids: list[int], values_name: str, top_prefix: str):
    values = arrays.get(values_name)
    if values is None:
        return None
    ids, tops = arrays.get(f"{top_prefix}_ids"), arrays.get(f"{top_prefix}_values")
    entries = []
    for i, value in enumerate(values.reshape(-1).tolist()):
        top = []
        if ids is not None:
            top = [(t, v) for t, v in zip(ids[i].tolist(), tops[i].tolist(), strict=True) if t >= 0]
        token = token_ids[i] if i < len(token_ids) else -1
        entries.append(Logprob(token, None if math.isnan(value) else value, top))
    return entries


def _final_event(arrays: Arrays) -> FinalEvent:
    values = {}
    for f in fields(FinalEvent):
        array = arrays.get(f.name)
        if array is None or not array.size:
            continue
        value = array.reshape(-1)[0]
        values[f.name] = value.decode() if isinstance(value, bytes) else value.item()
    if "finish_reason" not in values or "finish_guard" not in values:
        raise ContractError("finish_reason", "the final response carries no finish_reason / finish_guard")
    values["finish_reason"] = FinishReason(values["finish_reason"])
    for name in ("finish_guard", "thinking_guard"):
        if name in values:
            values[name] = FinishGuard(values[name])
    return FinalEvent(**values)
