"""The adapters resident for the forward: MAX_LORAS lanes, each holding one adapter version.

Engine thread only. A running sequence with an adapter holds a reference on the lane of
its version (`acquire` at admission, `release` when it leaves the batch); a lane is
refilled only when no sequence references it, the emptiest or least recently used
first, and its weights are then built anew from zeros: nothing of the version it held
before can remain, whatever the ranks. A version the scheduler cannot place (every
lane referenced by other versions) waits in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.lora.batch import GROUPS, MASKED_MAX_ROWS, GroupWeights, LaneWeights, LoraBatch, LoraSegment
from backend.lora.peft_format import LoraWeights, projection_shape
from backend.lora.registry import AdapterVersion
from backend.types.model_config import ModelConfig


@dataclass(eq=False, slots=True)
class Lane:
    version: AdapterVersion | None = None
    weights: LaneWeights | None = None
    refs: int = 0
    last_used: int = 0  # the acquisition count when it was last acquired


@dataclass(slots=True)
class LoraLanes:
    max_loras: int
    model: ModelConfig
    dtype: torch.dtype
    device: torch.device
    lanes: list[Lane] = field(default_factory=list)
    num_loads: int = 0  # versions built into a lane since start
    _clock: int = 0
    _packed: tuple[LaneWeights, list[slice]] | None = None  # every lane side by side (made when needed)

    def __post_init__(self) -> None:
        self.lanes = [Lane() for _ in range(self.max_loras)]

    def acquire(self, version: AdapterVersion, weights: LoraWeights) -> int | None:
        """The lane holding `version` (filled now if need be), referenced once more;
        None when every lane is referenced by other versions."""
        self._clock += 1
        index = next((i for i, lane in enumerate(self.lanes) if lane.version is version), None)
        if index is None:
            free = [i for i, lane in enumerate(self.lanes) if lane.refs == 0]
            if not free:
                return None
            index = min(free, key=lambda i: (self.lanes[i].version is not None, self.lanes[i].last_used))
            lane = self.lanes[index]
            lane.version, lane.weights = version, None  # the old weights go before the new are built
            lane.weights = lane_weights(weights, self.model, self.dtype, self.device)
            self.num_loads += 1
            self._packed = None
        lane = self.lanes[index]
        lane.refs += 1
        lane.last_used = self._clock
        return index

    def release(self, index: int) -> None:
        self.lanes[index].refs -= 1

    def weights(self, index: int) -> LaneWeights:
        return self.lanes[index].weights

    def packed(self) -> tuple[LaneWeights, list[slice]]:
        """Every filled lane's weights side by side, and each lane's columns (empty: none)."""
        if self._packed is None:
            widths = [lane.version.rank if lane.weights is not None else 0 for lane in self.lanes]
            self._packed = pack([lane.weights for lane in self.lanes], widths)
        return self._packed


def lora_batch(scheduled: list, query_start: list[int], lanes: LoraLanes, device: torch.device) -> LoraBatch | None:
    """Which rows of a batch of `scheduled` (in order) use which lane; None: none does."""
    if all(item.seq.lora_lane is None for item in scheduled):
        return None  # the base model alone: nothing more per step
    row_lanes: list[int | None] = []
    for i, item in enumerate(scheduled):
        row_lanes += [item.seq.lora_lane] * (query_start[i + 1] - query_start[i])
    used = sorted({lane for lane in row_lanes if lane is not None})
    if not used:
        return None
    if len(used) == 1 and None not in row_lanes:
        return LoraBatch(whole=lanes.weights(used[0]))
    if len(row_lanes) <= MASKED_MAX_ROWS:
        packed, columns = lanes.packed()
        mask = torch.zeros(len(row_lanes), packed_width(columns))
        for row, lane in enumerate(row_lanes):
            if lane is not None:
                mask[row, columns[lane]] = 1.0
        return LoraBatch(mask=mask.to(device, lanes.dtype, non_blocking=True), packed=packed)
    rows, segments = [], []
    for lane in used:
        lane_rows = [row for row, held in enumerate(row_lanes) if held == lane]
        segments.append(LoraSegment(len(rows), len(rows) + len(lane_rows), lanes.weights(lane)))
        rows += lane_rows
    return LoraBatch(rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True), segments=segments)


def packed_width(columns: list[slice]) -> int:
    return max((c.stop for c in columns), default=0)


def lane_weights(weights: LoraWeights, model: ModelConfig, dtype: torch.dtype, device: torch.device) -> LaneWeights:
    """An adapter's weights for the forward, each module's block `weights.rank` wide
    (zero-padded where a module's rank is smaller)."""
    width = weights.rank

    def group(layer: int, projs: tuple[str, ...]) -> GroupWeights | None:
        present = {p: weights.modules[(layer, p)] for p in projs if (layer, p) in weights.modules}
        if not present:
            return None
        shapes = [projection_shape(p, model) for p in projs]
        a_t = torch.zeros(shapes[0][0], len(projs) * width)
        b_ts: list[torch.Tensor | None] = []
        for m, p in enumerate(projs):
            if p not in present:
                b_ts.append(None)
                continue
            a, b = present[p]
            a_t[:, m * width : m * width + a.shape[0]] = a.t()
            b_t = torch.zeros(width, b.shape[0])
            b_t[: a.shape[0]] = b.t()
            b_ts.append(b_t.to(device, dtype))
        return GroupWeights(a_t.to(device, dtype), b_ts, _outputs(shapes), width)

    return LaneWeights([[group(layer, projs) for projs in GROUPS] for layer in range(model.num_layers)])


def pack(lanes: list[LaneWeights | None], widths: list[int]) -> tuple[LaneWeights, list[slice]]:
    """Several lanes' weights side by side in each module's block (an empty lane: width 0),
    and each lane's columns there."""
    columns, start = [], 0
    for width in widths:
        columns.append(slice(start, start + width))
        start += width
    present = [(lane, width) for lane, width in zip(lanes, widths, strict=True) if lane is not None]
    num_layers = len(present[0][0].layers)
    layers = [[_pack_group([(lane.layers[i][g], w) for lane, w in present]) for g in range(len(GROUPS))]
              for i in range(num_layers)]  # fmt: skip
    return LaneWeights(layers), columns


def _pack_group(parts: list[tuple[GroupWeights | None, int]]) -> GroupWeights | None:
    """One group of several lanes: module m's block holds each lane's block m in turn
    (zeros for a lane that leaves the group or the module alone)."""
    known = next((w for w, _ in parts if w is not None), None)
    if known is None:
        return None
    like = {"dtype": known.a_t.dtype, "device": known.a_t.device}
    fan_in = known.a_t.shape[0]
    blocks_a, b_t = [], []
    for m, cols in enumerate(known.outputs):
        blocks_b = []
        for w, width in parts:
            b = w.b_t[m] if w is not None else None
            blocks_a.append(
                w.a_t[:, m * width : (m + 1) * width] if w is not None else torch.zeros(fan_in, width, **like)
            )
            blocks_b.append(b if b is not None else torch.zeros(width, cols.stop - cols.start, **like))
        adapted = any(w is not None and w.b_t[m] is not None for w, _ in parts)
        b_t.append(torch.cat(blocks_b).contiguous() if adapted else None)
    return GroupWeights(torch.cat(blocks_a, dim=1).contiguous(), b_t, known.outputs, sum(w for _, w in parts))


def _outputs(shapes: list[tuple[int, int]]) -> list[slice]:
    out, start = [], 0
    for _, fan_out in shapes:
        out.append(slice(start, start + fan_out))
        start += fan_out
    return out
