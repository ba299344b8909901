"""The rollout: one owner for a training group's life, from admission to the ledger.

    admit_forever ──(StalenessCapacity: room?)──> Group ──> Dispatcher.run_group
         ^                                         (each sample its own request, graded
         | on_version(v): capacity moves            as it finishes)
         |                                                  |
    cancel_doomed(v) <── on_trained(batch) <── take(n) <── group done:
     (live groups the policy             (ledger: TRAINED /   cancelled -> its verdict's status
      says can never train)               DROPPED / FILTERED)  nothing graded -> untrainable
                                                               zero variance -> FILTERED
                                                               else -> buffer

The controller sees five calls: ``admit_forever`` (a task for the run's life), ``take``,
``on_trained``, ``on_version`` and ``stop``, plus ``stats`` for the meters and ``step_stats``
for the step's waste, length bias and trained mixture (:class:`StepTally`). A task stream
that learns from its groups (:class:`MixFeedback`, the data layer's ``TaskMix``) hears of each
admitted group twice: ``ended`` when its generation is over, with the rewards the
zero-variance filter saw, and ``resolved`` once it trained or never will; when the stream has
no task to give (in-flight caps), admission waits for a group to end. A durable
checkpoint calls :meth:`snapshot` (generation is held only while in-flight requests come back
with their tokens and the state is copied) and a resumed run :meth:`restore` before
``admit_forever``: buffered groups go to the trainer, in-flight ones continue from their
tokens, groups the ledger already retired are skipped. Everything a group
goes through is decided here, with the rules of :class:`StalenessPolicy` and the state
changes of :class:`Lifecycle`; every retired group frees its admission capacity exactly once.

With ``rollout.early_stop`` on, each graded sample is shown to :class:`EarlyStop`, and a
group whose graded rewards agree and whose other samples likely would too is cancelled and
FILTERED as zero variance (rollout/early_stop.py).

With ``rollout.replay`` on, each trained group is offered to the :class:`ReplayPool`, and
``take`` fills a batch short of fresh groups with replays (at most the configured share; a
replay never displaces a ready fresh group); ``on_trained`` records a replay as a ledger
event, not a second terminal status.

``take`` raises :class:`RolloutStopped` when the rollout can no longer feed the trainer: no
engine is alive, or :class:`Liveness` found a stream of untrainable groups. The message is the
diagnostic; the controller ends the run with it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

from rollstream.config import RolloutConfig
from rollstream.durable.state import group_from_dict, group_to_dict
from rollstream.engine.protocol import SamplingParams
from rollstream.rollout.admission import StalenessCapacity
from rollstream.rollout.buffer import TrajectoryBuffer
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.early_stop import EarlyStop, Stop
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.rollout.liveness import Liveness
from rollstream.rollout.replay import ReplayPool
from rollstream.rollout.step_tally import StepTally
from rollstream.staleness import StalenessPolicy
from rollstream.trajectory import Group, Sample, SampleStatus, StepResult, Task

S = SampleStatus
RUN_ENDED = "run ended before the sample was trained"


class TaskStream(Protocol):
    def next_task(self) -> Task | None:
        """The next task; None: none may start now (in-flight caps): ask after a group ends."""

    def state(self) -> dict[str, Any]:
        """The cursor (JSON), so that a restored stream draws the same next tasks."""

    def restore(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class MixFeedback(Protocol):
    """A task stream that learns what became of its tasks' groups."""

    def ended(self, group: Group, rewards: list[float] | None) -> None:
        """``group``'s generation is over; ``rewards``: its baseline's (None: cancelled)."""

    def resolved(self, group: Group, num_trained: int) -> None:
        """``group`` is done: ``num_trained`` samples trained (0: filtered, dropped, aborted)."""

    def metrics(self) -> dict[str, float]:
        """Its per-step metrics (the trained mixture)."""


class RolloutStopped(RuntimeError):
    """The rollout cannot feed the trainer any more; the message says why."""


