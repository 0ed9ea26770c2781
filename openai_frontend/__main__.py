"""`python -m openai_frontend --model-path DIR --served-model-name NAME ...`"""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from openai_frontend.app import create_app
from openai_frontend.generation.routing import ROUTER_MODES
from openai_frontend.http_server import uvicorn_options
from openai_frontend.settings import Settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m openai_frontend", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC address")
    parser.add_argument(
        "--triton-metrics-url",
        default=None,
        help="Triton's metrics endpoint, for the engine's gauges on /metrics; "
        "default: port 8002 on the --triton-url host",
    )
    parser.add_argument("--model-path", required=True, help="the served Hugging Face model folder")
    parser.add_argument("--served-model-name", default=None, help="default: the folder's name")
    parser.add_argument(
        "--dynamo-namespace",
        default=None,
        help="serve through the Triton instances registered in NVIDIA Dynamo under this namespace "
        "(launcher.dynamo_worker), routed by Dynamo's KV-aware router; --triton-url is then unused",
    )
    parser.add_argument("--router-mode", choices=ROUTER_MODES, default="kv", help="with --dynamo-namespace")
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--dump",
        default=None,
        metavar="DIR",
        help="write one JSON file per request here (body, tensors, final event, response); default $DUMP_DIR",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or args.model_path.rstrip("/").rsplit("/", 1)[-1]
    metrics_url = args.triton_metrics_url or default_metrics_url(args.triton_url)
    settings = Settings.from_env(os.environ, args.model_path, name, triton_url=args.triton_url, dump_dir=args.dump,
                                 triton_metrics_url=metrics_url, dynamo_namespace=args.dynamo_namespace,
                                 router_mode=args.router_mode)  # fmt: skip
    app = create_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                **uvicorn_options(settings.http))  # fmt: skip


def default_metrics_url(triton_url: str) -> str:
    """Triton's default metrics port (8002) on the gRPC address's host."""
    host = triton_url.rsplit(":", 1)[0] if ":" in triton_url else triton_url
    return f"http://{host}:8002/metrics"


if __name__ == "__main__":
    main()
