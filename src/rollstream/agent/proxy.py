"""An OpenAI-compatible endpoint that turns any agent harness into a rollout source.

An unmodified agent written against the official ``openai`` SDK (``chat.completions``,
streaming or not, with tools) is pointed at ``base_url`` with a per-episode ``api_key``. Each
call is rendered with the model's chat template, sent to an engine as token ids, and its
tokens, logprobs and versions are recorded; the calls of one session are stitched into one
trajectory by **dialogue-prefix matching**: a call whose messages are the previous call's
messages plus the reply it got plus new ones (tool results, a user turn) continues the
trajectory, the new messages rendered incrementally after the tokens already served
(``ChatRenderer.extend``); a call that rewrote history (dropped, edited or reordered earlier
messages), or follows a call the engine failed, starts a new sample, recorded with the
reason. A session sticks to the engine its first call went to (which holds its prefix) while
that engine is UP, and moves to the least loaded one otherwise.

Security: binds to 127.0.0.1 unless told otherwise, and every call needs the bearer key of an
open session (401 otherwise). The run side opens a session, hands its URL and key to a
harness, and closes it when the harness finishes or times out (:meth:`AgentProxy.run_harness`),
receiving the samples.

Simplifications: ``n`` must be 1; a streamed reply is sent as one content chunk (and one chunk
per tool call) after generation, since the engine protocol returns a turn at once.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from fastapi import Request

from rollstream.agent.chat import ChatRenderer, Message
from rollstream.agent.loop import generate_turn
from rollstream.agent.tools import HermesToolParser, ToolCall, ToolCallParser
from rollstream.engine import Engine, EngineHealth, FinishReason, SamplingParams
from rollstream.trajectory import Segment

DEFAULT_MAX_TOKENS = 256


class EngineFailed(RuntimeError):
    """The engine failed a call (the harness gets HTTP 502 with the reason)."""


@dataclass(slots=True, kw_only=True)
class ProxySample:
    """One stitched trajectory of a session."""

    prompt_ids: list[int]
    messages: list[Message]  # the conversation as rendered (model turns as their raw text)
    segments: list[Segment] = field(default_factory=list)
    num_calls: int = 0
    started_because: str | None = None  # why a new sample began (None: the first one)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + [t for s in self.segments for t in s.token_ids]


@dataclass(slots=True, kw_only=True)
class _Session:
    key: str
    episode_id: str
    samples: list[ProxySample] = field(default_factory=list)
    # the last request's messages + its reply (None: that call failed)
    seen: list[Message] | None = field(default_factory=list)
    ended_turn: bool = True  # the last model turn ended with its stop token
    engine: Engine | None = None
    num_calls: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(slots=True, kw_only=True, frozen=True)
class SessionHandle:
    base_url: str
    api_key: str


class AgentProxy:
    def __init__(self, engines: Sequence[Engine], tokenizer: Any, *,
                 host: str = "127.0.0.1", port: int = 0,
                 parser: ToolCallParser | None = None) -> None:
        if not engines:
            raise ValueError("AgentProxy needs at least one engine")
        self.engines, self.tokenizer = list(engines), tokenizer
        self.host, self.port = host, port
        self.parser = parser or HermesToolParser()
        self._sessions: dict[str, _Session] = {}
        self._server = None
        self._task: asyncio.Task | None = None
        self.app = self._build_app()

    # ---- the run side --------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def open_session(self, episode_id: str) -> SessionHandle:
        key = f"rs-{secrets.token_urlsafe(24)}"
        self._sessions[key] = _Session(key=key, episode_id=episode_id)
        return SessionHandle(base_url=self.base_url, api_key=key)

    def close_session(self, api_key: str) -> list[ProxySample]:
        """Stop accepting the session's calls; its samples."""
        return self._sessions.pop(api_key).samples

    async def run_harness(self, harness: Callable[[SessionHandle], Awaitable[Any]], *,
                          episode_id: str, timeout_s: float | None = None):
        """Run ``harness(handle)`` in a session of its own; (samples, harness result or the
        exception that ended it). A harness that times out or raises still yields the
        samples it produced."""
        handle = self.open_session(episode_id)
        try:
            async with asyncio.timeout(timeout_s):
                outcome = await harness(handle)
        except Exception as e:  # noqa: BLE001 - fault boundary: the episode ends with it
            outcome = e
        return self.close_session(handle.api_key), outcome

    async def start(self) -> None:
        import uvicorn

        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                await self._task  # raises why it could not start
                raise RuntimeError("the proxy server stopped while starting")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ---- the harness side ----------------------------------------------------------------

    def _build_app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="rollstream proxy")

        def error(status: int, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}},
                                status_code=status)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            auth = request.headers.get("authorization", "")
            session = self._sessions.get(auth.removeprefix("Bearer ").strip())
            if not auth.startswith("Bearer ") or session is None:
                return error(401, "missing or unknown API key (each episode has its own)")
            body = await request.json()
            if body.get("n", 1) != 1:
                return error(400, "n must be 1")
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                return error(400, "messages must be a non-empty list")
            try:
                reply = await self._complete(session, body)
            except (ValueError, TypeError) as e:
                return error(400, str(e))
            except EngineFailed as e:
                return error(502, str(e))
            if body.get("stream"):
                return StreamingResponse(_sse(reply), media_type="text/event-stream")
            return reply

        return app

    async def _complete(self, session: _Session, body: dict) -> dict:
        messages = [_plain(m) for m in body["messages"]]
        renderer = ChatRenderer(self.tokenizer, tools=body.get("tools") or None)
        async with session.lock:
            session.num_calls += 1
            sample = session.samples[-1] if session.samples else None
            if sample is None:
                at: int | str = "the first call"
            elif session.seen is None:  # its tokens end where that call's prompt did
                at = "the previous call failed"
            else:
                at = _extends(session.seen, messages)
            if isinstance(at, int):
                new = [_templated(m, self.parser) for m in messages[at:]]
                if new:
                    delta = await asyncio.to_thread(renderer.extend, sample.messages, new,
                                                    model_ended_turn=session.ended_turn)
                    sample.segments.append(Segment.env(delta))
                    sample.messages.extend(new)
            else:
                templated = [_templated(m, self.parser) for m in messages]
                prompt = await asyncio.to_thread(renderer.prompt, templated)
                sample = ProxySample(prompt_ids=prompt, messages=templated,
                                     started_because=None if not session.samples else at)
                session.samples.append(sample)
            stop = tuple(renderer.stop_token_ids(sample.messages))
            params = SamplingParams(
                temperature=float(body.get("temperature", 1.0)),
                top_p=float(body.get("top_p", 1.0)),
                max_new_tokens=int(body.get("max_completion_tokens")
                                   or body.get("max_tokens") or DEFAULT_MAX_TOKENS),
                stop_token_ids=stop, seed=body.get("seed"))
            if session.engine is None or session.engine.stats().health is not EngineHealth.UP:
                session.engine = self._pick_engine()  # first call, or its engine went away
            turn: list[Segment] = []
            out = await generate_turn(session.engine, sample.token_ids, params,
                                      f"{session.key[-8:]}/{session.num_calls}", turn)
            if out.error is not None:
                session.seen = None
                raise EngineFailed(f"the engine failed the call: {out.error}")
            sample.segments += turn
            sample.num_calls += 1
            session.ended_turn = out.finish_reason is FinishReason.STOP
            served = [t for seg in turn for t in seg.token_ids]
            ids = served[:-1] if session.ended_turn else served
            text = await asyncio.to_thread(self.tokenizer.decode, ids)
            sample.messages.append({"role": "assistant", "content": text})
            message = self._message(text, session)
            session.seen = [*messages, _plain(message)]
        finish = "length" if out.finish_reason is FinishReason.LENGTH else (
            "tool_calls" if message.get("tool_calls") else "stop")
        return {"id": f"chatcmpl-{session.key[-8:]}-{session.num_calls}",
                "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "rollstream"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(sample.token_ids) - out.num_tokens,
                          "completion_tokens": out.num_tokens,
                          "total_tokens": len(sample.token_ids)}}

    def _message(self, text: str, session: _Session) -> dict:
        parsed = self.parser.parse(text)
        if not parsed.calls:  # the text exactly as sampled (as vLLM's server answers)
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": [
            {"id": f"call_{session.num_calls}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for i, c in enumerate(parsed.calls)]}

    def _pick_engine(self) -> Engine:
        up = [e for e in self.engines if e.stats().health is EngineHealth.UP] or self.engines
        return min(up, key=lambda e: (s := e.stats()).num_running + s.num_waiting)


def _plain(message: Any) -> Message:
    """A request message as comparable data: role, text content, tool calls."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: Message = {"role": message.get("role"), "content": content or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            (c["function"]["name"], _arguments(c["function"].get("arguments")))
            for c in message["tool_calls"]]
    return out


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _templated(message: Message, parser: ToolCallParser) -> Message:
    """A message as the chat template renders it: tool calls as the model writes them."""
    text = message["content"]
    calls = [parser.render(ToolCall(id="", name=name, arguments=args))
             for name, args in message.get("tool_calls", ())]
    if calls:
        text = "\n".join([text, *calls]) if text else "\n".join(calls)
    return {"role": message["role"], "content": text}


def _extends(seen: list[Message], messages: list[Message]) -> int | str:
    """Where the new messages start, when ``messages`` continue ``seen``; else why not."""
    if len(messages) <= len(seen):
        return f"history rewritten: {len(messages)} messages sent after {len(seen)} seen"
    for i, (a, b) in enumerate(zip(seen, messages, strict=False)):
        if a != b:
            return f"history rewritten at message {i} ({a['role']} -> {b['role']})"
    return len(seen)


async def _sse(reply: dict):
    """The reply as OpenAI stream chunks: role, content, tool calls, finish, [DONE]."""
    choice = reply["choices"][0]
    message = choice["message"]
    base = {k: reply[k] for k in ("id", "created", "model")} | {"object":
                                                               "chat.completion.chunk"}

    def chunk(delta: dict, finish: str | None = None) -> str:
        data = base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(data)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message["content"]:
        yield chunk({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls", ())):
        yield chunk({"tool_calls": [{"index": i, **call}]})
    yield chunk({}, choice["finish_reason"])
    yield "data: [DONE]\n\n"


def serve(model_dir: Path, *, port: int, num_sessions: int, out: Path | None,
          max_slots: int = 16) -> None:
    """``rollstream proxy``: the embedded engine on ``model_dir`` behind the proxy, with
    ``num_sessions`` open sessions (their URL and keys printed), until SIGINT or SIGTERM;
    then every session's samples are written to ``out`` (JSON lines)."""
    import signal

    from rollstream.config.schema import EngineConfig, LocalEngineConfig
    from rollstream.engine import build_engine
    from rollstream.models.tokenizer import load_tokenizer
    from rollstream.models.warmstart import validate_model_folder

    folder = validate_model_folder(Path(model_dir))
    tokenizer = load_tokenizer(folder)

    async def main() -> None:
        engine = build_engine(EngineConfig(kind="local", local=LocalEngineConfig(
            max_slots=max_slots)), folder, engine_id="local-0")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            async with AgentProxy([engine], tokenizer, port=port) as proxy:
                handles = [proxy.open_session(f"session-{i}") for i in range(num_sessions)]
                print(f"base_url {proxy.base_url}", flush=True)
                for h in handles:
                    print(f"api_key {h.api_key}", flush=True)
                await stop.wait()
                records = [
                    {"session": i, "sample": j, "started_because": s.started_because,
                     "num_calls": s.num_calls, "messages": s.messages,
                     "prompt_ids": s.prompt_ids,
                     "segments": [{"kind": seg.kind.value, "token_ids": seg.token_ids,
                                   "logprobs": seg.logprobs, "versions": seg.versions}
                                  for seg in s.segments]}
                    for i, h in enumerate(handles)
                    for j, s in enumerate(proxy.close_session(h.api_key))]
        finally:
            await engine.close()
        if out is not None:
            out.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{len(records)} samples from {num_sessions} sessions"
              + (f" written to {out}" if out is not None else ""), flush=True)

    asyncio.run(main())
