"""Paged attention over the KV cache layout of backend/forward_batch.py.

On the CPU (our kernels built) every query row of a step, decode, verify or prefill, goes to
one kernel, `paged_attention_rows` (backend/kernels/paged_attention.cpp), each row over its
own positions: a row's numbers never depend on the rest of the step (batch invariance).
Elsewhere, plain torch: the model builds one `AttentionPlan` per forward (and per distinct
sliding window) and reuses it in every layer, so the gather indices and masks cost once
per step, not once per layer. Short queries (a decode's one token, a verify step's 1 + k)
run as one batched SDPA call per query length over their gathered, padded contexts; longer
prefill chunks run one SDPA call per sequence, batched ([1, H, T, D]: 3-D inputs take
SDPA's slow path). A chunk after cached context, on a CPU without our kernels, runs as two
unmasked flash calls merged by their logsumexps (`_split_attention`) instead of SDPA under
a [Tq, L] mask: a 512-token chunk at 4,000 positions, 9 query heads over 3 KV heads, 2
cores, took 102 ms a layer 3-D and masked, 36 batched and masked, 30 split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.kernels import paged_attention_rows
from backend.runner.eager_attention import eager_attention
from backend.runner.forward_batch import ForwardBatch


@dataclass(slots=True)
class PagedKv:
    """One layer's KV cache [2, num_blocks, block_size, KV, D] with the flat per-slot views
    attention reads and writes, made once (the model keeps them across steps) rather
    than by a handful of view ops in every layer of every step."""

    cache: torch.Tensor
    keys: torch.Tensor  # [num_slots, KV, D]
    values: torch.Tensor
    key_rows: torch.Tensor  # [num_slots, KV * D], what a gather reads
    value_rows: torch.Tensor


def paged_kv(kv_cache: torch.Tensor) -> PagedKv:
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    keys, values = (kv_cache[i].view(-1, num_kv_heads, head_dim) for i in (0, 1))
    rows = num_kv_heads * head_dim
    return PagedKv(kv_cache, keys, values, keys.view(-1, rows), values.view(-1, rows))


@dataclass(slots=True)
class DecodeRows:
    """Sequences of one short query length (a decode: 1; a verify step: 1 + its drafts),
    attended in one batched SDPA call over their gathered, padded contexts."""

    token_rows: torch.Tensor | None  # [Bd * query_len] rows of the flat batch; None: all, in order
    query_len: int
    slots: torch.Tensor  # [Bd * L] flat KV slot of each context position, padding points at slot 0
    mask: torch.Tensor | None  # [Bd, 1, query_len * G, L] additive (0 or -inf); None: nothing masked
    # one sequence whose context is one run of slots (its blocks consecutive): the first
    # slot and the length, so the layers read a view of the cache instead of a gather
    run: tuple[int, int] | None = None
    # a decode's (query_len 1) block tables [Bd, max_blocks] and context lengths [Bd] int64,
    # which our paged kernel reads the cache through in place; None: no decode group
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    window: int | None = None


@dataclass(slots=True)
class PrefillChunk:
    start: int  # first row of the chunk in the flat batch
    end: int
    slots: torch.Tensor | None  # [L] context slots; None when the chunk is the whole context
    # [Tq, L] bool; None: plain causal over the chunk, after every cached key (`_split_attention`)
    mask: torch.Tensor | None


@dataclass(slots=True)
class QueryRows:
    """Every row of the step for our paged kernel (paged_attention_rows, on the CPU): row r
    attends over positions up to lens[r] of sequence seq[r], through block_tables[seq[r]].
    One kernel for decode, verify and prefill rows, each row's arithmetic its own: the same
    numbers whatever the batch, the prefill chunks or the cache hits (batch invariance)."""

    tables: torch.Tensor  # [B, max_blocks] int64
    seq: torch.Tensor  # [T] int64
    lens: torch.Tensor  # [T] int64
    window: int | None


@dataclass(slots=True)
class AttentionPlan:
    decode: list[DecodeRows]  # one per short query length present
    prefills: list[PrefillChunk]
    rows: QueryRows | None = None  # on the CPU: the kernel's operands, which every row then takes
    window: int | None = None  # the sliding window it was built for


MAX_SHORT_QUERY = 16  # query tokens up to which a sequence joins the batched decode call


def build_attention_plan(
    batch: ForwardBatch,
    block_size: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    query_group: int = 1,
) -> AttentionPlan:
    """`query_group`: query heads per KV head (the layout a multi-token mask needs)."""
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(batch.query_lens):
        if n <= MAX_SHORT_QUERY:
            by_len.setdefault(n, []).append(i)
    decode = [
        _decode_rows(batch, seqs, n, block_size, dtype, sliding_window, query_group) for n, seqs in by_len.items()
    ]
    prefills = [
        _prefill_chunk(batch, i, block_size, sliding_window, dtype)
        for i, n in enumerate(batch.query_lens)
        if n > MAX_SHORT_QUERY
    ]
    return AttentionPlan(decode, prefills, _query_rows(batch, sliding_window), sliding_window)


def _query_rows(batch: ForwardBatch, sliding_window: int | None) -> QueryRows | None:
    """The step's rows for paged_attention_rows, where it may run (the CPU); query t of a
    sequence sits at position ctx - query_len + t and sees the positions up to there."""
    if batch.block_tables.device.type != "cpu":
        return None
    seq, lens = [], []
    for i, (n, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        seq += [i] * n
        lens += range(ctx - n + 1, ctx + 1)
    tables = batch.block_tables.to(torch.int64).contiguous()
    return QueryRows(
        tables, torch.tensor(seq, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64), sliding_window
    )


def _context_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    # block_tables: [B, max_blocks] -> slots: [B, length], the flat slot of each context position
    pos = torch.arange(length, device=block_tables.device)
    return block_tables[:, pos // block_size] * block_size + pos % block_size


def _decode_rows(
    batch: ForwardBatch,
    seqs: list[int],
    query_len: int,
    block_size: int,
    dtype: torch.dtype,
    sliding_window: int | None,
    query_group: int,
) -> DecodeRows:
    device = batch.block_tables.device
    tables = batch.block_tables
    token_rows = None
    if len(seqs) < batch.num_seqs:
        tables = tables.index_select(0, torch.tensor(seqs, device=device))
        rows = [batch.query_start[i] + t for i in seqs for t in range(query_len)]
        token_rows = torch.tensor(rows, device=device)
    ctx = [batch.context_lens[i] for i in seqs]
    max_len = max(ctx)
    slots = _context_slots(tables, max_len, block_size).reshape(-1)
    if query_len == 1 and min(ctx) == max_len and (sliding_window is None or sliding_window >= max_len):
        run = _slot_run(tables, max_len, block_size)  # every key seen
        return DecodeRows(token_rows, 1, slots, None, run, *_paged(tables, ctx, sliding_window))
    # Query t of a sequence sits at position ctx - query_len + t: it sees the keys up to
    # there (and, with a sliding window, only the last `sliding_window` of them). An
    # additive mask measured faster than a boolean one in SDPA's CPU kernel.
    last = torch.tensor(ctx, device=device)[:, None] - query_len + torch.arange(query_len, device=device)
    pos = torch.arange(max_len, device=device)[None, None, :]
    seen = pos <= last[:, :, None]  # [Bd, query_len, L]
    if sliding_window is not None:
        seen &= pos > last[:, :, None] - sliding_window
    mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
    if query_len > 1:  # one mask row per (query token, query head of the group), in that order
        mask = mask.repeat_interleave(query_group, dim=1)
        return DecodeRows(token_rows, query_len, slots, mask[:, None, :, :])
    return DecodeRows(token_rows, 1, slots, mask[:, None, :, :], None, *_paged(tables, ctx, sliding_window))


def _paged(tables: torch.Tensor, ctx: list[int], window: int | None) -> tuple:
    """DecodeRows' fields for the paged kernel: (tables, lens, window)."""
    return tables.contiguous(), torch.tensor(ctx, dtype=torch.int64, device=tables.device), window


