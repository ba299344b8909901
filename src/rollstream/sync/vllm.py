"""vLLM's reload path: :class:`VllmReload` installs a payload into one running vLLM server
and owns its version label (``VllmEngine.load_weights`` calls it; its server's worker reads
the folder through ``engine/vllm/worker_ext.py``).

Ordering contract of ``load``, which makes the version boundary exact: the payload is
written to shared memory (``shm.py``), then ``/pause?mode=keep`` (in-flight requests
freeze between two steps), reload in place through ``/collective_rpc`` (``worker_ext.py``),
``/update_weight_version``, ``/resume``; the frozen requests then continue on the new
weights. Requests sent while the server is paused (``paused_for``) are sampled by the new
version; the in-flight streams are told, just before ``/resume`` is sent, that what they hold
was sampled before (``StreamState.resuming``, ``engine/vllm/wire.py``). One load or restart
at a time: ``load`` holds the health's ``control`` lock, and waits out a recovery without
holding it.

A LoRA engine (``lora`` set) installs ``adapter`` payloads into the server's one adapter slot
in place, under the same pause, and registers that slot on every (re)started server before
anything else (``vllm_lora.py``).

A reload that fails is a server fault: the version is set anyway (the recovery restores the
written weights and labels them) and ``load`` raises only if the engine is DEAD after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from rollstream.sync.protocol import Payload
from rollstream.sync.shm import WeightStore, WrittenWeights
from rollstream.sync.vllm_lora import ADAPTER_NAME, LoraSlot

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class SyncTiming:
    version: int
    num_bytes: int
    write_s: float  # state dict -> safetensors buckets in shared memory
    pause_s: float  # engine paused: reload + version label
    total_s: float


class Health(Protocol):
    """What a reload needs of the engine's health (``engine/vllm/health.py``)."""

    control: asyncio.Lock  # held by a restart or a reload
    ready: asyncio.Event  # set while the server can serve

    async def serving(self) -> str | None:
        """None once the server serves; why not when the engine is DEAD."""

    def fault(self, reason: str) -> None: ...


class Resumable(Protocol):
    """An in-flight stream (``engine/vllm/wire.py``'s ``StreamState``)."""

    def resuming(self) -> None:
        """The server resumes after a reload: what the stream holds was sampled before."""


class VllmReload:
    """``post(path, **kwargs)`` posts to the server (raising on an HTTP error);
    ``streams()`` are the engine's in-flight streams."""

    def __init__(self, *, engine_id: str, version: int, store: WeightStore,
                 health: Health, post: Callable[..., Awaitable[httpx.Response]],
                 streams: Callable[[], Iterable[Resumable]],
                 lora: LoraSlot | None = None) -> None:
        self.engine_id = engine_id
        self.version = version  # of the weights the server samples with
        self.paused_for: int | None = None  # a reload to this version has the server paused
        self.timings: deque[SyncTiming] = deque(maxlen=256)  # the latest loads' (bounded)
        self._store, self._health, self._post, self._streams = store, health, post, streams
        self.lora = lora

    async def restore(self, written: WrittenWeights | None) -> None:
        """On a (re)started server: register the adapter slot (LoRA), reload ``written``, if
        any, and label ``version``."""
        if self.lora is not None:
            await self._register(self.lora)
        if written is not None:
            await self._install(written)
        await self._label(self.version)

    async def load(self, payload: Payload) -> None:
        health, version = self._health, payload.version
        while True:  # wait out a recovery without holding the lock it needs
            if (why := await health.serving()) is not None:
                raise RuntimeError(why)
            await health.control.acquire()
            if health.ready.is_set():
                break
            health.control.release()
        t0 = time.perf_counter()
        try:
            written = await asyncio.to_thread(self._store.write, payload)
            t1 = time.perf_counter()
            try:
                await self._post("/pause", params={"mode": "keep"})
                self.paused_for = version  # requests sent from now on are sampled by it
                await self._install(written)
                await self._label(version)
                self.version, self.paused_for = version, None
                for stream in self._streams():  # what they hold now was sampled before
                    stream.resuming()
                await self._post("/resume")
                failed = None
            except httpx.HTTPError as e:
                failed = e
                self.version, self.paused_for = version, None  # recovery restores `written`
                health.fault(f"weight load of version {version} failed: {e!r}")
            t2 = time.perf_counter()
        finally:
            health.control.release()
        if failed is not None and (why := await health.serving()) is not None:
            raise RuntimeError(why) from failed
        self._store.prune()
        timing = SyncTiming(version=version, num_bytes=written.num_bytes, write_s=t1 - t0,
                            pause_s=t2 - t1, total_s=time.perf_counter() - t0)
        self.timings.append(timing)
        log.info("vllm engine %s: weights v%d (%.1f MB) synced in %.3f s (write %.3f, paused %.3f)",
                 self.engine_id, version, written.num_bytes / 1e6, timing.total_s,
                 timing.write_s, timing.pause_s)

    async def _install(self, written: WrittenWeights) -> None:
        if written.kind == "adapter":
            await self._load_adapter(written.path)
            return
        await self._reload(written)
        if self.lora is not None:  # a full version serves no adapter (vllm_lora.py)
            await self._load_adapter(self.lora.zero_path)

    async def _register(self, lora: LoraSlot) -> None:
        """Register the adapter slot on the server and load its zero adapter into it (the
        worker learns the slot's id: worker_ext.py); an attached server that an earlier
        engine registered it on keeps it, reset to zero."""
        try:
            await self._post("/v1/load_lora_adapter", json={
                "lora_name": ADAPTER_NAME, "lora_path": str(lora.zero_path)})
        except httpx.HTTPStatusError as e:
            text = e.response.text[:300]
            if e.response.status_code != 400 or "already been loaded" not in text:
                raise RuntimeError(
                    f"vLLM server of engine {self.engine_id} cannot serve model.lora: "
                    f"/v1/load_lora_adapter answered HTTP {e.response.status_code} {text!r} "
                    "(it needs --enable-lora, --max-lora-rank >= model.lora.rank and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, which launched servers get)") from None
        await self._load_adapter(lora.zero_path)

    async def _load_adapter(self, path: Path) -> None:
        await self._post("/collective_rpc", json={
            "method": "rollstream_load_adapter",
            "kwargs": {"name": ADAPTER_NAME, "path": str(path)}})

    async def _reload(self, written: WrittenWeights) -> None:
        await self._post("/collective_rpc", json={
            "method": "rollstream_reload", "kwargs": {"weights_dir": str(written.path)}})

    async def _label(self, version: int) -> None:
        await self._post("/update_weight_version", json={"new_version": str(version)})
