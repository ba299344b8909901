"""``VllmEngine``: the engine protocol over one real vLLM server (launched or attached).

    caller threads / event loops            engine I/O thread (its own asyncio loop)
    ----------------------------            -----------------------------------------
    generate ------ run_coroutine ------->  one SSE stream per request  --> vLLM server
    interrupt ----- _threadsafe  ------->  POST /abort_requests              (own process
    load_weights -  (wrap_future) ------>  VllmReload: write buckets,        group)
                                            pause/reload/version/resume
                                            ServerHealth: process + /health --fault-->
                                                          restart, restore weights

All I/O runs on the engine's own loop thread, so one engine serves any number of caller
loops in turn (tests run one loop per test; builders are synchronous) and its health watch
runs even when no caller loop does. Cancelling a caller's ``generate`` cancels its stream,
and vLLM aborts a request whose client went away.

Versions. Tokens are stamped from the spans vLLM puts on a stream's final event (exact: the
engine core labels every step with its current version). ``load_weights`` makes the boundary
exact (``sync/vllm.py``): in-flight requests freeze between two steps, the weights are reloaded in
place, and they continue on the new weights. Only a stream that breaks (server died, or
an interrupt that had to drop its stream) has no final event. It still returns exact
versions: a request sent at version v (or during the pause of a reload to v) is sampled by v
until a reload during the stream resumes the server; the tokens received before that
``/resume`` was sent are kept, labelled v, and the later ones, which may come from either
side of the reload, are dropped from the partial output (resubmitted, they are sampled
again). See ``wire.py``.

LoRA (built with ``lora``): the server holds one adapter slot that every request names, and
``load_weights`` of an adapter reloads that slot in place under the same pause as a full
reload, so the version rules above hold unchanged (``sync/vllm_lora.py``).

Prefix cache: requests carry ``cache_salt = "rollstream-v{version}"``, so a prompt sent after a
reload never reuses KV blocks computed with older weights. Requests in flight across a reload
do not keep their KV, unlike the local engine's: vLLM 0.32's ``/pause`` clears the KV cache
(its ``clear_cache`` default) and preempts them, so on ``/resume`` they recompute it with the
new weights (tests/vllm/test_lora.py: the tokens after an adapter load mid-stream are the new
adapter's greedy continuation of the whole sequence).

Interrupts and pauses travel through vLLM's API server. On a saturated machine it was seen
to lag generation by seconds (and to deliver whole streams in one burst at their end); an
interrupt may then find its request already finished, and returns the full output. A request
interrupted before its first token drops its stream (vLLM aborts it) and returns no tokens.

Faults. When the server dies, in-flight ``generate`` calls return ABORT with their partial
output, the engine restarts the server and restores its weights (``stats().health`` is
RECOVERING meanwhile), or stays DEAD if it cannot; ``health.py`` has the details. A server
that stays alive but fails a request (HTTP 5xx, 408 or 429 while ``/health`` answers; a stream
that breaks) also gets ABORT with its partial output and the answer in ``error``: the
engine's fault, which the rollout retries elsewhere and counts in the engine's breaker
(``rollout/breaker.py``). An HTTP 4xx is the request's fault: ERROR.

Stats are client-side: ``num_waiting`` = in flight without a token yet, ``num_running`` = in
flight with tokens, ``busy_s`` = wall time with at least one request in flight (vLLM's own
forward time is not exposed per request), ``capacity`` = ``--max-num-seqs`` (extra_args)
or vLLM's CPU default, 128.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from rollstream.engine.protocol import EngineStats, FinishReason, GenerateOutput, GenerateRequest
from rollstream.engine.vllm.checkpoint import CheckpointSpec
from rollstream.engine.vllm.health import HEALTH_TIMEOUT_S, ServerHealth
from rollstream.engine.vllm.server import LOGPROBS_MODE, ServerProcess, VllmServerError
from rollstream.engine.vllm.wire import GENERATE_PATH, StreamState, request_body
from rollstream.sync.protocol import Header, Payload, is_adapter
from rollstream.sync.shm import WeightStore, WrittenWeights
from rollstream.sync.vllm import SyncTiming, VllmReload
from rollstream.sync.vllm_lora import ADAPTER_NAME, LoraSlot

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class _Ticket:
    taken: bool = False


@dataclass(slots=True, kw_only=True, eq=False)
class _Inflight:
    request: GenerateRequest
    wire_id: str
    task: asyncio.Task
    stream: StreamState
    done: asyncio.Event = field(default_factory=asyncio.Event)
    cut: str | None = None  # why it was cut short: interrupt, closed, died: ..., broken: ...
    streaming: bool = True  # still inside the HTTP stream (where cancel() is handled)


class VllmEngine:
    """Implements :class:`rollstream.engine.protocol.Engine`, ``Closeable`` and weight
    sync's ``ReportsSync`` (its weights reach the server through shared memory, as given)."""

    weight_transport = "shared_memory"

    def __init__(self, server: ServerProcess, *, engine_id: str, version: int,
                 checkpoint: CheckpointSpec, store: WeightStore, capacity: int,
                 startup_timeout_s: float, health_period_s: float = 5.0,
                 lora: LoraSlot | None = None) -> None:
        self.engine_id = engine_id
        self.server = server
        self._checkpoint, self._store, self._capacity = checkpoint, store, capacity
        self._startup_timeout_s = startup_timeout_s
        self._health = ServerHealth(engine_id=engine_id, server=server, period_s=health_period_s,
                                    probe=self._healthy, drop_streams=self._drop_streams,
                                    restart=self._restart)
        self._sync = VllmReload(engine_id=engine_id, version=version, store=store,
                                health=self._health, post=self._post, streams=self._streams,
                                lora=lora)
        self._max_model_len = 0
        self._inflight: dict[str, _Inflight] = {}
        self._lock = threading.Lock()
        self._num_submitted = 0  # generate() called, not yet registered on the I/O loop
        self._ids = itertools.count()
        self._generated_tokens, self._busy_s, self._busy_since = 0, 0.0, 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"rollstream-{engine_id}-io")
        self._thread.start()
        try:
            self._run(self._start())
        except BaseException:
            self.shutdown()
            raise

    # ---- public API (any thread / loop) ----------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if self._health.closed:  # the I/O loop is gone
            _, why = self._health.status()
            return _output(request.request_id, StreamState(base_version=self._sync.version),
                           FinishReason.ABORT, why)
        ticket = _Ticket()
        with self._lock:  # counted as waiting from now on, even before the I/O loop sees it
            self._num_submitted += 1
        try:
            return await self._call(self._generate(request, ticket))
        finally:
            self._take_ticket(ticket)

    async def interrupt(self, request_ids: Sequence[str] | None = None) -> None:
        if self._health.closed or self._health.fatal is not None:
            return  # a dead engine has nothing in flight
        await self._call(self._interrupt(None if request_ids is None else set(request_ids)))

    async def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Install a full HF-named state dict, or (an engine built with ``lora``) a LoRA
        adapter (``sync/vllm_lora.py``); tokens sampled afterwards carry ``version``.
        In-flight requests freeze during the reload and continue on the new weights."""
        lora = self._sync.lora
        if is_adapter(tensors):
            if lora is None:
                raise ValueError(f"vllm engine {self.engine_id} got a LoRA adapter but was "
                                 "built without model.lora (its server serves no adapter)")
            lora.check(tensors, self._checkpoint.shapes)
            payload = Payload(header=Header.describe(version, "adapter", tensors),
                              tensors=tensors)
        else:
            payload = Payload.full(version, dict(self._checkpoint.check(tensors)))
        await self._call(self._sync.load(payload))

    def stats(self) -> EngineStats:
        inflight = list(self._inflight.values())
        running = sum(1 for st in inflight if st.stream.token_ids)
        busy = self._busy_s + (time.perf_counter() - self._busy_since if inflight else 0.0)
        with self._lock:
            submitted = self._num_submitted
        health, why = self._health.status()
        return EngineStats(engine_id=self.engine_id, version=self._sync.version,
                           num_running=running, num_waiting=submitted + len(inflight) - running,
                           capacity=self._capacity, generated_tokens=self._generated_tokens,
                           busy_s=busy, health=health, health_reason=why)

    def last_sync(self) -> None:
        """``ReportsSync``: the server reloads the tensors as they were handed over."""

    @property
    def num_restarts(self) -> int:
        return self._health.num_restarts

    @property
    def sync_timings(self) -> Sequence[SyncTiming]:
        return self._sync.timings

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Synchronous close: in-flight requests return ABORT, the server is stopped."""
        if self._thread.is_alive() and not self._health.closed:
            with contextlib.suppress(Exception):  # close even if the loop is wedged
                self._run(self._stop(), timeout=30.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
            if not self._thread.is_alive():
                self._loop.close()
        self._health.closed = True
        self.server.stop()
        self._store.clear()

    # ---- bridging ---------------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._health.closed:
            coro.close()
            raise RuntimeError(f"vllm engine {self.engine_id} is closed")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    # ---- I/O loop: lifecycle ----------------------------------------------------------------
    async def _start(self) -> None:
        self._client = _new_client(self.server)
        await self._boot(restore=None)
        self._health.start()

    async def _boot(self, restore: WrittenWeights | None) -> None:
        """Start (or reach) the server, then restore weights and the version label."""
        self.server.start()  # on the I/O thread: the PDEATHSIG tie lives as long as we do
        await self.server.wait_ready(self._startup_timeout_s)
        models = (await self._client.get(f"{self.url}/v1/models")).json()["data"]
        self._max_model_len = int(models[0]["max_model_len"])
        await self._check_logprobs_mode()
        await self._sync.restore(restore)

    async def _check_logprobs_mode(self) -> None:
        """Refuse a server whose sampler does not report processed logprobs (the tempered,
        truncated distribution each token was drawn from; ``worker_ext.py``)."""
        try:
            resp = await self._post("/collective_rpc",
                                    json={"method": "rollstream_logprobs_mode"})
            modes = {r["logprobs_mode"] for r in resp.json()["results"]}
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
            raise VllmServerError(
                f"vLLM server at {self.url} could not confirm that it returns "
                f"{LOGPROBS_MODE} (it needs --logprobs-mode {LOGPROBS_MODE} and this "
                f"package's --worker-extension-cls): {e!r}") from e
        if modes != {LOGPROBS_MODE}:
            raise VllmServerError(
                f"vLLM server at {self.url} returns logprobs mode {sorted(modes)}, not "
                f"{LOGPROBS_MODE}: its logprobs would not be those of the distribution it "
                f"samples, so it cannot serve training (start it with --logprobs-mode "
                f"{LOGPROBS_MODE})")

    async def _stop(self) -> None:
        self._health.close()
        await self._cut(None, "closed")
        await asyncio.sleep(0)
        await self._client.aclose()

    async def _restart(self) -> None:
        """After a fault: restart the server, restore the latest synced weights."""
        old, self._client = self._client, _new_client(self.server)  # nobody sees a closed one
        await old.aclose()
        await asyncio.to_thread(self.server.stop)
        await self._boot(restore=self._store.latest)
        log.warning("vllm engine %s is back at version %d", self.engine_id, self._sync.version)

    async def _healthy(self) -> bool:
        try:
            resp = await self._client.get(f"{self.url}/health", timeout=HEALTH_TIMEOUT_S)
            return resp.status_code == 200
        except httpx.TransportError:
            return False

    # ---- I/O loop: requests ------------------------------------------------------------------
    def _take_ticket(self, ticket: _Ticket) -> None:
        with self._lock:
            if not ticket.taken:
                ticket.taken = True
                self._num_submitted -= 1

    async def _generate(self, request: GenerateRequest, ticket: _Ticket) -> GenerateOutput:
        self._take_ticket(ticket)
        rid = request.request_id
        error = self._checkpoint.check_prompt(request.prompt_ids, self._max_model_len)
        if error is None and (dead := await self._health.serving()) is not None:
            return _output(rid, StreamState(base_version=self._sync.version), FinishReason.ABORT,
                           dead)
        if error is None and rid in self._inflight:
            error = "duplicate request_id still in flight"
        if error is not None:
            return _output(rid, StreamState(base_version=self._sync.version), FinishReason.ERROR,
                           error)
        paused = self._sync.paused_for is not None  # then sampled after /resume, by the new
        stream = StreamState(base_version=self._sync.paused_for if paused else self._sync.version,
                             sent_paused=paused)
        st = _Inflight(request=request, wire_id=f"{rid}#{next(self._ids)}",
                       task=asyncio.current_task(), stream=stream)
        if not self._inflight:
            self._busy_since = time.perf_counter()
        self._inflight[rid] = st
        try:
            return await self._stream(st)
        finally:
            del self._inflight[rid]
            if not self._inflight:
                self._busy_s += time.perf_counter() - self._busy_since
            st.done.set()

    async def _stream(self, st: _Inflight) -> GenerateOutput:
        rid, s = st.request.request_id, st.stream
        max_tokens = min(st.request.params.max_new_tokens,
                         self._max_model_len - len(st.request.prompt_ids))
        body = request_body(st.request, st.wire_id, max_tokens)
        # vLLM rejects stop ids outside the vocabulary; they can never be sampled anyway
        body["sampling_params"]["stop_token_ids"] = [
            t for t in st.request.params.stop_token_ids if 0 <= t < self._checkpoint.vocab_size]
        body["cache_salt"] = f"rollstream-v{self._sync.version}"
        if self._sync.lora is not None:  # the one adapter slot, whatever version it holds
            body["model"] = ADAPTER_NAME
        failure: httpx.TransportError | None = None
        refused: str | None = None  # the server's fault, answered at once: HTTP 5xx
        try:
            async with self._client.stream("POST", self.url + GENERATE_PATH, json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:500]
                    answer = f"vLLM HTTP {resp.status_code}: {text}"
                    if _server_fault(resp.status_code):
                        refused = answer
                    else:  # 4xx: the request's own fault
                        s.finish, s.error = FinishReason.ERROR, answer
                else:
                    async for line in resp.aiter_lines():
                        had = len(s.token_ids)
                        s.feed(line)
                        self._generated_tokens += len(s.token_ids) - had
                        if st.request.on_tokens is not None and len(s.token_ids) > had:
                            st.request.on_tokens(s.token_ids[had:])
        except asyncio.CancelledError:
            if st.cut is None:
                raise  # the caller cancelled generate
            asyncio.current_task().uncancel()
        except httpx.TransportError as e:
            failure = e
        finally:
            st.streaming = False  # from here on, cuts are read, not delivered by cancel()
        if st.cut is None and refused is not None:  # a dying server fails requests so too
            dead = await self._health.is_dead()
            st.cut = st.cut or (f"died: {refused}" if dead else f"failed: {refused}")
        elif st.cut is None and (failure is not None or s.finish is None):
            why = repr(failure) if failure is not None else "the stream ended without a finish"
            dead = await self._health.is_dead()
            st.cut = st.cut or (f"died: {why}" if dead else f"broken: {why}")
        if st.cut is None and s.finish is FinishReason.ABORT:  # not ours: a server told to
            dead = await self._health.is_dead()  # stop (SIGTERM) aborts what it runs
            st.cut = st.cut or ("died: the server aborted the stream" if dead
                                else "broken: the server aborted the stream")
        if st.cut is None:
            return _output(rid, s, s.finish, s.error)
        kind, _, why = st.cut.partition(": ")
        if kind == "died":
            self._health.fault(why)
        error = {"interrupt": None,
                 "closed": f"vllm engine {self.engine_id} closed",
                 "died": f"vllm engine {self.engine_id} died ({why}); partial output "
                         "returned, the engine restarts",
                 "broken": f"stream from vllm engine {self.engine_id} broke ({why}); partial "
                           "output returned",
                 "failed": f"vllm engine {self.engine_id} failed the request ({why}) while "
                           "its /health answers"}[kind]
        if kind == "interrupt" and s.finish is not None:
            return _output(rid, s, s.finish, s.error)  # ABORT, or it finished first
        return _output(rid, s, FinishReason.ABORT, error)

    async def _interrupt(self, ids: set[str] | None) -> None:
        await self._cut(ids, "interrupt")

    async def _cut(self, ids: set[str] | None, why: str) -> None:
        """Stop the selected streams; wait until their generate calls have returned."""
        targets = [st for rid, st in self._inflight.items() if ids is None or rid in ids]
        for st in targets:
            st.cut = st.cut or why
        started = [st.wire_id for st in targets if st.stream.token_ids]
        if started and self._health.ready.is_set():
            with contextlib.suppress(httpx.HTTPError):
                await self._abort_wire(started)
        for st in targets:  # not started: nothing to keep, drop the stream (vLLM aborts it)
            if not st.stream.token_ids and st.streaming:
                st.task.cancel()
        waits = [asyncio.create_task(st.done.wait()) for st in targets]
        if waits:
            _, late = await asyncio.wait(waits, timeout=10.0)
            for st in targets:
                if not st.done.is_set() and st.streaming:
                    st.task.cancel()
            for w in late:
                w.cancel()

    def _drop_streams(self, why: str) -> None:
        """Cut every stream not cut yet, without waiting (the server is gone)."""
        for st in self._inflight.values():
            if st.cut is None:
                st.cut = why
                if st.streaming:
                    st.task.cancel()

    def _streams(self) -> Iterator[StreamState]:
        return (st.stream for st in self._inflight.values())

    async def _abort_wire(self, wire_ids: list[str]) -> None:
        # the token endpoint registers requests as "generate-tokens-<request_id>"
        await self._post("/abort_requests",
                         json={"request_ids": [f"generate-tokens-{w}" for w in wire_ids]})

    async def _post(self, path: str, **kwargs: Any) -> httpx.Response:
        resp = await self._client.post(self.url + path, timeout=300.0, **kwargs)
        resp.raise_for_status()
        return resp


def _server_fault(status: int) -> bool:
    """An HTTP status that is the server's fault, not the request's: 5xx, and 408 / 429 (it
    timed out or is overloaded); the request is tried again elsewhere. Other codes (4xx) say
    the request itself is wrong."""
    return status >= 500 or status in (408, 429)


def _new_client(server: ServerProcess) -> httpx.AsyncClient:
    """Streams may stay open for minutes (long generations, pauses): no read timeout. No
    connection is kept alive for reuse: on vLLM 0.32's API server, requests sent on reused
    connections started one at a time (its log: ``Running: 1 reqs, Waiting: 0`` with 64 in
    flight) and ran at 0.5-2k tok/s where fresh connections gave 8-9k on the same server;
    reused connections also broke now and then with ``ReadError`` (docs/vllm.md). A connect
    on 127.0.0.1 costs well under a millisecond. The server picks the transport: this one
    to its URL, or (a server on another Ray node) one through its actor."""
    direct = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=4096,
                                                          max_keepalive_connections=0))
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                             transport=server.transport(direct))


def _output(rid: str, s: StreamState, reason: FinishReason, error: str | None) -> GenerateOutput:
    token_ids, logprobs, versions = s.result()
    return GenerateOutput(request_id=rid, token_ids=token_ids, logprobs=logprobs,
                          versions=versions, finish_reason=reason, error=error)
