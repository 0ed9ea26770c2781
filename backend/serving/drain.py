"""The drain before shutdown: the launcher signals the stub (contract.DRAIN_SIGNAL), the
model aborts every live request, sends its final and refuses new ones. Triton calls
finalize() only once nothing is in flight, so finalize alone cannot do this."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("llm")


def install_drain_handler(signum: int, on_drain: Callable[[], None]) -> bool:
    """Call `on_drain` on a watcher thread when `signum` arrives; False if it cannot be
    installed (not the main thread). The stub's main thread sits in C++, so a Python
    handler alone would run late; the wakeup fd is written at once."""
    try:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.signal(signum, lambda received, frame: None)
        signal.set_wakeup_fd(write_fd)
    except ValueError:
        log.warning("drain signal handler not installed")
        return False

    def watch() -> None:
        while os.read(read_fd, 1) != bytes([signum]):
            pass
        on_drain()

    threading.Thread(target=watch, name="llm-drain", daemon=True).start()
    return True
