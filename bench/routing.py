"""KV-aware routing against round robin over 3 Triton instances of one model, same run.

Two replica stacks (launcher/replica_stack.py), one after the other, serve the same
workload, built from the same seed: CONVERSATIONS multi-turn chats, each on one of
SYSTEM_PROMPTS distinct system prompts of several hundred tokens; each turn appends the
previous answer and a new user message. Conversations run CONCURRENCY at a time, each
one's turns in order; greedy, MAX_TOKENS tokens, streamed with usage. No session_id or
prompt_cache_key is sent: the frontend keys a session by the prompt's first tokens.
Each instance gets KV_CACHE_MB (below) of KV cache: less than all the system prompts.

- prefix-cache hit rate: sum of usage.prompt_tokens_details.cached_tokens over sum of
  usage.prompt_tokens, over all requests (goal: KV >= 2x round robin);
- time to first token: from sending to the first content delta, mean and p50 (goal: lower);
- requests per instance, from the frontend's llm_router_requests_total;
- the ideal: the hit rate of one unbounded cache shared by all instances, from the same
  prompts and answers tokenized here (ideal_hit_rate), the most any router could reach.

Each stack first gets one short request per instance (warm-up, not counted).
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from dataclasses import dataclass, field

import httpx

SYSTEM_PROMPTS, CONVERSATIONS, TURNS, CONCURRENCY, MAX_TOKENS, SEED = 8, 16, 4, 8, 24, 7
PROMPT_WORDS = 440  # words of rules per system prompt (about 600 tokens)
REPLICAS = 3
# Each instance's KV pool: 96 MB is ~2,100 tokens of the default model in float32, room
# for about 3 of the 8 system prompts next to the running conversations. Together the 3
# instances hold all 8 when each keeps its own families (KV-aware routing); round robin
# shows every family to every instance, so each one's cache cycles through all 8. The
# ratio depends on this pressure and on how many families are in use at once: 8
# conversations at a time put every system prompt in use, as a deployment serving
# several applications sees it (docs/speed.md "Routing"; earlier runs, in git's history of
# docs/speed.md's routing table: at 4 at a time only half the families were live, round
# robin's caches held most of those, and the ratio was 1.88x-2.03x; with caches that hold
# every family everywhere, round robin misses only each instance's first sight of a prompt).
KV_CACHE_MB = 96
PERSONAS = [
    ("Nimbus Drive", "the customer support assistant of Nimbus Drive, a cloud storage service"),
    ("Harvest Table", "the cooking assistant of Harvest Table, a recipe and meal-planning site"),
    ("Wayfarer", "the travel planning assistant of Wayfarer, an online travel agency"),
    ("Linthouse", "the code review assistant of Linthouse, a developer tools company"),
    ("Greenleaf Bank", "the banking assistant of Greenleaf Bank, a retail bank"),
    ("Pulse Fitness", "the training assistant of Pulse Fitness, a gym chain with an app"),
    ("Brightpath", "the tutoring assistant of Brightpath, an online school for teenagers"),
    ("Homestead", "the home repair assistant of Homestead, a hardware store"),
]
RULES = [
    "Always greet the user briefly and get to the point of their question about {topic}.",
    "Never invent facts about {name}; if you are unsure, say so and suggest where to look.",
    "Keep answers under five sentences unless the user asks for more detail on {topic}.",
    "Use plain language, avoid jargon, and define any technical term about {topic} you must use.",
    "If the request is outside {topic}, politely explain that you can only help with {topic}.",
    "Ask one clarifying question when the request about {topic} is ambiguous, never more than one.",
    "Do not share personal data, account numbers or passwords, even if the user offers them.",
    "When giving steps, number them and keep each step to a single short sentence.",
    "Mention the relevant {name} help page when it exists, but never make up a link.",
    "Stay calm and friendly when the user is frustrated, and acknowledge the problem first.",
    "Prefer concrete examples about {topic} over abstract explanations.",
    "Do not promise refunds, discounts or deadlines on behalf of {name}; refer to a human agent.",
    "Summarize the user's goal in one sentence before a long answer about {topic}.",
    "If safety is involved, put the safety warning first and make it explicit.",
    "End with a short offer to help further with {topic}, without repeating the answer.",
    "Respect the user's language: answer in the language the user writes in.",
]
QUESTIONS = [
    "How do I get started?",
    "What should I do first if something goes wrong?",
    "Can you give me a quick example?",
    "What is the most common mistake people make?",
    "Is there a faster way to do this?",
    "What would you recommend for a beginner?",
    "How long does this usually take?",
    "What are the limits I should know about?",
]


@dataclass(slots=True)
class ModeFigures:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)  # seconds
    per_instance: list[int] = field(default_factory=list)  # requests routed, by instance name
    reasons: dict[str, int] = field(default_factory=dict)  # requests routed, by reason
    sent: list[list[dict]] = field(default_factory=list)  # each request's messages and then its answer, in send order

    hit_rate = property(lambda self: self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0)
    ttft_mean = property(lambda self: statistics.fmean(self.ttfts))
    ttft_p50 = property(lambda self: statistics.median(self.ttfts))


def system_prompt(index: int, seed: int) -> str:
    """One persona's instructions: the rules in rounds, each round shuffled by the seed and
    cut at a random length, numbered, until PROMPT_WORDS words."""
    name, role = PERSONAS[index % len(PERSONAS)]
    topic = f"{name} and its services"
    rng = random.Random(seed * 1000 + index)
    lines, words, n = [f"You are {role}. Follow these rules in every answer."], 0, 0
    while words < PROMPT_WORDS:
        rules = RULES[:]
        rng.shuffle(rules)
        for rule in rules[: rng.randint(6, len(rules))]:
            if words >= PROMPT_WORDS:
                break
            n += 1
            line = f"Rule {n}: " + rule.format(name=name, topic=topic)
            lines.append(line)
            words += len(line.split())
    return "\n".join(lines)


def workload(conversations: int, turns: int, seed: int) -> list[tuple[str, list[str]]]:
    """(system prompt, user messages) per conversation: the i-th on system prompt i % SYSTEM_PROMPTS."""
    prompts = [system_prompt(i, seed) for i in range(SYSTEM_PROMPTS)]
    rng = random.Random(seed)
    ask = lambda c, t: f"{rng.choice(QUESTIONS)} (conversation {c}, turn {t + 1})"
    users = [[ask(c, t) for t in range(turns)] for c in range(conversations)]
    return [(prompts[c % SYSTEM_PROMPTS], users[c]) for c in range(conversations)]


async def _turn(client, model: str, messages: list[dict], fig: ModeFigures, max_tokens: int = MAX_TOKENS) -> str:
    """One streamed chat completion: its answer; its TTFT and usage go into `fig`."""
    start, first, text, usage = time.perf_counter(), None, [], None
    record = [*messages]
    fig.sent.append(record)
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                text.append(choice.delta.content)
    record.append({"role": "assistant", "content": "".join(text)})
    fig.requests += 1
    fig.ttfts.append((first or time.perf_counter()) - start)
    fig.prompt_tokens += usage.prompt_tokens
    details = usage.prompt_tokens_details
    fig.cached_tokens += (details.cached_tokens or 0) if details else 0
    return "".join(text)


async def _conversation(client, model: str, chat: tuple[str, list[str]], fig: ModeFigures, gate, max_tokens) -> None:
    system, users = chat
    async with gate:
        messages = [{"role": "system", "content": system}]
        for user in users:
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": await _turn(client, model, messages, fig, max_tokens)})


async def _drive(stack, chats: list[tuple[str, list[str]]], concurrency: int, max_tokens: int) -> ModeFigures:
    from openai import AsyncOpenAI

    fig, gate, model = ModeFigures(), asyncio.Semaphore(concurrency), stack.served_model_name
    async with AsyncOpenAI(base_url=stack.base_url, api_key="none", timeout=600.0, max_retries=0) as client:
        for i in range(REPLICAS):  # warm-up, one per instance (an idle set is walked in turn), not counted
            await _turn(client, model, [{"role": "user", "content": f"Say hello to number {i}."}], ModeFigures())
        before = routed(stack.metrics_url)
        await asyncio.gather(*(_conversation(client, model, chat, fig, gate, max_tokens) for chat in chats))
    after = routed(stack.metrics_url)
    counts = {key: n - before.get(key, 0) for key, n in after.items()}
    for name in sorted({name for name, _ in counts}):
        fig.per_instance.append(sum(n for (i, _), n in counts.items() if i == name))
    for (_, reason), n in counts.items():
        if n:
            fig.reasons[reason] = fig.reasons.get(reason, 0) + n
    return fig


def ideal_hit_rate(model_path: str, sent: list[list[dict]], block_size: int = 16) -> float:
    """The hit rate of one unbounded prefix cache over `sent` (each request's messages, its
    answer last) in send order: a prompt's full blocks count as cached up to the first one
    that no earlier prompt-and-answer began with. Re-tokenized answers can differ from the
    generated tokens, so this is an estimate."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    render = lambda messages, prompt: list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=prompt, tokenize=True, return_dict=True)["input_ids"])  # fmt: skip
    seen, cached, total = set(), 0, 0
    for record in sent:
        prompt, whole = render(record[:-1], True), render(record, False)
        blocks = [tuple(prompt[: (i + 1) * block_size]) for i in range(len(prompt) // block_size)]
        hits = next((i for i, block in enumerate(blocks) if block not in seen), len(blocks))
        cached, total = cached + hits * block_size, total + len(prompt)
        seen.update(tuple(whole[: (i + 1) * block_size]) for i in range(len(whole) // block_size))
    return cached / total if total else 0.0


def routed(metrics_url: str) -> dict[tuple[str, str], int]:
    """llm_router_requests_total by (instance, reason)."""
    pattern = r'^llm_router_requests_total\{instance="([^"]*)",reason="([^"]*)"\} ([0-9.e+]+)$'
    text = httpx.get(metrics_url, timeout=10).text
    return {(m[1], m[2]): int(float(m[3])) for m in re.finditer(pattern, text, re.MULTILINE)}


def measure(model_path: str, mode: str, chats, concurrency: int, kv_cache_mb: int, max_tokens: int) -> ModeFigures:
    from launcher.replica_stack import ReplicaStack

    env = {"KV_CACHE_MB": str(kv_cache_mb)}
    with ReplicaStack(model_path, replicas=REPLICAS, router_mode=mode, env=env) as stack:
        return asyncio.run(_drive(stack, chats, concurrency, max_tokens))


def main(model_path: str, conversations: int = CONVERSATIONS, turns: int = TURNS, seed: int = SEED,
         concurrency: int = CONCURRENCY, kv_cache_mb: int = KV_CACHE_MB,
         max_tokens: int = MAX_TOKENS) -> dict[str, ModeFigures]:  # fmt: skip
    chats = workload(conversations, turns, seed)
    print(f"routing: {conversations} conversations x {turns} turns on {SYSTEM_PROMPTS} system prompts, "
          f"{concurrency} at a time, {max_tokens} tokens a turn, over {REPLICAS} instances "
          f"(KV_CACHE_MB={kv_cache_mb} each): "
          "KV-aware vs round robin ...", flush=True)  # fmt: skip
    modes = ("kv", "round-robin")
    figs = {mode: measure(model_path, mode, chats, concurrency, kv_cache_mb, max_tokens) for mode in modes}
    print(f"{'mode':>12} {'requests':>9} {'hit rate':>9} {'TTFT ms':>8} {'p50 ms':>7}  per instance   reasons")
    for mode, f in figs.items():
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(f.reasons.items()))
        print(f"{mode:>12} {f.requests:>9} {f.hit_rate:>9.1%} {f.ttft_mean * 1e3:>8.0f} {f.ttft_p50 * 1e3:>7.0f}  "
              f"{'/'.join(map(str, f.per_instance)):<14} {reasons}")  # fmt: skip
    kv, rr = figs["kv"], figs["round-robin"]
    print(f"KV / round robin: hit rate {kv.hit_rate / rr.hit_rate if rr.hit_rate else float('inf'):.2f}x "
          f"(goal >= 2x), mean TTFT {kv.ttft_mean / rr.ttft_mean:.2f}x (goal < 1)")  # fmt: skip
    print(f"ideal (one unbounded cache, the same prompts and answers): {ideal_hit_rate(model_path, kv.sent):.1%}")
    return figs


if __name__ == "__main__":
    import argparse

    from backend.runner.convert import ensure_default_model

    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face folder (default: the converted default model)")
    parser.add_argument("--conversations", type=int, default=CONVERSATIONS)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="conversations at a time")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens a turn")
    parser.add_argument("--kv-cache-mb", type=int, default=KV_CACHE_MB, help="each instance's KV_CACHE_MB")
    args = parser.parse_args()
    main(args.model or str(ensure_default_model()), args.conversations, args.turns, SEED, args.concurrency,
         args.kv_cache_mb, args.max_tokens)  # fmt: skip
