"""`python -m launcher.dynamo_worker ...`: one tritonserver instance as an NVIDIA Dynamo worker.

The shim registers its instance in Dynamo's discovery under the endpoint
`NAMESPACE.llm.generate` (the model, the KV block size, the pool's size and batch
limits, so Dynamo's KvRouter can weigh load), relays the engine's KV events (the
tritonserver's KV_EVENTS_ENDPOINT, backend/serving/kv_events.py) to Dynamo's event plane,
and answers a request on the endpoint with where its tritonserver listens. Generation
requests do not pass through it: a router picks a worker, then talks to that
tritonserver over gRPC itself.

While the model is not ready (tritonserver or its stub died; the watchdog restarts them)
the instance is taken out of discovery, and put back once the model is ready again.
If its registration disappears while it should be listed (file discovery expires keys
not touched for 10 s, e.g. after the machine was paused: a suspended VM's every worker
expired at once), the shim starts over in the same process (`os.execv`): a fresh
runtime registers the instance, its model card and its event channel again.

Dynamo reads its own settings from the environment: NATS_SERVER, DYN_DISCOVERY_BACKEND
(`file`, with DYN_FILE_KV its folder), DYN_REQUEST_PLANE (`tcp`), DYN_TCP_RPC_HOST,
DYN_EVENT_PLANE (`nats`); `dynamo_env` gives the loopback set. nats-server must run
with JetStream (`-js`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import asdict

import httpx
import tritonclient.grpc.aio as grpcclient

from openai_frontend.generation.dynamo_view import ENDPOINT, WorkerInfo
from openai_frontend.operations.engine_metrics import parse_engine

log = logging.getLogger("dynamo_worker")
CHECK_S = 0.5
LOST_AFTER_S = 3.0  # listed but absent from discovery this long: the registration is lost


def dynamo_env(nats_url: str, discovery_dir: str, host: str = "127.0.0.1") -> dict[str, str]:
    """Dynamo's settings for processes on one machine: file discovery, TCP requests on
    `host`, KV events over NATS."""
    return {
        "NATS_SERVER": nats_url,
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": discovery_dir,
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_TCP_RPC_HOST": host,
        "DYN_EVENT_PLANE": "nats",
        "HF_HUB_OFFLINE": "1",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launcher.dynamo_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", default="tritonllm")
    parser.add_argument("--triton-grpc-url", required=True)
    parser.add_argument("--triton-metrics-url", required=True)
    parser.add_argument("--advertise-grpc-url", help="the gRPC address routers use (default: --triton-grpc-url)")
    parser.add_argument("--advertise-metrics-url", help="the metrics URL routers use (default: --triton-metrics-url)")
    parser.add_argument("--kv-events", required=True, help="the tritonserver's KV_EVENTS_ENDPOINT")
    parser.add_argument("--model-path", required=True, help="the served Hugging Face folder (its tokenizer)")
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    return parser.parse_args(argv)


async def _model_ready(url: str) -> bool:
    client = grpcclient.InferenceServerClient(url)
    try:
        return await client.is_model_ready("llm")
    except Exception:  # noqa: BLE001 - down is not ready
        return False
    finally:
        await client.close()


async def _kv_blocks_total(metrics_url: str) -> int:
    async with httpx.AsyncClient(timeout=5) as client:
        page = (await client.get(metrics_url)).text
    return int(parse_engine(page).get("llm_kv_blocks_total", 0))


async def serve(args: argparse.Namespace) -> None:
    from dynamo.llm import KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType, register_model
    from dynamo.runtime import DistributedRuntime

    while not await _model_ready(args.triton_grpc_url):
        await asyncio.sleep(CHECK_S)
    backend, plane = os.environ.get("DYN_DISCOVERY_BACKEND", "file"), os.environ.get("DYN_REQUEST_PLANE", "tcp")
    runtime = DistributedRuntime(asyncio.get_running_loop(), backend, plane, True)
    endpoint = runtime.endpoint(f"{args.namespace}.{ENDPOINT}")
    config = ModelRuntimeConfig()
    config.total_kv_blocks = await _kv_blocks_total(args.triton_metrics_url)
    config.max_num_seqs = args.max_num_seqs
    config.max_num_batched_tokens = args.max_num_batched_tokens
    config.enable_local_indexer = True
    publisher = KvEventPublisher(
        endpoint, kv_block_size=args.block_size, zmq_endpoint=args.kv_events, zmq_topic="", enable_local_indexer=True
    )
    await register_model(
        ModelInput.Tokens, ModelType.Completions, endpoint, args.model_path, args.served_model_name,
        kv_cache_block_size=args.block_size, runtime_config=config,
    )  # fmt: skip
    info = asdict(_worker_info(args))

    async def describe(request, context=None):
        yield info

    log.info("worker %d: %s, %d KV blocks", endpoint.connection_id(), args.triton_grpc_url, config.total_kv_blocks)
    watch = asyncio.create_task(_watch_health(endpoint, args.triton_grpc_url))
    try:
        await endpoint.serve_endpoint(describe)
    finally:
        watch.cancel()
        publisher.shutdown()


def _worker_info(args: argparse.Namespace) -> WorkerInfo:
    grpc_url = args.advertise_grpc_url or args.triton_grpc_url
    metrics_url = args.advertise_metrics_url or args.triton_metrics_url
    return WorkerInfo(grpc_url, metrics_url, args.served_model_name, args.block_size)


async def _watch_health(endpoint, triton_grpc_url: str) -> None:
    """Out of discovery while the model is not ready; back in when it is; start over
    when discovery lost the registration."""
    listed, client, missing_since = True, await endpoint.client(), None
    while True:
        await asyncio.sleep(CHECK_S)
        ready = await _model_ready(triton_grpc_url)
        if ready != listed:
            log.warning("model %s: %s discovery", "ready, back in" if ready else "not ready, out of", triton_grpc_url)
            await (endpoint.register_endpoint_instance() if ready else endpoint.unregister_endpoint_instance())
            listed, missing_since = ready, None
            continue
        if not listed or endpoint.connection_id() in client.instance_ids():
            missing_since = None
        elif missing_since is None:
            missing_since = time.monotonic()
        elif time.monotonic() - missing_since > LOST_AFTER_S:
            log.warning("worker %d left discovery while listed; starting over", endpoint.connection_id())
            _restart_in_place()


def _restart_in_place() -> None:
    """This process becomes a fresh shim with the same arguments (and the same pid, so
    whoever supervises it keeps its handle)."""
    logging.shutdown()
    os.execv(sys.executable, [sys.executable, "-m", "launcher.dynamo_worker", *sys.argv[1:]])


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    loop = asyncio.new_event_loop()
    task = loop.create_task(serve(args))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass
    finally:
        loop.close()


if __name__ == "__main__":
    main()
