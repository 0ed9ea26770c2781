"""The quantized matmul: our AVX-512 kernels (kernels.cpp), built once per machine, or a plain
dequantize-then-matmul where they cannot run (no AVX-512, not the CPU, not float32).

`python -m backend.runner.quant.kernels` builds them (`make setup` does), so no server
compiles at its first request. bench/quant_kernels.py measures them against PyTorch's own
int8 / int4 CPU kernels and the dequantize-then-matmul reference.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.runner.quant.formats import QuantizedWeight, dequantize

# Weights with tiles (formats.Tiles, made at load where these kernels run) take the tiles'
# GEMV at every row count: against the float32 GEMM after a dequantize it measured ~1.5x
# (int4) and ~2x (int8) from 1 to 512 rows on the default model's layers (2 cores; the GEMM
# is MKL's, far from this CPU's float32 peak). What follows is the path of weights without
# tiles (rows not a multiple of formats.TILE).
# Up to this many rows the GEMV kernel runs (it decodes each weight once per 8 rows); past it
# the weights are dequantized whole and multiplied by a GEMM, which a prefill chunk amortizes:
# float32 (MKL; exact, the float32 model's numbers) unless QUANT_GEMM=bf16 (oneDNN's bf16
# GEMM, AMX where the CPU has it: faster prefill, activations rounded to bf16). The crossovers
# were measured on the default model's shapes (2 cores): int4's table-lookup GEMV stays ahead
# to ~48 rows (24 rows: 1.5x), int8's to ~12. QUANT_GEMV_MAX_ROWS overrides both.
GEMV_MAX_ROWS = {"int4": 48, "int8": 12}
if os.environ.get("QUANT_GEMV_MAX_ROWS"):
    GEMV_MAX_ROWS = dict.fromkeys(GEMV_MAX_ROWS, int(os.environ["QUANT_GEMV_MAX_ROWS"]))
GEMM_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}
# QUANT_ACTIVATIONS=int8: tiles meet activations rounded to int8 in blocks of 32 at every row
# count (tiles_a8.cpp, AVX-512 VNNI), as llama.cpp's Q4_1 / Q8_0 x Q8_1 (a cap on the rows
# made a row's arithmetic depend on its batch); weights without tiles stay float32. auto (the
# default): int8 where the decoder's linears are int4 (the default model's Q4_1: llama.cpp's
# own arithmetic on its own weights, within its perplexity), float32 otherwise.
# Against the float32 tiles on the default model's 120 int4 linears it measured 1.05-1.36x
# at 1 row (memory-bound), ~1.55x at 12-64 rows, 1.4-1.5x from 128 to 1024; the int8
# lm_head 1.54x at 1 row, ~1.03x from 12 to 64.
ACTIVATIONS = ("auto", "float32", "int8")
_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma")
_SOURCES = [
    str(Path(__file__).with_name(name))
    for name in ("kernels.cpp", "paged_attention.cpp", "tiles.cpp", "tiles_a8.cpp", "decode_layer.cpp", "first_max.cpp")
]


@functools.cache
def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


_CFLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]


@functools.cache
def build_directory() -> Path:
    """The build's folder, named by torch's version and a digest of what the build depends
    on (the sources and headers, their paths, the flags, this Python): every process of
    one checkout loads one build, and two checkouts (or an edit) never rebuild over each
    other's."""
    cache = os.environ.get("LLM_CACHE_DIR") or Path.home() / ".cache" / "tritonllm"
    digest = hashlib.sha256(f"{_CFLAGS} {sys.executable}".encode())
    folder = Path(__file__).parent
    for path in sorted([*folder.glob("*.cpp"), *folder.glob("*.h")]):
        digest.update(f"{path}\0".encode() + path.read_bytes())
    return Path(cache) / "kernels" / f"torch-{torch.__version__}-{digest.hexdigest()[:12]}"


@functools.cache
def native():
    """The compiled module, or None where this CPU lacks the instructions it uses."""
    if not set(_FLAGS) <= _cpu_flags():
        return None

    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return _build(folder)
    except Exception as exc:  # no compiler, no ninja: served by the plain path (QUANT=auto: float32)
        print(f"quantized kernels could not be built in {folder}: {exc}", file=sys.stderr, flush=True)
        return None


def _build(folder: Path):
    from torch.utils.cpp_extension import load

    # torch runs the first `ninja` on PATH. Every process must run the same one: two ninja
    # versions hash a command differently, so each rebuilt what the other had built (the
    # setup's /usr/bin/ninja against the stub's, whose PATH starts with the venv's bin/).
    _venv_bin_first()

    # -ffp-contract=off (_CFLAGS): the dequantization multiplies then adds, as the reference does
    return load(name="tritonllm_quant", sources=_SOURCES, extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                build_directory=str(folder), verbose=False)  # fmt: skip