class Rollout:
    def __init__(self, *, cfg: RolloutConfig, policy: StalenessPolicy, groups_per_step: int,
                 total_groups: int | None, tasks: TaskStream, dispatcher: Dispatcher,
                 lifecycle: Lifecycle, failed_reward: float | None = None) -> None:
        self.cfg, self.policy = cfg, policy
        self.tasks, self.dispatcher, self.lifecycle = tasks, dispatcher, lifecycle
        self.feedback = tasks if isinstance(tasks, MixFeedback) else None
        self.tally = StepTally()
        self.failed_reward = failed_reward
        self.capacity = StalenessCapacity(groups_per_step=groups_per_step,
                                          max_staleness=policy.max_staleness,
                                          total_groups=total_groups)
        self.buffer = TrajectoryBuffer(policy)
        self.replay = ReplayPool(cfg.replay, policy, failed_reward)
        self.early_stop = EarlyStop(cfg.early_stop, cfg.group_size)
        self._stopped: dict[str, Stop] = {}  # group id -> why it was stopped early
        self._replaying: set[str] = set()  # group ids of the batch taken that are replays
        self.liveness = Liveness(cfg)
        self.live: dict[str, Group] = {}
        self._cancelled: dict[str, tuple[SampleStatus, str]] = {}  # group id -> outcome
        self._stopping = False
        self._pass: dict[str, list[float]] = {}  # source -> [reward sum, graded samples]
        self._blocked_read = 0.0  # capacity.blocked_s at the previous stats()
        self._gate_blocked_s = 0.0  # admission's waits for the dispatch gate (weight loads)
        self._gate_read = 0.0
        self._restored: list[Group] = []  # in flight at the checkpoint: continued first
        # generation stopped because no engine is alive: kept whole (tokens and all) for the
        # stop's checkpoint, recorded ABORTED by stop()
        self._stranded: dict[str, Group] = {}
        self._skip: set[str] = set()  # group ids the ledger already retired (resume)

    # ---- admission ---------------------------------------------------------------------
    async def admit_forever(self) -> None:
        """Admit groups while the capacity has room, until :meth:`stop`; each group's life is
        a task of this one, so this returns once every admitted group has ended."""
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            await self.dispatcher.cancel([g.group_id for g in self._restored
                                          if g.group_id in self._cancelled])
            for group in self._restored:
                self._start_group(tg, group, None)
            self._restored = []
            while not self._stopping:
                if (n := self.capacity.room()) == 0:
                    await self.capacity.wait_changed()
                    continue
                t0 = loop.time()
                await self.dispatcher.wait_open()  # closed while a weight load pauses dispatch
                self._gate_blocked_s += loop.time() - t0
                if self._stopping or self.capacity.room() < n:
                    continue
                if not self._admit(n, tg):  # no task may start: wait for a group to end
                    await self.capacity.wait_changed()

    def _admit(self, n: int, tg: asyncio.TaskGroup) -> bool:
        """Admit up to ``n`` groups; False when the task stream had no task to give."""
        for _ in range(n):
            task = self.tasks.next_task()
            if task is None:
                return False
            self.capacity.admit(1)
            # k = admission index: a task drawn again (a dataset epoch) gets a new id
            group = Group.new(task, self.cfg.group_size, k=self.capacity.num_admitted - 1)
            if group.group_id in self._skip:  # retired before the run resumed
                self._skip.discard(group.group_id)
                self.capacity.retire()
                if self.feedback is not None:
                    self.feedback.ended(group, None)
                    self.feedback.resolved(group, 0)
                continue
            # the sampling parameters in force at admission (a reconfiguration may follow)
            self._start_group(tg, group, self.dispatcher.params)
        return True

    def _start_group(self, tg: asyncio.TaskGroup, group: Group,
                     params: SamplingParams | None) -> None:
        """``group`` live, its life a task of ``tg``."""
        self.live[group.group_id] = group
        task = tg.create_task(self._group_life(group, params), name=f"group {group.group_id}")
        task.add_done_callback(lambda t: self._group_task_done(group, t))

    def _group_task_done(self, group: Group, task: asyncio.Task) -> None:
        """A group's task cancelled by the loop's teardown (an error raised into it) is no
        longer live, so that :meth:`stop` does not wait for it; stop records it ABORTED. A
        done callback, so that this holds for a task cancelled before it first ran too (its
        coroutine then never enters a handler of its own)."""
        if task.cancelled() and self.live.get(group.group_id) is group:
            self._stranded[group.group_id] = self.live.pop(group.group_id)

    async def _group_life(self, group: Group, params: SamplingParams | None = None) -> None:
        await self.dispatcher.run_group(
            group, params, on_graded=self._graded if self.early_stop.cfg.after else None)
        del self.live[group.group_id]
        self.dispatcher.forget(group.group_id)
        self.early_stop.ended(group)
        outcome = self._cancelled.pop(group.group_id, None)
        stopped = self._stopped.pop(group.group_id, None)
        if outcome is None and self.dispatcher.fatal is not None and any(
                s.status is not S.GRADED and not s.status.is_terminal() for s in group.samples):
            self._stranded[group.group_id] = group  # not ended: it resumes with an engine
            self.buffer.notify()  # take() sees the run cannot go on
            return
        baseline = (group.baseline_rewards(self.failed_reward)
                    if outcome is None or stopped is not None else None)
        self.tally.ended(group)
        if self.feedback is not None:
            self.feedback.ended(group, None if baseline is None else [r for _, r in baseline])
        self.capacity.wake()  # an in-flight cap may have room now
        if stopped is not None:  # its other samples were cancelled: zero variance, as likely
            self.tally.stopped_early(group, stopped.chance)
            status, why = outcome or (S.FILTERED, stopped.reason)
            self._retire(group, status, why, zero_variance=True)
            return
        if outcome is not None:
            self._retire(group, *outcome)
            return
        tally = self._pass.setdefault(group.task.source, [0.0, 0.0])
        graded = [s for s in group.samples if s.status is S.GRADED]
        for s in graded:
            tally[0] += float(s.reward or 0.0)
            tally[1] += 1
        if not graded:
            self._retire(group, S.FILTERED, "no sample of the group was graded")
        elif self.cfg.filter_zero_variance and len({r for _, r in baseline}) == 1:
            self._retire(group, S.FILTERED,
                         f"zero reward variance in group (every reward {baseline[0][1]:g})",
                         zero_variance=True)
        else:
            self.liveness.trainable()
            self.buffer.put(group)

    async def _graded(self, group: Group, sample: Sample) -> None:
        """A sample of ``group`` was graded: cancel the rest when ``rollout.early_stop``
        says they would likely agree with it (the group is then FILTERED as zero
        variance)."""
        if group.group_id in self._cancelled:
            return
        stop = self.early_stop.graded(group, sample)
        if stop is not None:
            self._cancelled[group.group_id] = (S.FILTERED, stop.reason)
            self._stopped[group.group_id] = stop
            await self.dispatcher.cancel([group.group_id])

    def _retire(self, group: Group, status: SampleStatus, reason: str, *,
                zero_variance: bool = False) -> None:
        """The group will never train: every sample not yet terminal ends in ``status``; its
        admission capacity is freed; it counts as untrainable unless the run is stopping."""
        for s in group.samples:
            if not s.status.is_terminal():
                self.lifecycle.move(s, status, reason)
        self.capacity.retire()
        self._resolved(group, zero_variance=zero_variance)
        if status is not S.ABORTED:
            self.liveness.untrainable(group)
        self.buffer.notify()  # take() re-checks liveness

    def _resolved(self, group: Group, *, zero_variance: bool = False) -> None:
        """``group`` trained (its samples say which) or will never train."""
        self.tally.resolved(group, zero_variance=zero_variance)
        if self.feedback is not None:
            self.feedback.resolved(group, sum(s.status is S.TRAINED for s in group.samples))

    # ---- the trainer's side ------------------------------------------------------------
    async def take(self, n: int, step: int) -> list[Group]:
        """``n`` groups the policy allows at trainer step ``step`` (stale ones are recorded
        DROPPED_STALE on the way); raises RolloutStopped when none can come any more. While
        fresh groups are short by at most the replay share, replays fill the batch."""
        while True:
            for group, verdict in self.buffer.pop_stale(step):
                self._retire(group, S.DROPPED_STALE, verdict.reason or "stale")
            if (why := self._why_stopped()) is not None:
                raise RolloutStopped(why)
            if (batch := self.buffer.pop_batch(n)) is not None:
                return batch
            short = n - len(self.buffer)
            if short <= self.replay.max_groups(n) and \
                    (replays := self.replay.draw(short, step)) is not None:
                self._replaying = {g.group_id for g in replays}
                return [*(self.buffer.pop_batch(n - short) or []), *replays]
            await self.buffer.wait_changed()

    def _why_stopped(self) -> str | None:
        if self.dispatcher.fatal is not None:
            return self.dispatcher.fatal
        return self.liveness.verdict()

    async def on_trained(self, batch: list[Group], step: int,
                         result: StepResult) -> list[Sample]:
        """Record the outcome of every graded sample of a trained batch (what the trainer's
        loss kept decides TRAINED), cancel live groups that can no longer train, and return
        the samples recorded TRAINED."""
        trained = []
        for group in batch:
            if group.group_id in self._replaying:
                self._replayed(group, step, result)
                continue
            for s in group.samples:
                if s.status is not S.GRADED:
                    continue
                s.taken_at_step = step
                verdict = self.policy.sample_verdict(s, step)
                kept = result.kept.get(s.uid)
                if not verdict.ok:
                    self.lifecycle.move(s, S.DROPPED_STALE,
                                        f"{verdict.reason}; reward used in the group baseline only")
                elif kept is None or kept.num_tokens == 0:
                    why = kept.reason if kept is not None else "the trainer did not use it"
                    self.lifecycle.move(s, S.FILTERED, f"no token kept by the loss: {why}")
                else:
                    s.trained_at_step = step
                    s.min_trained_version = kept.min_version
                    s.num_trained_tokens = kept.num_tokens
                    s.trained_version_sum = kept.version_sum
                    self.lifecycle.move(s, S.TRAINED)
                    trained.append(s)
            self._resolved(group)
            self.replay.offer(group)
        self._replaying = set()
        self.replay.evict(step + 1)  # bounded: only what may still be replayed
        await self.cancel_doomed(step + 1)
        return trained

    def _replayed(self, group: Group, step: int, result: StepResult) -> None:
        """A replayed group trained at ``step``: a ledger event per sample the loss kept
        tokens of (its terminal status stays), and the step's replay counts."""
        kept_samples = []
        for s in group.samples:
            kept = result.kept.get(s.uid)
            if kept is None or kept.num_tokens == 0:
                continue
            self.lifecycle.replayed(s, step, num_tokens=kept.num_tokens,
                                    min_version=kept.min_version)
            kept_samples.append(s)
        self.tally.replayed(kept_samples)

    async def cancel_doomed(self, version: int) -> None:
        """Cancel live groups that can never be trained at ``version`` or later."""
        doomed = {}
        for gid, group in self.live.items():
            if gid in self._cancelled:
                continue
            verdict = self.policy.live_verdict(group, version)
            if not verdict.ok:
                doomed[gid] = (S.DROPPED_STALE, verdict.reason or "stale")
        if doomed:
            self._cancelled.update(doomed)
            await self.dispatcher.cancel(list(doomed))

    async def set_policy(self, policy: StalenessPolicy, version: int) -> None:
        """A reconfigured staleness bound, in force from the next trainer step (the engines
        serve ``version``): admission's capacity follows it at once, buffered groups are
        judged again at their step, and live groups that can no longer train are cancelled.
        Groups admitted under a larger bound go on; each is trained only if it is within the
        bound in force at its step (docs/reconfigure.md)."""
        self.policy = policy
        self.buffer.set_policy(policy)
        self.replay.policy = policy
        self.capacity.set_max_staleness(policy.max_staleness)
        await self.cancel_doomed(version)

    def on_version(self, version: int) -> None:
        """The engines now serve ``version``: admission may move on."""
        self.capacity.set_version(version)

    # ---- the end -----------------------------------------------------------------------
    async def stop(self) -> None:
        """End of run: admit nothing more, cancel what is live, and record every sample not
        yet trained ABORTED (the admission task then returns)."""
        self._stopping = True
        self.capacity.wake()  # admission sees _stopping and returns
        self.dispatcher.resume()
        while self.live:
            ids = [g for g in self.live if g not in self._cancelled]
            self._cancelled.update(dict.fromkeys(ids, (S.ABORTED, RUN_ENDED)))
            await self.dispatcher.cancel(list(self.live))  # again: a request may slip past
            await asyncio.sleep(0.01)
        for group in self._stranded.values():
            self._retire(group, S.ABORTED, self.dispatcher.fatal or RUN_ENDED)
        self._stranded.clear()
        for group in self.buffer.drain():
            for s in group.samples:
                if not s.status.is_terminal():
                    self.lifecycle.move(s, S.ABORTED, RUN_ENDED)

    # ---- durable state -----------------------------------------------------------------
    async def snapshot(self) -> dict[str, Any]:
        """The rollout's state as JSON, consistent with the ledger and the task cursor.

        Holds the dispatch gate, interrupts every in-flight request (each comes back with its
        tokens, logprobs and versions, the samples INTERRUPTED), copies the state with the
        ledger fsynced, and opens the gate again: the interrupted samples resume at once.
        Call between trainer steps with no weight load in progress."""
        self.dispatcher.pause()
        try:
            await self.dispatcher.interrupt(None)
            await self.dispatcher.wait_idle()
            live = [*self.live.values(), *self._stranded.values()]
            buffered = self.buffer.groups()
            return {
                "ledger_lines": self.lifecycle.ledger.sync(),
                "replay_lines": self.lifecycle.ledger.num_replay_lines,
                "replay_pool": self.replay.state(),
                "early_stop": self.early_stop.state(),
                "stopped_early": {gid: [st.reason, st.chance]
                                  for gid, st in self._stopped.items()},
                "tasks": self.tasks.state(),
                "num_admitted": self.capacity.num_admitted,
                "num_retired": self.capacity.num_retired,
                "held_groups": [g.group_id for g in (*buffered, *live)],
                "buffer": [group_to_dict(g) for g in buffered],
                "live": [group_to_dict(g) for g in live],
                "cancelled": {gid: [st.value, why] for gid, (st, why) in self._cancelled.items()},
                "skip": sorted(self._skip),
            }
        finally:
            self.dispatcher.resume()

    def skip(self, group_ids: set[str]) -> None:
        """Pass over these groups when admission reaches them: the ledger already retired
        them (``durable.resume.reconcile_ledger``)."""
        self._skip |= group_ids

    def restore(self, state: dict[str, Any], *, version: int) -> None:
        """Continue from :meth:`snapshot`'s ``state`` (before :meth:`admit_forever`), with the
        engines serving ``version``."""
        self.tasks.restore(state["tasks"])
        self.capacity.num_admitted = state["num_admitted"]
        self.capacity.num_retired = state["num_retired"]
        self.capacity.set_version(version)
        self._cancelled = {gid: (S(st), why) for gid, (st, why) in state["cancelled"].items()}
        self._skip |= set(state["skip"])
        for d in state["buffer"]:
            group = group_from_dict(d)
            self._open(group)
            self.buffer.put(group)
        self._restored = [group_from_dict(d) for d in state["live"]]
        self.replay.restore(state.get("replay_pool", []))  # older checkpoints: no pool
        self.early_stop.restore(state.get("early_stop", []))  # older ones: nothing measured
        self._stopped = {gid: Stop(*v) for gid, v in state.get("stopped_early", {}).items()}

    def _open(self, group: Group) -> None:
        for s in group.samples:
            if not s.status.is_terminal():
                self.lifecycle.open(s)

    # ---- meters ------------------------------------------------------------------------
    def step_stats(self) -> dict[str, float]:
        """Since the previous call (a trainer step): the waste and the length bias
        (:class:`StepTally`), and the task stream's metrics (the trained mixture)."""
        out = self.tally.read()
        if self.feedback is not None:
            out.update(self.feedback.metrics())
        return out

    def stats(self) -> dict[str, float]:
        """Gauges of the rollout, and since the previous call each source's pass rate and the
        seconds admission waited at the staleness limit (``staleness_blocked_s``) and for the
        dispatch gate a weight load closed (``gate_blocked_s``: drain waits there)."""
        blocked, gate = self.capacity.blocked_s, self._gate_blocked_s
        out = {"live_groups": float(len(self.live)), "buffered_groups": float(len(self.buffer)),
               "replay_pool_groups": float(len(self.replay)),
               "untrainable_streak": float(self.liveness.streak),
               "staleness_blocked_s": blocked - self._blocked_read,
               "gate_blocked_s": gate - self._gate_read}
        self._blocked_read, self._gate_read = blocked, gate
        for src, (total, n) in self._pass.items():
            if n:
                out[f"pass_rate/{src}"] = total / n
        self._pass.clear()
        return out

