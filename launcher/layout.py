"""Where things are: the nvidia-pytriton wheel, the Triton backend folder, the model.

`prepare_backend_dir()` lays the Python backend out of the wheel (idempotent):
BK/python/{libtriton_python.so, triton_python_backend_utils.py,
triton_python_backend_stub}, the stub matching the running Python's version.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO_ROOT / "build"
BACKEND_DIR = BUILD_DIR / "triton_backends"
MODEL_REPOSITORY = REPO_ROOT / "model_repository"

_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB = "triton_python_backend_stub"


class SetupError(RuntimeError):
    """The environment is not ready to serve; the message says what to do."""


@dataclass(frozen=True, slots=True)
class TritonWheel:
    """The parts of the nvidia-pytriton wheel the launcher uses."""

    root: Path  # site-packages/pytriton/tritonserver

    @classmethod
    def find(cls) -> TritonWheel:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise SetupError("nvidia-pytriton is not installed: run `make setup`")
        root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
        if not (root / "bin" / "tritonserver").exists():
            raise SetupError(f"no tritonserver binary under {root}: reinstall nvidia-pytriton==0.7.0")
        return cls(root)

    @property
    def tritonserver(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        """The wheel's bundled shared libraries (libtritonserver and friends)."""
        return self.root.parent.parent / "nvidia_pytriton.libs"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    def stub(self, version: str | None = None) -> Path:
        version = version or f"{sys.version_info.major}.{sys.version_info.minor}"
        path = self.root / "python_backend_stubs" / version / _STUB
        if not path.exists():
            raise SetupError(f"the wheel has no Python backend stub for Python {version}")
        return path


def check_numpy_abi() -> None:
    """The wheel's Python backend stub binds NumPy 1's C structs: with NumPy 2 every
    tensor crossing the stub arrives empty or garbled (seen with numpy 2.4.6)."""
    version = importlib.metadata.version("numpy")
    if int(version.split(".")[0]) >= 2:
        raise SetupError(
            f"numpy {version} is installed, but the Python backend stub of nvidia-pytriton 0.7.0 "
            "needs numpy<2 (with numpy 2 every tensor arrives empty or garbled): pin numpy==1.26.4"
        )


def prepare_backend_dir(backend_dir: Path = BACKEND_DIR, wheel: TritonWheel | None = None) -> Path:
    """Lay out BK/python/ from the wheel; copy only what is missing or changed."""
    wheel = wheel or TritonWheel.find()
    target = backend_dir / "python"
    target.mkdir(parents=True, exist_ok=True)
    sources = [wheel.python_backend / name for name in _BACKEND_FILES] + [wheel.stub()]
    for source in sources:
        _copy_if_changed(source, target / source.name)
    return backend_dir


def _copy_if_changed(source: Path, dest: Path) -> None:
    src_stat = source.stat()
    if dest.exists():
        dst_stat = dest.stat()
        if dst_stat.st_size == src_stat.st_size and dst_stat.st_mtime >= src_stat.st_mtime:
            return
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copy2(source, tmp)
    os.replace(tmp, dest)


@dataclass(frozen=True, slots=True)
class TritonInstall:
    """The tritonserver binary to run, its backend folder, and the libraries it needs."""

    tritonserver: Path
    backend_dir: Path
    lib_dirs: tuple[str, ...] = ()


def find_triton() -> TritonInstall:
    """$TRITONSERVER_BIN with $TRITON_BACKEND_DIR (NVIDIA's image), else the wheel's."""
    binary = os.environ.get("TRITONSERVER_BIN")
    if binary:
        backends = Path(os.environ.get("TRITON_BACKEND_DIR", "/opt/tritonserver/backends"))
        if not Path(binary).exists() or not (backends / "python").is_dir():
            raise SetupError(f"TRITONSERVER_BIN={binary} or TRITON_BACKEND_DIR={backends} (no python/) is wrong")
        return TritonInstall(Path(binary), backends)
    wheel = TritonWheel.find()
    return TritonInstall(wheel.tritonserver, prepare_backend_dir(BACKEND_DIR, wheel), (str(wheel.libs),))


def python_libdir() -> str:
    """The running Python's LIBDIR: the stub must load this libpython, not the system's."""
    return sysconfig.get_config_var("LIBDIR") or ""


def venv_bin() -> Path:
    """The bin/ of the running Python (a venv's, unresolved, so its packages come along)."""
    return Path(sys.executable).parent


def triton_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment tritonserver and its stubs need (see TRITON_NOTES.md).

    LD_LIBRARY_PATH: the running Python's LIBDIR (so the stub loads the matching
    libpython) and the install's libs (the wheel's). PATH: this Python's bin/ first (the stub finds
    `python3` on PATH and takes its packages from there).
    """
    env = dict(os.environ if base is None else base)
    lib_path = [python_libdir(), *install.lib_dirs, env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in lib_path if p)
    env["PATH"] = os.pathsep.join(p for p in (str(venv_bin()), env.get("PATH", "")) if p)
    return env


def default_model_path(explicit: str | Path | None = None) -> Path:
    """`explicit`, else $MODEL (a Hugging Face folder, or a GGUF file: backend/runner/gguf_model.py),
    else the default model (converted on first use)."""
    chosen = explicit or os.environ.get("MODEL")
    if chosen:
        from backend.runner.gguf_model import model_folder

        try:
            path = model_folder(chosen)  # a GGUF file: its prepared folder (config, tokenizer)
        except ValueError as e:
            raise SetupError(str(e)) from None
        if not (path / "config.json").exists():
            raise SetupError(f"{path} is neither a Hugging Face model folder (no config.json) nor a GGUF file")
        return path
    from backend.runner.convert import ensure_default_model

    return Path(ensure_default_model())
