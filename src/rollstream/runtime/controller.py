"""The controller: one loop whose modes are settings.

Named asyncio loops, joined by the rollout's buffer and admission capacity::

    admit_forever ──> groups ──> Dispatcher ──> engines          (rollout/rollout.py)
          ^                                          ^
          | on_version(v)                            | load v (interrupt | continue | drain)
    WeightSync.run  <──── publish(v+1) ──── train loop: take(G) -> trainer.step -> on_trained
    EngineSupervisor.run: an engine whose loop died is revived at the current version
    Autoscaler.run: engines join and leave by runtime.autoscale (runtime/autoscale.py)

Modes are settings of this one loop (the staleness policy and the sync policy, both chosen
when the run is built): ``sync`` is staleness 0 (one batch per version, exactly on-policy),
``one_step`` 1, ``async`` ``max_staleness``. The controller decides nothing about groups or
tokens; it runs the loops, times the steps and ends the run: after ``steps``, at
``max_wall_s`` (enforced while waiting for a batch, not only between steps), or when the
rollout reports it cannot feed the trainer (``RolloutStopped``: no engine alive, a stream of
untrainable groups), with that diagnostic as the result's ``stop_reason``, or on
:meth:`Controller.request_stop` (SIGTERM: while waiting for a batch it stops at once, during a
trainer step after it). A loop that dies cancels the others and the run stops with its
traceback (asyncio.TaskGroup). A resumed run starts at ``start_step``; ``after_step`` runs
after each step (a run's evaluations and checkpoints: runtime/steps.py), ``before_stop`` after
the last one, while the rollout still holds its in-flight samples (the final durable
checkpoint). The controller is built whole: everything it runs, these included, is given to
its constructor. Right after it publishes version ``v`` the controller hands the boundary to
``reconfigure`` (runtime/reconfigure.py), which applies the changes due at step ``v`` before
any group is admitted under ``v``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from rollstream.clock import Clock, WallClock
from rollstream.monitor.rollout_meter import RolloutMeter, busy_by_engine, busy_share
from rollstream.rollout.rollout import Rollout, RolloutStopped
from rollstream.rollout.supervisor import EngineSupervisor
from rollstream.staleness import age
from rollstream.sync.weights import WeightSync
from rollstream.trajectory import Group, Sample, SegmentKind, StepResult


class TrainerLike(Protocol):
    def step(self, groups: Sequence[Group], step: int) -> StepResult: ...

    def state_dict(self) -> dict[str, Any]: ...


class MetricsLike(Protocol):
    def record(self, kind: str, step: int, values: dict[str, float]) -> None: ...

    def observe(self, name: str, value: float) -> None: ...


class Loops(Protocol):
    async def run(self) -> None:
        """A loop of the run's (until cancelled)."""


class Boundary(Protocol):
    """What runs when weight version ``version`` is published, before the next step begins
    (the run's reconfiguration, runtime/reconfigure.py)."""

    async def at_boundary(self, version: int) -> None: ...


@dataclass(slots=True, kw_only=True)
class ControllerResult:
    steps_done: int = 0
    trained_samples: int = 0
    stop_reason: str | None = None  # why the run ended before its steps; None = all done
    stalled: bool = False  # it ended because it could not train (stop_reason says why)


AfterStep = Callable[[int, dict[str, float]], Awaitable[None]]
BeforeStop = Callable[["ControllerResult"], Awaitable[None]]
TrainerTurn = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


