"""Structured output, the masking half: each sequence's place in its grammar, and the batched mask.

- `CompiledGrammar` (backend.sampling.grammar_compiler makes them) is immutable and
  shared by every sequence that uses it.
- `GrammarState` (one per sequence; engine thread only) follows the tokens a sequence
  has produced and says which tokens may come next.
- `apply_grammar_masks` puts -inf on every token a row's grammar refuses, for a whole
  batch at once.

What we rely on in xgrammar 0.2.9 (checked by tests/backend/sampling/test_grammar.py):
- Token masks are bitmasks of int32 words, ceil(vocab_size / 32) per row, where
  vocab_size is the model's logits width given to the TokenizerInfo; ids beyond the
  tokenizer's own tokens, and special tokens other than the stop tokens, are refused.
- A matcher refuses a token without changing state, and accepts a stop token only
  once its grammar is complete; after that it is terminated and refuses everything.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import xgrammar as xgr


class CompiledGrammar:
    """A compiled grammar; immutable and shared by every sequence that uses it."""

    __slots__ = ("compiled", "vocab_size")

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int):
        self.compiled = compiled
        self.vocab_size = vocab_size

    def new_state(self) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(self.compiled), self.vocab_size)


class GrammarState:
    """Where one sequence stands in its grammar. Engine thread only."""

    __slots__ = ("_matcher", "vocab_size", "stop_token_ids")

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(matcher.stop_token_ids)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar refuses it."""
        return self._matcher.accept_token(token_id)

    def accept_many(self, token_ids: Sequence[int]) -> bool:
        """Advance by all the tokens, or by none: False if the grammar refuses any of them."""
        for accepted, token_id in enumerate(token_ids):
            if not self._matcher.accept_token(token_id):
                self.rollback(accepted)
                return False
        return True

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of the tokens, in order, the grammar would accept from here (the state
        is left as it was: a check, not an advance)."""
        accepted = 0
        for token_id in token_ids:
            if not self._matcher.accept_token(token_id):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted; every token is refused now."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The output so far is a whole sentence of the grammar (a stop token may come next)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected speculative tokens, say)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (int32, CPU, xgrammar's layout).

        A terminated matcher refuses to fill (xgrammar raises); it gets its stop tokens,
        so a row that keeps decoding past its grammar can only say it is done.
        """
        if self._matcher.is_terminated():
            _allow_only(bitmask[row], self.stop_token_ids)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


def _allow_only(bitmask_row: torch.Tensor, token_ids: Sequence[int]) -> None:
    words = [0] * bitmask_row.shape[0]
    for token_id in token_ids:
        words[token_id // 32] |= 1 << (token_id % 32)
    # as int32: bit 31 is the sign bit
    bitmask_row.copy_(torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32))


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask [batch, ceil(vocab_size / 32)] on the CPU (xgrammar's layout)."""
    return xgr.allocate_token_bitmask(batch, vocab_size)


# For each byte value, 8 additive penalties: 0.0 where the byte's bit is set (allowed),
# -inf where it is clear. A bitmask's int32 words, read as little-endian bytes, index it.
_BYTE_PENALTIES = torch.where(
    ((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf")
)  # [256, 8]


class BitmaskBuffer:
    """What apply_grammar_masks reuses from step to step: the CPU bitmask the matchers
    fill (grown to the most grammar rows seen), its copy on the logits' device, and the
    byte-penalty table there."""

    def __init__(self):
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        self._penalties: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def host(self, rows: int, vocab_size: int) -> torch.Tensor:
        words = (vocab_size + 31) // 32
        if self._host is None or self._host.shape[0] < rows or self._host.shape[1] != words:
            self._host = allocate_bitmask(rows, vocab_size)
        return self._host[:rows]

    def penalties(self, host_rows: torch.Tensor, width: int, vocab_size: int, like: torch.Tensor) -> torch.Tensor:
        """[R, width] on like's device and dtype: 0.0 where the bitmask allows a token, -inf
        elsewhere, columns from vocab_size on included."""
        bitmask = self._on(like.device, host_rows)
        table = self._penalties.get((like.device, like.dtype))
        if table is None:
            table = self._penalties[like.device, like.dtype] = _BYTE_PENALTIES.to(like.device, like.dtype)
        # [R, 4W] bytes -> [R, 4W, 8] penalties -> [R, 32W]
        penalty = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), table).view(bitmask.shape[0], -1)
        if penalty.shape[1] == width == vocab_size:
            return penalty
        return torch.nn.functional.pad(penalty[:, :vocab_size], (0, width - vocab_size), value=float("-inf"))

    def _on(self, device: torch.device, host_rows: torch.Tensor) -> torch.Tensor:
        if device.type == "cpu":
            return host_rows
        buffer = self._device
        if buffer is None or buffer.device != device or buffer.shape != self._host.shape:
            buffer = self._device = torch.empty(self._host.shape, dtype=torch.int32, device=device)
        rows = buffer[: host_rows.shape[0]]
        rows.copy_(host_rows)  # blocking: the host rows are refilled next step
        return rows


_thread_buffers = threading.local()


def _default_buffer() -> BitmaskBuffer:
    """One buffer per thread: masks are filled on the engine thread, and a test thread
    never shares a buffer with it."""
    if not hasattr(_thread_buffers, "buffer"):
        _thread_buffers.buffer = BitmaskBuffer()
    return _thread_buffers.buffer


def apply_grammar_masks(
    logits: torch.Tensor,
    states: Sequence[GrammarState | None],
    buffer: BitmaskBuffer | None = None,
) -> None:
    """In place on [B, V] float logits (CPU or CUDA): -inf on every token row i's grammar
    refuses now; rows whose state is None are left untouched, allowed logits keep their
    values (x + 0.0).

    V may exceed the grammar's vocab_size (logits padded past the TokenizerInfo): the
    extra columns of grammar rows are refused too.

    Not xgrammar's apply_token_bitmask_inplace: its CPU kernel took 3-6 ms for 32 rows
    of 49152 on a 2-core machine, this table lookup 0.6-0.8 ms, and its CUDA kernel needs
    the `triton` package. The bits come from xgrammar's matchers either way.
    """
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return
    vocab_size = states[rows[0]].vocab_size
    if logits.shape[-1] < vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} columns, fewer than the grammar's vocab_size {vocab_size}")
    buffer = buffer or _default_buffer()
    bitmask = buffer.host(len(rows), vocab_size)  # one row per grammar row
    for j, i in enumerate(rows):  # on 2 cores a plain loop beats xgrammar's BatchGrammarMatcher threads
        states[i].fill_bitmask(bitmask, j)
    penalty = buffer.penalties(bitmask, logits.shape[-1], vocab_size, logits)
    logits.index_add_(0, torch.tensor(rows, device=logits.device), penalty)
