"""Child processes: start, wait until ready, stop; reap Triton's Python backend stubs.

A tritonserver that is killed, or that times out waiting for a request, can leave
its stub (a child process) orphaned with a /dev/shm/triton_python_backend_shm_region_*
file. The stub's command line names its shm region, so the launcher records the stubs
of its server while the server runs, and afterwards kills any that survive and
removes exactly their shm files.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

STUB_NAME = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")


class StartupError(RuntimeError):
    """A process died or never became ready during start-up."""


_ISSUED_PORTS: set[int] = set()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports, none handed out before by this process.

    All sockets stay bound until every port is picked, so the kernel cannot give the same
    port twice within one call (it did: tritonserver refused gRPC and metrics on one port)."""
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in _ISSUED_PORTS:
                ports.append(port)
                _ISSUED_PORTS.add(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies, so nothing is left behind.

    (Linux ties this to the thread that started the child: start stacks from a thread
    that lives as long as they do, e.g. the main thread.)"""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ManagedProcess:
    """One child process in its own process group (Ctrl-C reaches only the launcher)."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], cwd: Path, log_path: Path | None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        stdout = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            stdout = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._log_file = stdout
        self.popen = subprocess.Popen(
            self.argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout else None,
            process_group=0,
            preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def check_alive(self) -> None:
        code = self.poll()
        if code is not None:
            raise StartupError(f"{self.name} exited with status {code} during start-up{self._log_hint()}")

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, wait up to `timeout` s, then SIGKILL. Returns the exit status."""
        if self.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        if self._log_file is not None:
            self._log_file.close()
        return self.popen.returncode

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def _log_hint(self) -> str:
        if self.log_path is None:
            return " (its output is above)"
        return f"; from {self.log_path}:\n{self.log_digest()}"

    def log_digest(self, errors: int = 4, tail: int = 8) -> str:
        """The log's error lines (tritonserver's start with E) and its last lines, tables left out."""
        lines = [ln for ln in self.log_tail(400).splitlines() if ln.strip() and ln[:1] not in "|+"]
        error_lines = [ln for ln in lines if re.match(r"E\d{4} ", ln)]
        return "\n".join([*error_lines[-errors:], "...", *lines[-tail:]])


def wait_http_ok(url: str, procs: Sequence[ManagedProcess], timeout: float, what: str) -> None:
    """Poll `url` until it answers 200; fail fast if any of `procs` exits."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in procs:
            proc.check_alive()
        if http_ok(url):
            return
        if time.monotonic() > deadline:
            raise StartupError(f"{what} was not ready after {timeout:.0f} s ({url})")
        time.sleep(0.25)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


# ---------------------------------------------------------------------------
# Python backend stubs


@dataclass(frozen=True, slots=True)
class Stub:
    pid: int
    start_time: int  # clock ticks since boot: tells this process from a reused pid
    shm_region: str


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # fields after "pid (comm)"


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def find_stubs(server_pid: int) -> list[Stub]:
    """The Python backend stubs that are children of `server_pid` now."""
    stubs = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None or int(fields[1]) != server_pid:  # fields[1]: ppid
            continue
        argv = _cmdline(int(entry.name))
        if argv and argv[0].endswith(STUB_NAME) and len(argv) > 2:
            stubs.append(Stub(int(entry.name), int(fields[19]), argv[2]))  # fields[19]: starttime
    return stubs


def _is_same_process(stub: Stub) -> bool:
    fields = _stat_fields(stub.pid)
    return fields is not None and int(fields[19]) == stub.start_time and fields[0] != "Z"


def signal_stubs(stubs: Sequence[Stub], sig: int) -> None:
    for stub in stubs:
        if _is_same_process(stub):
            _signal(stub.pid, sig)


def reap_stubs(stubs: Sequence[Stub], timeout: float = 3.0) -> list[int]:
    """Kill the stubs that outlived their server; remove their shm files. Returns pids killed."""
    alive = [s for s in stubs if _is_same_process(s)]
    for stub in alive:
        _signal(stub.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_is_same_process(s) for s in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    for stub in alive:
        if _is_same_process(stub):
            _signal(stub.pid, signal.SIGKILL)
    for stub in stubs:
        (SHM_DIR / stub.shm_region).unlink(missing_ok=True)
    return [s.pid for s in alive]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
