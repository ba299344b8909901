"""Streamed replies of the agent proxy (``stream: true``): a call's text as OpenAI chunks while
the engine samples it.

The engine hands over each call's tokens as it samples them (``GenerateRequest.on_tokens``,
called from its own thread), and they are queued for the response. The reply's content is
the text decoded so far, sent as far as it is certain: up to where a tool call begins or may
begin (``ToolCallParser.call_start``; a parser without it sends the content at the end),
without trailing whitespace (a reply with tool calls has its prose stripped) and not ending in
half a character. When the call ends, the rest of the content, the tool calls, the finish
chunk (with ``finish_reason``), a usage chunk when ``stream_options.include_usage`` asks for
it, and ``[DONE]`` follow, so the chunks add up to the reply the call would have had without
streaming. A call refused before its generation starts is an HTTP error as without
streaming; an engine failure after the first chunk is an ``error`` event (the SDK raises).
A Ray engine actor streams what the driver's peeks bring (``runtime/ray/peeks.py``); a reply
answered from an episode's record (a resume) sends its content in one chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollstream.agent.proxy_wire import chunk, closing

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class StreamedText:
    """The content of a reply being sampled, handed out as it becomes certain (module
    docstring)."""

    decode: Callable[[list[int]], str]
    parser: Any  # the model's ToolCallParser
    stop: frozenset[int] = frozenset()
    ids: list[int] = field(default_factory=list)
    sent: str = ""

    def add(self, ids: list[int]) -> str:
        """The content to send after ``ids`` were sampled ("" when none is certain yet)."""
        self.ids += ids
        text = self.decode([t for t in self.ids if t not in self.stop])
        start = getattr(self.parser, "call_start", None)
        safe = "" if start is None or text.endswith("\ufffd") else text[:start(text)].rstrip()
        if safe[:1].isspace() or not safe.startswith(self.sent):
            return ""  # leading space: kept without tool calls, stripped with them
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def rest(self, content: str | None) -> str:
        """What is left to send of the reply's final ``content``."""
        final = content or ""
        if not final.startswith(self.sent):  # a tokenizer whose prefix decodes differently
            log.warning("a streamed reply sent %r, which does not begin its content %r",
                        self.sent[:80], final[:80])
            return ""
        return final[len(self.sent):]


class ReplyStream:
    """One streamed call's side of the run: ``start`` when its generation begins (its prompt
    was accepted), ``on_tokens`` from the engine's thread, the end when the call returns."""

    def __init__(self, text: StreamedText) -> None:
        self.loop = asyncio.get_running_loop()
        self.text = text
        self.queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self.started: asyncio.Future[str] = self.loop.create_future()

    def start(self, reply_id: str, stop: tuple[int, ...]) -> None:
        self.text.stop = frozenset(stop)
        if not self.started.done():
            self.started.set_result(reply_id)

    def on_tokens(self, ids: list[int]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, list(ids))


async def streamed(complete: Callable[[ReplyStream], Awaitable[dict]], text: StreamedText, *,
                   model: str, usage: bool) -> tuple[AsyncIterator[str] | None, asyncio.Task]:
    """Run ``complete(stream)`` (the call); once its generation starts, the SSE lines of the
    reply (None when the call ended before: the task holds its reply or its error)."""
    stream = ReplyStream(text)
    task = asyncio.create_task(complete(stream))

    def ended(t: asyncio.Task) -> None:
        stream.queue.put_nowait(None)
        if not t.cancelled():
            t.exception()  # retrieved here too: a client gone before the end never reads it

    task.add_done_callback(ended)
    await asyncio.wait({task, stream.started}, return_when=asyncio.FIRST_COMPLETED)
    if not stream.started.done():
        return None, task
    head = {"id": stream.started.result(), "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}
    return _lines(stream, task, head, usage), task


async def _lines(stream: ReplyStream, task: asyncio.Task, head: dict,
                 usage: bool) -> AsyncIterator[str]:
    yield chunk(head, {"role": "assistant", "content": ""})
    done = False
    while not done:
        batch = [await stream.queue.get()]
        while not stream.queue.empty():  # what came while the last chunk went out: one decode
            batch.append(stream.queue.get_nowait())
        done = None in batch
        ids = [t for b in batch if b is not None for t in b]
        if ids and (delta := await asyncio.to_thread(stream.text.add, ids)):
            yield chunk(head, {"content": delta})
    try:
        reply = task.result()
    except Exception as e:  # noqa: BLE001 - after the first chunk an error is an event
        status = getattr(e, "status", 502)
        yield f"data: {json.dumps({'error': {'message': str(e), 'code': status}})}\n\n"
        return
    message = reply["choices"][0]["message"]
    for line in closing(reply, head, stream.text.rest(message["content"]), usage=usage):
        yield line