def _venv_bin_first() -> None:
    """This Python's bin/ (where requirements.txt's ninja is) first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join(p for p in (bin_dir, path) if p)


def _bits(weight: QuantizedWeight) -> int:
    return 4 if weight.kind == "int4" else 8


EMPTY = torch.empty(0)  # what the kernels take for an absent mins / bias tensor


def quant_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, gemv_rows: int | None = None
) -> torch.Tensor:
    """x: [M, in] @ the weight's [in, out] (+ bias) -> [M, out], x's dtype. Up to `gemv_rows`
    rows (default: GEMV_MAX_ROWS of the weight's kind) the GEMV kernel runs; a weight with
    tiles takes the tiles' GEMV at every row count while the GEMM would be float32's (with
    tiles multiplying int8 activations, `Tiles.activations`: their GEMV at every row count)."""
    lib = native() if x.is_cpu and x.dtype == torch.float32 else None
    if lib is None:
        return F.linear(x, dequantize(weight).to(device=x.device, dtype=x.dtype), bias)
    b = EMPTY if bias is None else bias
    if weight.tiles is not None and weight.tiles.activations == "int8":
        return lib.tiled_matmul_a8(x.contiguous(), weight.tiles.data, weight.tiles.params, b)
    gemv = x.shape[0] <= (gemv_rows or GEMV_MAX_ROWS[weight.kind])
    if weight.tiles is not None and (gemv or gemm_dtype() == torch.float32):
        return lib.tiled_matmul(x.contiguous(), weight.tiles.data, weight.tiles.params, b)
    mins = EMPTY if weight.mins is None else weight.mins
    if gemv:
        return lib.quant_matmul(x.contiguous(), weight.q, weight.scales, mins, b, weight.group, _bits(weight))
    bf16 = gemm_dtype() == torch.bfloat16
    w = lib.dequant(weight.q, weight.scales, mins, weight.group, _bits(weight), bf16, _scratch(weight, bf16))
    if bf16:
        y = F.linear(x.to(torch.bfloat16), w).float()
        return y if bias is None else y.add_(bias)
    return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(weight: QuantizedWeight, bf16: bool) -> torch.Tensor:
    """The buffer the dequantized weights are written to, kept and grown to the largest layer:
    a fresh tensor each time measured slower (the allocator hands big blocks back to the OS,
    so every step page-faulted the whole model's weights in again)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    size = weight.out_features * weight.in_features
    buffer = _SCRATCH.get(dtype)
    if buffer is None or buffer.numel() < size:
        _SCRATCH[dtype] = buffer = torch.empty(size, dtype=dtype)
    return buffer


def gemm_dtype() -> torch.dtype:
    name = os.environ.get("QUANT_GEMM") or "float32"
    if name not in GEMM_DTYPES:
        raise ValueError(f"QUANT_GEMM must be one of {', '.join(GEMM_DTYPES)}; got {name!r}")
    return GEMM_DTYPES[name]


@functools.cache
def activations() -> str:
    """QUANT_ACTIVATIONS as set (ACTIVATIONS); read once per process."""
    name = os.environ.get("QUANT_ACTIVATIONS") or "auto"
    if name not in ACTIVATIONS:
        raise ValueError(f"QUANT_ACTIVATIONS must be one of {', '.join(ACTIVATIONS)}; got {name!r}")
    if name == "int8" and "avx512_vnni" not in _cpu_flags():
        raise ValueError("QUANT_ACTIVATIONS=int8 needs a CPU with AVX-512 VNNI")
    return name


def activations_for(kind: str) -> str:
    """What the tiles of a model whose decoder linears are `kind` (QUANT) multiply: float32
    or int8, QUANT_ACTIVATIONS with auto resolved (int8 for int4 where the CPU has VNNI)."""
    name = activations()
    if name == "auto":
        name = "int8" if kind == "int4" and "avx512_vnni" in _cpu_flags() else "float32"
    return name


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over x's last dimension; on the CPU in float32, one call of our kernel (the
    same arithmetic, in another order of additions) instead of PyTorch's six small ops, a
    measurable share of a decode step at one stream."""
    lib = native() if x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and weight.dtype == torch.float32 else None
    if lib is None:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return lib.rms_norm(x.contiguous(), weight, eps)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor | None:
    """One query token's attention, q [H, D] over keys / values [L, KV, D] (one sequence's
    consecutive cache slots): [H, D]; None where our kernel cannot run (the caller's SDPA
    then does). SDPA's call for one query measured ~55 us a layer at one stream."""
    usable = q.is_cpu and q.dtype == torch.float32 == keys.dtype and q.shape[1] % 16 == 0
    lib = native() if usable and q.is_contiguous() and keys.is_contiguous() and values.is_contiguous() else None
    return None if lib is None else lib.decode_attention(q, keys, values, scale)


PAGED_HEAD_DIMS = (32, 64, 128)  # the head sizes paged_decode_attention (and decode_layer) take
KV_KERNEL_DTYPES = (torch.float32, torch.float16)  # the caches they read (KV_CACHE_DTYPE)


def paged_decode_attention(
    q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], tables: torch.Tensor, lens: torch.Tensor,
    block_size: int, scale: float, window: int | None,
) -> torch.Tensor | None:  # fmt: skip
    """One query token per sequence, q [B, H, D], over its cached keys / values, kv: the
    layer's flat slot views [num_slots, KV, D] each, read through `tables` [B, max_blocks]
    up to `lens` [B] (the last `window` positions, with a sliding window): [B, H, D]; None
    where our kernel cannot run (the caller then gathers the contexts for SDPA)."""
    keys, values = kv
    usable = q.is_cpu and q.dtype == torch.float32 and keys.dtype in KV_KERNEL_DTYPES and q.shape[-1] in PAGED_HEAD_DIMS
    lib = native() if usable and keys.is_contiguous() and values.is_contiguous() else None
    if lib is None:
        return None
    return lib.paged_decode_attention(q.contiguous(), keys, values, tables, lens, block_size, scale, window or 0)


def main() -> None:
    lib = native()
    print(f"quantized kernels: {'built in ' + str(build_directory()) if lib else 'not used (no AVX-512 here)'}")


if __name__ == "__main__":
    main()
