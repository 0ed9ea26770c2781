"""K-quant GGUF files of the default model against llama-server (`make bench`, where
LLAMA_SERVER is set): llama.cpp's own `llama-quantize` (beside llama-server, or LLAMA_QUANTIZE)
makes Q4_K_M and Q6_K files from the default model's Q4_1 GGUF (`--allow-requantize`: the
tensors' formats are what a Q4_K_M / Q6_K file of the model holds; only their values carry
Q4_1's rounding), into build/ggufs/; then `bench.llamacpp_ab --gguf` runs both servers on
each file, in turns.

    LLAMA_SERVER=/path/to/llama-server python -m bench.gguf_ab [--rounds 2] [--kinds Q4_K_M,Q6_K]
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from bench import llamacpp, llamacpp_ab

OUT = Path("build/ggufs")


def quantize_binary() -> str | None:
    """LLAMA_QUANTIZE, else the llama-quantize beside LLAMA_SERVER."""
    named = os.environ.get("LLAMA_QUANTIZE")
    server = llamacpp.server_binary()
    path = named or (str(Path(server).parent / "llama-quantize") if server else None)
    return path if path and os.access(path, os.X_OK) else None


def kquant_file(kind: str, binary: str) -> Path:
    """The default model in `kind` (made once into build/ggufs/)."""
    from backend.runner.convert import MODEL_NAME, gguf_path

    out = OUT / f"{MODEL_NAME}.{kind}.gguf"
    if not out.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
        cmd = [binary, "--allow-requantize", str(gguf_path()), str(out), kind]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", default="Q4_K_M,Q6_K")
    args = parser.parse_args(argv)
    binary = quantize_binary()
    if binary is None or llamacpp.server_binary() is None:
        print("K-quant files against llama-server: skipped (LLAMA_SERVER, with llama-quantize beside it)")
        return
    for kind in args.kinds.split(","):
        print(f"{kind}: ours and llama-server on the same file", flush=True)
        llamacpp_ab.main(["--gguf", str(kquant_file(kind, binary)), "--rounds", str(args.rounds)])


if __name__ == "__main__":
    main()
