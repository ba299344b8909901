"""HTTP to a vLLM server on another node, carried by the Ray actor that launched it.

    driver                                        the server's node
    ------                                        -----------------
    VllmEngine's httpx client                     ServerActor.relay (an async generator)
      NodeTransport  -- method, path, headers,  -->  httpx to the server's 127.0.0.1
                        body (one Ray call)          yields the status and headers, then
                     <-- Ray streaming generator --  the body as it arrives

A server binds 127.0.0.1 only, so the driver reaches one on its own node directly (the
loopback) and one on any other node through its actor: the engine's streams, aborts,
pauses, weight reloads and health probes alike, unchanged above the transport. The choice is
made at each request from the node the server's current actor runs on (a restarted server
may land elsewhere), as ``vllm_weights.py`` chooses the weights' path.

Body chunks that arrive while the previous one is on its way are sent joined, so a busy
server's token events cross in fewer Ray messages. Failures keep httpx's meaning for the
engine: the server unreachable from its actor is the actor's httpx error, re-raised here by
class; the actor itself gone (killed, its node lost) is a ``ConnectError`` before the
response and a ``ReadError`` during it; a request past its timeout is a ``ReadTimeout``.
Closing a response early (a cut stream) cancels the actor's call, which closes its
connection to the server, as a closed connection of the driver's would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

RELAY_MARGIN_S = 10.0  # beyond a request's own timeout: Ray's calls to the actor and back
_HOP_BY_HOP = {"host", "connection", "content-length", "transfer-encoding", "keep-alive"}

Head = tuple[str, int, list[tuple[str, str]]]  # ("head", status, headers)
Failure = tuple[str, str, str]  # ("error", httpx exception class name, message)


def relay_client() -> httpx.AsyncClient:
    """The actor's client for :func:`relay` (one per actor, on its event loop): no
    connection kept for reuse, as the engine's own client (``engine/vllm/engine.py``)."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=0))


async def relay(client: httpx.AsyncClient, url: str, method: str, path: str,
                headers: list[tuple[str, str]], body: bytes,
                timeout: dict[str, float | None]) -> AsyncIterator[Any]:
    """The actor's side: one request to the server at ``url`` (on this node), yielding its
    :data:`Head`, then its raw body in chunks, or a :data:`Failure` where httpx raised."""
    try:
        async with client.stream(method, url + path, headers=headers, content=body,
                                 timeout=httpx.Timeout(**timeout) if timeout
                                 else httpx.Timeout(None)) as resp:
            yield ("head", resp.status_code, [(k, v) for k, v in resp.headers.multi_items()
                                              if k.lower() not in _HOP_BY_HOP])
            async for chunk in _joined(resp.aiter_raw()):
                yield chunk
    except httpx.TransportError as e:
        yield ("error", type(e).__name__, str(e) or repr(e))


async def _joined(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks``, those that arrived while the last one was being sent joined into one."""
    buf: list[bytes] = []
    ready = asyncio.Event()
    done = False

    async def read() -> None:
        nonlocal done
        try:
            async for chunk in chunks:
                buf.append(chunk)
                ready.set()
        finally:
            done = True
            ready.set()

    reader = asyncio.create_task(read())
    try:
        while not (done and not buf):
            await ready.wait()
            ready.clear()
            if buf:
                out = b"".join(buf)
                buf.clear()
                yield out
        await reader  # its error, if it ended with one
    finally:
        reader.cancel()


class NodeTransport(httpx.AsyncBaseTransport):
    """The driver's side: ``direct`` while ``actor()`` is None (the server is on this node),
    else each request through that actor's ``relay``. ``relayed``: requests sent so."""

    def __init__(self, actor: Callable[[], Any], direct: httpx.AsyncBaseTransport) -> None:
        self.actor, self.direct = actor, direct
        self.relayed = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        actor = self.actor()
        if actor is None:
            return await self.direct.handle_async_request(request)
        from ray.exceptions import RayError

        self.relayed += 1
        body = await request.aread()
        timeout = dict(request.extensions.get("timeout") or {})
        headers = [(k, v) for k, v in request.headers.multi_items()
                   if k.lower() not in _HOP_BY_HOP]
        path = request.url.raw_path.decode("ascii")
        gen = actor.relay.options(num_returns="streaming").remote(
            request.method, path, headers, body, timeout)
        wait_s = _wait_s(timeout)
        try:
            head = await _next(gen, wait_s)
        except (TimeoutError, RayError) as e:
            _cancel(gen)
            raise _as_httpx(e, request, before_response=True) from e
        except asyncio.CancelledError:
            _cancel(gen)
            raise
        if head is None or head[0] == "error":
            raise _failure(request, head)
        _, status, out_headers = head
        return httpx.Response(status, headers=out_headers, request=request,
                              stream=_RelayedBody(request, gen, wait_s))

    async def aclose(self) -> None:
        await self.direct.aclose()


class _RelayedBody(httpx.AsyncByteStream):
    def __init__(self, request: httpx.Request, gen: Any, wait_s: float | None) -> None:
        self.request, self.gen, self.wait_s = request, gen, wait_s
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        from ray.exceptions import RayError

        while True:
            try:
                item = await _next(self.gen, self.wait_s)
            except (TimeoutError, RayError) as e:
                self.finished = True
                _cancel(self.gen)
                raise _as_httpx(e, self.request, before_response=False) from e
            if item is None:
                self.finished = True
                return
            if not isinstance(item, bytes):
                self.finished = True
                raise _failure(self.request, item)
            yield item

    async def aclose(self) -> None:
        if not self.finished:  # closed early: end the actor's call and its connection
            self.finished = True
            _cancel(self.gen)


async def _next(gen: Any, wait_s: float | None) -> Any:
    """The generator's next item (None at its end), within ``wait_s``."""
    async def take() -> Any:
        try:
            ref = await gen.__anext__()
        except StopAsyncIteration:
            return None
        return await ref

    return await asyncio.wait_for(take(), wait_s)


def _wait_s(timeout: dict[str, float | None]) -> float | None:
    """How long the driver waits for one item: the request's connect and read timeouts
    (httpx's per-request ``timeout`` extension) and :data:`RELAY_MARGIN_S`; None when the
    request has no read timeout (a stream that may idle for minutes)."""
    read = timeout.get("read")
    if read is None:
        return None
    return read + (timeout.get("connect") or 0.0) + RELAY_MARGIN_S


def _cancel(gen: Any) -> None:
    import ray

    # already finished, or its actor gone: nothing to end
    with contextlib.suppress(Exception):
        ray.cancel(gen)


def _failure(request: httpx.Request, item: Failure | None) -> httpx.TransportError:
    """The httpx error the actor met (by class name), or a broken relay's."""
    if item is None:
        return httpx.RemoteProtocolError("the server's actor ended the relay without a "
                                         "response", request=request)
    _, name, message = item
    cls = getattr(httpx, name, None)
    if not (isinstance(cls, type) and issubclass(cls, httpx.TransportError)):
        cls = httpx.TransportError
    return cls(f"{message} (from the server's actor)", request=request)


def _as_httpx(error: Exception, request: httpx.Request, *,
              before_response: bool) -> httpx.TransportError:
    """A timeout or a Ray error of the relay, as httpx raises its like on a connection."""
    if isinstance(error, TimeoutError):
        return httpx.ReadTimeout("no answer from the server's actor within the request's "
                                 "timeout", request=request)
    cls = httpx.ConnectError if before_response else httpx.ReadError
    return cls(f"the server's actor is gone ({type(error).__name__}: {error})"[:2000],
               request=request)
