"""Structured output, the compiling half: (kind, spec) -> CompiledGrammar, cached and bounded.

`GrammarCompiler` (one per engine; called from Triton's request threads) turns a
(kind, spec) pair into a `CompiledGrammar` (backend.sampling.grammar), with an LRU
cache and a time limit. Specs are checked and adjusted before xgrammar sees them.

Built on xgrammar 0.2.9. Compilation releases the GIL but cannot be cancelled, and has
no time limit of its own: a schema with many anyOf branches of many properties takes
minutes, a schema nested 1000 levels deep 44 s. We run it on a daemon thread and stop
waiting at a deadline (see `GrammarCompiler.compile`), and refuse deep JSON up front.
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

import xgrammar as xgr

from backend.contract import ContractError
from backend.sampling.grammar import CompiledGrammar, GrammarState

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")

# Most whitespace characters allowed between two JSON tokens of a structural tag (tool
# calls). Unbounded whitespace (xgrammar's default) lets a weak model, or a sampler with
# a flat distribution, emit newlines forever inside an otherwise valid document; a bound
# of 24 still let SmolLM2 at temperature 1 write 16+ single-newline tokens in one gap,
# which the content-loop guard (rightly) took for a loop and cut the call short (seen
# once in CI). One character keeps ", ", ": " and a newline; as with response_format,
# the layout of arguments carries no information.
JSON_MAX_WHITESPACE = 1
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
