"""The embedded ``local`` engine: continuous batching on a background thread, asyncio API.

    caller threads / event loops                engine thread (owns every tensor)
    ----------------------------                ---------------------------------
    generate / submit ---- Submit -----+
    interrupt ----------- Interrupt ---+--> inbox (SimpleQueue) --> between two steps:
    load_weights -------- Load --------+        apply commands, then step():
    peek ---------------- Peek --------+          (peek: the running requests so far)
    close --------------- Close -------+          admit waiting rows -> prefill (packed)
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

Faults. The engine thread is a fault boundary: when a step or a command raises, the engine
stops serving and nothing escapes to callers. While it has restarts left
(``engine.local.max_restarts``) it is RECOVERING (the cause in ``health_reason``, the
traceback in the log) until :meth:`LocalEngine.restart` (the rollout's supervisor calls it
with the current weights) has given it a fresh cache, scheduler and thread; then, or when it was
closed, it is DEAD for good. Each running request returns ABORT with the tokens, logprobs
and versions its row holds, read from the runner first (no tokens when the rows cannot be
read or were being moved when it failed); waiting and later requests return ABORT without
tokens; ``error`` names the engine and the cause. Pending and later weight loads raise
RuntimeError, interrupts do nothing. ``close`` ends the engine the same way (reason: closed).

Prefixes (``prefix.py``): leading blocks of a prompt that an earlier prompt, interrupted row or
finished turn of its episode computed are copied into its row and not prefilled; the cache is
dropped with the rows' on a weight load (kept under ``keep``), an ended episode's first evicted.

Deliberately simplified: one engine = one thread = one device; weights arrive as a full HF
state dict (copied in place between steps).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from rollstream.config.schema import LocalEngineConfig
from rollstream.engine.local.commands import (
    Close,
    Command,
    EndEpisode,
    Interrupt,
    Load,
    Peek,
    Submit,
    fail,
    output,
    resolve,
    validate,
)
from rollstream.engine.local.device import DTYPES, resolve_device
from rollstream.engine.local.passes import PassTimes
from rollstream.engine.local.prefix import BLOCK_TOKENS
from rollstream.engine.local.runner import ModelRunner, chunks_work
from rollstream.engine.local.sampler import seed_key
from rollstream.engine.local.scheduler import Scheduler, Sequence
from rollstream.engine.local.weights import load_folder
from rollstream.engine.protocol import (
    WORK_KEYS,
    EngineStats,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
)
from rollstream.engine.states import EngineHealth

log = logging.getLogger(__name__)
class LocalEngine:
    """Implements ``Engine``, ``Closeable``, ``KeepsEpisodes`` and ``HoldsPrefixes``
    (engine/protocol.py)."""

    def __init__(self, model_path: Path, cfg: LocalEngineConfig, *, engine_id: str = "local-0",
                 version: int = 0, seed: int = 0,
                 training: Callable[[], bool] | None = None) -> None:
        """``training``: whether a trainer step computes now, read once per pass
        (:class:`PassTimes`); None: never."""
        self.engine_id = engine_id
        self.model_path = Path(model_path)
        if not self.model_path.is_dir():
            raise ValueError(f"model folder {self.model_path} does not exist")
        self._cfg = cfg
        self.max_seq_len = cfg.max_seq_len
        self.num_restarts = 0
        self._closed = False
        self._build()
        self._threads = cfg.threads
        self._recompute_on_load = cfg.kv_on_load == "recompute"
        self._fuse_prefill = cfg.fuse_prefill
        self._cpu_affinity = cfg.cpu_affinity
        self._version = version
        self._seeds = torch.Generator().manual_seed(seed)  # requests without a seed
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # also orders puts into the inbox before a death
        self._num_queued = 0  # submitted, not yet seen by the engine thread
        self._active: dict[str, Sequence] = {}  # the requests the engine thread holds
        self._generated_tokens = 0
        self._busy_s = 0.0
        self._work = dict.fromkeys(WORK_KEYS, 0.0)  # where _busy_s went (EngineStats.work)
        # pass times by shape, for fitting the simulator's profile
        self.passes = PassTimes(training=training)
        self._death: str | None = None  # why it stopped serving (closed, or died)
        self._restarting = False  # a restart runs: RECOVERING, even on the last one
        self._applying: Command | None = None  # answered by _die if applying it raises
        self._rows_moving = False  # scheduler and runner rows disagree meanwhile
        self._thread = self._start_thread()

    def _build(self) -> None:
        """Weights from the model folder, a fresh KV cache and scheduler."""
        cfg, device = self._cfg, resolve_device(self._cfg.device)
        self.spec, self._weights = load_folder(self.model_path, device, DTYPES[cfg.dtype])
        self._runner = ModelRunner(self.spec, self._weights, max_rows=cfg.max_slots,
                                   max_seq_len=cfg.max_seq_len, device=device,
                                   dtype=DTYPES[cfg.dtype],
                                   prefix_cache_tokens=cfg.prefix_cache_tokens)
        self._scheduler = Scheduler(max_rows=cfg.max_slots, prefix=self._runner.prefix,
                                    prefill_budget_tokens=cfg.max_prefill_tokens)

    def _start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._main, name=f"rollstream-{self.engine_id}",
                                  daemon=True)
        thread.start()
        return thread

    def needs_restart(self) -> bool:
        """Its step loop died and it may be restarted (RECOVERING)."""
        return bool(self._death) and not self._closed and self.num_restarts < self._cfg.max_restarts

    async def restart(self, version: int, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Serve again after the step loop died: weights from the model folder, then
        ``tensors`` (the current version's, unless ``version`` is the folder's 0), a fresh
        cache and scheduler, a new thread; UP at ``version`` when this returns. The caller
        must not modify ``tensors`` until then."""
        if not self.needs_restart():
            raise RuntimeError(f"local engine {self.engine_id} cannot restart: "
                               f"{self._death or 'it is running'}")
        self.num_restarts, self._restarting = self.num_restarts + 1, True
        try:
            await asyncio.to_thread(self._restart, version, tensors)
        finally:
            self._restarting = False

    def _restart(self, version: int, tensors: Mapping[str, torch.Tensor] | None) -> None:
        self._thread.join()
        self._build()
        if tensors is not None:
            self._weights.copy_in(self._weights.check(tensors))
        self._version = version
        self._inbox = queue.SimpleQueue()
        self._active.clear()
        self._applying, self._rows_moving = None, False
        with self._lock:
            self._death = None
        self._thread = self._start_thread()
        log.warning("local engine %s restarted at version %d (restart %d of %d)",
                    self.engine_id, version, self.num_restarts, self._cfg.max_restarts)

    # ---- public API (any thread) ---------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        future = self.submit(request)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._post(Interrupt(ids=frozenset({request.request_id}), done=None))
            raise

    def submit(self, request: GenerateRequest) -> concurrent.futures.Future:
        """Thread-safe, non-blocking: queue a request; the future yields its GenerateOutput
        (ABORT with the cause once the engine is dead)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        error = validate(request, self.spec.vocab_size, self.max_seq_len)
        if error is not None:
            future.set_result(output(request.request_id, FinishReason.ERROR, error=error))
            return future
        prompt_len = len(request.prompt_ids)
        seed = request.params.seed
        if seed is None:
            with self._lock:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        seq = Sequence(request=request, future=future, seed_key=seed_key(seed),
                       max_new_tokens=min(request.params.max_new_tokens,
                                          self.max_seq_len - prompt_len))
        if not self._post(Submit(seq=seq)):
            future.set_result(output(request.request_id, FinishReason.ABORT, error=self._death))
        return future

    def generate_many(self, requests: Seq[GenerateRequest]) -> list[GenerateOutput]:
        """Synchronous convenience (benchmarks, tests): submit all, wait for all."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    async def interrupt(self, request_ids: Seq[str] | None = None) -> None:
        ids = None if request_ids is None else frozenset(request_ids)
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self._post(Interrupt(ids=ids, done=done)):  # a dead engine has nothing to stop
            await asyncio.wrap_future(done)

    def end_episode(self, episode_id: str) -> None:
        """``KeepsEpisodes``: the episode's turns in the prefix cache become first to evict."""
        self._post(EndEpisode(episode_id=episode_id))

    def cached_tokens(self, prompt_ids: Seq[int]) -> int:
        """``HoldsPrefixes``: of ``prompt_ids``, the tokens the prefix cache holds now."""
        return self._runner.prefix.held(prompt_ids)

    async def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Install a full HF-named state dict between two steps. The caller must not modify
        ``tensors`` until this returns (they are copied on the engine thread). RuntimeError
        with the cause when the engine is dead or dies before installing them."""
        pairs = self._weights.check(tensors)
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self._post(Load(version=version, pairs=pairs, done=done)):
            raise RuntimeError(self._death)
        await asyncio.wrap_future(done)

    async def peek(self) -> list[GenerateOutput]:
        """What each running request has generated so far (ABORT-shaped outputs, read between
        two steps; none once the engine is dead). A caller in another process keeps them so
        that a request whose process dies still returns its partial tokens."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self._post(Peek(done=done)):
            return []
        return await asyncio.wrap_future(done)

    def stats(self) -> EngineStats:
        with self._lock:
            waiting = self._num_queued
        death = self._death
        return EngineStats(
            engine_id=self.engine_id,
            version=self._version,
            num_running=len(self._scheduler.running),
            num_waiting=waiting + len(self._scheduler.waiting),
            capacity=self._scheduler.max_rows,
            generated_tokens=self._generated_tokens,
            busy_s=self._busy_s,
            work={**self._work, **self._runner.prefix.counts},
            health=(EngineHealth.UP if death is None else EngineHealth.RECOVERING
                    if self._restarting or self.needs_restart() else EngineHealth.DEAD),
            health_reason=death,
        )

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Synchronous close: pending requests return ABORT, the thread exits (a dead engine's
        thread has exited already)."""
        self._closed = True  # a closed engine is never restarted
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self._post(Close(done=done)):
            done.result()
        self._thread.join()

    # ---- caller-side helpers -------------------------------------------------------------
    def _post(self, cmd: Command) -> bool:
        """Queue a command for the engine thread; False once the engine is dead (nothing
        reads the inbox then: _die answered everything queued before)."""
        with self._lock:
            if self._death is not None:
                return False
            self._num_queued += isinstance(cmd, Submit)
            self._inbox.put(cmd)
            return True

    # ---- engine thread -------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self._cpu_affinity:  # on Linux this pins the calling (engine) thread only
                os.sched_setaffinity(0, self._cpu_affinity)
            if self._threads > 0:
                torch.set_num_threads(self._threads)
            with torch.inference_mode():
                while self._death is None:
                    self._apply_commands(block=not self._scheduler.has_work())
                    if self._scheduler.has_work() and self._death is None:
                        self._step()
        except BaseException as e:  # fault boundary: the engine is dead, its requests return
            log.error("local engine %s died", self.engine_id, exc_info=e)
            self._die(f"local engine {self.engine_id} died: {e!r}")

    def _apply_commands(self, *, block: bool) -> None:
        if block:
            self._apply(self._inbox.get())
        while not self._inbox.empty():  # this thread is the only consumer
            self._apply(self._inbox.get_nowait())

    def _apply(self, cmd: Command) -> None:
        self._applying = cmd
        match cmd:
            case Submit(seq=seq):
                with self._lock:
                    self._num_queued -= 1
                if seq.request_id in self._active:
                    dup = "duplicate request_id still in flight"
                    resolve(seq.future, output(seq.request_id, FinishReason.ERROR, error=dup))
                else:
                    self._active[seq.request_id] = seq
                    self._scheduler.waiting.append(seq)
            case Interrupt(ids=ids, done=done):
                self._abort(ids, error=None)
                if done is not None:
                    resolve(done, None)
            case Load(version=version, pairs=pairs, done=done):
                t0 = time.perf_counter()
                self._weights.copy_in(pairs)
                self._version = version
                rows, recomputed = self._runner.num_rows, 0
                if self._recompute_on_load:  # cached prefixes are of the old weights too
                    self._runner.prefix.clear()
                if self._recompute_on_load and rows:
                    t1 = time.perf_counter()
                    self._runner.recompute_cache(self._scheduler.prefill_budget_tokens)
                    recomputed = int(self._runner.length_host[:rows].sum())
                    self._count("recompute", time.perf_counter() - t1, tokens=recomputed)
                self._busy_s += (seconds := time.perf_counter() - t0)
                self.passes.add("load", rows, recomputed, seconds)
                for row, seq in enumerate(self._scheduler.running):
                    seq.mark_version(self._runner.num_generated(row, seq.prompt_len), version)
                resolve(done, None)
            case Peek(done=done):
                resolve(done, self._running_outputs())
            case EndEpisode(episode_id=episode_id):
                self._runner.prefix.end_episode(episode_id)
            case Close(done=done):
                self._closed = True
                self._die(f"local engine {self.engine_id} closed")
                resolve(done, None)
        self._applying = None

    def _count(self, what: str, seconds: float, tokens: int | None = None) -> None:
        work = self._work
        work[f"{what}_count"] += 1
        work[f"{what}_s"] += seconds
        if tokens is not None:
            work[f"{what}_tokens"] += tokens

    def _step(self) -> None:
        """Admit waiting requests and decode one token for every live row. With
        ``fuse_prefill`` the new prompts are prefilled inside the decode forward pass (their
        first token sampled there); otherwise, and when no row is live, they are prefilled in
        a pass of their own first (and then decoded with the others)."""
        t0 = time.perf_counter()
        runner = self._runner
        if runner.num_rows:
            self._rows_moving = True
            if (order := runner.sort_rows()) is not None:
                running = self._scheduler.running
                self._scheduler.running = [running[i] for i in order]
                self._count("sort", time.perf_counter() - t0)
            self._rows_moving = False
        n = runner.num_rows
        new = self._scheduler.admit()
        for seq in new:
            seq.mark_version(0, self._version)
        new_tokens = sum(s.prompt_len - len(s.prefix) * BLOCK_TOKENS for s in new)  # uncached
        fused = new if self._fuse_prefill and n else []
        if new and not fused:
            t1 = time.perf_counter()
            done = runner.prefill(new)
            self._count("prefill", seconds := time.perf_counter() - t1, tokens=new_tokens)
            self.passes.add("prefill", len(new), new_tokens, seconds)
            self._generated_tokens += len(new)  # counted before anyone hears of it
            self._scheduler.stream(self._runner.read)
            self._finish(done, FinishReason.LENGTH)
        if runner.num_rows:
            t1 = time.perf_counter()
            rows, context = runner.num_rows, int(runner.length_host[:runner.num_rows].sum())
            done = runner.decode(fused)
            training = self.passes.training()  # before _finish delivers (PassTimes.add)
            self._generated_tokens += runner.num_rows  # one token each, finished ones too
            if fused:  # its time is the decode step's
                self._work["fused_prefill_count"] += 1
                self._work["fused_prefill_tokens"] += new_tokens
            chunks = runner.last_chunks
            self._work["attention_positions"] += context
            self._work["attention_work"] += chunks_work(chunks)
            self._work["attention_chunks"] += len(chunks)
            self._scheduler.stream(self._runner.read)
            self._finish(done, FinishReason.LENGTH)
            self._count("decode", seconds := time.perf_counter() - t1)
            if not fused:  # a fused pass is a decode and a prefill: not one shape to fit
                self.passes.add("decode", rows, context, seconds, training)
        self._busy_s += time.perf_counter() - t0

    def _finish(self, rows: list[int], reason: FinishReason, error: str | None = None) -> None:
        """Deliver rows that stopped (reason: LENGTH or ABORT; STOP is read off the last
        token) and release their cache rows."""
        if not rows:
            return
        seqs = [self._scheduler.running[r] for r in rows]
        results = self._runner.read(rows, [s.prompt_len for s in seqs])
        routing = self._runner.routing(rows)  # of prompt + output (runner.ModelRunner.routing)
        if error is None:  # not a failure: interrupted rows and finished turns of episodes
            self._runner.store_ended(rows, seqs, results, reason is FinishReason.ABORT)
        self._rows_moving = True
        removed, src, dst = self._scheduler.release(rows)
        for seq, (tokens, logprobs), route in zip(removed, results, routing, strict=True):
            why = reason
            if reason is FinishReason.LENGTH and tokens[-1] in seq.request.params.stop_token_ids:
                why = FinishReason.STOP
            self._deliver(seq, output(seq.request_id, why, tokens, logprobs,
                                      seq.versions(len(tokens)), error, route))
        self._runner.release(len(rows), src, dst)  # delivered first: a failure here loses none
        self._rows_moving = False

    def _abort(self, ids: frozenset[str] | None, *, error: str | None) -> None:
        rows = [
            i for i, s in enumerate(self._scheduler.running) if ids is None or s.request_id in ids
        ]
        self._finish(rows, FinishReason.ABORT, error)
        for seq in self._scheduler.take_waiting(ids):
            self._deliver(seq, output(seq.request_id, FinishReason.ABORT, error=error))

    def _deliver(self, seq: Sequence, out: GenerateOutput) -> None:
        if self._active.get(seq.request_id) is seq:
            del self._active[seq.request_id]
        resolve(seq.future, out)

    def _die(self, reason: str) -> None:
        """Stop serving for good: every request held or queued returns ABORT with ``reason``
        (running rows with their partial output), queued commands are answered (loads fail)."""
        with self._lock:  # callers see the death from now on instead of queueing
            self._death = reason
            self._num_queued = 0
        partials = self._partials()
        running, waiting = list(self._scheduler.running), list(self._scheduler.waiting)
        self._scheduler.running.clear()  # before anyone hears back: stats show nothing left
        self._scheduler.waiting.clear()
        for seq, (tokens, logprobs) in zip(running, partials, strict=True):
            versions = seq.versions(len(tokens))
            if len(versions) != len(tokens):  # no version mark yet: nothing exact to return
                tokens, logprobs, versions = [], [], []
            abort = output(seq.request_id, FinishReason.ABORT, tokens, logprobs, versions, reason)
            self._deliver(seq, abort)
        for seq in [*waiting, *self._active.values()]:  # active: held between two lists
            self._deliver(seq, output(seq.request_id, FinishReason.ABORT, error=reason))
        pending = [self._applying] if self._applying is not None else []
        while True:
            try:
                pending.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            match cmd:
                case Submit(seq=seq):
                    resolve(seq.future, output(seq.request_id, FinishReason.ABORT, error=reason))
                case Load(done=done):
                    fail(done, RuntimeError(reason))
                case Interrupt(done=done) | Close(done=done) if done is not None:
                    resolve(done, None)
                case Peek(done=done):
                    resolve(done, [])

    def _running_outputs(self) -> list[GenerateOutput]:
        """The running requests' tokens so far, as ABORT outputs (those with exact versions)."""
        outs = []
        for seq, (tokens, logprobs) in zip(self._scheduler.running, self._partials(),
                                           strict=True):
            versions = seq.versions(len(tokens))
            if tokens and len(versions) == len(tokens):
                outs.append(output(seq.request_id, FinishReason.ABORT, tokens, logprobs,
                                   versions))
        return outs

    def _partials(self) -> list[tuple[list[int], list[float]]]:
        """Tokens and logprobs each running row holds; none for rows that cannot be trusted
        (rows being moved, rows not prefilled yet) or read (the device failed)."""
        running = self._scheduler.running
        readable = 0 if self._rows_moving else min(len(running), self._runner.num_rows)
        try:
            lens = [s.prompt_len for s in running[:readable]]
            out = self._runner.read(list(range(readable)), lens)
        except Exception as e:  # a broken device: the requests still return, without tokens
            log.error("local engine %s: partial outputs unreadable", self.engine_id, exc_info=e)
            out = []
        return out + [([], [])] * (len(running) - len(out))
