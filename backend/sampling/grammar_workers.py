"""Grammar compilations that can be stopped, and their slots shared out by tenant.

xgrammar 0.2.9 cannot cancel a compilation, and a schema of many anyOf branches of many
properties compiles for minutes. So compilations run in worker processes (`spawn`: the
Triton stub holds torch and its threads, which a fork would copy half-made), at a low
CPU priority, so the engine's steps win the cores. One past its deadline is stopped by
killing its worker: its slot and its CPU come back at once, and a fresh worker starts
in its place. A worker's start takes 2-6 s (xgrammar's imports: torch, transformers;
the tokenizer's table), so one more worker than slots is kept: while a killed one
starts again, every slot still has a started worker, and the tenant whose compilation
was killed does not pass the start's wait on to the next tenant.

A worker says whether the spec compiles within the deadline, and why not; it does not
send the grammar back. xgrammar's `serialize_json` is no way to carry one: its size
grows with the rules times the automaton (a 40-branch x 40-property schema compiles in
0.3 s and serializes to 720 MB, which takes 10 s to read back), so the Triton process
compiles a spec again once a worker has shown that it compiles in time.

Slots: `workers` compilations at once in all, at most `per_tenant` of one tenant's; a
tenant's next compilation waits for its own earlier ones, within its own deadline.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection

from backend.contract import ContractError, EngineUnavailable

# CPU priority of grammar compilations (the workers, and the Triton process's own thread
# that compiles again): below the engine's 0, so a decode step takes the cores first.
COMPILE_NICENESS = 10
# How long a fresh worker may take to start (imports, the tokenizer's table) before a
# compilation gives up on it; not counted in the compilation's own time.
_START_TIMEOUT_S = 120.0
_PARENT_CHECK_S = 0.5  # how often a worker checks that the Triton process still runs


class CompileTimeout(Exception):
    """No slot came, or the compilation did not end, before the deadline."""


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What a worker builds its xgrammar TokenizerInfo from, as GrammarCompiler does."""

    tokenizer_path: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]


