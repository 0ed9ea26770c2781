"""A GGUF file as a model folder: MODEL may name a `.gguf` file (or a folder holding one, without
a config.json). Once per file, transformers reads its metadata into a folder in the cache:
config.json (architecture and hyper-parameters), the tokenizer and its chat template, and
SOURCE naming the file. No weights are written: the loader reads them from the file itself,
in their own block formats (backend/runner/quant/gguf_blocks.py)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path

from backend.runner.gguf_archs import register as register_gguf_architectures
from backend.runner.gguf_gaps import fill_gaps
from backend.settings.paths import GGUF_SOURCE_FILE as SOURCE
from backend.settings.paths import cache_dir, gguf_source_file

_TOKENIZER_KEY = b"tokenizer.ggml.model"
_LAYOUT = 3  # what a prepared folder holds; a new one prepares every file again (3: the embedding's rows)


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or a folder's only .gguf (or the first part
    of the one split file it holds) when the folder has no config.json; None for a Hugging Face
    folder."""
    path = Path(path).expanduser()
    if path.is_file():
        return path.resolve() if path.suffix == ".gguf" or _magic(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = _one_split(sorted(path.glob("*.gguf")))
    if len(files) > 1:
        raise ValueError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); name one")
    return files[0].resolve() if files else None


def _one_split(files: list[Path]) -> list[Path]:
    """[the first part] where `files` are the parts of one GGUF split by gguf-split
    (`name-00001-of-00003.gguf` ...: the first holds the metadata); else `files`."""
    names = [re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", f.name) for f in files]
    if len(files) < 2 or not all(names) or len({(m[1], m[3]) for m in names}) != 1:
        return files
    return [f for f, m in zip(files, names, strict=True) if m[2] == "00001"] or files


def gguf_source(folder: str | Path) -> Path | None:
    """The GGUF file a prepared folder stands for (None: not a prepared folder)."""
    return gguf_source_file(Path(folder))


def model_folder(path: str | Path) -> Path:
    """MODEL as a folder: a Hugging Face folder as it is, a GGUF file's prepared folder."""
    source = gguf_file(path)
    return prepare(source) if source is not None else Path(path).expanduser().resolve()


def prepare(source: Path) -> Path:
    """The prepared folder of GGUF file `source`, made first when missing or out of date."""
    stat = source.stat()
    stamp = {"path": str(source), "size": stat.st_size, "mtime": stat.st_mtime, "layout": _LAYOUT}
    digest = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{source.stem}-gguf-{digest}"
    if (target / SOURCE).exists():
        return target
    _check(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_folder(source, tmp)
        (tmp / SOURCE).write_text(json.dumps(stamp) + "\n")  # last: a folder holding it is complete
        tmp.chmod(0o755)
        try:
            tmp.rename(target)
        except OSError:  # another process prepared it first
            if not (target / SOURCE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check(source: Path) -> None:
    """ValueError, one line, for a file we cannot serve before transformers parses it."""
    from backend.runner.quant.gguf_blocks import read_tensor_table

    read_tensor_table(source)  # not a GGUF, truncated, a split file's later part or one missing: its own ValueError
    with source.open("rb") as f:
        head = f.read(1 << 20)
    if _TOKENIZER_KEY not in head:
        raise ValueError(f"{source.name} has no tokenizer in its metadata ({_TOKENIZER_KEY.decode()}); "
                         f"a GGUF made without one cannot be served")  # fmt: skip


def _write_folder(source: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    register_gguf_architectures(source)
    try:
        config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    except ValueError as e:  # "GGUF model with architecture X is not supported yet."
        supported = sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer", "tokenizer_config"))
        raise ValueError(f"{source.name}: {e} (GGUF architectures read: {', '.join(supported)})") from None
    if config.model_type not in CAUSAL:
        raise ValueError(f"{source.name}: model_type {config.model_type!r} is not a causal language model")
    config = fill_gaps(config, source)
    config.architectures = [CAUSAL[config.model_type]]
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)


def _magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"
