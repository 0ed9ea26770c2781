"""LoRA in the forward: which rows of a step use which adapter, and the low-rank update.

The batch keeps the plan's order (a row's result never depends on where it sits, so the
base model's rows of a step with adapters are bit for bit those of the same step
without). A layer's projections are adapted in four groups, as the forward fuses them
(q|k|v, o, gate|up, down). Per group, one shrink GEMM s = x A^T, A^T holding each
module's block of W columns side by side, then per module one expand GEMM adding
s_m B_m^T into the module's output columns (the scaling folded into B). Three ways, by
the step:

- `whole`: every row uses one lane: that lane's weights, W its rank; nothing else.
- `mask`: few rows (decode) over several lanes: the lanes' weights packed side by side
  (W the sum of their ranks), and s multiplied by the rows' lane mask; a row of the base
  model gets exact zeros added. A few large GEMMs, every lane's weights read once.
- gathered (`rows` and `segments`): many rows (prefill chunks) over several lanes: each
  lane's rows gathered, adapted with its own weights, added back with one index_add.

A step without adapter rows has no LoraBatch and costs nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QKV, O_PROJ, GATE_UP, DOWN = range(4)
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
MASKED_MAX_ROWS = 128  # above this many rows, several lanes are gathered instead of masked


@dataclass(slots=True)
class GroupWeights:
    """One group's adapter weights: A^T [in, modules * width] (module-major), and per
    module its B^T [width, out] (None: not adapted) and its columns of the group's output."""

    a_t: torch.Tensor
    b_t: list[torch.Tensor | None]
    outputs: list[slice]
    width: int


@dataclass(slots=True)
class LaneWeights:
    """An adapter version's weights (or several, packed) for the forward: per layer, per
    group (None where no adapter touches the group)."""

    layers: list[list[GroupWeights | None]]


@dataclass(slots=True)
class LoraSegment:
    start: int  # entries [start, end) of LoraBatch.rows use `weights`
    end: int
    weights: LaneWeights


@dataclass(slots=True)
class LoraBatch:
    """Which rows of a step use which adapter: one of `whole`, `mask` (with `packed`), or
    `rows` and `segments` (gathered)."""

    whole: LaneWeights | None = None
    mask: torch.Tensor | None = None  # [T, width of packed]: 1 in each row's lane columns
    packed: LaneWeights | None = None
    rows: torch.Tensor | None = None  # the adapter rows, grouped by lane
    segments: list[LoraSegment] | None = None


def add_lora(out: torch.Tensor, x: torch.Tensor, lora: LoraBatch, layer: int, group: int) -> None:
    """out[r] += (x[r] A^T) B^T for every adapter row r, with its lane's A and B (in place)."""
    if lora.whole is not None:
        _update(out, x, lora.whole.layers[layer][group])
    elif lora.mask is not None:
        _update(out, x, lora.packed.layers[layer][group], lora.mask)
    else:
        parts = [(s, s.weights.layers[layer][group]) for s in lora.segments]
        parts = [(slice(s.start, s.end), w) for s, w in parts if w is not None]
        if not parts:
            return
        target, xs = out.new_zeros(len(lora.rows), out.shape[1]), x.index_select(0, lora.rows)
        for rows, weights in parts:
            _update(target[rows], xs[rows], weights)
        out.index_add_(0, lora.rows, target)


def _update(out: torch.Tensor, x: torch.Tensor, w: GroupWeights | None, mask: torch.Tensor | None = None) -> None:
    if w is None:
        return
    s = torch.mm(x, w.a_t)  # [T, modules * width]
    if mask is not None:
        s.view(s.shape[0], len(w.b_t), w.width).mul_(mask[:, None, :])
    for m, (b_t, cols) in enumerate(zip(w.b_t, w.outputs, strict=True)):
        if b_t is not None:
            out[:, cols].addmm_(s[:, m * w.width : (m + 1) * w.width], b_t)
