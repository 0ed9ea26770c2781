"""`python -m launcher setup` lays out what serving needs; `python -m launcher serve` serves.

serve: tritonserver (model `llm`) and the OpenAI frontend on loopback, until Ctrl-C or
SIGTERM; then the frontend stops first, tritonserver second, and leftover backend
stubs are reaped. Exits non-zero if a process dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from launcher.layout import SetupError, check_numpy_abi, default_model_path, find_triton
from launcher.procs import StartupError
from launcher.stack import Stack, TritonPorts


class _Terminated(Exception):
    """SIGTERM arrived."""


def _on_sigterm(signum, frame) -> None:
    raise _Terminated()


def cmd_setup(args: argparse.Namespace) -> int:
    install = find_triton()
    print(f"tritonserver: {install.tritonserver}; backend folder: {install.backend_dir}")
    model = default_model_path()
    print(f"model: {model}")
    try:
        check_numpy_abi()
    except SetupError as exc:  # serving fails on it; the unit tests do not
        print(f"WARNING: {exc}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    find_triton()
    model = default_model_path(args.model)
    signal.signal(signal.SIGTERM, _on_sigterm)
    stack = Stack(
        model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        triton_ports=TritonPorts.from_env(),
        log_dir=Path(args.log_dir) if args.log_dir else None,
    )
    try:
        print(f"starting tritonserver (model {model}) ...", flush=True)
        stack.start()
        print(
            f"serving {stack.served_model_name!r}: OpenAI API at {stack.base_url} "
            f"(tritonserver gRPC {stack.triton_grpc_url}, HTTP {stack.triton_http_url}, "
            f"metrics {stack.triton_metrics_url}); Ctrl-C stops",
            flush=True,
        )
        return _watch(stack)
    except (KeyboardInterrupt, _Terminated):
        print("stopping ...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()


def _watch(stack: Stack) -> int:
    """Block until a process exits (an error: report it) or a signal arrives."""
    while True:
        for proc in stack.processes():
            code = proc.poll()
            if code is not None:
                print(f"error: {proc.name} exited with status {code}; stopping", file=sys.stderr, flush=True)
                return 1
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="lay out the Triton backend folder and convert the default model")
    serve = sub.add_parser("serve", help="serve the OpenAI API through tritonserver")
    serve.add_argument("--model", help="Hugging Face model folder (default: $MODEL, else the default model)")
    serve.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    serve.add_argument("--served-model-name", default=os.environ.get("SERVED_MODEL_NAME"))
    serve.add_argument("--log-dir", default=os.environ.get("LOG_DIR"), help="write process logs here")
    args = parser.parse_args(argv)
    try:
        return cmd_setup(args) if args.command == "setup" else cmd_serve(args)
    except (SetupError, StartupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
