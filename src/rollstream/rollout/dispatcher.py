"""Sample-level dispatch: every sample is its own engine request.

No batch or prompt barrier: a group's samples go to the engines independently, each is graded
the moment it finishes, and the group completes when its last sample is graded. An engine
slot that frees is refilled by whichever sample comes next.

A sample's life here (``run_sample``)::

    wait for the gate -> pick a live engine (least load) -> generate(prompt + tokens so far)
      STOP/LENGTH -> GENERATED -> grade -> GRADED
      ABORT       -> interrupted by a weight update, a cancel, or an engine fault (a dying
                     engine, a broken stream, an HTTP 5xx, an actor that raised): keep the
                     partial tokens and their versions, resubmit (partial rollout), after an
                     engine fault on another engine
      ERROR       -> FAILED with the engine's reason (the request's own fault: bad prompt)

A task whose ``Task.harness`` is not ``single_turn`` (an agent episode) is handed to the
harness registered under that name (the contract: ``rollout/harness.py``), which generates
each model turn with :meth:`Dispatcher.generate_turn` (the loop above, for one turn) and so
gets the same gate, routing, interrupts, retries and spans (``agent/harness.py``).

Engine states (``engine/states.py``): requests go to UP engines that are routed, least
loaded first; when none is but one is RECOVERING or out of routing, they wait; never to a DEAD
one. Preemption: :meth:`Dispatcher.drain` takes an engine out of routing and interrupts its
requests at a token boundary; they come back with their tokens and continue on another engine
(or wait for one), until :meth:`Dispatcher.undrain`. An engine that raises from ``generate``
is a fault like a dead stream: the attempt returns its partial tokens (none). After an engine
fault a sample is retried on an engine that has not failed it in this turn while one may take
it, and the router's breaker (``rollout/breaker.py``) quarantines an UP engine whose requests
keep failing without a token (grey failures). A sample FAILS after ``MAX_ENGINE_RETRIES``
consecutive failed attempts that produced no token. When no engine is alive the dispatcher
records why in ``fatal`` and stops dispatching; the rollout stops the run with that reason.

The ``gate`` (``pause``/``resume``, the protocol weight sync uses) is closed while weights are
swapped, so no request is submitted against half-published weights. ``cancel`` gives up on
groups: their requests are interrupted and not resubmitted; the caller records their samples'
terminal status. Every status change goes through :class:`Lifecycle`.

Episodes: every request of a sample carries its uid as ``episode_id`` (its turns and its
resubmissions extend one another, but where the chat template rewrote earlier turns a turn is
served its context anew: ``Sample.served_ids``); when ``run_sample`` ends, the engine of its
last request may drop what it kept (``KeepsEpisodes``: an actor sends only added tokens).

Random streams: with a run ``seed``, a request without a seed of its own gets
:func:`sample_seed` (run seed, sample uid), the same on every attempt of that sample. An
engine that seeds by token position (the local engine) then draws a resumed sample's next
tokens from the stream it was drawing from, whichever engine or process continues it: a
checkpoint needs no engine RNG state, and a resumed run samples as the uninterrupted one.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from rollstream.clock import Clock
from rollstream.config.breaker import BreakerConfig
from rollstream.engine.protocol import (Engine, FinishReason, GenerateOutput, GenerateRequest,
                                        OnTokens, SamplingParams)
from rollstream.engine.states import EngineHealth
from rollstream.reward.pool import GraderPool
from rollstream.rollout.grading import Grading
from rollstream.rollout.harness import Harness, TurnOutput
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.rollout.predict import LengthPredictor
from rollstream.rollout.queue import Ask, DispatchQueue, Grant, LimitFactory
from rollstream.rollout.routing import Router
from rollstream.trajectory import SINGLE_TURN, Group, Sample, SampleStatus, SegmentKind

MAX_ENGINE_RETRIES = 3  # consecutive failed attempts without progress before a sample FAILS
RECOVERY_POLL_S = 0.05  # how often a request waiting for a RECOVERING engine looks again
_OUTCOME = {FinishReason.ABORT: "interrupted", FinishReason.ERROR: "failed"}  # spans; else "done"


class NoEngineAlive(RuntimeError):
    """Every engine is DEAD: nothing can be generated any more."""


@dataclass(slots=True, kw_only=True)
class InFlight:
    sample: Sample
    engine: Engine
    slot: int
    t_start_s: float
    version_start: int
    grant: Grant | None = None  # its slot in the dispatch queue (None: no queue)


@dataclass(slots=True, kw_only=True)
class DispatchStats:
    num_requests: int = 0
    num_interrupts: int = 0
    num_resumes: int = 0
    num_engine_failures: int = 0
    generated_tokens: int = 0
    # recent response lengths per source (the meters' len_mean)
    per_source_tokens: dict[str, deque[int]] = field(default_factory=dict)


SpanSink = Callable[..., None]


def sample_seed(seed: int, uid: str) -> int:
    """The request seed of sample ``uid`` in a run seeded ``seed`` (62 bits, stable across
    processes and Python versions)."""
    digest = hashlib.blake2b(f"{seed}/{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class Dispatcher:
    def __init__(
        self,
        *,
        engines: Sequence[Engine],
        params: SamplingParams,
        graders: GraderPool,
        decode: Callable[[list[int]], str],
        lifecycle: Lifecycle,
        clock: Clock,
        span: SpanSink | None = None,
        seed: int | None = None,
        harnesses: Mapping[str, Harness] | None = None,
        dispatch: Literal["engine", "fifo", "longest_first"] = "engine",
        concurrency: LimitFactory | None = None,
        prefix_affinity: bool = False,
        breaker: BreakerConfig | None = None,
    ) -> None:
        if not engines:
            raise ValueError("at least one engine is needed")
        self.engines = engines if isinstance(engines, list) else list(engines)  # the roster
        self.params = params
        self.grading = Grading(graders, decode, lifecycle)
        self.lifecycle = lifecycle
        self.clock = clock
        self.span = span or (lambda **_: None)
        self.seed = seed  # per-sample random streams (None: the engines' own)
        self.harnesses = dict(harnesses or {})  # Task.harness -> what runs its samples
        self.in_flight: dict[str, InFlight] = {}
        self.stats = DispatchStats()
        self.fatal: str | None = None  # why nothing can be dispatched any more
        self._gate = asyncio.Event()
        self._gate.set()
        self._cancelled: set[str] = set()
        self._free_slots: list[int] = []
        self._next_slot = itertools.count()
        self._ids = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()
        self.router = Router(self.engines, prefix_affinity=prefix_affinity, breaker=breaker,
                             now=clock.now)
        self.predictor = LengthPredictor(self.stats.per_source_tokens,
                                         default=max(params.max_new_tokens / 2, 1.0))
        # rollout.dispatch: engine = submit at once (engines queue); else wait here in order;
        # rollout.concurrency: adaptive = each engine's slots found by its ConcurrencyLimit
        if concurrency is not None and dispatch == "engine":
            raise ValueError("adaptive concurrency needs a dispatch queue (fifo or longest_first)")
        self.queue = None if dispatch == "engine" else DispatchQueue(
            dispatch, self.router.routable, adaptive=concurrency, now=clock.now,
            cap=self.router.cap)

    def set_params(self, params: SamplingParams) -> None:
        """Sampling parameters of the samples dispatched from now on (a reconfiguration;
        ``runtime.reconfigure``); a sample keeps the temperature of its first dispatch."""
        self.params = params

    # ---- the gate (weight sync's pause protocol) ----------------------------------------
    def pause(self) -> None:
        """Submit no new request until :meth:`resume` (running ones go on)."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    async def wait_open(self) -> None:
        await self._gate.wait()

    async def wait_idle(self) -> None:
        """Until no request is in flight."""
        await self._idle.wait()

    def live_engines(self) -> list[Engine]:
        """Engines that are not DEAD (the ones weight sync loads)."""
        return [e for e in self.engines if e.stats().health is not EngineHealth.DEAD]

    # ---- routing (``routing.Router``) ------------------------------------------------------
    async def _pick_engine(self, ask: Callable[[], Ask], sample: Sample,
                           avoid: set[str]) -> tuple[Engine, Grant | None]:
        """The engine for the next request and, with a dispatch queue, the slot it holds there
        (ranked and sized by ``ask()``): the least loaded routable engine, one not in
        ``avoid`` (engine ids) while another may take it; waits while engines recover or are
        out of routing, raises NoEngineAlive when every engine is DEAD."""
        while True:
            await self._gate.wait()
            if self.queue is None:
                engine = self.router.pick(sample, avoid)
                if engine is not None:
                    return engine, None
            elif self.router.routable():
                grant = await self.queue.acquire(
                    ask, avoid, lambda least, free: self.router.place(sample, least, free))
                if grant is None:  # the engines went away while it waited: look again
                    continue
                if self._gate.is_set():
                    return grant.engine, grant
                self.queue.release(grant)  # a weight sync closed the gate meanwhile
                continue
            if not self.router.may_come_back():
                reasons = "; ".join(f"{e.engine_id}: {e.stats().health_reason}"
                                    for e in self.engines)
                raise NoEngineAlive(f"no engine is alive ({reasons})")
            await asyncio.sleep(RECOVERY_POLL_S)  # one is being restarted, or drained

    def _take_slot(self) -> int:
        return self._free_slots.pop() if self._free_slots else next(self._next_slot)

    # ---- one sample ----------------------------------------------------------------------
    async def run_sample(self, sample: Sample, params: SamplingParams | None = None) -> None:
        """Generate ``sample`` to GENERATED (or GRADED, when its harness grades), or to
        FAILED; a cancelled group's sample, or any sample once no engine is alive, is left
        where it is for the caller to record. A task of another harness than a single
        request (an agent episode) is run by that harness, which generates each model turn
        with :meth:`generate_turn`."""
        params = params or self.params
        if sample.temperature is None:  # its first dispatch fixes it (Sample.temperature)
            sample.temperature = params.temperature
        elif sample.temperature != params.temperature:  # a sample continued after a change
            params = replace(params, temperature=sample.temperature)
        try:
            if sample.task.harness != SINGLE_TURN:
                harness = self.harnesses.get(sample.task.harness)
                if harness is None:
                    self.lifecycle.move(sample, SampleStatus.FAILED,
                                        f"no harness {sample.task.harness!r} in this run "
                                        f"(known: {', '.join(sorted(self.harnesses)) or 'none'})")
                    return
                await harness.run(sample, self, params)
                return
            out = await self.generate_turn(sample, params)
            if out is not None:
                self.finish(sample, out.finish_reason.value)
        finally:  # an engine that kept the episode's history may drop it (KeepsEpisodes;
            # looked up by name: a Protocol isinstance costs ~6 us, per sample at sim scale)
            self.router.end(sample)
            engine = self.router.by_id.get(sample.engine_id) if sample.engine_id else None
            if (end := getattr(engine, "end_episode", None)) is not None:
                end(sample.uid)

    def finish(self, sample: Sample, finish_reason: str) -> None:
        """``sample``'s generation is over: GENERATED, counted in the per-source lengths."""
        sample.finish_reason = finish_reason
        self.lifecycle.move(sample, SampleStatus.GENERATED)
        self.predictor.observe(sample, sample.num_response_tokens)  # and the source's lengths

    async def episode_turn(self, sample: Sample, params: SamplingParams, *,
                           deadline: float | None = None, on_tokens: OnTokens | None = None,
                           ) -> TurnOutput | None:
        """One model turn of a multi-turn episode (harnesses call this): a trailing policy
        segment is the same turn, continued (one cut by a checkpoint); otherwise a new turn
        starts after the response so far. Afterwards the sample is INTERRUPTED: no request is
        in flight while its environment or agent answers, so a checkpoint may be taken.
        ``on_tokens``: hears the turn's tokens as they are sampled (``GenerateRequest``)."""
        last = sample.segments[-1] if sample.segments else None
        ongoing = len(last) if last is not None and last.kind is SegmentKind.POLICY else 0
        out = await self.generate_turn(sample, params, deadline=deadline, on_tokens=on_tokens,
                                       turn_start=sample.num_response_tokens - ongoing)
        if out is not None and sample.status is SampleStatus.RUNNING:
            self.lifecycle.move(sample, SampleStatus.INTERRUPTED)
        return out

    async def generate_turn(self, sample: Sample, params: SamplingParams, *, turn_start: int = 0,
                            deadline: float | None = None, on_tokens: OnTokens | None = None,
                            ) -> TurnOutput | None:
        """Generate one model turn of ``sample``, its tokens appended from response position
        ``turn_start`` on (a single-turn sample: 0, the whole response), until it stops or has
        ``params.max_new_tokens`` tokens. An interrupt (weight update, drain, dead engine)
        keeps the partial tokens and resubmits prompt + response so far, on another engine
        when this one died. ``deadline`` (``clock.now()`` time): the request is interrupted
        then and the turn returns ``out_of_time``. None: the sample FAILED (engine error, or
        ``MAX_ENGINE_RETRIES`` failed attempts in a row), its group was cancelled, or no
        engine is alive; the caller leaves it as it is."""
        failures = interrupts = 0
        failed_on: set[str] = set()  # engines that failed this turn (an engine fault)
        # the request seed: the same on every attempt, so drawn once per turn
        seed = (sample_seed(self.seed, sample.uid)
                if params.seed is None and self.seed is not None else params.seed)
        while True:
            await self._gate.wait()
            if sample.group_id in self._cancelled or self.fatal is not None:
                return None
            done = sample.num_response_tokens - turn_start
            remaining = params.max_new_tokens - done
            if remaining <= 0:
                return TurnOutput(finish_reason=FinishReason.LENGTH, num_tokens=done,
                                  num_interrupts=interrupts)
            try:
                once = await self._generate_once(
                    sample, replace(params, max_new_tokens=remaining, seed=seed), failed_on,
                    deadline, on_tokens)
            except NoEngineAlive as e:
                self.fatal = self.fatal or str(e)
                return None
            if once is None:  # cancelled while it waited for an engine
                return None
            out, out_of_time = once
            sample.append_policy_tokens(out.token_ids, out.logprobs, out.versions, out.routing)
            done += len(out.token_ids)
            if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) or out_of_time:
                return TurnOutput(finish_reason=out.finish_reason, num_tokens=done,
                                  num_interrupts=interrupts, out_of_time=out_of_time)
            if out.finish_reason is FinishReason.ERROR:
                self.lifecycle.move(sample, SampleStatus.FAILED, f"engine error: {out.error}")
                return None
            # ABORT: interrupted at a token boundary (weight update, cancel) or an engine fault
            failures = 0 if out.token_ids else failures
            if out.engine_fault:  # tried again elsewhere, with the tokens it brought
                self.stats.num_engine_failures += 1
                failed_on.add(sample.engine_id or "")
                failures += not out.token_ids
                if failures >= MAX_ENGINE_RETRIES:
                    self.lifecycle.move(sample, SampleStatus.FAILED,
                                        f"engine failed {failures} times: {out.error}")
                    return None
            sample.num_interrupts += 1
            interrupts += 1
            self.lifecycle.move(sample, SampleStatus.INTERRUPTED)
            self.stats.num_interrupts += 1
            if sample.group_id not in self._cancelled:
                self.stats.num_resumes += 1

    async def _generate_once(self, sample: Sample, params: SamplingParams, avoid: set[str],
                             deadline: float | None = None, on_tokens: OnTokens | None = None,
                             ) -> tuple[GenerateOutput, bool] | None:
        """One request, on an engine not in ``avoid`` while another may take it; (its output,
        whether it was interrupted at ``deadline``); None when its group was cancelled while
        it waited for an engine."""
        def ask() -> tuple[tuple[float, ...], float]:  # asked when the queue decides
            done = sample.num_response_tokens
            size, fresh = self.predictor.rank(sample)
            left = self.predictor.predict(sample) - done
            return (size - done, fresh), float(min(max(left, 1.0), params.max_new_tokens))

        self.predictor.predict(sample)  # its first prediction, for len_pred_err in any mode
        engine, grant = await self._pick_engine(ask, sample, avoid)
        if sample.group_id in self._cancelled:
            if grant is not None:
                self.queue.release(grant)  # type: ignore[union-attr]
            return None
        self.predictor.started(sample)
        request_id = f"{sample.uid}@{next(self._ids)}"
        slot = self._take_slot()
        self.in_flight[request_id] = InFlight(
            sample=sample, engine=engine, slot=slot, t_start_s=self.clock.now(),
            version_start=engine.stats().version, grant=grant)
        self.router.load.add(engine, 1)
        self._idle.clear()
        self.lifecycle.move(sample, SampleStatus.RUNNING)
        sample.engine_id = engine.engine_id
        self.stats.num_requests += 1
        request = GenerateRequest(request_id=request_id, params=params, episode_id=sample.uid,
                                  prompt_ids=sample.served_ids(), on_tokens=on_tokens)
        out_of_time = False
        try:
            if deadline is None:
                out = await engine.generate(request)
            else:
                task = asyncio.ensure_future(engine.generate(request))
                timeout = max(0.0, deadline - self.clock.now())
                finished, _ = await asyncio.wait({task}, timeout=timeout)
                if not finished:
                    out_of_time = True
                    if engine.stats().health is not EngineHealth.DEAD:
                        await engine.interrupt([request_id])
                out = await task
        except Exception as e:  # noqa: BLE001 - fault boundary: an engine that raises failed this attempt
            out = GenerateOutput(request_id=request_id, token_ids=[], logprobs=[], versions=[],
                                 finish_reason=FinishReason.ABORT,
                                 error=f"engine {engine.engine_id} raised {e!r}")
        finally:
            info = self.in_flight.pop(request_id)
            self.router.load.add(engine, -1)
            self._free_slots.append(slot)
            if grant is not None:
                self.queue.release(grant)  # type: ignore[union-attr]
            if not self.in_flight:
                self._idle.set()
        self.stats.generated_tokens += len(out.token_ids)
        self.router.observe(engine, out)
        outcome = _OUTCOME.get(out.finish_reason, "done")
        self.span(
            sample_uid=sample.uid, engine_id=engine.engine_id, slot=info.slot,
            t_start_s=info.t_start_s, t_end_s=self.clock.now(),
            version_start=out.versions[0] if out.versions else info.version_start,
            version_end=out.versions[-1] if out.versions else info.version_start,
            num_tokens=len(out.token_ids), outcome=outcome,
        )
        return out, out_of_time and out.finish_reason is FinishReason.ABORT

    # ---- groups ------------------------------------------------------------------------
    async def run_group(self, group: Group, params: SamplingParams | None = None, *,
                        on_graded: Callable[[Group, Sample], Awaitable[None]] | None = None,
                        ) -> Group:
        """Dispatch every sample of ``group`` on its own; grade each as soon as it finishes,
        or, when the source's reward is a group reward, grade the generated ones together
        once every sample has finished. ``on_graded(group, sample)`` hears of each sample
        graded one at a time (it may cancel the group).

        A group restored from a checkpoint goes on where each sample stood: a partial sample
        continues from its tokens, a generated one is graded, a graded or terminal one waits."""
        for s in group.samples:
            if not s.status.is_terminal():
                self.lifecycle.open(s)
        together = self.grading.together(group.task)

        async def one(s: Sample) -> None:
            if s.status in (SampleStatus.PENDING, SampleStatus.INTERRUPTED):
                await self.run_sample(s, params)
            if (not together and s.status is SampleStatus.GENERATED
                    and group.group_id not in self._cancelled):
                await self.grading.sample(s)
                if on_graded is not None:
                    await on_graded(group, s)

        await asyncio.gather(*(one(s) for s in group.samples))
        if together and group.group_id not in self._cancelled:
            await self.grading.group(group)
        return group

    async def cancel(self, group_ids: Iterable[str]) -> None:
        """Give up on groups: interrupt their requests at the next token boundary and never
        resubmit them. Their ``run_group`` calls return with the samples not yet terminal."""
        ids = set(group_ids)
        self._cancelled |= ids
        await self.interrupt([rid for rid, f in self.in_flight.items()
                              if f.sample.group_id in ids])

    async def drain(self, engine_id: str) -> int:
        """Preempt ``engine_id``: route nothing more to it and interrupt its requests at a
        token boundary. Each returns its partial tokens (exact versions) and its sample
        continues on another engine, or waits for one. Returns the requests handed back."""
        engine = self.router.engine(engine_id)
        self.router.drained.add(engine_id)
        ids = [rid for rid, f in self.in_flight.items() if f.engine is engine]
        if ids and engine.stats().health is not EngineHealth.DEAD:
            await engine.interrupt(ids)
        return len(ids)

    def undrain(self, engine_id: str) -> None:
        """Route to ``engine_id`` again."""
        self.router.engine(engine_id)
        self.router.drained.discard(engine_id)
        if self.queue is not None:
            self.queue.wake()

    def engine_table(self) -> list[dict[str, object]]:
        return self.router.table()

    def gauges(self) -> dict[str, float]:
        """For the step metrics: ``len_pred_err`` (mean ``|predicted - actual| / actual`` of
        the samples finished since the last call, when any), ``dispatch_waiting`` (requests
        waiting in the dispatch queue) and, with adaptive concurrency, ``concurrency_mean``
        (the engines' current request limits, averaged); with prefix affinity, ``spills``
        (requests sent away from the engine holding most of their prefix, so far)."""
        out: dict[str, float] = {"spills": float(self.router.num_spills)} \
            if self.router.prefix_affinity else {}
        errors = self.predictor.take_errors()
        if errors:
            out["len_pred_err"] = sum(errors) / len(errors)
        if self.queue is not None:
            out["dispatch_waiting"] = float(self.queue.num_waiting)
            if self.queue.limits:
                limits = [c.limit for c in self.queue.limits.values()]
                out["concurrency_mean"] = sum(limits) / len(limits)
        return out

    def forget(self, group_id: str) -> None:
        """A group's life is over: drop what the dispatcher kept of it."""
        self._cancelled.discard(group_id)
        self.router.home.pop(group_id, None)
        self.predictor.forget(group_id)

    def cancelled(self, group_id: str) -> bool:
        return group_id in self._cancelled

    async def interrupt(self, request_ids: Sequence[str] | None = None) -> None:
        """Interrupt requests (all when None) on every live engine at the next token boundary."""
        engines = self.live_engines()
        if request_ids is None:
            await asyncio.gather(*(e.interrupt(None) for e in engines))
            return
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            if (f := self.in_flight.get(rid)) is not None:
                by_engine.setdefault(id(f.engine), []).append(rid)
        await asyncio.gather(
            *(e.interrupt(by_engine[id(e)]) for e in engines if id(e) in by_engine))
