"""How much each tenant, and the server, may ask for at once.

- Admission (operations/admission.py): at most MAX_INFLIGHT_REQUESTS generation
  requests run at once and MAX_QUEUED_REQUESTS more wait their turn; past both, a 503.
- Per tenant: TENANT_MAX_CONCURRENT requests at once, and TENANT_TOKENS_PER_MINUTE
  through a token bucket (capacity: a minute's tokens; refilled continuously at
  limit/60 per second). A request reserves prompt + n * max new tokens (max_tokens, or
  what the context leaves), capped at the bucket's capacity so that no request is
  refused for good; at its end the reservation is settled against its actual usage,
  which may leave the bucket in debt for later requests to wait out. Over a limit: a
  429 with Retry-After and OpenAI's x-ratelimit-* headers.

All state lives on the event loop's thread: plain counters, no locks.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field, fields

from fastapi import Request

from openai_frontend.api.errors import OpenAIError
from openai_frontend.generation.deltas import Delta
from openai_frontend.operations.admission import RETRY_SOON_S, Admission
from openai_frontend.operations.auth import OPEN_TENANT

CLIENT_CLOSED_REQUEST = 499  # serving.py's status for a client that left mid-request


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """The limits: the environment variables of the same names, as openai_frontend/settings.py
    passes them to `from_env`. 0 is unlimited for the tenants' limits, max_messages and
    max_string_chars; 0 queued: no queue."""

    tenant_max_concurrent: int = 0
    tenant_tokens_per_minute: int = 0
    max_inflight_requests: int = 256
    max_queued_requests: int = 512
    max_request_bytes: int = 32 * 2**20  # images ride in the body as base64 data URLs
    max_messages: int = 1024  # a conversation's messages (chat, Anthropic) or items (Responses)
    max_string_chars: int = 200_000
    max_json_items: int = 262_144  # any other array or object of a body: token ids, logit bias, tools ...
    max_json_nesting: int = 128

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> LimitSettings:
        values = {}
        for f in fields(cls):
            raw = environ.get(f.name.upper(), "").strip()
            if raw:
                values[f.name] = _non_negative_int(f.name.upper(), raw)
        settings = cls(**values)
        for name in ("max_inflight_requests", "max_request_bytes", "max_json_items", "max_json_nesting"):
            if getattr(settings, name) < 1:
                raise ValueError(f"{name.upper()} must be at least 1")
        return settings


def _non_negative_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {value}")
    return value


@dataclass(slots=True)
class TokenBucket:
    """A minute's worth of tokens, refilled continuously; it starts full."""

    capacity: int
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60)
        self.stamp = now

    def seconds_until(self, tokens: float) -> float:
        return max(0.0, (tokens - self.level) * 60 / self.capacity)


@dataclass(slots=True)
class _Tenant:
    running: int = 0
    bucket: TokenBucket | None = None


