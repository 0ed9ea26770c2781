"""Qwen2-VL's multimodal rotary positions (M-RoPE), for the language model's side.

Each prompt token has three position ids (time, height, width). A text token has the
same id in all three, counting on from the token before it. An image's (or video's)
placeholder tokens, one per merged 2x2 patch in row-major order, are at
(start + t, start + row, start + col), `start` the position the image begins at; the
text after it resumes at the run's largest id + 1 (for an image, start + max(rows, cols);
not start + the number of its tokens), so a prompt's last position id is usually below
its length. That is the rule Qwen2-VL and Qwen2.5-VL were released with (transformers
4.49, vLLM); transformers 5.24 resumes at start + max(rows, cols) always, which differs
for a video whose time ids outgrow its grid's side (tests/backend/vision/test_mrope.py). Decoding continues in 1-D
from there: token p (p >= prompt length) is at p + delta, delta = max id + 1 - length,
in all three rows.

The rotary angles follow: the head's frequency pairs are split in `mrope_section` (for
example [16, 24, 24] of 64 pairs), section i turning by row i's ids; the two halves of
the head rotate alike, as in every Llama-family RoPE.

Both follow transformers' (Qwen2VLModel.get_rope_index, Qwen2VLRotaryEmbedding), written
again here for our flat batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Grid = tuple[int, int, int]  # (t, h, w) in patches, before the merge


@dataclass(frozen=True, slots=True)
class VisionRun:
    """A run of one image's or video's placeholder tokens in a prompt."""

    start: int  # the index of its first placeholder token
    grid: Grid

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * (h // merge) * (w // merge)


def vision_runs(prompt: Sequence[int], placeholder_ids: Sequence[int], grids: Sequence[Grid], merge: int):
    """The runs of placeholder tokens (any of `placeholder_ids`) in `prompt`, one per grid in
    order; ValueError when the runs' lengths do not match the grids' token counts."""
    runs, i, grids = [], 0, list(grids)
    placeholders = set(placeholder_ids)
    while i < len(prompt):
        if prompt[i] not in placeholders:
            i += 1
            continue
        if len(runs) == len(grids):
            raise ValueError(f"the prompt has more placeholder runs than the {len(grids)} images and videos sent")
        run = VisionRun(i, grids[len(runs)])
        end = i + run.num_tokens(merge)
        if end > len(prompt) or any(t not in placeholders for t in prompt[i:end]):
            raise ValueError(f"image {len(runs)} needs {run.num_tokens(merge)} placeholder tokens at {i}")
        runs.append(run)
        i = end
    if len(runs) != len(grids):
        raise ValueError(f"{len(grids)} images and videos sent, {len(runs)} placeholder runs in the prompt")
    return runs


def mrope_positions(
    length: int, runs: Sequence[VisionRun], merge: int, time_steps: Sequence[float] | None = None
) -> tuple[torch.Tensor, int]:
    """([3, length] int64 position ids of a prompt of `length` tokens with these vision
    runs, the delta its decode positions are shifted by).

    `time_steps` (one per run; None: all 1) spaces a run's temporal ids: temporal patch i is
    at start + floor(i * step). Qwen2.5-VL's videos: step = tokens_per_second * the video's
    seconds per temporal patch (its images: 1); Qwen2-VL: 1 always."""
    pieces, position, at = [], 0, 0
    steps = [1.0] * len(runs) if time_steps is None else list(time_steps)
    if len(steps) != len(runs):
        raise ValueError(f"{len(steps)} time steps for {len(runs)} vision runs")
    for run, step in zip(runs, steps, strict=True):
        text = run.start - at
        pieces.append(torch.arange(position, position + text).expand(3, -1))
        position += text
        t, h, w = run.grid[0], run.grid[1] // merge, run.grid[2] // merge
        # float32 like transformers, so the floor lands where its does
        times = (torch.arange(t) * torch.tensor(step, dtype=torch.float32)).long()
        grid = torch.meshgrid(times, torch.arange(h), torch.arange(w), indexing="ij")
        ids = torch.stack([g.reshape(-1) for g in grid]) + position
        pieces.append(ids)
        position = int(ids.max()) + 1  # after the run's largest id, in any of the three rows
        at = run.start + run.num_tokens(merge)
    pieces.append(torch.arange(position, position + length - at).expand(3, -1))
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - length if length else 0


def decode_positions(positions: torch.Tensor, delta: int) -> torch.Tensor:
    """[3, T] ids of tokens at 1-D sequence positions `positions` [T] past the prompt."""
    return (positions + delta).expand(3, -1)


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, section: Sequence[int]):
    """positions [3, T] -> (cos, sin), each [T, 2 * len(inv_freq)] float32: frequency pair
    j turns by the row of the section it falls in."""
    if sum(section) != inv_freq.numel():
        raise ValueError(f"mrope_section {list(section)} must add up to {inv_freq.numel()} frequency pairs")
    rows = torch.repeat_interleave(torch.arange(len(section)) % 3, torch.tensor(list(section)))
    chosen = positions.to(inv_freq.device)[rows]  # [pairs, T]: each pair's position row
    angles = chosen.t().float() * inv_freq.float()  # [T, pairs]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()
