"""The soak's users (loadtest/soak.py runs them headless): chat and completions, streamed
or not, some left mid-way on purpose, two tenants' keys.

Every request is counted client-side by how it ended, so the soak can prove that none
was lost: `ok` (a complete answer: a JSON body with choices and finish reasons, or a
stream that ended with `data: [DONE]`), `error` (an explicit error: an error status with
OpenAI's error body, or an error event in the stream), `left` (this client hung up on
purpose), `lost` (anything else: a connection reset, a timeout, a cut stream, a body
that is not an answer). Requests started but never ended (killed at the stop) are lost
too. At the stop, the counts and one sample per request go to $SOAK_SAMPLES as JSON lines.

Env: SOAK_KEYS (comma-separated API keys, one tenant each), SOAK_SAMPLES (output file),
MODEL (the served model name).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass

import gevent
from locust import HttpUser, between, events, task

PROMPTS = [
    "the history of the bicycle",
    "why the ocean is salty",
    "how to brew a good cup of tea",
    "the life cycle of a star",
    "what makes a bridge stable",
]
CLIENT_TIMEOUT_S = 300  # no byte for this long: the request is lost (under soak.py's stop timeout)
_user_numbers = itertools.count()


@dataclass(slots=True)
class Sample:
    """One finished request, for the report's plots and the tally."""

    end: float  # wall-clock time (s) the request ended
    latency_s: float
    kind: str  # chat | completion, with " stream" when streamed
    tenant: int  # index into SOAK_KEYS
    outcome: str  # ok | error | left | lost
    status: int
    tokens: int  # completion tokens the usage reported (0 when none)
    detail: str = ""  # for a lost request: what happened (an exception, a cut stream, ...)


SAMPLES: list[Sample] = []
STARTED = Counter()  # per kind
IN_FLIGHT: dict[int, dict] = {}  # id -> kind, start, how far it got: what a stop would lose
STOPPING = False  # the run is stopping: no new requests; those in flight are waited for


def _is_error_body(text: str) -> bool:
    try:
        return "message" in json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False


def _complete_json(text: str) -> tuple[bool, int]:
    """(whether the body is a whole answer, its completion tokens)."""
    try:
        body = json.loads(text)
        done = bool(body["choices"]) and all(c.get("finish_reason") for c in body["choices"])
        return done, (body.get("usage") or {}).get("completion_tokens", 0)
    except (ValueError, KeyError, TypeError):
        return False, 0


