"""The live dashboard: a FastAPI app served by uvicorn on 127.0.0.1 in a background thread.

Routes (all JSON unless noted):

    GET /                  the page (HTML; polls api/poll and redraws)
    GET /api/poll          metric lines and spans after the given cursors, plus state, ledger
                           summary, config and summary.json: ?metrics_since=N&spans_since=M;
                           of a live run, also its engines' states (as GET /api/engines)
                           and its nodes (as GET /api/nodes)
    GET /api/state         Metrics.latest() (or the run directory's equivalent)
    GET /api/metrics       metric lines: ?since=N -> {"lines", "next"}
    GET /api/timeline      timeline spans: ?since=N -> {"spans", "next"}
    GET /api/ledger        ledger summary (counts per status / source, reasons, staleness)
    GET /api/config        {"text": config.yaml (secrets redacted) or null}
    GET /api/summary       summary.json or null
    GET /metrics           Prometheus text (when serving a live Metrics registry)

Operating a live run (when it was given an ``EngineControl``; 404 otherwise), with the run's
token as ``Authorization: Bearer TOKEN`` (401 otherwise):

    GET  /api/engines                      [{engine_id, health, health_reason, version,
                                             routing, routing_reason, in_flight,
                                             generated_tokens, member,
                                             node_id, node_address, node_hostname,
                                             transport, sync_version, sync_kind,
                                             sync_bytes_last, sync_dtype, sync_bytes_total,
                                             syncs}]
                                           (states: rollstream/engine/states.py; member:
                                           joining, serving or leaving; node and weight
                                           syncs: rollstream/runtime/nodes.py)
    GET  /api/nodes                        [{node_id, address, hostname, engines: [{engine_id,
                                             health, version, routing, member}], transports,
                                             dtypes, sync_version, sync_bytes_last,
                                             sync_bytes_total}]: the engines by node
    POST /api/engines/{engine_id}/drain    preempt it: {"engine_id", "handed_back": n}
    POST /api/engines/{engine_id}/undrain  route to it again
    POST /api/engines/add?count=N          N engines join (at most runtime/fleet.py's MAX_ADD),
                                           each serving the current version before its first
                                           request: {"added": [ids]}
    POST /api/engines/{engine_id}/remove   drain it, then close it and release its resources:
                                           {"engine_id", "handed_back": n}

An unknown engine is 404, a change the run cannot take now (its last engine, too many at once,
a run that cannot add engines) 409, a count that is not a positive integer 422; none takes a
body.

A live dashboard writes its URL to ``RUN_DIR/dashboard.url`` and a token made for this run to
``RUN_DIR/dashboard.token`` (readable by its owner only) while it serves; ``rollstream engines
RUN_DIR`` reads both. Every route answers only a ``Host`` header naming the bound address
(``127.0.0.1``, ``localhost`` or ``[::1]`` with the bound port; 403 otherwise), so a web page
that rebinds its own name to 127.0.0.1 (DNS rebinding) reaches nothing; and a page, which
cannot read the token file, cannot operate the run.

With a `Metrics` registry the data is the registry's in-memory view (updated as the run
goes); with ``metrics=None`` the dashboard follows the run directory's files instead, so a
finished run or one written by another process can be browsed too.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from rollstream.config.schema import MonitorConfig
from rollstream.monitor.metrics import Metrics
from rollstream.monitor.page import payload, render_page
from rollstream.monitor.runlog import RunDirReader, RunLog, read_config_text, read_summary
from rollstream.run_files import DASHBOARD_TOKEN, RunFiles


class Control(Protocol):
    """What the dashboard may do to a live run (``rollstream.runtime.control``)."""

    def engines(self) -> list[dict[str, Any]]: ...

    def nodes(self) -> list[dict[str, Any]]: ...

    def drain(self, engine_id: str) -> int: ...

    def undrain(self, engine_id: str) -> None: ...

    def add(self, count: int) -> list[str]: ...

    def remove(self, engine_id: str) -> int: ...


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")  # what a Host header may name


class Dashboard:
    """Serves the live dashboard of a run. ``start()`` returns its URL; ``stop()`` ends it."""

    def __init__(self, metrics: Metrics | None, run_dir: Path | None, cfg: MonitorConfig, *,
                 control: Control | None = None) -> None:
        if metrics is None and run_dir is None:
            raise ValueError("Dashboard needs a Metrics registry or a run directory")
        self.metrics = metrics
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.cfg = cfg
        self.control = control
        self._reader = RunDirReader(self.run_dir) if metrics is None and self.run_dir else None
        self.name = self.run_dir.name if self.run_dir is not None else "run"
        self.url: str | None = None
        self.token = secrets.token_urlsafe(32)  # the control routes' bearer token
        self._hosts: frozenset[str] = frozenset()  # Host headers answered (set by start())
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    def _log(self) -> RunLog:
        if self.metrics is not None:
            return self.metrics.view()
        assert self._reader is not None
        return self._reader.refresh()

    def _state(self) -> dict[str, Any]:
        return self.metrics.latest() if self.metrics is not None else self._log().state()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rollstream dashboard", docs_url=None, redoc_url=None,
                      openapi_url=None)
        page = render_page(title=f"rollstream · {self.name}", boot={
            "mode": "live", "api": "", "poll_ms": int(self.cfg.dashboard_poll_s * 1000)})

        @app.middleware("http")
        async def bound_host_only(request: Request, call_next):
            if request.headers.get("host", "").lower() not in self._hosts:
                return JSONResponse({"detail": "the Host header must name the address this "
                                     f"dashboard is bound to: {', '.join(sorted(self._hosts))}"},
                                    status_code=403)
            return await call_next(request)

        @app.get("/", response_class=HTMLResponse)
        def index() -> HTMLResponse:
            return HTMLResponse(page, headers={"Cache-Control": "no-store"})

        @app.get("/favicon.ico")
        def favicon() -> Response:
            return Response(status_code=204)

        @app.get("/api/poll")
        def poll(metrics_since: int = Query(0, ge=0),
                 spans_since: int = Query(0, ge=0)) -> JSONResponse:
            data = payload(self._log(), self.run_dir, name=self.name,
                           metrics_since=metrics_since, spans_since=spans_since)
            if self.metrics is not None:
                data["state"] = self.metrics.latest()
            if self.control is not None:  # each engine's state, read only (the page's tables)
                data["engines"] = self.control.engines()
                data["nodes"] = self.control.nodes()
            return JSONResponse(data)

        @app.get("/api/state")
        def state() -> JSONResponse:
            return JSONResponse(self._state())

        @app.get("/api/metrics")
        def metrics_lines(since: int = Query(0, ge=0)) -> JSONResponse:
            lines, nxt = self._log().records(since)
            return JSONResponse({"lines": lines, "next": nxt})

        @app.get("/api/timeline")
        def timeline(since: int = Query(0, ge=0)) -> JSONResponse:
            spans, nxt = self._log().spans(since)
            return JSONResponse({"spans": spans, "next": nxt})

        @app.get("/api/ledger")
        def ledger() -> JSONResponse:
            return JSONResponse(self._log().ledger_summary())

        @app.get("/api/config")
        def config() -> JSONResponse:
            return JSONResponse({"text": read_config_text(self.run_dir)})

        @app.get("/api/summary")
        def summary() -> JSONResponse:
            return JSONResponse(read_summary(self.run_dir))

        @app.get("/metrics")
        def prometheus() -> Response:
            if self.metrics is None:
                return Response("no live registry\n", status_code=404, media_type="text/plain")
            return Response(self.metrics.prom.text(),
                            media_type="text/plain; version=0.0.4; charset=utf-8")

        def control(request: Request) -> Control:
            if self.control is None:
                raise HTTPException(404, "this dashboard does not control a live run")
            auth = request.headers.get("authorization", "")
            if not (auth.startswith("Bearer ") and secrets.compare_digest(
                    auth[7:].strip().encode(), self.token.encode())):
                raise HTTPException(401, f"operating the run needs its token (in RUN_DIR/"
                                         f"{DASHBOARD_TOKEN}) as `Authorization: Bearer TOKEN`")
            return self.control

        @app.get("/api/engines")
        def engines(request: Request) -> JSONResponse:
            return JSONResponse(control(request).engines())

        @app.get("/api/nodes")
        def nodes(request: Request) -> JSONResponse:
            return JSONResponse(control(request).nodes())

        @app.post("/api/engines/{engine_id}/drain")
        def drain(engine_id: str, request: Request) -> JSONResponse:
            try:
                n = control(request).drain(engine_id)
            except ValueError as e:
                raise HTTPException(404, str(e)) from None
            return JSONResponse({"engine_id": engine_id, "handed_back": n})

        @app.post("/api/engines/add")
        def add(request: Request, count: int = Query(1, ge=1)) -> JSONResponse:
            try:
                added = control(request).add(count)
            except ValueError as e:
                raise HTTPException(getattr(e, "http_status", 404), str(e)) from None
            return JSONResponse({"added": added})

        @app.post("/api/engines/{engine_id}/remove")
        def remove(engine_id: str, request: Request) -> JSONResponse:
            try:
                n = control(request).remove(engine_id)
            except ValueError as e:
                raise HTTPException(getattr(e, "http_status", 404), str(e)) from None
            return JSONResponse({"engine_id": engine_id, "handed_back": n})

        @app.post("/api/engines/{engine_id}/undrain")
        def undrain(engine_id: str, request: Request) -> JSONResponse:
            try:
                control(request).undrain(engine_id)
            except ValueError as e:
                raise HTTPException(404, str(e)) from None
            return JSONResponse({"engine_id": engine_id})

        return app

    def start(self, timeout_s: float = 10.0) -> str:
        """Serve on 127.0.0.1:cfg.dashboard_port (0 = a free port); returns the URL."""
        if self._server is not None:
            assert self.url is not None
            return self.url
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.cfg.dashboard_port))
        port = sock.getsockname()[1]
        self._hosts = frozenset(f"{name}:{port}" for name in LOOPBACK_NAMES) | (
            frozenset(LOOPBACK_NAMES) if port == 80 else frozenset())  # 80 may go unnamed
        config = uvicorn.Config(self.app, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=2)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name="rollstream-dashboard", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise RuntimeError(f"dashboard did not start on 127.0.0.1:{port}")
            time.sleep(0.02)
        self._server, self._thread, self._sock = server, thread, sock
        self.url = f"http://127.0.0.1:{port}/"
        if self.metrics is not None and self.run_dir is not None:
            files = RunFiles(self.run_dir)
            files.dashboard_token.unlink(missing_ok=True)  # a killed run's, maybe wider
            token = os.open(files.dashboard_token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(token, "w") as f:
                f.write(self.token + "\n")
            files.dashboard_url.write_text(self.url + "\n")
        return self.url

    def stop(self) -> None:
        """Stop serving and join the server thread."""
        if self._server is None:
            return
        self._server.should_exit = True
        assert self._thread is not None
        self._thread.join(timeout=10)
        self._sock.close()
        if self.metrics is not None and self.run_dir is not None:
            RunFiles(self.run_dir).dashboard_url.unlink(missing_ok=True)
            RunFiles(self.run_dir).dashboard_token.unlink(missing_ok=True)
        self._server = self._thread = None
        self.url = None

    def __enter__(self) -> Dashboard:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