def _slot_run(tables: torch.Tensor, length: int, block_size: int) -> tuple[int, int] | None:
    """(first slot, length) when one sequence's first `length` slots are consecutive."""
    if tables.shape[0] != 1:
        return None
    blocks = tables[0, : -(-length // block_size)].tolist()
    return (blocks[0] * block_size, length) if blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None


def _prefill_chunk(
    batch: ForwardBatch, i: int, block_size: int, sliding_window: int | None, dtype: torch.dtype
) -> PrefillChunk:
    start, end = batch.query_start[i], batch.query_start[i + 1]
    q_len, ctx_len = end - start, batch.context_lens[i]
    device = batch.block_tables.device
    slots = None
    if ctx_len > q_len:
        slots = _context_slots(batch.block_tables[i : i + 1], ctx_len, block_size)[0]
    mask = None
    if sliding_window is not None or (slots is not None and not _splits(device, dtype)):
        # The chunk's queries are the last q_len positions of the context.
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
        k_pos = torch.arange(ctx_len, device=device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    return PrefillChunk(start, end, slots, mask)


def write_kv(kv_cache: torch.Tensor | PagedKv, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]
    kv = kv_cache if isinstance(kv_cache, PagedKv) else paged_kv(kv_cache)
    kv.keys.index_copy_(0, slot_mapping, k.to(kv.keys.dtype))  # KV_CACHE_DTYPE=float16: rounded here
    kv.values.index_copy_(0, slot_mapping, v.to(kv.values.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor | PagedKv,
    batch: ForwardBatch,
    scale: float,
    plan: AttentionPlan | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write the new k/v at batch.slot_mapping, then attend; returns [T, num_heads, head_dim].

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (rotary already applied).
    `kv_cache`: the layer's cache, or its `paged_kv` views (kept by the caller across steps).
    `plan` is build_attention_plan(batch, ...) shared by the layers; built here when absent.
    `softcap` > 0: scores soft-capped, softcap * tanh(score / softcap) (Gemma 2): our kernel,
    else eager_attention (SDPA does not take it); 0: off.
    """
    kv = kv_cache if isinstance(kv_cache, PagedKv) else paged_kv(kv_cache)
    if plan is None:
        plan = build_attention_plan(batch, kv.cache.shape[2], q.dtype)
    write_kv(kv, k, v, batch.slot_mapping)
    if plan.rows is not None:
        rows = plan.rows
        out = paged_attention_rows(q, (kv.keys, kv.values), rows.tables, rows.seq, rows.lens, kv.cache.shape[2],
                                   scale, rows.window, softcap)  # fmt: skip
        if out is not None:
            return out
    if softcap:
        return eager_attention(q, kv, batch, scale, plan.window, softcap)
    if len(plan.decode) == 1 and plan.decode[0].token_rows is None:
        return _decode_attention(q, kv, plan.decode[0], scale)
    out = torch.empty_like(q)
    for group in plan.decode:
        rows = group.token_rows
        out.index_copy_(0, rows, _decode_attention(q.index_select(0, rows), kv, group, scale))
    for chunk in plan.prefills:
        out[chunk.start : chunk.end] = _prefill_attention(q, k, v, kv.cache, chunk, scale)
    return out


def _decode_attention(q: torch.Tensor, kv: PagedKv, rows: DecodeRows, scale: float) -> torch.Tensor:
    # q: [Bd * n, H, D] -> [Bd, KV, n * G, D]: a KV head's G query heads, for each of a
    # sequence's n query tokens, act as n * G queries of one sequence, so GQA needs
    # neither repeat_interleave nor enable_gqa here, and each sequence's context is
    # gathered once for all its query tokens.
    num_kv_heads, head_dim = kv.keys.shape[1], kv.keys.shape[2]
    n, num_heads = rows.query_len, q.shape[1]
    num_seqs, group = q.shape[0] // n, num_heads // num_kv_heads
    if n == 1:  # [Bd, H, D] is [Bd, KV, G, D] already: a view
        grouped = q.view(num_seqs, num_kv_heads, group, head_dim)
    else:
        grouped = q.view(num_seqs, n, num_kv_heads, group, head_dim).transpose(1, 2)
        grouped = grouped.reshape(num_seqs, num_kv_heads, n * group, head_dim)
    if rows.run is not None:  # one sequence, consecutive slots: a view of the cache
        first, length = rows.run
        k, v = (half[first : first + length].unsqueeze(0).transpose(1, 2) for half in (kv.keys, kv.values))
    else:
        k, v = (_gather(half, rows.slots, num_seqs, num_kv_heads) for half in (kv.key_rows, kv.value_rows))
    out = F.scaled_dot_product_attention(grouped, k.to(q.dtype), v.to(q.dtype), attn_mask=rows.mask, scale=scale)
    if n == 1:
        return out.reshape(num_seqs, num_heads, head_dim)  # a view when SDPA's output allows
    out = out.view(num_seqs, num_kv_heads, n, group, head_dim).transpose(1, 2)
    return out.reshape(num_seqs * n, num_heads, head_dim)


def _gather(rows: torch.Tensor, slots: torch.Tensor, num_seqs: int, num_kv_heads: int) -> torch.Tensor:
    # rows: [num_slots, KV * D] -> [Bd, KV, L, D]. A dim-0 index_select on the flat view
    # measured ~2x faster than one select of k and v together.
    flat = rows.index_select(0, slots)
    return flat.view(num_seqs, -1, num_kv_heads, rows.shape[1] // num_kv_heads).transpose(1, 2)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    # -> [Tq, H, D]
    q_seq = q[chunk.start : chunk.end]  # [Tq, H, D]
    if chunk.slots is None:
        k_seq, v_seq = k[chunk.start : chunk.end], v[chunk.start : chunk.end]  # [Tq, KV, D]
    else:
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        kv = kv_cache.view(2, -1, num_kv_heads, head_dim).index_select(1, chunk.slots).to(q.dtype)
        k_seq, v_seq = kv[0], kv[1]  # [L, KV, D]
        if chunk.mask is None:
            return _split_attention(q_seq, k_seq, v_seq, scale)
    # batched [1, H, T, D]: 3-D inputs take SDPA's slow path (a 512-token first chunk: 7.3 -> 4.8 ms)
    out = F.scaled_dot_product_attention(
        *(x.transpose(0, 1)[None] for x in (q_seq, k_seq, v_seq)),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (out, logsumexp)


def _splits(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a chunk after cached context runs as `_split_attention` there."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


def _split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk's attention over its cached context and itself, without a mask.

    q: [Tq, H, D], the last Tq positions of k, v: [L, KV, D] -> [Tq, H, D]. Every query
    sees every cached key, and the chunk's own keys causally: one flash call each, with
    the softmax's logsumexp. Over both parts the softmax weighs each part's output by its
    share of the exponentials, exp(lse_part) / (exp(lse_past) + exp(lse_own)): for the past,
    sigmoid(lse_past - lse_own).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group, cached = num_heads // num_kv_heads, k.shape[0] - num_tokens
    # the past: a KV head's G query heads x Tq tokens are G * Tq queries of that head (no mask, no repeat)
    grouped = q.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    grouped = grouped.reshape(1, num_kv_heads, group * num_tokens, head_dim)
    past_k, past_v = (x[:cached].transpose(0, 1)[None] for x in (k, v))
    past, past_lse = _FLASH_CPU(grouped, past_k, past_v, 0.0, False, scale=scale)  # [1, KV, G * Tq, D]
    # the chunk itself: causal, each KV head repeated to its query heads
    own_k, own_v = (x[cached:].repeat_interleave(group, dim=1).transpose(0, 1)[None] for x in (k, v))
    own, own_lse = _FLASH_CPU(q.transpose(0, 1)[None], own_k, own_v, 0.0, True, scale=scale)  # [1, H, Tq, D]
    weight = torch.sigmoid(past_lse.reshape(num_heads, num_tokens) - own_lse.reshape(num_heads, num_tokens))
    out = torch.lerp(own[0].float(), past.view(num_heads, num_tokens, head_dim).float(), weight[:, :, None])
    return out.transpose(0, 1).to(q.dtype)  # merged in float32: a no-op for float32
