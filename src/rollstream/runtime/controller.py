"""The controller: one loop whose modes are settings.

Named asyncio loops, joined by the buffer and the admission capacity::

    admit ──(StalenessCapacity: room for a group?)──> Group ──> Dispatcher.run_group
      ^                                                   (each sample its own request;
      |                                                    graded as it finishes)
      | set_version(v)                                          |
    sync  <── publish(v+1) ── train <── buffer.take(G) <── group done: filter / buffer
    (interrupt | continue | drain, then load weights)

Modes are settings of this one loop: ``sync`` is staleness 0 (one batch per version, exactly
on-policy); ``one_step`` is staleness 1 (rollout of step s+1 overlaps training of step s);
``async`` is staleness ``max_staleness``.
Staleness counts the tokens the loss keeps: all of a sample's tokens, or with
``train.max_token_age`` only those the trainer does not mask as too old (so a long sample
resumed across many updates trains on its recent tokens instead of being dropped; a sample
whose every token is too old is DROPPED_STALE, its reward still in its group's baseline).
Partial rollout picks the sync policy (interrupt or continue in place), otherwise in-flight
samples drain on the old weights first. A loop that dies cancels the others and the run
stops with its traceback (asyncio.TaskGroup); nothing is fire-and-forget.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollstream.clock import Clock
from rollstream.config import RolloutConfig, TrainConfig
from rollstream.data.buffer import (
    TrajectoryBuffer,
    group_min_version,
    group_staleness,
    group_too_old,
)
from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import SamplingParams
from rollstream.rollout.admission import StalenessCapacity
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.sync.weights import WeightSync
from rollstream.trajectory import Group, SampleStatus, Task


class TaskStream(Protocol):
    def next_task(self) -> Task: ...


class TrainerLike(Protocol):
    def step(self, groups: Sequence[Group], step: int) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...


class MetricsLike(Protocol):
    def record(self, kind: str, step: int, values: dict[str, float]) -> None: ...

    def observe(self, name: str, value: float) -> None: ...


@dataclass(slots=True, kw_only=True)
class StepLog:
    step: int
    values: dict[str, float]


@dataclass(slots=True, kw_only=True)
class ControllerResult:
    steps_done: int
    trained_samples: int
    history: list[StepLog] = field(default_factory=list)


def staleness_settings(cfg: RolloutConfig) -> tuple[int, str]:
    """(max_staleness, weight-sync policy) for a rollout config."""
    k = {"sync": 0, "one_step": 1}.get(cfg.mode, cfg.max_staleness)
    policy = cfg.on_update if cfg.partial_rollout else "drain"
    return k, policy


class Controller:
    def __init__(
        self,
        *,
        rollout: RolloutConfig,
        train: TrainConfig,
        tasks: TaskStream,
        dispatcher: Dispatcher,
        trainer: TrainerLike,
        ledger: Ledger,
        metrics: MetricsLike,
        clock: Clock,
        on_step: Any = None,
        max_wall_s: float | None = None,
    ) -> None:
        self.cfg, self.train_cfg = rollout, train
        self.tasks, self.dispatcher, self.trainer = tasks, dispatcher, trainer
        self.ledger, self.metrics, self.clock = ledger, metrics, clock
        self.on_step = on_step or (lambda step, values: None)
        self.max_wall_s = max_wall_s
        self.k, policy = staleness_settings(rollout)
        self.max_token_age = train.max_token_age
        self.capacity = StalenessCapacity(
            groups_per_step=train.groups_per_step, max_staleness=self.k,
            total_groups=train.steps * train.groups_per_step,
        )
        self.sync = WeightSync(dispatcher, policy, self._on_applied)  # type: ignore[arg-type]
        self.buffer = TrajectoryBuffer()
        self.version = 0  # optimizer steps done = newest published weight version
        self.live: dict[str, Group] = {}
        self._train_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        self._tg: asyncio.TaskGroup | None = None
        self._last_sync_s = 0.0
        self._t_run = time.perf_counter()
        self._last_rollout: tuple[float, int, float] | None = None
        self._pass: dict[str, list] = {}  # source -> [reward sum, graded samples] since last step

    # ---- the top-level loop --------------------------------------------------------------
    async def run(self) -> ControllerResult:
        result = ControllerResult(steps_done=0, trained_samples=0)
        self._t_run = time.perf_counter()
        # rollout rates count only this run's generation (not an evaluation before it)
        busy = sum(e.stats().busy_s for e in self.dispatcher.engines)
        self._last_rollout = (self._t_run, self.dispatcher.stats.generated_tokens, busy)
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            sync = tg.create_task(self.sync.run(), name="sync")
            admit = tg.create_task(self._admit_loop(), name="admit")
            await self._train_loop(result)
            admit.cancel()
            await self._stop_rollouts()
            sync.cancel()
        self._train_pool.shutdown(wait=True)
        return result

    async def _admit_loop(self) -> None:
        assert self._tg is not None
        while True:
            n = await self.capacity.wait_for_room()
            await self.dispatcher.gate.wait()
            self.capacity.admit(n)
            for i in range(self.capacity.num_admitted - n, self.capacity.num_admitted):
                # k = admission index: a task drawn again (a dataset epoch) gets a new group id
                group = Group.new(self.tasks.next_task(), self.cfg.group_size, k=i)
                self.live[group.group_id] = group
                self._tg.create_task(self._group_life(group), name=f"group {group.group_id}")

    async def _group_life(self, group: Group) -> None:
        await self.dispatcher.run_group(group)
        self.live.pop(group.group_id, None)
        now = self.clock.now()
        if self.dispatcher.is_doomed(group.group_id):
            for s in group.samples:
                if not s.status.is_terminal():
                    self.ledger.record(s, self._doom_status(group), self._doom_reason(group), now)
            self.capacity.retire()
            return
        graded = [s for s in group.samples if s.status is SampleStatus.GRADED]
        tally = self._pass.setdefault(group.task.source, [0.0, 0])
        for s in graded:
            tally[0] += float(s.reward or 0.0)
            tally[1] += 1
        if not graded or (self.cfg.filter_zero_variance and len({s.reward for s in graded}) == 1):
            for s in graded:
                self.ledger.record(s, SampleStatus.FILTERED,
                                   "zero reward variance in group" if graded else None, now)
            self.capacity.retire()
            return
        self.buffer.put(group)

    async def _train_loop(self, result: ControllerResult) -> None:
        t_start = time.perf_counter()
        g = self.train_cfg.groups_per_step
        for step in range(self.train_cfg.steps):
            if self.max_wall_s is not None and time.perf_counter() - t_start > self.max_wall_s:
                break
            t0 = time.perf_counter()
            batch = await self._take_batch(g)
            wait_s = time.perf_counter() - t0
            values = await asyncio.get_running_loop().run_in_executor(
                self._train_pool, self.trainer.step, batch, self.version
            )
            self._mark_trained(batch, step)
            self.version += 1
            self.sync.publish(self.version, self.trainer.state_dict())
            await self._drop_doomed()
            values = {**values, **self._batch_stats(batch), "wait_s": wait_s,
                      "train_s": time.perf_counter() - t0 - wait_s}
            rollout = self._rollout_stats()
            self.metrics.record("rollout", step, rollout)
            values["gen_tok_s"] = rollout["gen_tok_s"]
            result.steps_done = step + 1
            result.trained_samples += int(values["trained_samples"])
            result.history.append(StepLog(step=step, values=values))
            self.metrics.record("train", step, values)
            self.on_step(step, values)
        await self.sync.wait_applied()

    async def _take_batch(self, n: int) -> list[Group]:
        while True:
            batch, stale = await self.buffer.take(n, self.version, self.k, self.max_token_age)
            for group in stale:
                self._record_group(group, SampleStatus.DROPPED_STALE, self._stale_reason(group))
                self.capacity.retire()
            if batch:
                return batch

    def _mark_trained(self, batch: list[Group], step: int) -> None:
        now = self.clock.now()
        m = self.max_token_age
        for group in batch:
            for s in group.samples:
                if s.status is not SampleStatus.GRADED:
                    continue
                if s.too_old(self.version, m):  # the loss kept none of its tokens
                    self.ledger.record(s, SampleStatus.DROPPED_STALE, (
                        f"every token older than max_token_age {m} (trainer step "
                        f"{self.version}); reward used in the group baseline only"), now)
                    continue
                s.trained_at_step = step
                s.min_trained_version = s.min_version(None if m is None else self.version - m)
                s.num_trained_tokens = s.num_kept_tokens(self.version, m)
                self.metrics.observe("staleness", float(s.staleness(self.version, m)))
                self.ledger.record(s, SampleStatus.TRAINED, None, now)

    def _batch_stats(self, batch: list[Group]) -> dict[str, float]:
        samples = [s for g in batch for s in g.samples if s.status is SampleStatus.TRAINED]
        stale = [s.staleness(self.version - 1, self.max_token_age) for s in samples]
        return {
            "trained_samples": float(len(samples)),
            "reward_mean": statistics.fmean(s.reward or 0.0 for s in samples) if samples else 0.0,
            "staleness_mean": statistics.fmean(stale) if stale else 0.0,
            "staleness_max": float(max(stale, default=0)),
            "len_mean": statistics.fmean(s.num_response_tokens for s in samples) if samples else 0.0,
            "version": float(self.version),
        }

    def _rollout_stats(self) -> dict[str, float]:
        """Generation since the previous call: throughput, engine busy share, queue depths."""
        now = time.perf_counter()
        st = self.dispatcher.stats
        engines = [e.stats() for e in self.dispatcher.engines]
        busy = sum(e.busy_s for e in engines)
        last_t, last_tokens, last_busy = self._last_rollout or (self._t_run, 0, 0.0)
        dt = max(now - last_t, 1e-9)
        self._last_rollout = (now, st.generated_tokens, busy)
        out = {
            "gen_tok_s": (st.generated_tokens - last_tokens) / dt,
            "engine_busy": (busy - last_busy) / dt / len(engines),
            "in_flight": float(len(self.dispatcher.in_flight)),
            "queued": float(sum(e.num_waiting for e in engines)),
            "interrupts": float(st.num_interrupts),
            "resumes": float(st.num_resumes),
            "engine_failures": float(st.num_engine_failures),
            "live_groups": float(len(self.live)),
            "buffered_groups": float(len(self.buffer)),
        }
        for src, lengths in st.per_source_tokens.items():
            out[f"len_mean/{src}"] = statistics.fmean(lengths[-256:])
        for src, (total, n) in self._pass.items():
            if n:
                out[f"pass_rate/{src}"] = total / n
        self._pass.clear()
        return out

    # ---- weight versions and staleness ---------------------------------------------------
    async def _on_applied(self, version: int, sync_s: float) -> None:
        self._last_sync_s = sync_s
        self.metrics.record("phase", version, {"sync_s": sync_s})
        self.capacity.set_version(version)

    async def _drop_doomed(self) -> None:
        """Live groups whose oldest token is already too old can never be trained: stop them.
        (With ``max_token_age`` old tokens are masked, not fatal: live groups run on, and the
        buffer's check decides when the group is trained.)"""
        if self.max_token_age is not None:
            return
        limit = self.version - self.k
        doomed = [g for g in self.live.values() if group_min_version(g) < limit
                  and any(s.min_version() is not None for s in g.samples)]
        request_ids = [rid for g in doomed for rid in self.dispatcher.doom(g.group_id)]
        if request_ids:
            await self.dispatcher.interrupt(request_ids)

    def _doom_status(self, group: Group) -> SampleStatus:
        return SampleStatus.ABORTED if self._stopping else SampleStatus.DROPPED_STALE

    def _doom_reason(self, group: Group) -> str:
        if self._stopping:
            return "run ended before the sample was trained"
        return self._stale_reason(group)

    def _stale_reason(self, group: Group) -> str:
        m = self.max_token_age
        if group_too_old(group, self.version, m):
            return f"every token older than max_token_age {m} (trainer step {self.version})"
        return (f"staleness {group_staleness(group, self.version, m)} > max_staleness {self.k} "
                f"(oldest token version {group_min_version(group)}, trainer step {self.version})")

    def _record_group(self, group: Group, status: SampleStatus, reason: str) -> None:
        now = self.clock.now()
        for s in group.samples:
            if not s.status.is_terminal():
                self.ledger.record(s, status, reason, now)

    # ---- shutdown ------------------------------------------------------------------------
    _stopping = False

    async def _stop_rollouts(self) -> None:
        """End of run: interrupt what is in flight; every leftover sample is ABORTED."""
        self._stopping = True
        for gid in list(self.live):
            self.dispatcher.doom(gid)
        self.dispatcher.gate.set()
        await self.dispatcher.interrupt(None)
        while self.live:
            await asyncio.sleep(0.01)
            await self.dispatcher.interrupt(None)
        for group in self.buffer.drain():
            self._record_group(group, SampleStatus.ABORTED, "run ended before the sample was trained")
