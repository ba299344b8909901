"""Sample-level dispatch: every sample is its own engine request.

No batch or prompt barrier: a group's samples go to the engines independently, each is graded
the moment it finishes, and the group completes when its last sample is graded. An engine
slot that frees is refilled by whichever sample comes next.

A sample's life here (``run_sample``)::

    wait for the gate -> pick an engine (least load) -> generate(prompt + tokens so far)
      STOP/LENGTH -> GENERATED -> grade -> GRADED
      ABORT       -> interrupted by a weight update or a dying engine: keep the partial
                     tokens and their versions, resubmit (partial rollout)
      ERROR       -> FAILED with the engine's reason

The ``gate`` is closed by the weight sync while it swaps weights, so no request is submitted
against half-published weights. Invariant (tested): every dispatched sample reaches the ledger
exactly once, across interruptions, engine failures, filtering and the end of the run.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from rollstream.clock import Clock
from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import (
    Engine,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
)
from rollstream.reward.pool import GraderPool
from rollstream.trajectory import Group, Sample, SampleStatus

MAX_ENGINE_RETRIES = 3  # consecutive failed attempts without progress before a sample FAILS


@dataclass(slots=True, kw_only=True)
class InFlight:
    sample: Sample
    engine: Engine
    slot: int
    t_start_s: float
    version_start: int


@dataclass(slots=True, kw_only=True)
class DispatchStats:
    num_requests: int = 0
    num_interrupts: int = 0
    num_resumes: int = 0
    num_engine_failures: int = 0
    generated_tokens: int = 0
    per_source_tokens: dict[str, list[int]] = field(default_factory=dict)


SpanSink = Callable[..., None]


class Dispatcher:
    def __init__(
        self,
        *,
        engines: Sequence[Engine],
        params: SamplingParams,
        graders: GraderPool,
        decode: Callable[[list[int]], str],
        ledger: Ledger,
        clock: Clock,
        span: SpanSink | None = None,
    ) -> None:
        if not engines:
            raise ValueError("at least one engine is needed")
        self.engines = list(engines)
        self.params = params
        self.graders = graders
        self.decode = decode
        self.ledger = ledger
        self.clock = clock
        self.span = span or (lambda **_: None)
        self.gate = asyncio.Event()
        self.gate.set()
        self.in_flight: dict[str, InFlight] = {}
        self.stats = DispatchStats()
        self._doomed: set[str] = set()  # group ids the controller gave up on
        self._load = {id(e): 0 for e in self.engines}
        self._free_slots: list[int] = []
        self._next_slot = itertools.count()
        self._ids = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- routing -----------------------------------------------------------------------
    def _pick_engine(self) -> Engine:
        return min(self.engines, key=lambda e: self._load[id(e)])

    def _take_slot(self) -> int:
        return self._free_slots.pop() if self._free_slots else next(self._next_slot)

    # ---- one sample --------------------------------------------------------------------
    async def run_sample(self, sample: Sample, params: SamplingParams | None = None) -> None:
        """Generate ``sample`` to completion (GENERATED) or to a recorded terminal status."""
        params = params or self.params
        failures = 0
        sample.t_dispatch_s = self.clock.now()
        while True:
            await self.gate.wait()
            if sample.group_id in self._doomed:
                return
            done = sample.num_response_tokens
            remaining = params.max_new_tokens - done
            if remaining <= 0:
                sample.finish_reason = "length"
                break
            out = await self._generate_once(sample, replace(params, max_new_tokens=remaining))
            sample.append_policy_tokens(out.token_ids, out.logprobs, out.versions)
            if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                sample.finish_reason = out.finish_reason.value
                break
            if out.finish_reason is FinishReason.ERROR:
                self.ledger.record(sample, SampleStatus.FAILED, f"engine error: {out.error}",
                                   self.clock.now())
                return
            # ABORT: interrupted at a token boundary (weight update, drop, or a dead engine)
            if out.error:
                self.stats.num_engine_failures += 1
                failures = failures + 1 if not out.token_ids else 0
                if failures >= MAX_ENGINE_RETRIES:
                    self.ledger.record(sample, SampleStatus.FAILED,
                                       f"engine failed {failures} times: {out.error}", self.clock.now())
                    return
            sample.num_interrupts += 1
            sample.status = SampleStatus.INTERRUPTED
            self.stats.num_interrupts += 1
            if sample.group_id not in self._doomed:
                self.stats.num_resumes += 1
        sample.status = SampleStatus.GENERATED
        sample.t_generated_s = self.clock.now()
        self.stats.per_source_tokens.setdefault(sample.task.source, []).append(
            sample.num_response_tokens
        )

    async def _generate_once(self, sample: Sample, params: SamplingParams) -> GenerateOutput:
        engine = self._pick_engine()
        request_id = f"{sample.uid}@{next(self._ids)}"
        version = engine.stats().version
        slot = self._take_slot()
        self.in_flight[request_id] = InFlight(
            sample=sample, engine=engine, slot=slot, t_start_s=self.clock.now(),
            version_start=version,
        )
        self._load[id(engine)] += 1
        self._idle.clear()
        sample.status = SampleStatus.RUNNING
        sample.engine_id = engine.engine_id
        self.stats.num_requests += 1
        try:
            out = await engine.generate(
                GenerateRequest(
                    request_id=request_id,
                    prompt_ids=list(sample.task.prompt_ids) + sample.response_ids,
                    params=params,
                )
            )
        finally:
            info = self.in_flight.pop(request_id)
            self._load[id(engine)] -= 1
            self._free_slots.append(slot)
            if not self.in_flight:
                self._idle.set()
        self.stats.generated_tokens += len(out.token_ids)
        outcome = {FinishReason.ABORT: "interrupted", FinishReason.ERROR: "failed"}.get(
            out.finish_reason, "done"
        )
        self.span(
            sample_uid=sample.uid, engine_id=engine.engine_id, slot=info.slot,
            t_start_s=info.t_start_s, t_end_s=self.clock.now(),
            version_start=out.versions[0] if out.versions else info.version_start,
            version_end=out.versions[-1] if out.versions else info.version_start,
            num_tokens=len(out.token_ids), outcome=outcome,
        )
        return out

    async def grade(self, sample: Sample) -> None:
        """Score a GENERATED sample; a failing reward marks it FAILED with the reason."""
        text = self.decode(sample.response_ids)
        result = await self.graders.grade(sample.task, text)
        if result.error is not None:
            self.ledger.record(sample, SampleStatus.FAILED, f"reward: {result.error}",
                               self.clock.now())
            return
        sample.reward = result.reward
        sample.status = SampleStatus.GRADED
        sample.t_graded_s = self.clock.now()

    # ---- groups ------------------------------------------------------------------------
    async def run_group(self, group: Group, params: SamplingParams | None = None) -> Group:
        """Dispatch every sample of ``group`` on its own; grade each as soon as it finishes."""
        for s in group.samples:
            self.ledger.open(s)

        async def one(s: Sample) -> None:
            await self.run_sample(s, params)
            if s.status is SampleStatus.GENERATED and group.group_id not in self._doomed:
                await self.grade(s)

        await asyncio.gather(*(one(s) for s in group.samples))
        return group

    def doom(self, group_id: str) -> list[str]:
        """Give up on a group: its requests are to be interrupted and not resumed."""
        self._doomed.add(group_id)
        return [rid for rid, f in self.in_flight.items() if f.sample.group_id == group_id]

    def is_doomed(self, group_id: str) -> bool:
        return group_id in self._doomed

    async def interrupt(self, request_ids: Sequence[str] | None = None) -> None:
        """Interrupt requests (all when None) on every engine at the next token boundary."""
        if request_ids is None:
            await asyncio.gather(*(e.interrupt(None) for e in self.engines))
            return
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            if (f := self.in_flight.get(rid)) is not None:
                by_engine.setdefault(id(f.engine), []).append(rid)
        await asyncio.gather(
            *(e.interrupt(by_engine[id(e)]) for e in self.engines if id(e) in by_engine)
        )

    async def wait_idle(self) -> None:
        await self._idle.wait()