class TenantLimits:
    """Each tenant's running requests and token bucket."""

    def __init__(self, max_concurrent: int, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.max_concurrent = max_concurrent
        self.tokens_per_minute = tokens_per_minute
        self._clock = clock
        # tenants come from the key file, so this dict stays as small as that file
        self._tenants: dict[str, _Tenant] = {}

    def enter(self, tenant: str) -> None:
        state = self._state(tenant)
        if self.max_concurrent and state.running >= self.max_concurrent:
            message = (
                f"Rate limit reached: {self.max_concurrent} concurrent requests per tenant (your API key's). "
                "Retry when one of yours has finished."
            )
            raise self._refusal(tenant, message, "requests", RETRY_SOON_S)
        state.running += 1

    def leave(self, tenant: str) -> None:
        self._tenants[tenant].running -= 1

    def reserve(self, tenant: str, tokens: int) -> int:
        """Take `tokens` (at most a full bucket) from the tenant's bucket and return how
        many were taken, or refuse with a 429 saying when they will be there."""
        bucket = self._bucket(tenant)
        if bucket is None:
            return 0
        needed = min(tokens, bucket.capacity)
        if needed > bucket.level:
            wait = bucket.seconds_until(needed)
            message = (
                f"Rate limit reached: {self.tokens_per_minute} tokens per minute per tenant; this request "
                f"needs {needed} and {max(0, int(bucket.level))} are left. Please try again in {_duration(wait)}."
            )
            raise self._refusal(tenant, message, "tokens", math.ceil(wait))
        bucket.level -= needed
        return needed

    def credit(self, tenant: str, tokens: int) -> None:
        """Give back `tokens` (take more, if negative) once a request's usage is known."""
        bucket = self._bucket(tenant)
        if bucket is not None:
            bucket.level = min(bucket.capacity, bucket.level + tokens)

    def headers(self, tenant: str) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits that are set. "requests" counts
        concurrent requests here, not requests per minute."""
        headers = {}
        if self.max_concurrent:
            running = self._state(tenant).running
            headers["x-ratelimit-limit-requests"] = str(self.max_concurrent)
            headers["x-ratelimit-remaining-requests"] = str(max(0, self.max_concurrent - running))
        bucket = self._bucket(tenant)
        if bucket is not None:
            headers["x-ratelimit-limit-tokens"] = str(self.tokens_per_minute)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, int(bucket.level)))
            headers["x-ratelimit-reset-tokens"] = _duration(bucket.seconds_until(bucket.capacity))
        return headers

    def _state(self, tenant: str) -> _Tenant:
        return self._tenants.setdefault(tenant, _Tenant())

    def _bucket(self, tenant: str) -> TokenBucket | None:
        if not self.tokens_per_minute:
            return None
        state = self._state(tenant)
        now = self._clock()
        if state.bucket is None:
            state.bucket = TokenBucket(self.tokens_per_minute, self.tokens_per_minute, now)
        state.bucket.refill(now)
        return state.bucket

    def _refusal(self, tenant: str, message: str, kind: str, retry_after: int) -> OpenAIError:
        headers = self.headers(tenant)
        headers["retry-after"] = str(max(1, retry_after))
        return OpenAIError(429, message, None, kind, "rate_limit_exceeded", headers)


def _duration(seconds: float) -> str:
    """A wait as OpenAI's headers write it: "1.5s", "120ms"."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


@dataclass(slots=True)
class Ticket:
    """One admitted request: its tenant and the tokens it reserved.

    Settling: a response with an error status (other than a client that left) sent
    nothing generated, so the reservation is given back; a response whose every choice
    reported its usage is charged that usage instead; otherwise (the client left, a
    stream broke) the reservation stands, as the model may have spent it.
    """

    tenant: str
    limits: TenantLimits | None = None
    reserved: int = 0
    prompt_tokens: int = 0
    choices: int = 0
    completion_tokens: list[int] = field(default_factory=list)

    def reserve(self, prompt_tokens: int, new_tokens: int, choices: int) -> None:
        """The request's prompts' tokens and the most its `choices` may generate in all."""
        if self.limits is not None:
            self.reserved = self.limits.reserve(self.tenant, prompt_tokens + new_tokens)
        self.prompt_tokens, self.choices = prompt_tokens, choices

    async def metered(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """The deltas of one choice, noting its usage when it ends."""
        async with aclosing(deltas):
            async for delta in deltas:
                if delta.final is not None:
                    self.completion_tokens.append(delta.final.num_output_tokens)
                yield delta

    def settle(self, status: int) -> None:
        if not self.reserved or self.limits is None:
            return
        if _sent_nothing(status):
            self.limits.credit(self.tenant, self.reserved)
        elif len(self.completion_tokens) == self.choices:
            used = self.prompt_tokens + sum(self.completion_tokens)
            self.limits.credit(self.tenant, self.reserved - used)
        self.reserved = 0


def _sent_nothing(status: int) -> bool:
    """No response began (0), or an error did: nothing generated reached the client."""
    return not status or (status >= 400 and status != CLIENT_CLOSED_REQUEST)


class Limits:
    """Admission and the tenants' limits together: a request enters with `admit` and
    leaves with `release`, whatever way it ends."""

    def __init__(self, settings: LimitSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.tenants = TenantLimits(settings.tenant_max_concurrent, settings.tenant_tokens_per_minute, clock)
        self.admission = Admission(settings.max_inflight_requests, settings.max_queued_requests)

    async def admit(self, tenant: str) -> Ticket:
        """The tenant's slot first (429), then the server's (503, or a wait in the queue)."""
        self.tenants.enter(tenant)
        try:
            await self.admission.enter()
        except BaseException:
            self.tenants.leave(tenant)
            raise
        return Ticket(tenant, self.tenants)

    def release(self, ticket: Ticket, status: int) -> None:
        ticket.settle(status)
        self.admission.leave()
        self.tenants.leave(ticket.tenant)


def ticket_of(request: Request) -> Ticket:
    """The request's ticket (set by the app's gate); an unlimited one for the open tenant
    when the Serving is driven without the gate."""
    return getattr(request.state, "ticket", None) or Ticket(OPEN_TENANT)
