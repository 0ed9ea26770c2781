"""Keeps model `llm` serving: notices a dead Python backend stub and restarts tritonserver.

Triton 2.51 does not notice a dead stub by itself (measured): `/v2/models/llm/ready`
stays 200, every new request fails after ~1 s with "Stub process 'llm_0_0' is not
healthy", the stub is never restarted, and a request in flight when the stub died
never gets another response (its stream hangs). So readiness alone cannot tell; the
watchdog also looks for the stub among the server's children. When the stub, the
server or readiness is gone, it restarts tritonserver on the same ports: killing the
server ends the hung streams (the frontend answers them with an error), and the
frontend's gRPC client reconnects to the new server by itself.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from launcher.procs import StartupError

if TYPE_CHECKING:
    from launcher.stack import TritonServer

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.5
NOT_READY_CHECKS = 3  # readiness may blink under load: restart after this many failed checks in a row


@dataclass(slots=True)
class Restart:
    """One restart: why, when it began and how long until the model was ready again."""

    reason: str
    started: float  # time.monotonic()
    seconds: float = 0.0


@dataclass(slots=True)
class Watchdog:
    """Checks one TritonServer and restarts it when its model is gone.

    `check()` is one round (the `serve` command calls it from its main loop);
    `start()` runs rounds on a thread until `close()` (what `Stack(supervise=True)` does).
    Restart from a thread that outlives the server: the server's PR_SET_PDEATHSIG is tied
    to the thread that started it, so the thread runs until `close()`.
    """

    server: TritonServer
    interval_s: float = CHECK_INTERVAL_S
    restarts: list[Restart] = field(default_factory=list)
    error: StartupError | None = None  # a restart that failed: the thread gives up
    _not_ready: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _paused: bool = False
    _closed: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def check(self) -> Restart | None:
        """Restart the server if its model is gone; the restart, or None if all is well.

        Raises StartupError when the restarted server does not come up."""
        with self._lock:
            if self._paused:
                return None
            reason = self._fault()
            if reason is None:
                return None
            return self._restart(reason)

    def _fault(self) -> str | None:
        """Why the model cannot serve, or None."""
        server = self.server
        if server.process is None:
            return None  # not started, or stopped on purpose
        code = server.process.poll()
        if code is not None:
            return f"tritonserver exited with status {code}"
        if not server.has_stub():
            return "the Python backend stub of model 'llm' is gone"
        self._not_ready = 0 if server.is_model_ready() else self._not_ready + 1
        if self._not_ready >= NOT_READY_CHECKS:
            return "model 'llm' is not ready"
        return None

    def _restart(self, reason: str) -> Restart:
        restart = Restart(reason, time.monotonic())
        print(f"watchdog: {reason}; restarting tritonserver", file=sys.stderr, flush=True)
        self._not_ready = 0
        self.server.restart()
        restart.seconds = time.monotonic() - restart.started
        self.restarts.append(restart)
        print(f"watchdog: model ready again after {restart.seconds:.1f} s", file=sys.stderr, flush=True)
        return restart

    def pause(self) -> None:
        """No more restarts (waits for one in progress): the stack is stopping."""
        with self._lock:
            self._paused = True

    # -- on a thread ------------------------------------------------------------

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._run, name="triton-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; call it after the server is stopped (see the class docstring)."""
        self.pause()
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while not self._closed.wait(self.interval_s):
            try:
                self.check()
            except StartupError as exc:
                self.error = exc
                log.error("watchdog: restart failed, giving up: %s", exc)
                self._closed.wait()  # keep the thread (and so the server's parent thread) alive
                return
            except Exception:  # a failed round must not end supervision
                log.exception("watchdog: check failed")