class CompileWorkers:
    """`workers` compilations at once for one vocabulary, `threads` xgrammar threads each,
    in `workers` + 1 processes (a started one to spare); thread-safe."""

    def __init__(self, vocabulary: Vocabulary, workers: int, per_tenant: int, threads: int):
        if workers < 1 or per_tenant < 1:
            raise ValueError("GRAMMAR_COMPILE_WORKERS and GRAMMAR_COMPILES_PER_TENANT must be at least 1")
        self.workers, self.per_tenant = workers, per_tenant
        self._cond = threading.Condition()
        self._idle = [_Worker(vocabulary, threads) for _ in range(workers + 1)]
        self._all = list(self._idle)
        self._running: dict[str, int] = {}  # compilations per tenant, holders of a tenant slot
        self._closed = False

    @contextmanager
    def tenant_slot(self, tenant: str, deadline: float) -> Iterator[None]:
        """One of the tenant's `per_tenant` slots, held for a whole compilation."""
        with self._cond:
            free = lambda: self._closed or self._running.get(tenant, 0) < self.per_tenant
            if not self._cond.wait_for(free, _left(deadline)):
                raise CompileTimeout
            self._check_open()
            self._running[tenant] = self._running.get(tenant, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._running[tenant] -= 1
                if not self._running[tenant]:
                    del self._running[tenant]
                self._cond.notify_all()

    def check(self, kind: str, text: str, deadline: float) -> str | None:
        """Compile in a worker: None if it compiles, else xgrammar's reason. Raises
        CompileTimeout past the deadline (the worker killed), ContractError if the
        worker died on it."""
        with self._cond:
            free = lambda: self._closed or len(self._idle) > len(self._all) - self.workers
            if not self._cond.wait_for(free, _left(deadline)):
                raise CompileTimeout
            self._check_open()
            worker = next((w for w in self._idle if w.ready), self._idle[0])  # a started one first
            self._idle.remove(worker)
        try:
            return worker.run(kind, text, deadline)
        except _WorkerDied as died:
            self._check_open()
            raise ContractError("grammar_spec", f"the {kind} grammar could not be compiled: {died}") from None
        except RuntimeError:  # a worker that cannot start: the server's fault
            self._check_open()
            raise
        finally:
            with self._cond:
                self._idle.append(worker)
                self._cond.notify_all()

    def wait_started(self) -> None:
        """Wait until a worker can compile; RuntimeError (the workers stopped) if none
        does in _START_TIMEOUT_S."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not any(worker.ready for worker in self._all):
            if not _left(deadline):
                self.close()
                raise RuntimeError("no grammar compiling process started")
            time.sleep(0.05)

    def pids(self) -> list[int]:
        """The worker processes running now."""
        return [worker.pid for worker in self._all if worker.alive]

    def close(self) -> None:
        """Stop every worker; compilations waiting or running fail (EngineUnavailable)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._all:
            worker.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineUnavailable("the server is shutting down")


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and its pipe; started at once, started again after a kill or a
    death, until `stop`."""

    def __init__(self, vocabulary: Vocabulary, threads: int):
        self._args = (vocabulary, threads)
        self._lock = threading.Lock()  # the process's start and end (a runner and `stop` may meet)
        self._stopped = False
        self._start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def ready(self) -> bool:
        """Whether it has started (its ready message taken, without waiting); idle workers only."""
        try:
            if not self._ready and self._conn.poll(0):
                self._ready = self._conn.recv() is None
        except (EOFError, OSError):  # it died starting: `run` finds out and starts another
            return False
        return self._ready

    def run(self, kind: str, text: str, deadline: float) -> str | None:
        """The compilation's outcome (None: it compiles; else the reason it does not).
        A worker that died before reading the spec (its pipe broken, or reset: the spec
        left unread) is not the spec's doing: the spec goes once more, to a fresh one."""
        try:
            try:
                return self._compile(kind, text, deadline)
            except (BrokenPipeError, ConnectionResetError):
                self._restart()
                return self._compile(kind, text, deadline)
        except (EOFError, OSError):
            raise _WorkerDied(f"the compiling process died (exit code {self._restart()})") from None

    def _compile(self, kind: str, text: str, deadline: float) -> str | None:
        deadline += self._wait_started()  # a worker's start is not the spec's time
        if _left(deadline) <= 0:
            raise CompileTimeout
        self._conn.send((kind, text))
        return self._receive(_left(deadline))

    def _wait_started(self) -> float:
        """The seconds spent waiting for the process to start; one that died idle (not the
        spec's doing) is replaced first. RuntimeError if it cannot start."""
        started = time.monotonic()
        if not self.alive or self._died_idle():
            self._restart()
        try:
            if not self.ready:
                self._receive(_START_TIMEOUT_S)
                self._ready = True
        except (EOFError, OSError):
            raise RuntimeError(f"a grammar compiling process failed to start (exit code {self._restart()})") from None
        return time.monotonic() - started

    def _died_idle(self) -> bool:
        """Whether a started worker's pipe reads as closed: an idle worker says nothing until
        sent a spec, so anything readable is its end. `alive` alone can miss a death: a pid
        reaped by another waiter reads as running to multiprocessing (waitpid's ECHILD).
        Neither sees a death in progress (a killed process's pipe closes when its last
        thread ends): `run` finds that one out when its spec comes back unread."""
        try:
            return self._ready and self._conn.poll(0)
        except (EOFError, OSError):
            return True

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._end()

    def _receive(self, timeout: float) -> str | None:
        if self._conn.poll(timeout):
            return self._conn.recv()
        self._restart()  # killed: its slot and its CPU are free now
        raise CompileTimeout

    def _restart(self) -> int | None:
        """The old process's exit code."""
        with self._lock:
            exitcode = self._end()
            if not self._stopped:
                self._start()
            return exitcode

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_end, *self._args), name="grammar-compile-worker", daemon=True
        )
        self._process.start()
        child_end.close()
        self._ready = False

    def _end(self) -> int | None:
        self._process.kill()
        self._process.join()
        self._conn.close()
        return self._process.exitcode


def lower_priority() -> None:
    """The calling thread (and the threads it starts) at COMPILE_NICENESS (Linux: per thread)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


# -- the worker process ---------------------------------------------------------


def _serve(conn: Connection, vocabulary: Vocabulary, threads: int) -> None:
    """A worker's life: a ready message once it can compile, then one answer per spec."""
    os.nice(COMPILE_NICENESS)
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    import xgrammar as xgr  # imported here, after the nice: its seconds of imports yield the cores too
    from transformers import AutoTokenizer

    from backend.sampling.grammar_specs import compile_spec, xgrammar_reason

    tokenizer = AutoTokenizer.from_pretrained(vocabulary.tokenizer_path)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocabulary.vocab_size, stop_token_ids=list(vocabulary.stop_token_ids)
    )
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    conn.send(None)
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):  # the Triton process closed the pipe, or is gone
            return
        try:
            compile_spec(compiler, kind, text)
            conn.send(None)
        except Exception as exc:  # xgrammar raises RuntimeError for all of these; be broad
            conn.send(xgrammar_reason(exc))


def _exit_with(parent: int) -> None:
    """A worker busy compiling does not read its pipe: it leaves when its parent is gone."""
    while os.getppid() == parent:
        time.sleep(_PARENT_CHECK_S)
    os._exit(0)
