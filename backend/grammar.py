"""Structured output: compile a grammar once, then mask each step's logits to what it accepts.

Three nouns, on two threads:
- `GrammarCompiler` (one per engine; called from Triton's request threads) turns a
  (kind, spec) pair into a `CompiledGrammar`, with an LRU cache and a time limit.
- `GrammarState` (one per sequence; engine thread only) follows the tokens a sequence
  has produced and says which tokens may come next.
- `apply_grammar_masks` puts -inf on every token a row's grammar refuses, for a whole
  batch at once.

Built on xgrammar 0.2.9. What we rely on (checked by tests/test_grammar.py):
- Token masks are bitmasks of int32 words, ceil(vocab_size / 32) per row, where
  vocab_size is the model's logits width given to the TokenizerInfo; ids beyond the
  tokenizer's own tokens, and special tokens other than the stop tokens, are refused.
- A matcher refuses a token without changing state, and accepts a stop token only
  once its grammar is complete; after that it is terminated and refuses everything.
- Compilation releases the GIL but cannot be cancelled, and has no time limit of its
  own: a schema with many anyOf branches of many properties takes minutes, a schema
  nested 1000 levels deep 44 s. We run it on a daemon thread and stop waiting at a
  deadline (see `GrammarCompiler.compile`), and refuse deep JSON up front.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr

from backend.contract import ContractError

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")

# Most whitespace characters allowed between two JSON tokens. Unbounded whitespace
# (xgrammar's default) lets a weak model, or a sampler with a flat distribution, emit
# newlines forever inside an otherwise valid document; 24 still fits pretty-printed
# JSON nested 5 levels deep with an indent of 4.
JSON_MAX_WHITESPACE = 24
# response_format output is one line, laid out as json.dumps lays it out: ", " and ": "
# and no other whitespace. With free whitespace (xgrammar's default), the default model
# sampling at 0.7 wrote newlines between most tokens and ran out of max_tokens before
# closing the object; the layout carries no information, so it is not left to chance.
_CANONICAL_JSON = {"any_whitespace": False, "separators": (", ", ": ")}
# Deepest JSON nesting a json_schema or structural_tag spec may have. xgrammar's
# compile time grows steeply with depth (schema depth 400: 3 s, 1000: 44 s); real
# schemas stay far below this.
MAX_SPEC_NESTING = 100
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Compilations that may run at once. Each may use `compile_threads` threads, and one
# that outlives its deadline keeps them until it finishes, so this also bounds the
# CPU an abandoned compilation can take from the engine.
_CONCURRENT_COMPILES = 2

_OBJECT_SCHEMA = '{"type": "object"}'
# any characters but the control ones, low to high of them (high empty: no upper bound)
_LENGTH_PATTERN = r"^[^\x00-\x1f]{{{low},{high}}}$"
_XGRAMMAR_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")
_MAX_REASON_CHARS = 400


class GrammarCompiler:
    """Compiles (kind, spec) pairs for one tokenizer; safe to call from many threads.

    The cache holds a Future per key, so concurrent requests for the same grammar
    share one compilation, and a request retried after a timeout waits on the
    compilation already running instead of starting another.
    """

    def __init__(
        self,
        tokenizer_path: str | Path,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = 256,
        *,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        compile_threads: int = 2,
    ):
        from transformers import AutoTokenizer  # heavy; only grammar users pay for it

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # our LRU replaces xgrammar's cache, which has no bound by default
        self._xgr = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(_CONCURRENT_COMPILES)

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        """The compiled grammar for (kind, spec); raises ContractError naming the bad field."""
        if kind not in GRAMMAR_KINDS:
            raise ContractError("grammar_kind", f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
        key = (kind, "" if kind == "json_object" else spec)  # json_object takes no spec
        future = self._cached_or_started(key)
        try:
            return future.result(timeout=self.compile_timeout_s)
        except (FutureTimeout, CancelledError):
            future.cancel()  # succeeds only while it still waits for a slot
            raise ContractError(
                "grammar_spec",
                f"compiling the {kind} grammar took longer than {self.compile_timeout_s:g} s; "
                "simplify it (fewer anyOf/oneOf branches, properties or nesting levels)",
            ) from None

    def new_state(self, kind: str, spec: str) -> GrammarState:
        return self.compile(kind, spec).new_state()

    def _cached_or_started(self, key: tuple[str, str]) -> Future:
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = Future()
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        # failures are not kept: the cache holds grammars and compilations in flight
        future.add_done_callback(lambda done: self._forget_failed(key, done))
        threading.Thread(target=self._run, args=(future, *key), name="grammar-compile", daemon=True).start()
        return future

    def _forget_failed(self, key: tuple[str, str], future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _run(self, future: Future, kind: str, spec: str) -> None:
        """Daemon thread body: a compilation nobody waits for any more cannot block exit."""
        with self._slots:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(CompiledGrammar(self._compile_now(kind, spec), self.vocab_size))
            except Exception as exc:  # a ContractError, or a bug: either way the waiters see it
                future.set_exception(exc)

    def _compile_now(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        if kind == "json_schema":
            schema = _parse_json(kind, spec)
            _bound_string_lengths_by_pattern(schema)
            spec = json.dumps(schema)
        elif kind == "structural_tag":
            tag = _parse_json(kind, spec)
            _patch_structural_tag(tag)
            spec = json.dumps(tag)
        try:
            if kind == "json_object":  # an object, any keys; not xgrammar's builtin, which allows arrays
                return self._xgr.compile_json_schema(_OBJECT_SCHEMA, strict_mode=False, **_CANONICAL_JSON)
            if kind == "json_schema":
                # strict mode (the default) refuses properties the schema does not name
                return self._xgr.compile_json_schema(spec, **_CANONICAL_JSON)
            if kind == "regex":
                return self._xgr.compile_regex(spec)
            if kind == "ebnf":
                return self._xgr.compile_grammar(spec)
            return self._xgr.compile_structural_tag(spec)
        except Exception as exc:  # xgrammar raises RuntimeError for all of these; be broad
            raise ContractError("grammar_spec", f"invalid {kind} grammar: {_xgrammar_reason(exc)}") from exc


def _parse_json(kind: str, spec: str) -> Any:
    """Parse errors from Python's json name line and column; xgrammar's do not."""
    try:
        value = json.loads(spec)
    except (ValueError, RecursionError) as exc:
        raise ContractError("grammar_spec", f"the {kind} spec is not valid JSON: {exc}") from None
    if _json_depth(value) > MAX_SPEC_NESTING:
        raise ContractError("grammar_spec", f"the {kind} spec nests deeper than {MAX_SPEC_NESTING} levels")
    return value


def _json_depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _bound_string_lengths_by_pattern(schema: Any) -> None:
    r"""In place: {"type": "string", "minLength": m, "maxLength": n} becomes the pattern
    ^[^\x00-\x1f]{m,n}$.

    xgrammar 0.2.9 compiles a length-bounded string to [^"\\\r\n]{m,n}, which lets raw
    control characters through (tab, \x15...): invalid JSON that json.loads refuses. A
    pattern is matched against the string's decoded characters and refuses them. Neither
    form allows an escape (\n, \"), so nothing valid is lost. (xgrammar ignores the
    lengths of a string that has a pattern; we leave those alone.)
    """
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "string" and "pattern" not in node and "format" not in node:
                low, high = node.get("minLength", 0), node.get("maxLength")
                if (
                    ("minLength" in node or "maxLength" in node)
                    and _is_count(low)
                    and (high is None or _is_count(high))
                ):
                    node.pop("minLength", None)
                    node.pop("maxLength", None)
                    node["pattern"] = _LENGTH_PATTERN.format(low=low, high="" if high is None else high)
            # constants are values, not schemas: a {"maxLength": 3} inside one stays as it is
            stack.extend(v for k, v in node.items() if k not in ("enum", "const", "default", "examples"))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _patch_structural_tag(tag: Any) -> None:
    """In place: every JSON-schema part of a structural tag gets JSON_MAX_WHITESPACE (unless
    it sets its own bound) and the length-bounded string fix."""
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                node.setdefault("max_whitespace_cnt", JSON_MAX_WHITESPACE)
                _bound_string_lengths_by_pattern(node["json_schema"])
            # a JSON schema's own keywords are not tag formats: do not walk into it
            stack.extend(v for k, v in node.items() if k != "json_schema")
        elif isinstance(node, list):
            stack.extend(node)


def _xgrammar_reason(exc: Exception) -> str:
    """xgrammar's message without its timestamp, C++ source location and check expression."""
    reason = " ".join(_XGRAMMAR_NOISE.sub("", str(exc)).split())
    return reason if len(reason) <= _MAX_REASON_CHARS else reason[:_MAX_REASON_CHARS] + "..."


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
