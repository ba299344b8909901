"""The embedded ``local`` engine: continuous batching on a background thread, asyncio API.

    caller threads / event loops                engine thread (owns every tensor)
    ----------------------------                ---------------------------------
    generate / submit ---- _Submit ----+
    interrupt ----------- _Interrupt --+--> inbox (SimpleQueue) --> between two steps:
    load_weights -------- _Load -------+        apply commands, then step():
    close --------------- _Close ------+          admit waiting rows -> prefill (packed)
                                                  decode one token for every live row
    concurrent Future <--- set_result ------------ finished / aborted rows
    (await-ed via asyncio.wrap_future, which resolves the caller's asyncio future with
     loop.call_soon_threadsafe)

Commands are applied only between steps, so interrupts stop requests at a token boundary and
a weight load never lands inside a forward pass. After a weight load the KV cache of every
in-flight row is recomputed with the new weights (one packed prefill), so the tokens after the
load, and their logprobs, are exactly what the new version produces from that prefix: the
version tag of a token then names the one policy that sampled it, which is what the trainer's
importance ratios assume. With ``kv_on_load: keep`` the cache stays as it is (as vLLM and
PipelineRL do): no recompute, but later tokens attend over keys/values of older weights.
Each step prefills the newly admitted prompts together (packed, one forward pass) and then
decodes every live row (attention in chunks of rows, each over its own longest row), so
requests join and leave the batch every step and nobody waits for the longest. torch releases the GIL in
its ops, so the caller's event loop keeps running while the engine computes.

Deliberately simplified: one engine = one thread = one device; weights arrive as a full HF
state dict (copied in place between steps).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from rollstream.config.schema import LocalEngineConfig
from rollstream.engine.local.runner import ModelRunner
from rollstream.engine.local.sampler import seed_key
from rollstream.engine.local.scheduler import Scheduler, Sequence
from rollstream.engine.local.weights import load_folder
from rollstream.engine.protocol import (
    EngineStats,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True, kw_only=True)
class _Submit:
    seq: Sequence


@dataclass(slots=True, kw_only=True)
class _Interrupt:
    ids: frozenset[str] | None
    done: concurrent.futures.Future | None


@dataclass(slots=True, kw_only=True)
class _Load:
    version: int
    pairs: list[tuple[str, torch.Tensor]]
    done: concurrent.futures.Future


@dataclass(slots=True, kw_only=True)
class _Close:
    done: concurrent.futures.Future


def resolve_device(name: str) -> torch.device:
    """``auto`` = cuda when available, else cpu; ValueError for an unusable name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"engine.local.device: {name!r} is not a torch device") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine.local.device is {name!r} but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"engine.local.device must be auto, cpu or cuda, got {name!r}")
    return device


