"""An OpenAI-compatible endpoint that turns any agent harness into a rollout source.

An unmodified agent written against the official ``openai`` SDK (``chat.completions``,
streaming or not, with tools, ``n`` choices) is pointed at ``base_url`` with a per-episode
``api_key``. Each call is rendered with the model's chat template, sent to an engine as token
ids, and its tokens, logprobs and versions are recorded; the calls of one session are stitched
into trajectories by **dialogue-prefix matching** (``proxy_session.py``): a call whose
messages are the previous call's messages plus a reply it got plus new ones (tool results, a
user turn) continues that reply's trajectory, the new messages rendered incrementally after
the tokens already served (``ChatRenderer.extend``); a call that rewrote history (dropped,
edited or reordered earlier messages), or follows a call the engine failed, starts a new
sample, recorded with the reason; each extra choice of a call is a sample of its own.
Engines are chosen by the rollout's :class:`~rollstream.rollout.routing.Router` with prefix
affinity, counting the proxy's calls in flight: a session's first call goes to the
least-loaded UP engine, and its later calls stay on the engine that holds its prefix while the
router keeps them there (UP, with a free sequence and not far above the least loaded), else
move to the least loaded. A training session's turns are routed by the run's dispatcher.

Security: binds to 127.0.0.1 unless told otherwise, and every call needs the bearer key of an
open session (401 otherwise). A key is ``rs-<id>.<secret>``: the session is found by its id
and the secret compared in constant time; only the id ever appears in request ids, episode
ids, reply ids and samples. The run side opens a session, hands its URL and key to a
harness, and closes it when the harness finishes or times out (:meth:`AgentProxy.run_harness`),
receiving the samples. What one call and one session may cost is bounded
(:class:`~rollstream.config.tasks.ProxyConfig`, docs/agents.md): the body's size (413 before
it is read whole), its shape (``proxy_wire.py``), a session's calls and history bytes, and
the prompt against the context (refused before rendering when its text alone cannot fit).
Every refusal is a 400 (or 413) whose ``param`` names the field or the limit.

A streamed reply (``stream: true``) sends the text as the engine samples it
(``proxy_stream.py``). A session bound to a training sample (``proxy_episode.py``) is one
trajectory, refuses ``n > 1``, runs the source's tools for its agent, and answers a restored
episode from its record.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Self

from fastapi import Request

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.loop import generate_turn
from rollstream.agent.proxy_episode import (Binding, EpisodeOver, EpisodeRefused,
                                            refused_calls)
from rollstream.agent.proxy_session import (Head, ProxySample, Session, Stitcher, held_tokens,
                                            render)
from rollstream.agent.proxy_stream import ReplyStream, StreamedText, streamed
from rollstream.agent.proxy_wire import (TOOL_PATH, ChatMessage, ChatRequest, Refused,
                                         SessionHandle, parse_request, parse_tool_call, plain,
                                         read_body, reply_message, sse)
from rollstream.agent.tools import HermesToolParser, ToolCallParser
from rollstream.config.tasks import ProxyConfig
from rollstream.engine import Engine, FinishReason, SamplingParams
from rollstream.engine.protocol import OnTokens
from rollstream.rollout.harness import TurnOutput
from rollstream.rollout.routing import Router
from rollstream.trajectory import Segment, ToolCall, ToolResult

__all__ = ["AgentProxy", "Binding", "EngineFailed", "EpisodeOver", "EpisodeRefused",
           "ProxySample", "SessionHandle"]  # what harnesses and the CLI take from here

KEY_PREFIX = "rs-"
# An agent's connection idles while its tools run. uvicorn closes an idle one after 5 s by
# default, and a client that reuses it as it closes gets a connection error mid-episode (seen
# with tools slower than 5 s, 32 verifiers rollouts at a time): keep it open far longer.
KEEP_ALIVE_S = 600


class EngineFailed(RuntimeError):
    """The engine failed a call (the harness gets HTTP 502 with the reason)."""


class AgentProxy:
    """``context_tokens``: what one sequence may hold on the engines (prompt and reply; None:
    no check here, the engine refuses); ``limits``: the proxy's caps (module docstring)."""

    def __init__(self, engines: Sequence[Engine], tokenizer: Any, *,
                 host: str = "127.0.0.1", port: int = 0,
                 parser: ToolCallParser | None = None, context_tokens: int | None = None,
                 limits: ProxyConfig = ProxyConfig()) -> None:
        if not engines:
            raise ValueError("AgentProxy needs at least one engine")
        self.router = Router(engines, prefix_affinity=True)  # for sessions not bound to a run
        self.tokenizer = tokenizer
        self.host, self.port = host, port
        self.parser = parser or HermesToolParser()
        self.context_tokens, self.limits = context_tokens, limits
        self.stitch = Stitcher(tokenizer=tokenizer, parser=self.parser, limits=limits,
                               context_tokens=context_tokens)
        self._sessions: dict[str, Session] = {}
        self._server = None
        self._task: asyncio.Task | None = None
        self.app = self._build_app()

    # ---- the run side --------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def open_session(self, episode_id: str, *, binding: Binding | None = None) -> SessionHandle:
        sid, secret = secrets.token_hex(6), secrets.token_urlsafe(24)
        self._sessions[sid] = Session(id=sid, secret=secret.encode(), episode_id=episode_id,
                                       binding=binding)
        return SessionHandle(base_url=self.base_url, api_key=f"{KEY_PREFIX}{sid}.{secret}",
                             session_id=sid)

    def _session(self, api_key: str) -> Session | None:
        """The open session whose key this is (its id finds it, its secret must match)."""
        sid, dot, secret = api_key.removeprefix(KEY_PREFIX).partition(".")
        session = self._sessions.get(sid)
        if session is None or not dot or not secrets.compare_digest(session.secret,
                                                                    secret.encode()):
            return None
        return session

    def close_session(self, api_key: str) -> list[ProxySample]:
        """Stop accepting the session's calls; its samples."""
        session = self._session(api_key)
        if session is None:
            raise KeyError("no open session has this key")
        del self._sessions[session.id]
        session.closed = True
        # an engine that kept the session's history may drop it (KeepsEpisodes)
        if (end := getattr(session.engine, "end_episode", None)) is not None:
            end(_episode(session))
        return session.samples

    async def end_session(self, api_key: str) -> list[ProxySample]:
        """Close the session and wait until a call it was still serving is over (an agent cut
        off mid-call leaves its call generating: a bound sample must not be judged while its
        turn may still append tokens to it); its samples."""
        session = self._session(api_key)
        samples = self.close_session(api_key)
        async with session.lock:
            return samples

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
                                lifespan="off", timeout_keep_alive=KEEP_ALIVE_S)
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

        app = FastAPI(title="rollstream proxy", docs_url=None, redoc_url=None,
                      openapi_url=None)

        def error(status: int, param: str | None, message: str) -> JSONResponse:
            return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                           "param": param, "code": None}}, status_code=status)

        def authorized(request: Request) -> Session | None:
            auth = request.headers.get("authorization", "")
            return self._session(auth[7:].strip()) if auth.startswith("Bearer ") else None

        unknown = error(401, None, "missing or unknown API key (each episode has its own)")

        @app.post(TOOL_PATH)
        async def tool_calls(request: Request):
            if (session := authorized(request)) is None:
                return unknown
            try:
                call = parse_tool_call(await read_body(request, self.limits.max_request_bytes))
                result = await self._tool_call(session, call)
            except Refused as e:
                refused_calls(session.binding, e)
                return error(e.status, e.param, str(e))
            return {"content": result.content, "ok": result.ok, "error": result.error}

        def failed(session: Session, e: Exception) -> JSONResponse:
            if isinstance(e, Refused):
                refused_calls(session.binding, e)
                return error(e.status, e.param, str(e))
            if isinstance(e, EngineFailed):
                return error(502, None, str(e))
            raise e

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            if (session := authorized(request)) is None:
                return unknown
            try:
                body = parse_request(await read_body(request, self.limits.max_request_bytes))
                if not body.stream:
                    return await self._complete(session, body)
            except (Refused, EngineFailed) as e:
                return failed(session, e)
            text = StreamedText(decode=self.tokenizer.decode, parser=self.parser)
            lines, task = await streamed(lambda stream: self._complete(session, body, stream),
                                         text, model=body.model, usage=bool(
                                             body.stream_options and
                                             body.stream_options.include_usage))
            if lines is None:  # it ended before generating: an answer of its own
                try:
                    return StreamingResponse(sse(task.result()), media_type="text/event-stream")
                except (Refused, EngineFailed) as e:
                    return failed(session, e)
            return StreamingResponse(lines, media_type="text/event-stream")

        return app

    async def _tool_call(self, session: Session, call: ToolCall) -> ToolResult:
        """A tool call of a training session's agent (``Binding.tool_call``), counted among
        the session's calls."""
        async with session.lock:
            if session.closed:
                raise Refused("authorization", "the session is closed: its episode ended")
            if session.binding is None:
                raise Refused("name", "name: tools are run for the sessions of training "
                                      "episodes (this one has none)")
            if session.num_tool_calls >= self.limits.max_session_calls:
                raise Refused("max_session_calls", (
                    f"the session has made {session.num_tool_calls} tool calls, the proxy's "
                    f"limit (agent.proxy.max_session_calls)"))
            session.num_tool_calls += 1
            return await session.binding.tool_call(call)

    async def _complete(self, session: Session, body: ChatRequest,
                        stream: ReplyStream | None = None) -> dict:
        """One call: its sample placed, its choices generated (``stream`` hears when that
        starts and the tokens as they are sampled), the reply."""
        messages = [plain(m) for m in body.messages]
        renderer = ChatRenderer(self.tokenizer, tools=body.tool_schemas())
        bound, n = session.binding, body.n or 1
        async with session.lock:
            if session.closed:
                raise Refused("authorization", "the session is closed: its episode ended")
            if session.num_calls >= self.limits.max_session_calls:
                raise Refused("max_session_calls", (
                    f"the session has made {session.num_calls} calls, the proxy's limit "
                    f"(agent.proxy.max_session_calls)"))
            if bound is not None and n > 1:
                raise Refused("n", "n: a training episode is one trajectory, so its calls take "
                                   "one choice (a task's samples: rollout.group_size)")
            session.num_calls += 1
            call = session.num_calls
            sample = await self.stitch.place(session, messages, renderer)
            # the sample now holds this call's prompt: until its replies are recorded, a call
            # that fails (engine, or an error of ours) has the next one start a new sample
            session.heads = []
            stop = tuple(await render(renderer.stop_token_ids, sample.messages))
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(body.top_k or 0, 0), max_new_tokens=body.max_new_tokens,
                stop_token_ids=stop, seed=body.seed)
            prompt_tokens = held_tokens(sample, bound)
            samples = [sample] + [self.stitch.fork(session, sample, i, call) for i in range(1, n)]
            if stream is not None:
                stream.start(f"chatcmpl-{session.id}-{call}", stop)
            outs = await asyncio.gather(*(  # a choice's own seed: the call's, told apart
                self._turn(session, s, params if body.seed is None else replace(
                    params, seed=body.seed ^ i), f"{session.id}/{call}" + (f".{i}" if i else ""),
                    None if stream is None else stream.on_tokens)
                for i, s in enumerate(samples)), return_exceptions=True)
            if failed := next((o for o in outs if isinstance(o, BaseException)), None):
                raise failed
            choices = [await self._choice(session, messages, i, s, *out)
                       for i, (s, out) in enumerate(zip(samples, outs, strict=True))]
        done = sum(out.num_tokens for out, _ in outs)
        return {"id": f"chatcmpl-{session.id}-{call}",
                "object": "chat.completion", "created": int(time.time()),
                "model": body.model, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                          "total_tokens": prompt_tokens + done}}

    async def _turn(self, session: Session, sample: ProxySample, params: SamplingParams,
                    rid: str, on_tokens: OnTokens | None) -> tuple[TurnOutput, list[Segment]]:
        """One choice's model turn: the run's for a training session, else the proxy's."""
        if session.binding is None:
            return await self._engine_turn(session, sample, params, rid, on_tokens)
        out = await session.binding.model_turn(params, rid, session.num_calls, on_tokens)
        if out is None:
            raise EngineFailed("the run gave up on this episode (cancelled, failed, or no "
                               "engine is alive)")
        return out

    async def _choice(self, session: Session, messages: list, index: int,
                      sample: ProxySample, out: TurnOutput, turn: list[Segment]) -> dict:
        """Record a choice's reply on its sample; the reply's choice, which a next call may
        continue."""
        sample.num_calls += 1
        ended = out.finish_reason is FinishReason.STOP
        served = [t for seg in turn for t in seg.token_ids]
        text = await asyncio.to_thread(self.tokenizer.decode, served[:-1] if ended else served)
        sample.messages.append({"role": "assistant", "content": text})
        session.history_bytes += len(text.encode())
        message = reply_message(text, self.parser.parse(text), session.num_calls)
        session.heads.append(Head(sample=sample, ended_turn=ended, seen=[
            *messages, plain(ChatMessage.model_validate(message))]))
        finish = "length" if out.finish_reason is FinishReason.LENGTH else (
            "tool_calls" if message.get("tool_calls") else "stop")
        return {"index": index, "message": message, "finish_reason": finish}

    async def _engine_turn(self, session: Session, sample: ProxySample, params: SamplingParams,
                           rid: str, on_tokens: OnTokens | None,
                           ) -> tuple[TurnOutput, list[Segment]]:
        """A turn on the session's engine (sticky while UP), appended to ``sample``."""
        engine = self.router.pick_near(session.engine)
        if engine is None:
            raise EngineFailed("no engine is UP to take the call")
        session.engine, turn = engine, []
        self.router.load.add(engine, 1)
        try:
            out = await generate_turn(engine, sample.token_ids, params, rid, turn,
                                      episode_id=_episode(session), on_tokens=on_tokens)
        finally:
            self.router.load.add(engine, -1)
        if out.error is not None:
            raise EngineFailed(f"the engine failed the call: {out.error}")
        sample.segments += turn
        return out, turn


def _episode(session: Session) -> str:
    """The episode id of an unbound session's requests: its calls continue one history (an
    engine that keeps it is sent only what each call adds, ``KeepsEpisodes``)."""
    return f"proxy/{session.id}"