def trainer_thread() -> ThreadPoolExecutor:
    """The one thread trainer steps (and, between them, checkpoints) run on."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")


class Controller:
    def __init__(self, *, rollout: Rollout, trainer: TrainerLike, sync: WeightSync,
                 meter: RolloutMeter, metrics: MetricsLike, steps: int, groups_per_step: int,
                 max_wall_s: float | None = None, after_step: AfterStep | None = None,
                 before_stop: BeforeStop | None = None, start_step: int = 0,
                 supervisor: EngineSupervisor | None = None, clock: Clock | None = None,
                 reconfigure: Boundary | None = None, trainer_turn: TrainerTurn | None = None,
                 train_pool: Executor | None = None,
                 training: threading.Event | None = None,
                 autoscaler: Loops | None = None) -> None:
        """``trainer_turn``: entered around each trainer step (colocated placement: the
        engines stop for it; runtime/placement.py); None: they run on. ``train_pool``: where
        trainer steps run (:func:`trainer_thread` if None; the simulator's costs virtual
        time), shut down when :meth:`run` ends. ``training``: set while a trainer step
        computes (the local engine's pass recorder reads it from its thread: passes that
        overlap training are binned apart, sim/calibrate.py). ``supervisor``: revives dead
        engines; None: nothing does (simulated engines never die). ``autoscaler``: adds and
        removes engines as the run goes (runtime/autoscale.py); None: nothing does."""
        self.rollout, self.trainer, self.sync = rollout, trainer, sync
        self.meter, self.metrics = meter, metrics
        self.steps, self.groups_per_step, self.max_wall_s = steps, groups_per_step, max_wall_s
        self.start_step = start_step
        self.supervisor, self.autoscaler = supervisor, autoscaler
        self.clock = clock or WallClock()  # times wait_s / train_s (virtual in `sim`)
        self.after_step, self.before_stop = after_step, before_stop
        self.reconfigure = reconfigure
        self.trainer_turn = trainer_turn or contextlib.nullcontext
        self.train_pool = train_pool if train_pool is not None else trainer_thread()
        self.training = training if training is not None else threading.Event()
        self._stop_reason: str | None = None
        self._waiting: asyncio.Timeout | None = None

    def request_stop(self, reason: str) -> None:
        """End the run at the next step boundary (now, if it is waiting for a batch)."""
        self._stop_reason = self._stop_reason or reason
        if self._waiting is not None:
            self._waiting.reschedule(asyncio.get_running_loop().time())

    async def run(self) -> ControllerResult:
        result = ControllerResult()
        self.meter.start()
        try:
            async with asyncio.TaskGroup() as tg:
                loops = [tg.create_task(self.sync.run(), name="sync")]
                if self.supervisor is not None:
                    loops.append(tg.create_task(self.supervisor.run(), name="supervisor"))
                if self.autoscaler is not None:
                    loops.append(tg.create_task(self.autoscaler.run(), name="autoscale"))
                tg.create_task(self.rollout.admit_forever(), name="admit")
                try:
                    await self._train_loop(result)
                    if self.before_stop is not None:
                        await self.before_stop(result)
                finally:
                    await self.rollout.stop()
                    for task in loops:
                        task.cancel()
        finally:
            self.train_pool.shutdown(wait=True)
        return result

    async def in_trainer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the trainer's thread (between steps: checkpoints)."""
        return await asyncio.get_running_loop().run_in_executor(self.train_pool, fn, *args)

    def _engines_busy_s(self) -> dict[str, float]:
        return busy_by_engine(e.stats() for e in self.rollout.dispatcher.engines)

    async def _train_loop(self, result: ControllerResult) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if self.max_wall_s is None else loop.time() + self.max_wall_s
        result.steps_done = self.start_step
        for step in range(self.start_step, self.steps):
            t0 = self.clock.now()
            try:
                if self._stop_reason is not None or (deadline is not None
                                                     and loop.time() >= deadline):
                    raise TimeoutError
                async with asyncio.timeout_at(deadline) as self._waiting:
                    batch = await self.rollout.take(self.groups_per_step, step)
            except TimeoutError:
                result.stop_reason = (self._stop_reason
                                      or f"max_wall_s = {self.max_wall_s:g} s reached")
                break
            except RolloutStopped as e:
                result.stop_reason, result.stalled = str(e), True
                break
            finally:
                self._waiting = None
            wait_s = self.clock.now() - t0
            async with self.trainer_turn():
                busy0 = self._engines_busy_s()
                self.training.set()
                try:
                    out = await self.in_trainer(self.trainer.step, batch, step)
                finally:
                    self.training.clear()
            step_s = self.clock.now() - t0 - wait_s
            busy = busy_share(busy0, self._engines_busy_s(), step_s)  # engines may join, leave
            trained = await self.rollout.on_trained(batch, step, out)
            self.sync.publish(step + 1, self.trainer.state_dict())
            values = {**out.metrics, **_batch_stats(trained, step), **self.rollout.step_stats(),
                      "wait_s": wait_s, "train_s": self.clock.now() - t0 - wait_s,
                      # engines' busy share while the step computed (the trainer's
                      # contention with them: sim/calibrate.py); at most 1: an engine credits
                      # a pass when it ends, one begun before the step counts in full
                      "engine_busy_in_train": min(1.0, busy)}
            for s in trained:
                if s.min_trained_version is not None:
                    self.metrics.observe("staleness", float(age(step, s.min_trained_version)))
            rollout = self.meter.read()
            self.metrics.record("rollout", step, rollout)
            values["gen_tok_s"] = rollout["gen_tok_s"]
            result.steps_done = step + 1
            result.trained_samples += len(trained)  # by this process
            self.metrics.record("train", step, values)
            if self.reconfigure is not None:  # nothing awaited since the publish
                await self.reconfigure.at_boundary(step + 1)
            if self.after_step is not None:
                await self.after_step(step, values)
        await self.sync.wait_applied()


def _batch_stats(trained: list[Sample], step: int) -> dict[str, float]:
    n = len(trained)
    stale = [age(step, s.min_trained_version) for s in trained
             if s.min_trained_version is not None]
    return {
        "trained_samples": float(n),
        "reward_mean": sum(s.reward or 0.0 for s in trained) / n if n else 0.0,
        "staleness_mean": sum(stale) / len(stale) if stale else 0.0,
        "staleness_max": float(max(stale, default=0)),
        "len_mean": sum(s.num_response_tokens for s in trained) / n if n else 0.0,
        "version": float(step + 1),
        **_episode_stats(trained),
    }


def _episode_stats(trained: list[Sample]) -> dict[str, float]:
    """Agent episodes of the batch: model turns and tool time per episode, and the share of
    their tokens the model produced (the rest is the environment's, masked)."""
    episodes = [s for s in trained if s.turns]
    if not episodes:
        return {}
    n = len(episodes)
    model_turns = [t for s in episodes for t in s.turns if t.kind is SegmentKind.POLICY]
    tool_s = sum(r.duration_s for s in episodes for t in s.turns for r in t.tool_results)
    tokens = sum(s.num_response_tokens for s in episodes)
    return {"turns_mean": len(model_turns) / n, "tool_s_mean": tool_s / n,
            "model_token_share": sum(t.num_tokens for t in model_turns) / max(1, tokens)}
