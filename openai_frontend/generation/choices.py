"""`n` choices of one prompt: each is its own generation (its own model request); these
run them together, collected whole or interleaved as they stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TypeVar

from openai_frontend.generation.deltas import Delta, collect

T = TypeVar("T")


async def collect_all(streams: list[AsyncIterator[Delta]]) -> list[Delta]:
    """Each choice collected, concurrently; one failing cancels the others."""
    tasks = [asyncio.ensure_future(collect(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def interleave(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The choices' deltas as they come, tagged with their index, until all have ended.

    A choice's error is raised here; closing the iterator (or an error) cancels every
    choice, and so its model request.
    """
    queue: asyncio.Queue[tuple[int, Delta | Exception | None]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(i, stream, queue)) for i, stream in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(index: int, stream: AsyncIterator[Delta], queue: asyncio.Queue) -> None:
    try:
        async with aclosing(stream):
            async for delta in stream:
                queue.put_nowait((index, delta))
        queue.put_nowait((index, None))
    except Exception as exc:  # noqa: BLE001 - handed to the reader of the queue
        queue.put_nowait((index, exc))


async def heads(deltas: AsyncIterator[tuple[int, Delta]], n: int) -> list[tuple[int, Delta]]:
    """Deltas until each of the n choices has sent one (a refusal comes before any)."""
    received: list[tuple[int, Delta]] = []
    seen: set[int] = set()
    while len(seen) < n:
        index, delta = await anext(deltas)
        received.append((index, delta))
        seen.add(index)
    return received


async def after(first: asyncio.Future[list[T]], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """The items `first` brings, then the rest's; closing it cancels both."""
    try:
        for item in await first:
            yield item
        async for item in rest:
            yield item
    finally:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)  # it may be inside `rest`: done first
        await rest.aclose()
