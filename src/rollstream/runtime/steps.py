"""What a training run does around its trainer steps, as named objects built with the run.

* :class:`Evaluations`: held-out evaluation rounds, numbered across resumes;
* :class:`TrainTotals`: the training wall time, generated tokens and engine work a
  checkpoint carries over and the summary reports;
* :class:`Checkpoints`: durable checkpoints (``rollstream.durable``): generation is held only
  while the rollout snapshots its in-flight samples, the weights and optimizer are written on
  the trainer's thread while the engines go on;
* the controller's two hooks: :class:`BetweenSteps` (after each step: the progress line, an
  evaluation every ``eval.every`` steps, a checkpoint every ``train.checkpoint_every``) and
  :class:`FinalCheckpoint` (when the run ends or stops).

``runtime/run.py`` builds them with the run and hands the hooks to the controller's
constructor.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.config import RunConfig
from rollstream.config.redact import saved_config
from rollstream.durable import checkpoint as durable
from rollstream.engine.protocol import Engine, SamplingParams
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.runtime.controller import ControllerResult, MetricsLike
from rollstream.runtime.evaluate import evaluate

if TYPE_CHECKING:
    from rollstream.monitor.metrics import Metrics
    from rollstream.monitor.progress import Progress
    from rollstream.runtime.build import Loop
    from rollstream.trajectory import Task

log = logging.getLogger(__name__)

Work = dict[str, dict[str, float]]  # engine id -> busy seconds and where they went


class Evaluations:
    """Held-out evaluation rounds. Each round samples under its own index (its group ids:
    ``<task_uid>#eval<r>/<i>``), counted across resumes: a checkpoint stores
    :attr:`next_round`."""

    def __init__(self, *, dispatcher: Dispatcher, tasks: list[Task], params: SamplingParams,
                 samples_per_task: int, metrics: MetricsLike, next_round: int = 0) -> None:
        self.dispatcher, self.tasks, self.params = dispatcher, tasks, params
        self.samples_per_task, self.metrics = samples_per_task, metrics
        self.next_round = next_round

    async def __call__(self, step: int) -> dict[str, float]:
        """The held-out reward (``reward``, and per source) with the weights of ``step``."""
        round_index, self.next_round = self.next_round, self.next_round + 1
        t0 = time.perf_counter()
        res = await evaluate(self.dispatcher, self.tasks, params=self.params,
                             samples_per_task=self.samples_per_task, round_index=round_index)
        if self.tasks:
            self.metrics.record("eval", step, res)
            self.metrics.record("phase", step, {"eval_s": time.perf_counter() - t0})
        return res


def engine_work(engines: list[Engine]) -> Work:
    """Each engine's busy seconds and where they went (``EngineStats.work``), totals so far."""
    return {e.engine_id: {"busy_s": (st := e.stats()).busy_s, **st.work} for e in engines}


class TrainTotals:
    """Training wall seconds and generated tokens over the whole run, resumes included (a
    checkpoint stores :meth:`so_far`), counted from :meth:`start` (after the initial
    evaluation, whose tokens are not training's) to :meth:`stop`; with the held-out reward
    before training (``initial``) and each engine's work meanwhile (:attr:`work`)."""

    def __init__(self, *, dispatcher: Dispatcher, engines: Callable[[], list[Engine]],
                 saved: Mapping[str, Any] | None = None) -> None:
        """``engines``: every engine of the run so far, those that left it included
        (``Fleet.every_engine``)."""
        saved = saved or {}
        self._dispatcher, self._engines = dispatcher, engines
        self._wall_s = float(saved.get("train_wall_s", 0.0))
        self._tokens = int(saved.get("generated_tokens", 0))
        self.initial: dict[str, float] = dict(saved.get("initial", {"reward": math.nan}))
        self._t0, self._tokens0 = time.perf_counter(), 0
        self._work0: Work = {}
        self.done: dict[str, Any] | None = None  # so_far() when training stopped
        self.work: Work = {}  # per engine, between start and stop

    def start(self, initial: Mapping[str, float]) -> None:
        """Training starts now, after the held-out reward ``initial`` was measured."""
        self.initial = dict(initial)
        self._t0 = time.perf_counter()
        self._tokens0 = self._dispatcher.stats.generated_tokens  # the initial evaluation's
        self._work0 = engine_work(self._engines())

    def so_far(self) -> dict[str, Any]:
        return {"train_wall_s": self._wall_s + time.perf_counter() - self._t0,
                "generated_tokens": self._tokens + self._dispatcher.stats.generated_tokens
                - self._tokens0, "initial": self.initial}

    def stop(self) -> None:
        """Training ended (the first call counts: the final evaluation is not training)."""
        if self.done is None:
            self.done = self.so_far()
            self.work = {k: {n: v - self._work0.get(k, {}).get(n, 0.0) for n, v in w.items()}
                         for k, w in engine_work(self._engines()).items()}


def save_model(trainer: Any, tokenizer: Any, folder: Path) -> Path:
    """The trainer's HF folder, its ``generation_config.json`` stopping at the chat's
    end-of-turn token as well, and its tokenizer checked: ``AutoTokenizer`` reads it as the
    run's (every save, durable and final; ``models/folder_check.py``)."""
    from rollstream.models.folder_check import check_tokenizer, write_stop_tokens

    trainer.save_checkpoint(folder)
    write_stop_tokens(folder, tokenizer)
    check_tokenizer(folder, tokenizer)
    return folder


class Checkpoints:
    """Writes the run's durable checkpoints; :attr:`last_step` is the newest one's step
    (-1: none yet)."""

    def __init__(self, *, cfg: RunConfig, run_dir: Path, loop: Loop, trainer: Any,
                 tokenizer: Any, metrics: Metrics, train_pool: Executor,
                 evaluations: Evaluations, totals: TrainTotals, last_step: int = -1) -> None:
        self.cfg, self.run_dir, self.loop, self.trainer = cfg, run_dir, loop, trainer
        self.tokenizer = tokenizer
        self.metrics, self.train_pool = metrics, train_pool
        self.evaluations, self.totals = evaluations, totals
        self.last_step = last_step

    async def write(self, done: int) -> None:
        """A checkpoint of the run after ``done`` steps, the engines serving version
        ``done``."""
        t0 = time.perf_counter()
        await self.loop.sync.wait_applied()
        t_hold = time.perf_counter()
        state = {"config": saved_config(self.cfg), "version": done,
                 "eval_rounds": self.evaluations.next_round, "totals": self.totals.so_far(),
                 "rollout": await self.loop.rollout.snapshot(),
                 "reconfig": self.loop.reconfigure.state()}
        held_s = time.perf_counter() - t_hold
        state["logs"] = self.metrics.sync()  # what a resume finds past these was lost
        state["config_hash"] = durable.config_hash(state["config"])
        path = await asyncio.get_running_loop().run_in_executor(
            self.train_pool, lambda: durable.write(
                self.run_dir, done, state,
                save_model=lambda d: save_model(self.trainer, self.tokenizer, d),
                save_trainer=self.trainer.save_training_state,
                keep=self.cfg.train.keep_checkpoints))
        self.last_step = done
        self.metrics.record("phase", done, {"checkpoint_step": float(done),
                                            "checkpoint_hold_s": held_s,
                                            "checkpoint_s": time.perf_counter() - t0})
        log.info(f"checkpoint: {path} (generation held {held_s * 1e3:.0f} ms)")


class BetweenSteps:
    """The controller's ``after_step``: the progress line; a held-out evaluation every
    ``eval.every`` steps (not after the last: the run's final one follows); a durable
    checkpoint every ``train.checkpoint_every`` steps."""

    def __init__(self, *, cfg: RunConfig, progress: Progress, evaluations: Evaluations,
                 checkpoints: Checkpoints) -> None:
        self.eval_every, self.checkpoint_every = cfg.eval.every, cfg.train.checkpoint_every
        self.steps = cfg.train.steps
        self.progress, self.evaluations, self.checkpoints = progress, evaluations, checkpoints

    async def __call__(self, step: int, values: dict[str, float]) -> None:
        self.progress.update(step, values)
        done = step + 1
        if self.eval_every and done % self.eval_every == 0 and done < self.steps:
            await self.evaluations(done)
        if self.checkpoint_every and done % self.checkpoint_every == 0:
            await self.checkpoints.write(done)


class FinalCheckpoint:
    """The controller's ``before_stop``: a checkpoint where the run ended or stopped, unless
    its last step wrote one; a stalled run (no engine alive) writes one anyway, with the
    partial samples it stranded."""

    def __init__(self, checkpoints: Checkpoints) -> None:
        self.checkpoints = checkpoints

    async def __call__(self, result: ControllerResult) -> None:
        if result.stalled or result.steps_done != self.checkpoints.last_step:
            await self.checkpoints.write(result.steps_done)
