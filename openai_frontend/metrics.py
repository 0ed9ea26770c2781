"""A few Prometheus counters, written in the text exposition format by hand.

All updates happen on the event loop's thread, so plain integers need no lock.
"""

from __future__ import annotations

from collections import Counter

PREFIX = "llm_frontend"


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()  # by endpoint
        self.errors: Counter[int] = Counter()  # by HTTP status
        self.finished: Counter[str] = Counter()  # by finish_reason ("abort": client left)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_prompt_tokens = 0
        self.running = 0

    def render(self) -> str:
        lines: list[str] = []
        _family(lines, "requests_total", "counter", "Generation requests received.")
        lines += [f'{PREFIX}_requests_total{{endpoint="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        _family(lines, "request_errors_total", "counter", "Requests answered with an error.")
        lines += [f'{PREFIX}_request_errors_total{{status="{k}"}} {v}' for k, v in sorted(self.errors.items())]
        _family(lines, "requests_finished_total", "counter", "Generations finished, by finish_reason.")
        lines += [f'{PREFIX}_requests_finished_total{{reason="{k}"}} {v}' for k, v in sorted(self.finished.items())]
        for name, value, text in (
            ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished generations."),
            ("completion_tokens_total", self.completion_tokens, "Tokens generated."),
            ("cached_prompt_tokens_total", self.cached_prompt_tokens, "Prompt tokens served from the prefix cache."),
        ):
            _family(lines, name, "counter", text)
            lines.append(f"{PREFIX}_{name} {value}")
        _family(lines, "requests_running", "gauge", "Generations in flight.")
        lines.append(f"{PREFIX}_requests_running {self.running}")
        return "\n".join(lines) + "\n"


def _family(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines.append(f"# HELP {PREFIX}_{name} {help_text}")
    lines.append(f"# TYPE {PREFIX}_{name} {kind}")
