"""The build of our CPU kernels (the .cpp files beside this one, AVX-512): compiled once per
machine into a folder named by a digest of what the build depends on, and loaded by every
process of the checkout (`native()`); `python -m backend.kernels` (`make setup`, `launcher
setup`, the Dockerfile) builds them, so no server compiles at its first request."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from backend.settings.paths import cache_dir

FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma")  # what the kernels need of the CPU
_FOLDER = Path(__file__).parent
_SOURCES = [
    str(_FOLDER / name)
    for name in (
        "kernels.cpp",
        "paged_attention.cpp",
        "tiles.cpp",
        "tiles_a8.cpp",
        "decode_layer.cpp",
        "layer_ops.cpp",
        "first_max.cpp",
        "dense.cpp",
    )  # fmt: skip
]
# -ffp-contract=off: the dequantization multiplies then adds, as the reference does
_CFLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]


@functools.cache
def cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo lists them (none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@functools.cache
def build_directory() -> Path:
    """The build's folder, named by torch's version and a digest of what the build depends
    on (the sources and headers, their paths, the flags, this Python): every process of
    one checkout loads one build, and two checkouts (or an edit) never rebuild over each
    other's."""
    digest = hashlib.sha256(f"{_CFLAGS} {sys.executable}".encode())
    for path in sorted([*_FOLDER.glob("*.cpp"), *_FOLDER.glob("*.h")]):
        digest.update(f"{path}\0".encode() + path.read_bytes())
    return cache_dir() / "kernels" / f"torch-{torch.__version__}-{digest.hexdigest()[:12]}"


@functools.cache
def native():
    """The compiled module, or None where this CPU lacks the instructions it uses."""
    if not set(FLAGS) <= cpu_flags():
        return None

    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return _build(folder)
    except Exception as exc:  # no compiler, no ninja: every caller has a plain path
        print(f"quantized kernels could not be built in {folder}: {exc}", file=sys.stderr, flush=True)
        return None


def _build(folder: Path):
    from torch.utils.cpp_extension import load

    # torch runs the first `ninja` on PATH. Every process must run the same one: two ninja
    # versions hash a command differently, so each rebuilt what the other had built (the
    # setup's /usr/bin/ninja against the stub's, whose PATH starts with the venv's bin/).
    _venv_bin_first()
    _clear_stale_lock(folder)
    return load(name="tritonllm_quant", sources=_SOURCES, extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                build_directory=str(folder), verbose=False)  # fmt: skip


STALE_LOCK_S = 600  # a build takes ~2 minutes on 2 cores; a lock this old was left by a killed one


def _clear_stale_lock(folder: Path) -> None:
    """torch's builder waits, forever, while its lock file exists: a build killed mid-way (a
    Ctrl-C, a test timeout) left one, and every later process hung on it. One older than
    STALE_LOCK_S is removed."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        print(f"removing {lock}, left {age / 60:.0f} minutes ago by a build that did not finish", file=sys.stderr)
        lock.unlink(missing_ok=True)


def _venv_bin_first() -> None:
    """This Python's bin/ (where requirements.txt's ninja is) first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join(p for p in (bin_dir, path) if p)


def main() -> None:
    lib = native()
    print(f"quantized kernels: {'built in ' + str(build_directory()) if lib else 'not used (no AVX-512 here)'}")
