"""QUANT on the transformers path: the model's RowLinears (every nn.Linear it had) served
from a GGUF file's own blocks (MODEL=file.gguf, QUANT=auto) or quantized at load
(QUANT=int8 | int4), multiplied by our quantized kernels as on our own forward.

A GGUF tensor replaces a linear only where it stands for exactly the weights transformers
loaded there (its dequantized numbers equal, bit for bit; a q / k tensor whose rows
llama.cpp's converter permuted, as transformers' reader un-permutes them): a file whose
converter otherwise reordered or rescaled a tensor keeps that linear in float32. A
mixture's router (`gate`, `router`) stays float32 under QUANT=int8 | int4: its top-k picks
the experts, and a rounding there would pick others."""

from __future__ import annotations

from pathlib import Path

import torch

from backend.kernels import native
from backend.runner.models.transformers_experts import ExpertBlocks, install, stacked_experts
from backend.runner.models.transformers_lm import RowLinear
from backend.runner.quant.apply import LM_HEAD_GROUP, QuantSpec
from backend.runner.quant.formats import QuantizedWeight, quantize, tile_weight
from backend.runner.quant.gguf_blocks import read_architecture, read_tensor_table
from backend.runner.quant.gguf_formats import BLOCK_TYPES
from backend.runner.quant.matmul import GEMM_DTYPES, activations_for
from backend.runner.transformers_gguf import same_weights

_ROUTERS = ("gate", "router")


def quantize_linears(
    linears: list[tuple[str, RowLinear]], spec: QuantSpec, source: Path | None, heads: dict[str, int] | None = None
) -> str | None:
    """Quantize the linears in place as QUANT (`spec`) says; a line saying what was done
    (None: they stay float32). Our kernels take float32 activations on the CPU only.
    `heads`: the q and k projections' head counts ("attn_q", "attn_k"), by which a file's
    Llama-permuted rows are put back in transformers' order."""
    if spec.kind == "none" or not linears:
        return None
    weight_t = linears[0][1].weight_t
    if not isinstance(weight_t, QuantizedWeight) and not multiplies_blocks(spec, weight_t.dtype, weight_t.device):
        if spec.kind == "auto":
            return None
        raise ValueError(f"QUANT={spec.kind} on the transformers path needs float32 weights on the CPU and our kernels")
    if spec.kind == "auto":
        return _gguf_blocks(linears, spec, source, heads or {}) if source is not None else None
    done = 0
    for name, row in linears:
        head = name == "lm_head"
        kind, group = ("int8", LM_HEAD_GROUP) if head else (spec.kind, spec.group)
        if name.rsplit(".", 1)[-1] in _ROUTERS or row.weight_t.shape[0] % group:
            continue
        _install(row, quantize(row.weight_t.t(), kind, group, spec.symmetric or head), spec, spec.kind)
        done += 1
    return f"QUANT={spec.kind}: {done} of {len(linears)} linears quantized at load (routers and the rest stay float32)"


def multiplies_blocks(spec: QuantSpec, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether QUANT (`spec`) can put linears of `dtype` weights on `device` in blocks: our
    kernels take float32 activations on the CPU only."""
    return spec.kind != "none" and native() is not None and device.type == "cpu" and dtype == torch.float32


def _gguf_blocks(linears: list[tuple[str, RowLinear]], spec: QuantSpec, source: Path, heads: dict[str, int]) -> str:
    """Each linear whose GGUF tensor holds exactly its weights takes the tensor's blocks (a q
    or k tensor's rows taken in transformers' order where llama.cpp permuted them)."""
    tensors = {t.name: t for t in read_tensor_table(source)}
    names = _name_map(source, tensors)
    done = 0
    for name, row in linears:
        if isinstance(row.weight_t, QuantizedWeight):  # kept in blocks as the file was read (transformers_gguf)
            _install(row, row.weight_t, spec, "int4")
            done += 1
            continue
        gguf_name = names.get_name(name)
        tensor = tensors.get(f"{gguf_name}.weight") if gguf_name else None
        if tensor is None and name == "lm_head":  # tied: the embedding's blocks
            tensor = tensors.get("token_embd.weight")
        served = tensor is not None and tensor.type_name in BLOCK_TYPES  # not a re-quantized one
        weight = tensor.weight() if served else None
        if not isinstance(weight, QuantizedWeight) or weight.out_features != row.weight_t.shape[1]:
            continue
        weight = same_weights(weight, row.weight_t.t(), heads.get((gguf_name or "").rsplit(".", 1)[-1]))
        if weight is not None:
            _install(row, weight, spec, "int4")  # llama.cpp's arithmetic: int8 activations where VNNI
            done += 1
    return f"QUANT=auto: {done} of {len(linears)} linears in the GGUF file's own block formats (the rest float32)"


def _name_map(source: Path, tensors: dict):
    """gguf-py's map of transformers module names to the file's tensor names."""
    import gguf

    arch_name = read_architecture(source)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    blocks = 1 + max((int(n.split(".")[1]) for n in tensors if n.startswith("blk.")), default=-1)
    return gguf.get_tensor_name_map(arch, blocks)


def install_experts(model: torch.nn.Module, experts: dict[str, ExpertBlocks], spec: QuantSpec) -> str | None:
    """Each module's experts multiplied from the blocks kept for them (a GGUF file's, as it was
    read); a line saying how many layers' experts are, None where none."""
    for name, blocks in experts.items():
        for weight in blocks.weights():
            _tiled(weight, spec, "int4")
        install(model.get_submodule(name), blocks)
    total = sum(1 for m in model.modules() if stacked_experts(m) or hasattr(m, "expert_blocks"))
    return f"{len(experts)} of {total} layers' experts in their blocks" if experts else None


def _install(row: RowLinear, weight: QuantizedWeight, spec: QuantSpec, kind: str) -> None:
    row.weight_t = _tiled(weight, spec, kind)


def _tiled(weight: QuantizedWeight, spec: QuantSpec, kind: str) -> QuantizedWeight:
    """`weight` with its tiles and how QUANT (`spec`) multiplies it (`kind`: its activations' choice)."""
    weight.tiles = tile_weight(weight, activations_for(kind, spec.activations))
    weight.gemv_max_rows, weight.gemm_dtype = spec.gemv_max_rows, GEMM_DTYPES[spec.gemm]
    return weight
