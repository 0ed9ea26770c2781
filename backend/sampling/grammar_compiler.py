"""Structured output, the compiling half: (kind, spec) -> CompiledGrammar, cached, bounded,
and isolated per tenant.

`GrammarCompiler` (one per engine; called from the threads that prepare requests) turns
a (kind, spec) pair of a tenant into a `CompiledGrammar` (backend.sampling.grammar):

1. the spec is checked against its limits and adjusted (backend.sampling.grammar_specs),
   before anything compiles: a spec past GRAMMAR_MAX_SPEC_NODES / _CHARS costs
   milliseconds;
2. a worker process compiles it (backend.sampling.grammar_workers) within the tenant's
   share of the slots and GRAMMAR_COMPILE_TIMEOUT_S, killed past it;
3. once a worker has shown that it compiles in time, this process compiles it again, on
   a thread at the workers' low priority, and keeps it in an LRU cache.

The cache is keyed by tenant as well, as the prefix cache is: one tenant cannot learn
from a fast answer that another compiled a schema, and cannot hold another's grammars.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import xgrammar as xgr

from backend.contract import ContractError
from backend.sampling.grammar import CompiledGrammar, GrammarState
from backend.sampling.grammar_specs import GRAMMAR_KINDS, checked_spec, compile_spec, xgrammar_reason
from backend.sampling.grammar_workers import CompileTimeout, CompileWorkers, Vocabulary, lower_priority


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one compilation may cost (EngineConfig's GRAMMAR_* settings)."""

    compile_timeout_s: float = 10.0  # a slot's wait and the worker's compilation, together
    workers: int = 2  # compilations at once, in all
    per_tenant: int = 1  # compilations of one tenant at once
    # the largest spec compiled: JSON values of a json_schema / structural_tag spec (the
    # largest real tool lists have about 12k: 128 tools of 10 parameters; 300 anyOf
    # branches of 60 properties, 37k, compile for 40 s), characters of a regex / ebnf
    max_spec_nodes: int = 30_000
    max_spec_chars: int = 65_536


_Key = tuple[str, str, str]  # (tenant, kind, spec)


class GrammarCompiler:
    """Compiles (kind, spec) pairs for one tokenizer; safe to call from many threads.

    The cache holds a Future per key, so concurrent requests of one tenant for the same
    grammar share one compilation and its outcome: the first one's thread runs it, within
    its deadline, and the others wait for it. Failures are not kept. Construction waits
    for a worker to start (2-6 s), so no deadline pays for the first start.
    """

    def __init__(
        self,
        tokenizer_path: str | Path,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = 256,
        *,
        limits: GrammarLimits | None = None,
        compile_threads: int = 2,
    ):
        from transformers import AutoTokenizer  # heavy; only grammar users pay for it

        limits = limits or GrammarLimits()
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # our LRU replaces xgrammar's cache, which has no bound by default
        self._xgr = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads, cache_enabled=False)
        vocabulary = Vocabulary(str(tokenizer_path), vocab_size, tuple(stop_token_ids))
        self.workers = CompileWorkers(vocabulary, limits.workers, limits.per_tenant, compile_threads)
        self.workers.wait_started()
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.limits = limits
        self._cache: OrderedDict[_Key, Future] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, spec: str, tenant: str = "") -> CompiledGrammar:
        """The compiled grammar for (kind, spec) in `tenant`'s cache; raises ContractError
        naming the bad field (a compilation past its time names grammar_spec)."""
        if kind not in GRAMMAR_KINDS:
            raise ContractError("grammar_kind", f"unknown grammar kind {kind!r}; expected one of {GRAMMAR_KINDS}")
        key = (tenant, kind, "" if kind == "json_object" else spec)  # json_object takes no spec
        future, owned = self._cached_or_new(key)
        if owned:
            self._settle(future, key, time.monotonic() + self.limits.compile_timeout_s)
        return future.result()  # bounded by its owner's deadline

    def new_state(self, kind: str, spec: str, tenant: str = "") -> GrammarState:
        return self.compile(kind, spec, tenant).new_state()

    def close(self) -> None:
        """Stop the worker processes; compilations after this fail."""
        self.workers.close()

    def _cached_or_new(self, key: _Key) -> tuple[Future, bool]:
        """(the key's Future, whether the caller is to run its compilation)."""
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future, False
            future = self._cache[key] = Future()
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda done: self._forget_failed(key, done))
        return future, True

    def _forget_failed(self, key: _Key, future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _settle(self, future: Future, key: _Key, deadline: float) -> None:
        try:
            future.set_result(self._compile_new(*key, deadline))
        except Exception as exc:  # a ContractError, or a bug: either way every waiter sees it
            future.set_exception(exc)

    def _compile_new(self, tenant: str, kind: str, spec: str, deadline: float) -> CompiledGrammar:
        text = checked_spec(kind, spec, self.limits.max_spec_nodes, self.limits.max_spec_chars)
        try:
            with self.workers.tenant_slot(tenant, deadline):
                reason = self.workers.check(kind, text, deadline)
                if reason is not None:
                    raise ContractError("grammar_spec", f"invalid {kind} grammar: {reason}")
                return CompiledGrammar(self._compile_here(kind, text), self.vocab_size)
        except CompileTimeout:
            raise self._too_slow(kind) from None

    def _compile_here(self, kind: str, text: str) -> xgr.CompiledGrammar:
        """xgrammar in this process, on a thread of its own at the workers' low priority
        (xgrammar's threads inherit it), so the engine's steps win the cores. It took the
        worker less than the time limit, and takes about as long here."""
        done: list[xgr.CompiledGrammar | Exception] = []

        def run() -> None:
            lower_priority()
            try:
                done.append(compile_spec(self._xgr, kind, text))
            except Exception as exc:  # xgrammar raises RuntimeError for all of these; be broad
                done.append(exc)

        thread = threading.Thread(target=run, name="grammar-compile")
        thread.start()
        thread.join()
        if isinstance(done[0], Exception):
            raise ContractError("grammar_spec", f"invalid {kind} grammar: {xgrammar_reason(done[0])}")
        return done[0]

    def _too_slow(self, kind: str) -> ContractError:
        return ContractError(
            "grammar_spec",
            f"compiling the {kind} grammar took longer than {self.limits.compile_timeout_s:g} s; "
            "simplify it (fewer anyOf/oneOf branches, properties or nesting levels)",
        )
