"""A scripted stand-in for a vLLM server's HTTP API, the vLLM engine's process edge.

It lets tests drive the engine's fault handling and version bookkeeping exactly, without
vLLM: the test decides what each stream delivers and when, makes ``/health`` fail, cuts a
stream mid-body, can hold a weight reload while the server is paused, and can answer every
generate request with an HTTP error while ``/health`` says 200 (a grey failure). It serves the
endpoints the engine calls (``/health``, ``/v1/models``, ``/inference/v1/generate``,
``/pause``, ``/collective_rpc``, ``/update_weight_version``, ``/resume``,
``/abort_requests``) with vLLM's wire format (see ``rollstream/engine/vllm/wire.py``); it
samples nothing: tokens are whatever the test pushes, with logprob ``-token / 100``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from rollstream.engine.vllm.server import free_port

_CUT = object()  # pushed to a stream: the server drops the connection mid-body


def event(tokens: list[int], *, finish: str | None = None,
          spans: list[tuple[int, int, int]] | None = None) -> str:
    """One SSE event; ``spans`` = (version, start, end) triples for a final event."""
    choice = {"index": 0, "token_ids": tokens, "finish_reason": finish,
              "logprobs": {"content": [{"token_id": t, "logprob": -t / 100} for t in tokens]},
              "weight_versions": None if spans is None else [
                  {"version": str(v), "start": a, "end": b} for v, a, b in spans]}
    return "data: " + json.dumps({"choices": [choice]}) + "\n\n"


class FakeVllm:
    def __init__(self, *, max_model_len: int = 128) -> None:
        self.healthy = True
        self.generate_status = 200  # else every generate request gets this status at once
        self.num_generate = 0  # generate requests received
        self.logprobs_mode = "processed_logprobs"  # what the worker's sampler reports
        self.calls: list[str] = []  # control endpoints in the order they were called
        self.version: str | None = None  # the label /update_weight_version set
        self.reloads_go = threading.Event()  # cleared: /collective_rpc waits until set
        self.reloads_go.set()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = free_port()
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"data": [{"id": "fake", "max_model_len": max_model_len}]}

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request) -> dict:
            self.version = (await request.json())["new_version"]
            self.calls.append(f"version {self.version}")
            return {}

        @app.post("/collective_rpc")
        async def collective_rpc(request: Request) -> dict:
            if (await request.json()).get("method") == "rollstream_logprobs_mode":
                return {"results": [{"logprobs_mode": self.logprobs_mode}]}  # boot check
            self.calls.append("reload")
            while not self.reloads_go.is_set():
                await asyncio.sleep(0.005)
            return {}

        for path in ("/pause", "/resume"):
            app.post(path)(self._recorder(path[1:]))

        @app.post("/abort_requests")
        async def abort_requests(request: Request) -> dict:
            for rid in (await request.json())["request_ids"]:
                wire = rid.removeprefix("generate-tokens-")
                if wire in self._streams:
                    self._streams[wire].put_nowait(event([], finish="abort"))
            return {}

        @app.post("/inference/v1/generate")
        async def generate(request: Request) -> Response:
            self.num_generate += 1
            if self.generate_status != 200:
                return Response(status_code=self.generate_status, content="scripted failure")
            wire = (await request.json())["request_id"]
            self._loop = asyncio.get_running_loop()
            queue = self._streams[wire] = asyncio.Queue()

            async def body():
                while True:
                    item = await queue.get()
                    if item is _CUT:
                        raise ConnectionAbortedError("the fake server cut the stream")
                    yield item
                    if '"finish_reason": null' not in item:
                        yield "data: [DONE]\n\n"
                        return

            return StreamingResponse(body(), media_type="text/event-stream")

        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical",
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="fake-vllm")

    def _recorder(self, name: str):
        async def record() -> dict:
            self.calls.append(name)
            return {}
        return record

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "the fake vLLM server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    async def stream_of(self, request_id: str, timeout_s: float = 10.0) -> str:
        """The wire id of the (latest) stream the engine opened for ``request_id``."""
        deadline = time.monotonic() + timeout_s
        while True:
            wires = [w for w in self._streams if w.rpartition("#")[0] == request_id]
            if wires:
                return wires[-1]
            assert time.monotonic() < deadline, f"no stream for {request_id}"
            await asyncio.sleep(0.005)

    def push(self, wire: str, tokens: list[int], *, finish: str | None = None,
             spans: list[tuple[int, int, int]] | None = None) -> None:
        """Deliver tokens on a stream (a final event when ``finish`` is given)."""
        self._put(wire, event(tokens, finish=finish, spans=spans))

    def cut(self, wire: str) -> None:
        """Drop the stream's connection without a final event."""
        self._put(wire, _CUT)

    def _put(self, wire: str, item: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._streams[wire].put_nowait, item)
