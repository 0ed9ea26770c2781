"""A vision request's state in the engine: its items, where their tokens sit, their positions.

Built once when the request is added (`VisionState.of`, which checks the prompt against the
items with the model's facts), shared by a beam request's rows, read by the scheduler (what
a chunk costs the vision encoder), the block manager (what a block's hash must cover) and
the model runner (the M-RoPE ids and the rows the encoder's output replaces).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from backend.contract import ContractError
from backend.contract.vision import VisionInfo, VisionItem
from backend.vision.mrope import mrope_positions, vision_runs


@dataclass(frozen=True, slots=True)
class Placed:
    """One item and the run of its placeholder tokens in the prompt, [start, end)."""

    item: VisionItem
    start: int
    end: int


@dataclass(eq=False, slots=True)
class VisionState:
    placed: tuple[Placed, ...]
    positions: torch.Tensor  # [3, prompt length] int64: the prompt's M-RoPE ids
    delta: int  # a generated token at sequence position p has id p + delta in all three rows

    @classmethod
    def of(cls, prompt: list[int], items: tuple[VisionItem, ...], info: VisionInfo) -> VisionState:
        """The state of a prompt holding `items`; ContractError when the prompt's placeholder
        runs do not match the items (their kinds, order and token counts)."""
        for i, item in enumerate(items):
            if item.pixels.shape[1] != info.patch_dim:
                raise ContractError("vision_pixels", f"item {i}: patches of {info.patch_dim} values expected, "
                                    f"got {item.pixels.shape[1]}")  # fmt: skip
            if item.grid[1] % info.merge_size or item.grid[2] % info.merge_size:
                raise ContractError("vision_grids", f"item {i}: h and w must be multiples of {info.merge_size}")
        placeholders = (info.image_token_id, info.video_token_id)
        try:
            runs = vision_runs(prompt, placeholders, [item.grid for item in items], info.merge_size)
        except ValueError as exc:
            raise ContractError("prompt_tokens", f"the placeholder tokens do not match the images: {exc}") from None
        for i, (run, item) in enumerate(zip(runs, items, strict=True)):
            want = info.placeholder_id(item.kind)
            if any(t != want for t in prompt[run.start : run.start + item.num_tokens(info.merge_size)]):
                raise ContractError("prompt_tokens", f"item {i} is a {item.kind}: its placeholder is token {want}")
        positions, delta = mrope_positions(len(prompt), runs, info.merge_size, _time_steps(items, info))
        merge = info.merge_size
        pairs = zip(runs, items, strict=True)
        placed = tuple(Placed(item, r.start, r.start + item.num_tokens(merge)) for r, item in pairs)
        return cls(placed, positions, delta)

    def overlapping(self, start: int, end: int) -> Iterator[Placed]:
        """The items with placeholder tokens among sequence positions [start, end)."""
        return (p for p in self.placed if p.start < end and start < p.end)

    def block_keys(self, start: int, end: int) -> bytes:
        """What a block over positions [start, end) must add to its hash: the content hash of
        every item whose tokens it holds (placeholder tokens are the same for every picture)."""
        return b"".join(bytes.fromhex(p.item.content_hash) for p in self.overlapping(start, end))

    def positions_of(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] ids of sequence positions [start, end), the prompt's and beyond."""
        length = self.positions.shape[1]
        known = self.positions[:, start:end]
        if end <= length:
            return known
        past = torch.arange(max(start, length), end) + self.delta
        return torch.cat((known, past.expand(3, -1)), dim=1)

    def fit_chunk(self, start: int, num_new: int, budget: int, fresh: bool, merge: int,
                  cached: Callable[[str], bool]) -> tuple[int, int]:  # fmt: skip
        """(tokens to compute from `start`, at most `num_new`; the encoder tokens they cost).
        The chunk stops before an item the encoder must run (not `cached`) when its tokens
        exceed what is left of the step's encoder `budget`; an item first in the chunk runs
        anyway in a step whose encoder has not run yet (`fresh`), or it never would."""
        cost = 0
        for p in self.overlapping(start, start + num_new):
            if cached(p.item.content_hash):
                continue
            tokens = p.item.num_tokens(merge)
            if cost + tokens > budget and not (fresh and cost == 0 and p.start <= start):
                return max(p.start - start, 0), cost
            cost += tokens
        return num_new, cost


def _time_steps(items: tuple[VisionItem, ...], info: VisionInfo) -> list[float]:
    """Each run's temporal id step: Qwen2.5-VL spaces a video's temporal patches by the time
    they cover (tokens_per_second * seconds per patch); everything else steps by 1."""
    if not info.tokens_per_second:
        return [1.0] * len(items)
    return [info.tokens_per_second * item.seconds_per_grid if item.kind == "video" else 1.0 for item in items]
