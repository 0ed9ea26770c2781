"""A GGUF file's weights on the transformers path, read one tensor at a time. transformers'
reader dequantizes the whole file to float32 before it fills the model (a 7B file: 28 GB at
load, whatever its blocks take). Here each tensor is dequantized and processed as that reader
does (its TensorProcessor: names, Gemma's norms, split experts, un-permuted rows), then a
linear's weight whose file blocks hold exactly those numbers (a q / k tensor's rows taken in
transformers' order where llama.cpp permuted them) is kept as its blocks, and the state dict
transformers loads holds a placeholder of no memory in its place (a stride-0 view, taken by
reference). Only the tensor at hand is float32 beside the blocks, and what transformers'
modules hold as float: embeddings, norms, biases, a mixture's routers and experts (its
experts are one stacked parameter, not linears). Files transformers' newer reader reads
(Qwen3.5, LFM2: transformers.integrations.gguf) load as it does, one tensor at a time too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backend.runner.gguf_experts import EXPERT_PARTS, expert_rows
from backend.runner.gguf_weights import permuted_row_order
from backend.runner.models.transformers_experts import ExpertBlocks, stacked_experts
from backend.runner.quant.formats import QuantizedWeight, concat_rows, dequantize, select_rows
from backend.runner.quant.gguf_blocks import GgufTensor, read_architecture, read_tensor_table, split_parts
from backend.runner.quant.gguf_formats import BLOCK_TYPES, common_format

TIED_HEAD = "lm_head.weight"  # the key of a tied head's blocks: the embedding's, where no output.weight
_lock = threading.Lock()
_ROWS = 4096  # rows dequantized at a time


@contextmanager
def streamed(kept: Kept | None) -> Iterator[None]:
    """While `from_pretrained(..., gguf_file=...)` runs inside: the file's state dict read one
    tensor at a time (every part of a split file), `kept` filled with what is left in blocks
    (None: every tensor float, as transformers' reader has them)."""
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    original = GgufHfQuantizer.get_state_dict

    def get_state_dict(self, checkpoint_file: str, model: Any) -> dict[str, torch.Tensor]:
        if self.supported:  # transformers' newer reader: its own load, tensor by tensor
            return original(self, checkpoint_file, model)
        return state_dict(Path(checkpoint_file), model, self.dtype or torch.float32, kept)

    with _lock:
        GgufHfQuantizer.get_state_dict = get_state_dict
        try:
            yield
        finally:
            GgufHfQuantizer.get_state_dict = original


def newer_reader(source: Path) -> bool:
    """Whether transformers' newer GGUF reader (transformers.integrations.gguf) loads the file
    itself (Qwen3.5, LFM2): one file's tensors, linears in blocks only after the load."""
    try:
        from transformers.integrations.gguf.utils import is_gguf_arch_supported
    except ImportError:  # a transformers without that reader
        return False
    return is_gguf_arch_supported(read_architecture(source))


@dataclass
class Kept:
    """What a GGUF load left in the file's blocks: linears by weight name (transformers'), a
    layer's stacked experts by their module's name."""

    linears: dict[str, QuantizedWeight] = field(default_factory=dict)
    experts: dict[str, ExpertBlocks] = field(default_factory=dict)


def state_dict(source: Path, model: Any, dtype: torch.dtype, kept: Kept | None) -> dict:
    """transformers' name -> tensor of the file's weights for `model` (built on the meta device),
    what is kept in blocks (into `kept`, where given) standing as placeholders."""
    import numpy as np
    from gguf import GGUFReader
    from transformers import modeling_gguf_pytorch_utils as reader

    parsed = reader.load_gguf_checkpoint(str(source))  # the metadata: the config its processor reads
    parsed["tensors"] = tensors = {}
    processor = reader.TENSOR_PROCESSORS.get(read_architecture(source), reader.TensorProcessor)(config=parsed["config"])
    mapping = reader.get_gguf_hf_weights_map(model, processor)
    keeping = _Keeping(model, {t.name: t for t in read_tensor_table(source)}, kept, dtype) if kept else None
    for tensor in (tensor for part in split_parts(source) for tensor in GGUFReader(part).tensors):
        if keeping is not None:  # a layer's experts, complete once the next layer's tensors begin
            keeping.experts_before(tensor.name, tensors)
        result = processor.process(
            weights=_floats(tensor), name=tensor.name, tensor_key_mapping=mapping, parsed_parameters=parsed
        )
        if result.name not in mapping:
            continue
        own = np.require(result.weights, requirements=["C", "W"])  # the file's own memory: a copy
        name, value = mapping[result.name], torch.from_numpy(own).to(dtype)
        del result, own  # one tensor's floats at a time
        tensors[name] = keeping.linear(name, tensor.name, value) if keeping is not None else value
    if keeping is not None:
        keeping.experts_before(None, tensors)
    return tensors


class _Keeping:
    """Which of the tensors read go into blocks (`kept`), each checked against the floats
    transformers' processing made of it."""

    def __init__(self, model: Any, table: dict[str, GgufTensor], kept: Kept, dtype: torch.dtype):
        self.table, self.kept, self.dtype = table, kept, dtype
        self.linears, self.heads = _linear_weights(model), _head_counts(model.config)
        self.tied = "output.weight" not in table
        self.experts = {name: m for name, m in model.named_modules() if stacked_experts(m)}
        self.layer: str | None = None

    def linear(self, name: str, file_name: str, value: torch.Tensor) -> torch.Tensor:
        """`value`, or a placeholder where the linear `name` was kept in its blocks."""
        if name not in self.linears and not (self.tied and file_name == "token_embd.weight"):
            return value
        blocks = file_blocks(self.table.get(file_name), value, self.heads)
        if blocks is not None and name in self.linears:
            self.kept.linears[name] = blocks
            return _placeholder(value)
        if blocks is not None:  # the embedding stays float (rows gathered); the tied head multiplies its blocks
            self.kept.linears[TIED_HEAD] = blocks
        return value

    def experts_before(self, file_name: str | None, tensors: dict[str, torch.Tensor]) -> None:
        """At the first tensor of a new layer (`blk.N.`; None: the end), the previous layer's
        experts into blocks where the file's hold exactly the floats processed for them."""
        layer = file_name.split(".")[1] if file_name and file_name.startswith("blk.") else None
        if layer == self.layer or self.layer is None:
            self.layer = layer or self.layer
            return
        done, self.layer = self.layer, layer
        for module in (m for m in self.experts if f".{done}." in f"{m}."):
            gate_up, down = (tensors.get(f"{module}.{p}") for p in ("gate_up_proj", "down_proj"))
            blocks = _expert_blocks(self.table, done, gate_up, down)
            if blocks is not None:
                self.kept.experts[module] = blocks
                tensors[f"{module}.gate_up_proj"], tensors[f"{module}.down_proj"] = map(_placeholder, (gate_up, down))


def _expert_blocks(table: dict[str, GgufTensor], layer: str, gate_up: torch.Tensor | None, down: torch.Tensor | None):
    """A layer's ExpertBlocks from the file's `ffn_{gate,up,down}_exps` where each expert's rows
    hold exactly `gate_up` [E, 2I, H] and `down` [E, H, I]; else None."""
    parts = [table.get(f"blk.{layer}.{part}.weight") for part in EXPERT_PARTS]
    if gate_up is None or down is None or any(t is None or t.type_name not in BLOCK_TYPES for t in parts):
        return None
    gate, up, down_blocks = (t.weight() for t in parts)
    if not all(isinstance(w, QuantizedWeight) for w in (gate, up, down_blocks)):
        return None
    experts, width, hidden = gate_up.shape[0], gate_up.shape[1] // 2, down.shape[1]
    if gate.out_features != experts * width or down_blocks.out_features != experts * hidden:
        return None
    blocks = ExpertBlocks([], [])
    for e in range(experts):
        pair = common_format([expert_rows(gate, e, width), expert_rows(up, e, width)])
        if pair is None or not _equal(concat_rows(pair), gate_up[e]):
            return None
        blocks.gate_up.append(concat_rows(pair))
        blocks.down.append(expert_rows(down_blocks, e, hidden))
        if not _equal(blocks.down[-1], down[e]):
            return None
    return blocks


def _placeholder(value: torch.Tensor) -> torch.Tensor:
    """A tensor of `value`'s shape and no memory (a stride-0 view), taken by reference."""
    return torch.zeros((), dtype=value.dtype).expand(value.shape)


def _floats(tensor: Any) -> Any:
    """A reader tensor's numbers as float32 numpy (the gguf package's dequantize), _ROWS of its
    outermost rows at a time: its temporaries are several times what it dequantizes."""
    import numpy as np
    from gguf import dequantize

    data = tensor.data
    if data.ndim < 2 or data.shape[0] <= _ROWS:
        return dequantize(data, tensor.tensor_type)
    first = dequantize(data[:1], tensor.tensor_type)
    floats = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    for start in range(0, data.shape[0], _ROWS):
        floats[start : start + _ROWS] = dequantize(data[start : start + _ROWS], tensor.tensor_type)
    return floats


def file_blocks(tensor: GgufTensor | None, loaded: torch.Tensor, heads: dict[str, int]) -> QuantizedWeight | None:
    """The file tensor's blocks where they hold exactly the `loaded` [out, in] weights (a q or k
    tensor's rows un-permuted by its `heads` count where that makes them so); else None."""
    if tensor is None or tensor.type_name not in BLOCK_TYPES or loaded.dim() != 2:
        return None
    weight = tensor.weight()
    if not isinstance(weight, QuantizedWeight) or weight.out_features != loaded.shape[0]:
        return None
    return same_weights(weight, loaded, heads.get(tensor.name.removesuffix(".weight").rsplit(".", 1)[-1]))


def same_weights(weight: QuantizedWeight, loaded: torch.Tensor, heads: int | None) -> QuantizedWeight | None:
    """`weight`, or its rows un-permuted (a q / k tensor of `heads` heads), holding exactly
    the `loaded` [out, in] weights; None if neither does."""
    if _equal(weight, loaded):
        return weight
    if heads and weight.out_features % (2 * heads) == 0:
        reordered = select_rows(weight, permuted_row_order(weight.out_features, heads))
        if _equal(reordered, loaded):
            return reordered
    return None


def _equal(weight: QuantizedWeight, loaded: torch.Tensor) -> bool:
    """Whether the blocks dequantize to `loaded` exactly, compared _ROWS rows at a time."""
    rows = range(0, weight.out_features, _ROWS)
    return all(torch.equal(dequantize(select_rows(weight, slice(a, a + _ROWS))), loaded[a : a + _ROWS]) for a in rows)


def _linear_weights(model: torch.nn.Module) -> set[str]:
    """The names of the model's nn.Linear weights (those a RowLinear will multiply)."""
    return {f"{name}.weight" for name, module in model.named_modules() if type(module) is torch.nn.Linear}


def _head_counts(config: Any) -> dict[str, int]:
    """The q and k projections' head counts, by their GGUF names (llama.cpp permuted their rows)."""
    text = config.get_text_config()
    q_heads = getattr(text, "num_attention_heads", None)
    try:
        kv_heads = getattr(text, "num_key_value_heads", None) or q_heads
    except Exception:  # a per-layer value transformers refuses to read globally
        kv_heads = q_heads
    return {"attn_q": q_heads, "attn_k": kv_heads} if q_heads else {}
