"""draw.first_max on the CPU (first_max.cpp) against torch's own max(dim=-1).indices: the
first of tied maxima, a NaN counted as the largest, rows of any width (vector tails)."""

from __future__ import annotations

import pytest
import torch

from backend import kernels
from backend.sampling.draw import first_max

needs_kernels = pytest.mark.skipif(kernels.native() is None, reason="no AVX-512 on this CPU")


def _cases(rows: int, width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=gen)
    if rows > 1:
        x[1] = x[1].round()  # many tied values, the maximum among them
    if rows > 2:
        x[2, width // 2 :] = float("nan")  # a NaN after the row's maximum
        x[2, -1] = 1e9
    if rows > 3:
        x[3] = float("-inf")  # every token masked
    if rows > 4:
        x[4, -1] = float("inf")
        x[4, 0] = float("inf")  # tied infinities: the first
    if rows > 5:
        x[5, -1] = float("nan")  # a NaN in the tail alone
    if rows > 6:
        x[6] = 0.0
        x[6, width - 1] = -0.0  # signed zeros tie
    return x


@needs_kernels
@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49152, 49153])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_first_max_is_torchs_max_indices(rows, width):
    x = _cases(rows, width)
    assert torch.equal(first_max(x), x.max(dim=-1).indices)
    assert torch.equal(kernels.native().first_max(x), x.max(dim=-1).indices)  # the kernel ran


@needs_kernels
def test_a_view_or_another_dtype_takes_the_same_answer():
    x = _cases(8, 300)
    assert torch.equal(first_max(x[:, 10:250]), x[:, 10:250].max(dim=-1).indices)  # not contiguous
    assert torch.equal(first_max(x.double()), x.double().max(dim=-1).indices)
