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
from pathlib import Path
from typing import Any

import torch

from backend.runner.gguf_weights import permuted_row_order
from backend.runner.quant.formats import QuantizedWeight, dequantize, select_rows
from backend.runner.quant.gguf_blocks import GgufTensor, read_architecture, read_tensor_table, split_parts
from backend.runner.quant.gguf_formats import BLOCK_TYPES

TIED_HEAD = "lm_head.weight"  # the key of a tied head's blocks: the embedding's, where no output.weight
_lock = threading.Lock()
_ROWS = 4096  # rows dequantized at a time


@contextmanager
def streamed(kept: dict[str, QuantizedWeight] | None) -> Iterator[None]:
    """While `from_pretrained(..., gguf_file=...)` runs inside: the file's state dict read one
    tensor at a time (every part of a split file), `kept` filled with each parameter
    (transformers' name) left in blocks (None: every tensor float, as transformers' reader)."""
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


def state_dict(source: Path, model: Any, dtype: torch.dtype, kept: dict[str, QuantizedWeight] | None) -> dict:
    """transformers' name -> tensor of the file's weights for `model` (built on the meta device),
    the linears kept in blocks (into `kept`, where given) standing as placeholders."""
    import numpy as np
    from gguf import GGUFReader
    from transformers import modeling_gguf_pytorch_utils as reader

    parsed = reader.load_gguf_checkpoint(str(source))  # the metadata: the config its processor reads
    parsed["tensors"] = tensors = {}
    processor = reader.TENSOR_PROCESSORS.get(read_architecture(source), reader.TensorProcessor)(config=parsed["config"])
    mapping = reader.get_gguf_hf_weights_map(model, processor)
    linears, heads = _linear_weights(model), _head_counts(model.config)
    table = {tensor.name: tensor for tensor in read_tensor_table(source)}
    tied = "output.weight" not in table
    for tensor in (tensor for part in split_parts(source) for tensor in GGUFReader(part).tensors):
        result = processor.process(
            weights=_floats(tensor), name=tensor.name, tensor_key_mapping=mapping, parsed_parameters=parsed
        )
        if result.name not in mapping:
            continue
        own = np.require(result.weights, requirements=["C", "W"])  # the file's own memory: a copy
        name, value = mapping[result.name], torch.from_numpy(own).to(dtype)
        del result, own  # one tensor's floats at a time
        if kept is not None and (name in linears or (tied and tensor.name == "token_embd.weight")):
            blocks = file_blocks(table.get(tensor.name), value, heads)
            if blocks is not None and name in linears:
                kept[name] = blocks
                value = torch.zeros((), dtype=dtype).expand(value.shape)
            elif blocks is not None:  # the embedding stays float (rows gathered); the tied head multiplies its blocks
                kept[TIED_HEAD] = blocks
        tensors[name] = value
    return tensors


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