class LocalEngine:
    """Implements :class:`rollstream.engine.protocol.Engine` (and ``Closeable``)."""

    def __init__(
        self,
        model_path: Path,
        cfg: LocalEngineConfig,
        *,
        engine_id: str = "local-0",
        version: int = 0,
    ) -> None:
        self.engine_id = engine_id
        self.model_path = Path(model_path)
        if not self.model_path.is_dir():
            raise ValueError(f"model folder {self.model_path} does not exist")
        device = resolve_device(cfg.device)
        self.spec, self._weights = load_folder(self.model_path, device, _DTYPES[cfg.dtype])
        self.max_seq_len = cfg.max_seq_len
        self._runner = ModelRunner(
            self.spec,
            self._weights,
            max_rows=cfg.max_slots,
            max_seq_len=cfg.max_seq_len,
            device=device,
            dtype=_DTYPES[cfg.dtype],
        )
        self._scheduler = Scheduler(
            max_rows=cfg.max_slots, prefill_budget_tokens=cfg.max_prefill_tokens
        )
        self._threads = cfg.threads
        self._recompute_on_load = cfg.kv_on_load == "recompute"
        self._cpu_affinity = cfg.cpu_affinity
        self._version = version
        self._seeds = torch.Generator().manual_seed(cfg.seed)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, not yet seen by the engine thread
        self._active: set[str] = set()  # request ids the engine thread holds
        self._generated_tokens = 0
        self._busy_s = 0.0
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, name=f"rollstream-{engine_id}", daemon=True
        )
        self._thread.start()

    # ---- public API (any thread) ---------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        future = self.submit(request)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._inbox.put(_Interrupt(ids=frozenset({request.request_id}), done=None))
            raise

    def submit(self, request: GenerateRequest) -> concurrent.futures.Future:
        """Thread-safe, non-blocking: queue a request; the future yields its GenerateOutput."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        error = self._validate(request)
        if error is not None:
            future.set_result(_output(request.request_id, FinishReason.ERROR, error=error))
            return future
        prompt_len = len(request.prompt_ids)
        seed = request.params.seed
        if seed is None:
            with self._lock:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        seq = Sequence(
            request=request,
            future=future,
            seed_key=seed_key(seed),
            max_new_tokens=min(request.params.max_new_tokens, self.max_seq_len - prompt_len),
        )
        with self._lock:
            self._num_queued += 1
        self._inbox.put(_Submit(seq=seq))
        return future

    def generate_many(self, requests: Seq[GenerateRequest]) -> list[GenerateOutput]:
        """Synchronous convenience (benchmarks, tests): submit all, wait for all."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    async def interrupt(self, request_ids: Seq[str] | None = None) -> None:
        ids = None if request_ids is None else frozenset(request_ids)
        await asyncio.wrap_future(self._command(lambda done: _Interrupt(ids=ids, done=done)))

    async def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Install a full HF-named state dict between two steps. The caller must not modify
        ``tensors`` until this returns (they are copied on the engine thread)."""
        pairs = self._weights.check(tensors)
        await asyncio.wrap_future(
            self._command(lambda done: _Load(version=version, pairs=pairs, done=done))
        )

    def stats(self) -> EngineStats:
        with self._lock:
            waiting = self._num_queued
        return EngineStats(
            engine_id=self.engine_id,
            version=self._version,
            num_running=len(self._scheduler.running),
            num_waiting=waiting + len(self._scheduler.waiting),
            capacity=self._scheduler.max_rows,
            generated_tokens=self._generated_tokens,
            busy_s=self._busy_s,
        )

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Synchronous close: pending requests return ABORT, the thread exits."""
        if self._thread.is_alive() and not self._closed:
            self._command(lambda done: _Close(done=done)).result()
        self._thread.join()

    # ---- caller-side helpers -------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"local engine {self.engine_id} died") from self._error
        if self._closed:
            raise RuntimeError(f"local engine {self.engine_id} is closed")

    def _command(self, make) -> concurrent.futures.Future:
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(make(done))
        return done

    def _validate(self, request: GenerateRequest) -> str | None:
        ids, vocab = request.prompt_ids, self.spec.vocab_size
        if not ids:
            return "empty prompt"
        if len(ids) >= self.max_seq_len:
            return (
                f"prompt of {len(ids)} tokens does not fit the context: max_seq_len is "
                f"{self.max_seq_len} (prompt + at least one new token)"
            )
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            return f"prompt has token ids outside [0, {vocab}): {bad[:5]}"
        return None

    # ---- engine thread -------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self._cpu_affinity:  # on Linux this pins the calling (engine) thread only
                os.sched_setaffinity(0, self._cpu_affinity)
            if self._threads > 0:
                torch.set_num_threads(self._threads)
            with torch.inference_mode():
                while not self._closed:
                    self._apply_commands(block=not self._scheduler.has_work())
                    if self._scheduler.has_work() and not self._closed:
                        self._step()
        except BaseException as e:  # fault boundary: every pending caller gets the error
            self._error = e
            self._fail_everything(e)
            raise

    def _apply_commands(self, *, block: bool) -> None:
        if block:
            self._apply(self._inbox.get())
        while not self._inbox.empty():  # this thread is the only consumer
            self._apply(self._inbox.get_nowait())

    def _apply(self, cmd: object) -> None:
        match cmd:
            case _Submit(seq=seq):
                with self._lock:
                    self._num_queued -= 1
                if seq.request_id in self._active:
                    _resolve(
                        seq.future,
                        _output(
                            seq.request_id,
                            FinishReason.ERROR,
                            error="duplicate request_id still in flight",
                        ),
                    )
                else:
                    self._active.add(seq.request_id)
                    self._scheduler.waiting.append(seq)
            case _Interrupt(ids=ids, done=done):
                self._abort(ids, error=None)
                if done is not None:
                    _resolve(done, None)
            case _Load(version=version, pairs=pairs, done=done):
                t0 = time.perf_counter()
                self._weights.copy_in(pairs)
                self._version = version
                if self._recompute_on_load:
                    self._runner.recompute_cache(self._scheduler.prefill_budget_tokens)
                self._busy_s += time.perf_counter() - t0
                for row, seq in enumerate(self._scheduler.running):
                    seq.mark_version(self._runner.num_generated(row, seq.prompt_len), version)
                _resolve(done, None)
            case _Close(done=done):
                self._abort(None, error="engine closed")
                self._closed = True
                _resolve(done, None)

    def _step(self) -> None:
        t0 = time.perf_counter()
        new = self._scheduler.admit()
        if new:
            for seq in new:
                seq.mark_version(0, self._version)
            done = self._runner.prefill(new)
            self._generated_tokens += len(new)  # counted before anyone hears of it
            self._finish(done, FinishReason.LENGTH)
        if self._runner.num_rows:
            n = self._runner.num_rows
            if (order := self._runner.sort_rows()) is not None:
                running = self._scheduler.running
                self._scheduler.running = [running[i] for i in order]
            done = self._runner.decode()
            self._generated_tokens += n
            self._finish(done, FinishReason.LENGTH)
        self._busy_s += time.perf_counter() - t0

    def _finish(self, rows: list[int], reason: FinishReason, error: str | None = None) -> None:
        """Deliver rows that stopped (reason: LENGTH or ABORT; STOP is read off the last
        token) and release their cache rows."""
        if not rows:
            return
        seqs = [self._scheduler.running[r] for r in rows]
        results = self._runner.read(rows, [s.prompt_len for s in seqs])
        removed, src, dst = self._scheduler.release(rows)
        self._runner.release(len(rows), src, dst)
        for seq, (tokens, logprobs) in zip(removed, results, strict=True):
            why = reason
            if reason is FinishReason.LENGTH and tokens[-1] in seq.request.params.stop_token_ids:
                why = FinishReason.STOP
            self._deliver(
                seq,
                _output(seq.request_id, why, tokens, logprobs, seq.versions(len(tokens)), error),
            )

    def _abort(self, ids: frozenset[str] | None, *, error: str | None) -> None:
        rows = [
            i for i, s in enumerate(self._scheduler.running) if ids is None or s.request_id in ids
        ]
        self._finish(rows, FinishReason.ABORT, error)
        for seq in self._scheduler.take_waiting(ids):
            self._deliver(seq, _output(seq.request_id, FinishReason.ABORT, error=error))

    def _deliver(self, seq: Sequence, out: GenerateOutput) -> None:
        self._active.discard(seq.request_id)
        _resolve(seq.future, out)

    def _fail_everything(self, exc: BaseException) -> None:
        pending = [s.future for s in self._scheduler.running] + [
            s.future for s in self._scheduler.waiting
        ]
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            pending.append(cmd.seq.future if isinstance(cmd, _Submit) else cmd.done)
        for f in pending:
            if f is not None and not f.done():
                f.set_exception(RuntimeError(f"local engine {self.engine_id} died: {exc!r}"))


def _output(
    request_id: str,
    reason: FinishReason,
    tokens: list[int] | None = None,
    logprobs: list[float] | None = None,
    versions: list[int] | None = None,
    error: str | None = None,
) -> GenerateOutput:
    return GenerateOutput(
        request_id=request_id,
        token_ids=tokens or [],
        logprobs=logprobs or [],
        versions=versions or [],
        finish_reason=reason,
        error=error,
    )


def _resolve(future: concurrent.futures.Future, value: object) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # the caller cancelled it
        future.set_result(value)