class SoakUser(HttpUser):
    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        keys = os.environ["SOAK_KEYS"].split(",")
        self.tenant = next(_user_numbers) % len(keys)
        self.headers = {"Authorization": f"Bearer {keys[self.tenant]}"}
        self.model = os.environ.get("MODEL", "")

    def _body(self, chat: bool, stream: bool) -> dict:
        topic = random.choice(PROMPTS)
        body = {"model": self.model, "max_tokens": random.randint(8, 32), "temperature": 0.7, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if chat:
            return {**body, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
        return {**body, "prompt": f"A short note on {topic}:"}

    def _record(self, kind: str, start: float, outcome: str, status: int, tokens: int = 0, detail: str = "") -> None:
        latency = time.perf_counter() - start
        SAMPLES.append(Sample(time.time(), latency, kind, self.tenant, outcome, status, tokens, detail))

    def _send(self, chat: bool, stream: bool, leave_after: int | None = None) -> None:
        """One request, read to its end (or, with `leave_after`, hung up on after that many
        stream lines), and counted."""
        if STOPPING:
            return
        kind = ("chat" if chat else "completion") + (" stream" if stream else "")
        path = "/v1/chat/completions" if chat else "/v1/completions"
        name = f"{path} ({'left' if leave_after is not None else 'stream' if stream else 'whole'})"
        STARTED[kind] += 1
        start = time.perf_counter()
        progress = IN_FLIGHT[id(self)] = {"kind": kind, "start": time.time(), "at": "sent"}
        try:
            with self.client.post(
                path, json=self._body(chat, stream), headers=self.headers, stream=stream,
                timeout=CLIENT_TIMEOUT_S, catch_response=True, name=name,
            ) as resp:  # fmt: skip
                progress["at"] = f"HTTP {resp.status_code}"
                outcome, tokens, detail = self._read(resp, stream, leave_after, progress)
                resp.success() if outcome in ("ok", "left", "error") else resp.failure(outcome)
                self._record(kind, start, outcome, resp.status_code, tokens, detail)
        except Exception as exc:  # a reset or a timeout mid-stream (before it, locust's status is 0)
            self._record(kind, start, "lost", 0, detail=f"{type(exc).__name__} after {progress['at']}: {exc}"[:300])
            raise
        finally:
            IN_FLIGHT.pop(id(self), None)
        if resp.status_code == 429:  # a polite client waits as told before its next request
            time.sleep(float(resp.headers.get("retry-after", "1")))

    def _read(self, resp, stream: bool, leave_after: int | None, progress: dict) -> tuple[str, int, str]:
        """(outcome, completion tokens, what went wrong if the request was lost)."""
        if resp.status_code != 200:
            if _is_error_body(resp.text):
                return "error", 0, ""
            return "lost", 0, f"HTTP {resp.status_code} without an error body: {resp.text[:200]!r}"
        if not stream:
            done, tokens = _complete_json(resp.text)
            return ("ok", tokens, "") if done else ("lost", tokens, f"not an answer: {resp.text[:200]!r}")
        return _read_stream(resp, leave_after, progress)

    @task(3)
    def chat_stream(self) -> None:
        self._send(chat=True, stream=True)

    @task(2)
    def chat(self) -> None:
        self._send(chat=True, stream=False)

    @task(2)
    def completion_stream(self) -> None:
        self._send(chat=False, stream=True)

    @task(2)
    def completion(self) -> None:
        self._send(chat=False, stream=False)

    @task(1)
    def leave_mid_stream(self) -> None:
        """A client disconnect: a stream closed after its first few lines."""
        self._send(chat=random.random() < 0.5, stream=True, leave_after=random.randint(1, 4))


def _read_stream(resp, leave_after: int | None, progress: dict) -> tuple[str, int, str]:
    tokens = 0
    for number, line in enumerate(resp.iter_lines(decode_unicode=True)):
        progress["at"] = f"stream line {number}"
        if leave_after is not None and number >= leave_after:
            resp.close()  # unread: the connection is dropped, the server sees the client leave
            return "left", tokens, ""
        if not line or not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "ok", tokens, ""
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return "error", tokens, ""
        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    if leave_after is not None:
        return "left", tokens, ""
    return "lost", tokens, f"the stream ended without data: [DONE] after {progress['at']}"


@events.test_stopping.add_listener
def _stop_sending(**_kw) -> None:
    global STOPPING
    STOPPING = True


@events.test_stop.add_listener
def _write_samples(environment, **_kw) -> None:
    """Counts and samples to $SOAK_SAMPLES; a request started and not ended is lost.

    Requests still in flight are waited for first (up to the client's timeout): locust
    stops users gracefully, but one it failed to stop would be killed mid-request after
    this, and the count must not depend on that."""
    path = os.environ.get("SOAK_SAMPLES")
    if not path:
        return
    waited_until = time.monotonic() + CLIENT_TIMEOUT_S + 5
    while IN_FLIGHT and time.monotonic() < waited_until:
        gevent.sleep(0.1)
    ended = Counter(s.kind for s in SAMPLES)
    unfinished = {kind: STARTED[kind] - ended[kind] for kind in STARTED if STARTED[kind] > ended[kind]}
    with open(path, "w") as out:
        stopped = time.time()
        cut = [{**entry, "age_s": round(stopped - entry["start"], 2)} for entry in IN_FLIGHT.values()]
        header = {"started": dict(STARTED), "unfinished": unfinished, "cut": cut}
        out.write(json.dumps(header) + "\n")
        for sample in SAMPLES:
            out.write(json.dumps(asdict(sample)) + "\n")
