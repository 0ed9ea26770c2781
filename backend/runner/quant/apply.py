"""QUANT at load: the decoder layers' linear weights (and the lm_head) become QuantizedWeights.

`QUANT=int8|int4` (groups of `QUANT_GROUP_SIZE` inputs, with zero points unless
`QUANT_SYMMETRIC=1`) quantizes the float weights the loader filled. Where the model folder
was converted from a GGUF file that stores a weight in exactly that format (the default
model: Q4_1 linears, a Q8_0 embedding), the GGUF's own blocks are taken instead, so int4
serves the very weights llama.cpp does. The lm_head is int8 in every quantized mode (its
GEMV measured faster than the float32 matmul and int8 keeps it near exact); the embedding
table stays float (one row read per token). MTP heads, draft models and vision towers stay float.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from backend.kernels import cpu_flags, native
from backend.runner import huge_pages
from backend.runner.quant.formats import KINDS, QuantizedWeight, Tiles, quantize, tile_weight
from backend.runner.quant.gguf_blocks import gguf_type, linear_format, read_gguf_weights
from backend.runner.quant.matmul import ACTIVATIONS, GEMM_DTYPES, activations_for

LINEARS = ("qkv_t", "o_proj_t", "gate_up_t", "down_t")
LM_HEAD_GROUP = 32


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """QUANT and its companions as the engine's settings hold them (model_runner builds it
    from EngineConfig); quantize_model hands the last three to every weight."""

    kind: str = "none"  # none | int8 | int4 | auto (resolve_auto)
    group: int = 32
    symmetric: bool = False  # False: zero points (a min per group)
    activations: str = "auto"  # QUANT_ACTIVATIONS: auto | float32 | int8 (matmul.ACTIVATIONS)
    gemm: str = "float32"  # QUANT_GEMM: float32 | bf16, the GEMM past the GEMV's rows (matmul.GEMM_DTYPES)
    gemv_max_rows: int | None = None  # QUANT_GEMV_MAX_ROWS; None: matmul.GEMV_MAX_ROWS of the weight's kind

    def __post_init__(self):
        if self.kind not in ("none", "auto", *KINDS):
            raise ValueError(f"QUANT must be one of none, auto, {', '.join(KINDS)}; got {self.kind!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"QUANT_ACTIVATIONS must be one of {', '.join(ACTIVATIONS)}; got {self.activations!r}")
        if self.gemm not in GEMM_DTYPES:
            raise ValueError(f"QUANT_GEMM must be one of {', '.join(GEMM_DTYPES)}; got {self.gemm!r}")


def resolve_auto(spec: QuantSpec, model: torch.nn.Module, device: torch.device, gguf_file: Path | None) -> QuantSpec:
    """QUANT=auto: where the model folder was converted from a GGUF file whose decoder linears
    are in a block format we serve (the default model: Q4_1), that format, read from the
    file as it is: float32's numbers from a fraction of the bytes (docs/quantization.md).
    Otherwise none: auto never requantizes a float checkpoint (QUANT=int8 does, within 1%
    perplexity), nor runs where our kernels cannot (a GPU, no AVX-512, bf16 weights)."""
    if spec.kind != "auto":
        return spec
    float32 = model.lm_head_t.dtype == torch.float32  # the kernels multiply float32 activations
    if gguf_file is None or device.type != "cpu" or not float32 or native() is None:
        return replace(spec, kind="none")
    stored = linear_format(gguf_file)
    if stored is None:
        return replace(spec, kind="none")
    kind, group, symmetric = stored
    return replace(spec, kind=kind, group=group, symmetric=symmetric)


def quantize_model(
    model: torch.nn.Module, spec: QuantSpec, gguf_file: Path | None = None,
    blocks: dict[str, QuantizedWeight] | None = None,
) -> int:  # fmt: skip
    """Quantize `model`'s decoder linears and lm_head in place; returns how many weights came
    from `gguf_file`'s blocks as they are (0 without a file, or when its formats differ), or
    from `blocks` (a GGUF model's linears in their own formats: backend/runner/gguf_weights.py,
    multiplied by int8 activations where QUANT_ACTIVATIONS=auto and the CPU has VNNI; the
    linears it lacks are quantized as `spec` says)."""
    if spec.activations == "int8" and "avx512_vnni" not in cpu_flags():
        raise ValueError("QUANT_ACTIVATIONS=int8 needs a CPU with AVX-512 VNNI")
    if spec.activations == "int8" and (spec.kind == "none" or native() is None):
        raise ValueError(f"QUANT_ACTIVATIONS=int8 needs int4 or int8 weights and our kernels; QUANT is {spec.kind}")
    if spec.kind == "none":
        return 0
    # built (make setup) or built now, at load, rather than at the first request; without it
    # the weights have no tiles and multiply float32 activations
    kind = "int4" if blocks else spec.kind  # a GGUF file's blocks: llama.cpp's int8 activations
    multiplied_by = activations_for(kind, spec.activations) if native() is not None else "float32"
    gemm_dtype = GEMM_DTYPES[spec.gemm]
    cfg = model.config
    taken: dict[str, QuantizedWeight] = dict(blocks or {})
    if gguf_file is not None:
        linear_type = gguf_type(spec.kind, spec.group, spec.symmetric)
        taken = read_gguf_weights(gguf_file, cfg.num_heads, cfg.num_kv_heads, linear_type)
    for name, module, attr in decoder_linears(model):
        param = getattr(module, attr)
        weight = taken.get(name)
        if blocks is not None and weight is None:
            continue  # a linear the GGUF file keeps in floats stays float
        if weight is None or not _same_shape(weight, param):
            weight = quantize(param.t(), spec.kind, spec.group, spec.symmetric)
        weight.tiles = _gemv_tiles(weight, multiplied_by)
        weight.gemv_max_rows, weight.gemm_dtype = spec.gemv_max_rows, gemm_dtype
        del module._parameters[attr]  # the float weights go; the module holds the quantized ones
        setattr(module, attr, weight)
    head = taken.get("lm_head_t")
    if blocks is None and (head is None or not _same_shape(head, model.lm_head_t)):  # int8, as GGUF's Q8_0
        head = quantize(model.lm_head_t.t(), "int8", LM_HEAD_GROUP, True)
    if head is not None:
        head.tiles = _gemv_tiles(head, multiplied_by)
        head.gemv_max_rows, head.gemm_dtype = spec.gemv_max_rows, gemm_dtype
        model.lm_head_q = head
    linears = [getattr(module, attr) for _, module, attr in decoder_linears(model)]
    _tiles_on_huge_pages([w for w in (*linears, head) if isinstance(w, QuantizedWeight)])
    read = weight_bytes(model) / 1e6
    if blocks:
        print(f"QUANT=auto: {len(taken)} weights in the GGUF file's own block formats, {multiplied_by} activations; "
              f"{read:.0f} MB read per token", file=sys.stderr)  # fmt: skip
        return len(taken)
    source = f"{len(taken)} weights as the GGUF file stores them" if taken else "quantized at load"
    points = ("symmetric" if spec.symmetric else "zero points") + f", {multiplied_by} activations"
    print(
        f"QUANT={spec.kind} (groups of {spec.group}, {points}): {source}; {read:.0f} MB read per token", file=sys.stderr
    )
    return len(taken)


def decoder_linears(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str]]:
    """(name, module, attribute) of each decoder linear: a layer's `LINEARS`, and in a routed
    layer (backend/runner/models/moe.py) each expert's gate|up and down, named
    `layers.{i}.moe.experts.{e}.{attr}`; the router is not one (it stays float)."""
    for i, layer in enumerate(model.layers):
        for prefix, module in layer.named_modules(prefix=f"layers.{i}"):
            yield from ((f"{prefix}.{a}", module, a) for a in LINEARS if hasattr(module, a))


def _gemv_tiles(weight: QuantizedWeight, multiplied_by: str) -> Tiles | None:
    """The weight's copy in the layout of the GEMV that runs here (none: our kernels do not)."""
    return tile_weight(weight, multiplied_by) if native() is not None else None


def _tiles_on_huge_pages(weights: list[QuantizedWeight]) -> None:
    """The tiles a decode step reads whole, moved into one region of huge pages (huge_pages.py)."""
    tiles = [w.tiles for w in weights if w.tiles is not None]
    if not tiles:  # our kernels do not run here
        return
    moved = huge_pages.copies([t for tile in tiles for t in (tile.data, tile.params)])
    for tile, data, params in zip(tiles, moved[::2], moved[1::2], strict=True):
        tile.data, tile.params = data, params


def _same_shape(weight: QuantizedWeight, param: torch.Tensor) -> bool:
    return (weight.in_features, weight.out_features) == tuple(param.shape)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: the decoder's linears and norms, and the
    lm_head in the format it runs in (the embedding table's single rows are left out)."""
    total = 0
    for layer in model.layers:  # a routed layer: all its experts (a token reads top_k of them)
        total += sum(p.numel() * p.element_size() for p in layer.parameters())
        total += sum(w.nbytes for m in layer.modules() for w in vars(m).values() if isinstance(w, QuantizedWeight))
    head = getattr(model, "lm_head_q", None)
    return total + (head.nbytes if head is not None else model.lm_head_t.numel() * model.lm_head_t.element_size())
