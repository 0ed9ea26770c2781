"""What a vision-language model's forward needs beyond the tokens (ForwardBatch's M-RoPE ids
and spliced embeddings), for one step.

Every token of the flat batch gets its (t, h, w) ids: a vision request's from its state
(backend.vision.state), any other's its 1-D position in all three rows. Each scheduled chunk
that covers placeholder tokens gets the vision encoder's embeddings for them: items found in
the encoder cache are taken from it, the others are encoded together in one call (the
encoder attends within each frame of each item only, so batching them changes nothing) and
kept there for the chunks and requests that follow.
"""

from __future__ import annotations

import numpy as np
import torch

from backend.contract.vision import VisionItem
from backend.types.step import ScheduledSeq
from backend.vision.encoder_cache import EncoderCache


def mrope_ids(scheduled: list[ScheduledSeq], positions: torch.Tensor) -> torch.Tensor:
    """[3, T] int64 ids of the step's tokens (the flat batch's `positions` [T] in all three
    rows, a vision sequence's slice from its state): the per-token path pays only for the
    vision sequences in the step."""
    ids = positions.expand(3, -1).clone()
    at = 0
    for item in scheduled:
        seq, n = item.seq, item.num_new_tokens
        if seq.vision is not None:
            start = seq.num_computed_tokens
            ids[:, at : at + n] = seq.vision.positions_of(start, start + n).to(ids.device)
        at += n
    return ids


def vision_embeds(
    scheduled: list[ScheduledSeq], query_start: list[int], encoder, cache: EncoderCache, merge: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows [R] of the flat batch, their embeddings [R, hidden]) for the placeholder tokens
    the step computes; None when it computes none."""
    wanted = []  # (flat row of the first token, offset into the item's embeddings, count, item)
    for item, row0 in zip(scheduled, query_start, strict=False):
        seq, start = item.seq, item.seq.num_computed_tokens
        if seq.vision is None:
            continue
        end = start + item.num_new_tokens
        for placed in seq.vision.overlapping(start, end):
            lo, hi = max(placed.start, start), min(placed.end, end)
            wanted.append((row0 + lo - start, lo - placed.start, hi - lo, placed.item))
    if not wanted:
        return None
    embeds = _embeddings([w[3] for w in wanted], encoder, cache, merge)
    device = embeds[wanted[0][3].content_hash].device
    rows = torch.cat([torch.arange(r, r + n) for r, _, n, _ in wanted]).to(device)
    values = torch.cat([embeds[item.content_hash][at : at + n] for _, at, n, item in wanted])
    return rows, values


def _embeddings(items: list[VisionItem], encoder, cache: EncoderCache, merge: int) -> dict[str, torch.Tensor]:
    """Each item's encoder output, by content hash: the cache's, or encoded now (and cached)."""
    found: dict[str, torch.Tensor] = {}
    missing: dict[str, VisionItem] = {}
    for item in items:
        key = item.content_hash
        if key in found or key in missing:
            continue
        cached = cache.get(key)
        if cached is not None:
            found[key] = cached
        else:
            missing[key] = item
    if missing:
        new = list(missing.values())
        pixels = torch.from_numpy(_stacked(new)).to(encoder.device, encoder.dtype)
        out = encoder(pixels, [item.grid for item in new])
        sizes = [item.num_tokens(merge) for item in new]
        for item, embeds in zip(new, out.split(sizes), strict=True):
            found[item.content_hash] = embeds
            cache.put(item.content_hash, embeds)
    return found


def _stacked(items: list[VisionItem]) -> np.ndarray:
    return np.concatenate([item.pixels for item in items]) if len(items) > 1 else items[0].pixels
