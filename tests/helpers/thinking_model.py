"""A reasoning variant of the default model, for tests of the thinking features.

`build_thinking_model(dest)` writes a model folder derived from the default model
(SmolLM2-135M-Instruct) that has what a Qwen3-style reasoning model has, at the token
level only; the model is no better at reasoning than before:

- `<think>` and `</think>` are added tokens of their own (ids 49152 and 49153). They
  are *not* special (`special=False, normalized=False`): each still encodes as one id
  wherever it appears in text, but `decode(ids, skip_special_tokens=True)`, which is
  how the frontend detokenizes, keeps them, so the reasoning parser finds the markers
  in the text. As special tokens they would be skipped and the parser would see
  nothing. Qwen3's own tokenizer marks them the same way.
- The embedding grows to 49154 rows; the two new rows are seeded random values
  (normal, std 0.02). The embedding is also the lm_head (tied), so the logits over the
  old 49152 tokens are exactly the default model's for any prompt without the markers.
- Its chat template is the default ChatML one, and the generation prompt opens a
  thinking block (`enable_thinking` true or unset) or writes an empty one (false).
- Its MODEL.toml names the markers and keeps the source's sampling defaults and tool
  parser (whether a prompt opened the block, the engine reads from the prompt). It sets
  no guards, so the loop detectors are off and a test sees every token the model writes.

`python -m tests.helpers.thinking_model DEST` (from the repository root) builds into DEST and prints it.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from backend.settings.model_settings import MODEL_SETTINGS_FILE, ModelSettings

THINK_START, THINK_END = "<think>", "</think>"
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"  # only in untied sources
NEW_ROWS_SEED, NEW_ROWS_STD = 0, 0.02
# Written last, holding BUILD_VERSION: a folder with it is a finished build of this code.
COMPLETE_MARKER = ".thinking-complete"
BUILD_VERSION = "2"  # 2: MODEL.toml without reasoning.starts_in_thinking (no longer a setting)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    # Qwen3's switch: thinking unless the caller turns it off; off writes an empty block.
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)


def build_thinking_model(dest: Path, source: Path | None = None) -> Path:
    """The reasoning variant of `source` (default: the default model) in `dest`, built
    unless `dest` already holds a finished build. Written into a temporary sibling and
    renamed into place, so an interrupted build never leaves a half folder at `dest`."""
    dest = Path(dest)
    if _is_complete(dest):
        return dest
    if source is None:
        from backend.runner.convert import ensure_default_model

        source = ensure_default_model()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _build(Path(source), tmp)
        if dest.exists():
            shutil.rmtree(dest)  # an unfinished or older build
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _is_complete(folder: Path) -> bool:
    marker = folder / COMPLETE_MARKER
    return marker.is_file() and marker.read_text().strip() == BUILD_VERSION


def _build(source: Path, out: Path) -> None:
    vocab_size = _write_tokenizer(source, out)
    _write_weights(source, out, vocab_size)
    config = json.loads((source / "config.json").read_text())
    config["vocab_size"] = vocab_size
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(source / "generation_config.json", out / "generation_config.json")
    (out / MODEL_SETTINGS_FILE).write_text(_settings_toml(ModelSettings.load(source)))
    _make_readable(out)
    (out / COMPLETE_MARKER).write_text(BUILD_VERSION + "\n")


def _make_readable(folder: Path) -> None:
    # mkdtemp and the safetensors writer create owner-only entries.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _write_tokenizer(source: Path, out: Path) -> int:
    """The source tokenizer plus the two markers, and our chat template; the new vocab size."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    old_size = len(tokenizer)
    markers = [AddedToken(text, special=False, normalized=False) for text in (THINK_START, THINK_END)]
    if tokenizer.add_tokens(markers) != 2:
        raise ValueError(f"{source}: its tokenizer already has {THINK_START} or {THINK_END}")
    ids = tokenizer.convert_tokens_to_ids([THINK_START, THINK_END])
    if ids != [old_size, old_size + 1]:
        raise ValueError(f"{source}: the markers got ids {ids}, not the next two after {old_size}")
    tokenizer.save_pretrained(str(out))
    # The template lives in chat_template.jinja only, so no copy in the config disagrees.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.pop("chat_template", None) is not None:
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return len(tokenizer)


def _write_weights(source: Path, out: Path, vocab_size: int) -> None:
    """The source's tensors under the same names, the embedding (and an untied lm_head)
    grown to `vocab_size` rows."""
    with safe_open(source / "model.safetensors", framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    generator = torch.Generator().manual_seed(NEW_ROWS_SEED)
    for name in (EMBEDDING, LM_HEAD):
        if name in tensors:
            tensors[name] = _grow_rows(tensors[name], vocab_size, generator)
    save_file(tensors, str(out / "model.safetensors"), metadata=metadata)


def _grow_rows(weight: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    # weight: [old_vocab, hidden] -> [rows, hidden]
    new = torch.randn(rows - weight.shape[0], weight.shape[1], generator=generator) * NEW_ROWS_STD
    return torch.cat([weight, new.to(weight.dtype)])


def _settings_toml(settings: ModelSettings) -> str:
    sampling = "".join(f"{key} = {value!r}\n" for key, value in settings.sampling.items())
    return (
        "# A reasoning variant of the default model, for tests (tests/helpers/thinking_model.py).\n"
        "# Schema: backend/settings/model_settings.py. No [guards]: loop detectors off.\n\n"
        f"[sampling]\n{sampling}\n"
        "[reasoning]\n"
        f'think_start = "{THINK_START}"\n'
        f'think_end = "{THINK_END}"\n\n'
        f'[tools]\nparser = "{settings.tools.parser}"\n'
    )


if __name__ == "__main__":
    print(build_thinking_model(Path(sys.argv[1])))
