"""CPU tensors on transparent huge pages (2 MiB), for what a decode step reads end to end.

A decode step at one stream reads every weight once, ~110 MB with QUANT=int4: in 4 KiB
pages that is ~27,000 pages, each a TLB miss and a page walk every step, since no TLB holds
them all. Linux gives a region huge pages where it is advised (`madvise(MADV_HUGEPAGE)`;
THP "madvise", the default of many distributions, gives them nowhere else), so the tensors
that are read whole every step are copied into, or made in, one anonymous region advised
so: the quantized weights' tiles (quant/apply.py) and the KV cache (drafters.allocate_kv).
Measured on the default model's 121 int4 / int8 tiled weights, one row, all of them a
step (2 cores; alternated, 8 rounds): 4.13 ms against 4.51 ms in 4 KiB pages.

Where THP is off, or not Linux, the region is plain pages: the same numbers, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor of a region starts on a cache line


def _region(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed anonymous memory, uint8, starting on a huge page boundary and
    advised as huge pages (the tensor keeps the mapping alive: freed with it)."""
    size = max(1, -(-nbytes // HUGE_PAGE)) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE here: plain pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -memory.data_ptr() % HUGE_PAGE
    return memory[start : start + nbytes]


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on huge pages, touched now (as torch.zeros's are), so that
    its memory is taken at start and no step pays its page faults."""
    tensor = _region(torch.Size(shape).numel() * dtype.itemsize).view(dtype).view(tuple(shape))
    return tensor.zero_()


def copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU `tensors`, side by side in one region of huge pages."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, end = [], 0
    for n in sizes:
        end = -(-end // _ALIGN) * _ALIGN
        offsets.append(end)
        end += n
    region = _region(end)
    return [
        region[at : at + n].view(t.dtype).view(t.shape).copy_(t)
        for t, at, n in zip(tensors, offsets, sizes, strict=True)
    ]


def release_freed_memory() -> None:
    """Give the OS back what the C heap holds free (glibc's malloc_trim): a load's transient
    tensors, freed one at a time, leave tens to hundreds of MB in the heap that a serving
    process would otherwise keep. A no-op where the C library has no malloc_trim."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
