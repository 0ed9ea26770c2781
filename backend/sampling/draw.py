"""The draw: filters over temperature-scaled logits, then an exact draw by the exponential race.

Steps 5-7 of the sampler's order (backend.sampling.sampler): temperature; top-k,
top-p, min-p, top-n-sigma on the sorted row; argmax(p / q) with q ~ Exp(1), q from a
counter-based hash of (seed, output index, token id) for seeded rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backend.kernels import native

if TYPE_CHECKING:
    from backend.types.sampling_row import SamplingRow

_MASK64 = (1 << 64) - 1


def seed_for_token(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for token `index` of a request seeded with `seed` (splitmix64)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def first_max(x: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R]: argmax of each row (its first maximum; NaN counts as the largest).
    On the CPU in float32, our kernel (first_max.cpp: 5 us for one 49k row, 55 for 32, where
    max's indices took 45 and 664); else max's indices on the CPU (measured ~1.6x argmax's: 105 ->
    75 us a row), argmax elsewhere, where max does not promise the first of tied maxima."""
    lib = native() if x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] else None
    if lib is not None:
        return lib.first_max(x.contiguous())
    return x.max(dim=-1).indices if x.is_cpu else x.argmax(dim=-1)


def _finite_std(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R]: population std over each row's finite entries."""
    finite = torch.isfinite(logits)
    if bool(finite.all()):
        return logits.std(dim=-1, correction=0)  # the common case, in one pass
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    values = torch.where(finite, logits, 0.0)
    mean = values.sum(dim=-1, keepdim=True) / count
    variance = torch.where(finite, (values - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count
    return variance.sqrt().squeeze(1)


def filtered_probs(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
    top_n_sigma: torch.Tensor | None = None,
):
    """Top-k, top-p, min-p, then top-n-sigma over temperature-scaled logits.

    logits: [B, V] float32; top_k: [B] int64 (0: off); top_p: [B] float32 (1.0: off);
    min_p: [B] float32 (0: off); top_n_sigma: [B] float32 (0: off).
    Returns (probs, order): probs [B, W] over the descending order `order` [B, W] of
    the W highest logits: W = the largest top_k when every row sets one, else V.
    """
    vocab = logits.shape[-1]
    width = vocab if bool((top_k <= 0).any()) else min(int(top_k.max()), vocab)
    if width < vocab:
        # what every row keeps lies in the top `width`: a partial sort suffices
        sorted_logits, order = logits.topk(width, dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(width, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    masked_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = masked_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass
    # before it is still below top_p (so the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    if min_p is not None:
        drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
    if top_n_sigma is not None:
        spread = top_n_sigma * _finite_std(logits)
        floor = torch.where(top_n_sigma > 0, sorted_logits[:, 0] - spread, float("-inf"))
        drop |= sorted_logits < floor.unsqueeze(1)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), order


_MASK32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix32 on int64 tensors holding 32-bit values (products wrap; the mask
    keeps their exact low 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def seeded_exponential(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """keys: [R] int64 (seed_for_token); ids: [R, W] token ids -> Exp(1) noise [R, W].

    Counter-based: the noise of token t is a pure function of (key, t), so it can be
    computed at just the tokens a row kept, and equals itself whatever the batch sorted.
    """
    lo, hi = (keys & _MASK32).unsqueeze(1), (keys >> 32).unsqueeze(1)
    h = _mix32(_mix32(ids ^ lo) ^ hi)
    h = _mix32(h ^ (ids * 0x9E3779B9 & _MASK32) ^ lo)
    return exponential_from_bits(h)


def exponential_from_bits(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> Exp(1) noise, never 0: u = (top 24 bits + 0.5) / 2**24 in (0, 1),
    computed in float64. (In float32 the largest u rounds to 1.0, whose noise -log(1) = 0
    made p / q = 0 / 0 = NaN for a filtered-out token, and argmax picks NaN: one
    row-step in ~340 over a 49k vocabulary drew a token its filters had removed.)"""
    uniform = ((h >> 8).double() + 0.5) / float(1 << 24)
    return (-uniform.log()).float()


def _exponential_noise(ids: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """ids: [R, W] -> Exp(1) noise [R, W]; a seeded row's from its (seed, output index)."""
    # never exactly 0 (p / 0 is NaN or inf): a filtered-out token must lose the race
    noise = torch.empty(ids.shape, device=ids.device).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
    seeded = [i for i, row in enumerate(rows) if row.params.seed is not None]
    if seeded:
        keys = [seed_for_token(rows[i].params.seed, rows[i].num_output_tokens) for i in seeded]
        index = torch.tensor(seeded, device=ids.device)
        noise[index] = seeded_exponential(torch.tensor(keys, device=ids.device), ids[index])
    return noise


def _per_row(values: list[float] | list[int], device, used: bool = True) -> torch.Tensor | None:
    return torch.tensor(values, device=device) if used else None


def draw(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [R, V] of non-greedy rows -> token ids [R]."""
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], device=device)
    logits = logits / temps.unsqueeze(1)
    uses_min_p = any(r.params.min_p > 0 for r in rows)
    uses_sigma = any(r.params.top_n_sigma > 0 for r in rows)
    if uses_min_p or uses_sigma or any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
        probs, order = filtered_probs(
            logits,
            _per_row([r.params.top_k for r in rows], device),
            _per_row([r.params.top_p for r in rows], device),
            _per_row([r.params.min_p for r in rows], device, uses_min_p),
            _per_row([r.params.top_n_sigma for r in rows], device, uses_sigma),
        )
    else:
        probs, order = logits.softmax(dim=-1), None
    if order is None:  # unsorted: column t is token t
        order = torch.arange(logits.shape[1], device=device).expand(logits.shape)
    # A seeded row's noise is a function of the token id, so it draws the same token
    # whether its batch took the full sort, the partial one, or none.
    choice = first_max(probs / _exponential_noise(order, rows))
    return order.gather(1, choice.unsqueeze(1)).squeeze(1)
