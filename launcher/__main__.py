"""`python -m launcher setup` lays out what serving needs; `python -m launcher serve` serves.

serve: tritonserver (model `llm`) and the OpenAI frontend on loopback, until Ctrl-C or
SIGTERM; then the frontend stops first, tritonserver second, and leftover backend
stubs are reaped. If the model's stub or tritonserver dies, tritonserver is restarted
(launcher.watchdog); exits non-zero if the frontend dies or a restart fails.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import time
from pathlib import Path

from launcher.layout import SetupError, check_numpy_abi, default_model_path, find_triton
from launcher.procs import StartupError
from launcher.stack import Stack, TritonPorts
from launcher.watchdog import Watchdog


class _Terminated(Exception):
    """SIGTERM arrived."""


def _on_sigterm(signum, frame) -> None:
    raise _Terminated()


def cmd_setup(args: argparse.Namespace) -> int:
    install = find_triton()
    print(f"tritonserver: {install.tritonserver}; backend folder: {install.backend_dir}")
    model = default_model_path()
    print(f"model: {model}")
    from backend.kernels.build import main as build_kernels

    build_kernels()  # our AVX-512 kernels (backend/kernels), compiled once here rather than at a server's start
    try:
        check_numpy_abi()
    except SetupError as exc:  # serving fails on it; the unit tests do not
        print(f"WARNING: {exc}", file=sys.stderr)
    return 0


def _warn_if_exposed(host: str) -> None:
    """Beyond loopback, anyone who reaches the port can use the API unless keys are set."""
    if os.environ.get("API_KEYS") or os.environ.get("API_KEYS_FILE"):
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if not loopback:
        print(
            f"WARNING: serving on {host} without API keys: anyone who reaches this port can use the API. "
            "Set API_KEYS or API_KEYS_FILE (docs/tenants.md).",
            file=sys.stderr,
            flush=True,
        )


def cmd_serve(args: argparse.Namespace) -> int:
    find_triton()
    model = default_model_path(args.model)
    print(f"model: {_describe(model)}", flush=True)
    _warn_if_exposed(args.host)
    ui = _ui_on()
    quant = os.environ.get("QUANT") or "auto (a GGUF file's own blocks; the default model: its Q4_1 blocks)"
    activations = os.environ.get("QUANT_ACTIVATIONS") or "auto (int4 weights: int8 where the CPU has VNNI)"
    print(
        f"weights: QUANT={quant}, QUANT_ACTIVATIONS={activations}; QUANT=none serves float32, "
        "QUANT_ACTIVATIONS=float32 float32's numbers from quantized weights (docs/quantization.md)",
        flush=True,
    )
    signal.signal(signal.SIGTERM, _on_sigterm)
    replicas = _replicas()
    if replicas > 1:
        return _serve_replicas(args, model, replicas, ui)
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
        page = f"playground page at {stack.frontend.url}/ (UI=0 leaves it out); " if ui else ""
        print(
            f"serving {stack.served_model_name!r}: {page}OpenAI API at {stack.base_url} "
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


def _describe(model: Path) -> str:
    """Which forward serves the model and its weights' formats; SetupError (one line) where none can."""
    from backend.runner.loader import describe_model

    try:
        return describe_model(model, os.environ.get("MODEL_IMPL") or "auto")
    except ValueError as exc:
        raise SetupError(str(exc)) from None


def _replicas() -> int:
    from launcher.replica_stack import replicas_from_env

    try:
        return replicas_from_env(os.environ.get("REPLICAS"))
    except ValueError as exc:
        raise SetupError(str(exc)) from None


def _serve_replicas(args: argparse.Namespace, model: Path, replicas: int, ui: bool) -> int:
    """REPLICAS=N: N tritonservers behind Dynamo's KV-aware router (launcher/replica_stack.py)."""
    from launcher.replica_stack import ReplicaStack

    log_dir = Path(args.log_dir) if args.log_dir else None
    stack = ReplicaStack(model, replicas, host=args.host, port=args.port, served_model_name=args.served_model_name,
                         **({"log_dir": log_dir} if log_dir else {}))  # fmt: skip
    try:
        print(f"starting nats-server and {replicas} tritonservers (model {model}) behind Dynamo's router ...",
              flush=True)  # fmt: skip
        stack.start()
        page = f"playground page at {stack.frontend.url}/; " if ui else ""
        servers = ", ".join(server.grpc_url for server in stack.servers)
        print(f"serving {stack.served_model_name!r}: {page}OpenAI API at {stack.base_url} over {replicas} instances "
              f"(tritonserver gRPC {servers}; routing on {stack.metrics_url}); Ctrl-C stops", flush=True)  # fmt: skip
        while True:
            stack.check()
            time.sleep(0.5)
    except (KeyboardInterrupt, _Terminated):
        print("stopping ...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.stop()


def _ui_on() -> bool:
    from openai_frontend.ui import ui_enabled

    try:
        return ui_enabled(os.environ)
    except ValueError as exc:
        raise SetupError(str(exc)) from None


def _watch(stack: Stack) -> int:
    """Block until the frontend exits (an error: report it), a restart of tritonserver
    fails (StartupError, reported by main) or a signal arrives. The watchdog runs here,
    on the main thread, which outlives every server it starts."""
    watchdog = Watchdog(stack.triton)
    while True:
        frontend = stack.frontend.process if stack.frontend else None
        code = frontend.poll() if frontend else None
        if code is not None:
            print(f"error: {frontend.name} exited with status {code}; stopping", file=sys.stderr, flush=True)
            return 1
        watchdog.check()
        time.sleep(watchdog.interval_s)


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
