"""The soak: a stack with two tenants under mixed load for minutes, then proof that it
came back to rest. `make soak` (SOAK_MINUTES, default 10; SOAK_USERS, default 8).

1. Start a Stack whose frontend knows two tenants' keys, with a per-tenant concurrency
   limit below each tenant's user count, so 429s (explicit errors) happen too.
2. Warm up with the same users, wait for rest, take the baseline: Triton's
   `llm_kv_blocks_used` and `llm_requests_in_flight`, and the RSS of the model's stub
   and of the frontend. The warm-up first, because allocators (glibc arenas, torch's CPU
   caching) keep the high-water mark of the batch shapes they have seen: growth up to
   it is not a leak.
3. Run locust headless (loadtest/soak_locustfile.py, a subprocess: locust's gevent
   monkey-patching stays out of the launcher) for the soak's length.
4. Wait for rest and compare: no request lost (counted client-side), KV blocks back to
   the idle value, nothing in flight, RSS within max(+10 %, +100 MB) of the baseline
   (the allowance is for allocator fragmentation; a per-request leak over thousands of
   requests outgrows it, and the RSS plot shows the trend), and each tenant served again.

Writes build/soak/ (SOAK_OUT): summary.md, latency.png, throughput.png, rss.png,
samples.jsonl and locust's CSVs. Exits 1 when any check fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from launcher import Stack
from launcher.procs import find_stubs
from loadtest.soak_report import Samples, write_report

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = REPO_ROOT / "loadtest" / "soak_locustfile.py"
KEYS = {"sk-soak-alpha": "alpha", "sk-soak-beta": "beta"}
RSS_TOLERANCE_FRACTION = 0.10
RSS_TOLERANCE_MB = 100.0
SETTLE_TIMEOUT_S = 60.0  # rest must come within this after the load stops
STOP_TIMEOUT_S = 360  # users finish the request they are in; the client gives up on one sooner (300 s)
DEFAULT_OUT = REPO_ROOT / "build" / "soak"


@dataclass(slots=True)
class SoakConfig:
    minutes: float = 10.0
    users: int = 8
    warmup_s: float = 20.0
    out_dir: Path = DEFAULT_OUT

    @classmethod
    def from_env(cls) -> SoakConfig:
        return cls(
            minutes=float(os.environ.get("SOAK_MINUTES", "10")),
            users=int(os.environ.get("SOAK_USERS", "8")),
            out_dir=Path(os.environ.get("SOAK_OUT", str(DEFAULT_OUT))),
        )

    @property
    def tenant_limit(self) -> int:
        """Below each tenant's share of users (users / 2), so some requests get a 429."""
        return max(1, self.users // 3)


@dataclass(slots=True)
class Snapshot:
    """The server at one moment: the figures a leak would move."""

    at: float
    kv_blocks_used: float
    requests_in_flight: float
    stub_rss_mb: float
    frontend_rss_mb: float


@dataclass(slots=True)
class SoakResult:
    config: SoakConfig
    baseline: Snapshot
    after: Snapshot
    samples: Samples
    rss_trace: list[Snapshot]
    load_s: float
    problems: list[str] = field(default_factory=list)


# -- measuring -------------------------------------------------------------------------


def triton_metric(stack: Stack, name: str) -> float:
    """One unlabelled value of the model's custom metrics on Triton's metrics port."""
    with urllib.request.urlopen(stack.triton_metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(rf"^{name}(?:\{{\}})? (\S+)$", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{name} is not in Triton's metrics")
    return float(match.group(1))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def snapshot(stack: Stack) -> Snapshot:
    stubs = find_stubs(stack.triton.process.pid)
    return Snapshot(
        at=time.time(),
        kv_blocks_used=triton_metric(stack, "llm_kv_blocks_used"),
        requests_in_flight=triton_metric(stack, "llm_requests_in_flight"),
        stub_rss_mb=sum(rss_mb(stub.pid) for stub in stubs),
        frontend_rss_mb=rss_mb(stack.frontend.process.pid),
    )


def wait_for_rest(stack: Stack, idle_kv: float, timeout_s: float = SETTLE_TIMEOUT_S) -> Snapshot:
    """The first snapshot with nothing in flight and the KV pool at `idle_kv` (the last
    one taken when that does not come within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = snapshot(stack)
        if (now.requests_in_flight == 0 and now.kv_blocks_used == idle_kv) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


class RssTrace:
    """Snapshots every `every_s` seconds in a thread, for the RSS plot."""

    def __init__(self, stack: Stack, every_s: float = 2.0):
        self.stack, self.every_s = stack, every_s
        self.points: list[Snapshot] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.points.append(snapshot(self.stack))
            except (OSError, RuntimeError):
                pass  # a missed point; the checks use their own snapshots

    def __enter__(self) -> RssTrace:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# -- load ------------------------------------------------------------------------------


def run_locust(stack: Stack, config: SoakConfig, seconds: float, name: str) -> Samples:
    """locust headless for `seconds` (users finish their request at the stop); its
    CSVs and log go to out_dir as `name`_*, its client-side count comes back."""
    samples_path = config.out_dir / f"{name}_samples.jsonl"
    argv = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", stack.base_url.removesuffix("/v1"), "-u", str(config.users),
        "-r", str(max(1, config.users // 2)), "-t", f"{max(1, round(seconds))}s", "--stop-timeout", str(STOP_TIMEOUT_S),
        "--csv", str(config.out_dir / name), "--csv-full-history", "--only-summary",
        "--exit-code-on-error", "0", "--loglevel", "INFO",
    ]  # fmt: skip
    env = dict(os.environ, SOAK_KEYS=",".join(KEYS), SOAK_SAMPLES=str(samples_path), MODEL=stack.served_model_name)
    with open(config.out_dir / f"{name}_locust.log", "w") as log:
        subprocess.run(argv, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                       timeout=seconds + STOP_TIMEOUT_S + 120)  # fmt: skip
    return Samples.load(samples_path)


def tenants_served(stack: Stack) -> list[str]:
    """Problems, if any: each tenant's plain chat request must succeed after the soak (a
    leaked concurrency slot would leave a tenant at 429)."""
    problems = []
    for key, tenant in KEYS.items():
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        reply = httpx.post(f"{stack.base_url}/chat/completions", json=body, timeout=120,
                           headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        if reply.status_code != 200:
            problems.append(f"tenant {tenant}: HTTP {reply.status_code} after the soak: {reply.text[:200]}")
    return problems


# -- checks ----------------------------------------------------------------------------


def rss_limit(baseline_mb: float) -> float:
    return baseline_mb + max(RSS_TOLERANCE_MB, RSS_TOLERANCE_FRACTION * baseline_mb)


def check(result: SoakResult) -> list[str]:
    """What failed, in words (empty: the soak passed)."""
    problems = []
    lost = result.samples.count("lost") + result.samples.unfinished
    if lost:
        problems.append(f"{lost} requests lost (no complete answer and no explicit error)")
        log = result.config.out_dir / "soak_locust.log"
        if log.exists() and "Not all users finished" in log.read_text(errors="replace"):
            problems.append(f"locust killed users still in a request {STOP_TIMEOUT_S} s after the stop")
    if not result.samples.count("ok"):
        problems.append("no request was answered")
    base, after = result.baseline, result.after
    if after.requests_in_flight != 0:
        problems.append(f"llm_requests_in_flight is {after.requests_in_flight:g} at rest, not 0")
    if after.kv_blocks_used != base.kv_blocks_used:
        problems.append(f"llm_kv_blocks_used is {after.kv_blocks_used:g} at rest, not {base.kv_blocks_used:g}")
    for what in ("stub_rss_mb", "frontend_rss_mb"):
        before, now = getattr(base, what), getattr(after, what)
        if now > rss_limit(before):
            problems.append(f"{what}: {now:.0f} MB after, over {rss_limit(before):.0f} MB ({before:.0f} MB before)")
    return problems


def run_soak(config: SoakConfig) -> SoakResult:
    """The whole soak on a stack of its own; the report is written, the result returned."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    env = {"API_KEYS": ",".join(f"{k}:{t}" for k, t in KEYS.items()), "TENANT_MAX_CONCURRENT": str(config.tenant_limit)}
    with Stack(env=env) as stack:
        run_locust(stack, config, config.warmup_s, "warmup")
        idle_kv = wait_for_rest(stack, idle_kv=0).kv_blocks_used
        baseline = wait_for_rest(stack, idle_kv)
        start = time.monotonic()
        with RssTrace(stack) as trace:
            samples = run_locust(stack, config, config.minutes * 60, "soak")
            load_s = time.monotonic() - start
            after = wait_for_rest(stack, baseline.kv_blocks_used)
        result = SoakResult(config, baseline, after, samples, trace.points, load_s)
        result.problems = check(result) + tenants_served(stack)
    write_report(result, config.out_dir)
    return result


def main() -> int:
    config = SoakConfig.from_env()
    print(f"soak: {config.minutes:g} min, {config.users} users, report in {config.out_dir}", flush=True)
    result = run_soak(config)
    print((config.out_dir / "summary.md").read_text())
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
