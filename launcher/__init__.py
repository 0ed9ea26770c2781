"""Set-up and process management: `python -m launcher setup | serve`, and `Stack` for tests."""

from launcher.procs import StartupError
from launcher.stack import Frontend, Stack, TritonPorts, TritonServer
from launcher.watchdog import Watchdog

__all__ = ["Frontend", "Stack", "StartupError", "TritonPorts", "TritonServer", "Watchdog"]
