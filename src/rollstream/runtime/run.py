"""One run, built whole: :func:`build_run` builds every component a config names for a run
directory and returns them as one :class:`Run`; ``runtime/train.py`` runs it.

Nothing is set on a component after it is built: the controller receives its hooks
(runtime/steps.py), its trainer thread and the flag the engines read while a trainer step
computes at construction. The run directory is prepared only after the model and the
datasets have loaded and each source has a prompt that fits the engines' context, so bad
input never costs an earlier run's files. A build that fails closes every component it had
built (engine threads, files, worker processes, Ray) before it raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.clock import WallClock
from rollstream.config import RunConfig
from rollstream.data.ledger import Ledger
from rollstream.durable import checkpoint as durable
from rollstream.durable.resume import reconcile_ledger, reconcile_logs
from rollstream.engine.protocol import Engine
from rollstream.run_files import RunFiles
from rollstream.runtime.build import (
    Loop,
    build_controller,
    build_engines,
    build_harnesses,
    build_loop,
    build_trainer,
    build_workers,
    engine_maker,
    prepare_run_dir,
    sampling_params,
)
from rollstream.runtime.controller import Controller, trainer_thread
from rollstream.runtime.reconfigure import with_applied
from rollstream.runtime.steps import (
    BetweenSteps,
    Checkpoints,
    Evaluations,
    FinalCheckpoint,
    TrainTotals,
)

if TYPE_CHECKING:
    from rollstream.data.mix import TaskMix
    from rollstream.monitor.metrics import Metrics
    from rollstream.monitor.progress import Progress
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import RewardFn
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.train.fsdp import FsdpTrainer
    from rollstream.train.trainer import Trainer
    from rollstream.trajectory import Task

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class Run:
    """Every component of one run, built whole by :func:`build_run` (closed by :meth:`close`,
    then :meth:`stop`)."""

    cfg: RunConfig
    files: RunFiles
    model_path: Path
    tokenizer: Any  # the model folder's (AutoTokenizer): each saved folder is checked against it
    mix: TaskMix
    metrics: Metrics
    ledger: Ledger
    engines: list[Engine]  # the roster: engines join and leave it (runtime/fleet.py)
    graders: GraderPool
    trainer: Trainer | FsdpTrainer
    loop: Loop
    controller: Controller
    progress: Progress
    evaluations: Evaluations
    totals: TrainTotals
    resumed: durable.Checkpoint | None = None  # the checkpoint this run continues
    superseded_lines: int = 0  # ledger lines a resume moved to ledger.superseded.jsonl
    cluster: RayCluster | None = None  # runtime.kind: ray (stopped after the trainer closes)
    sandbox: Any = None  # the RunSandbox of agent.sandbox (closed with the harnesses)

    def stop(self) -> None:
        """Close the trainer, then stop the Ray the run uses (fsdp rank actors live in it):
        after :meth:`close` and the final checkpoint."""
        try:
            self.trainer.close()
        finally:
            if self.cluster is not None:
                self.cluster.stop()

    async def close(self) -> None:
        """Close harnesses, the sandbox pool, engines and graders (the trainer and Ray stay:
        :meth:`stop`)."""
        for harness in self.loop.dispatcher.harnesses.values():
            close = getattr(harness, "close", None)
            if close is not None:
                await close()
        if self.sandbox is not None:
            await self.sandbox.close()
        for e in self.engines:
            close = getattr(e, "close", None)
            if close is not None:
                await close()
        res: Any = self.graders.close()
        if asyncio.iscoroutine(res):
            await res


async def build_run(cfg: RunConfig, run_dir: Path, *, resume: durable.Checkpoint | None = None,
                    rewards: Mapping[str, RewardFn] | None = None) -> Run:
    """Every component of a run; with ``cfg.resume`` it continues from ``resume`` (the run's
    newest checkpoint; None: none was written, the run starts at step 0 keeping the ledger's
    record of what the lost process did in ``ledger.superseded.jsonl``). ``rewards``: source
    name -> a reward callable given as an object (the Python API, ``rollstream.train``).
    On any failure, what was built is closed before the error propagates."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rollstream.agent.sandbox_shared import install_sandbox
    from rollstream.agent.verifiers_env import with_rubrics
    from rollstream.data.mix import TaskMix
    from rollstream.data.sources import source_rewards
    from rollstream.models.warmstart import prepare_model
    from rollstream.monitor.metrics import Metrics
    from rollstream.monitor.progress import Progress
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import build_resolver

    hf_logging.disable_progress_bar()
    saved = resume.state.get("reconfig", {}) if resume is not None else {}
    cfg_now = with_applied(cfg, saved.get("applied", []))  # what reconfigurations left in force
    resolve = build_resolver(cfg.reward, source_rewards(cfg.tasks),  # fail first
                             with_rubrics(cfg.tasks, rewards))
    model_path = Path(prepare_model(cfg.model, cfg.tasks, resolve))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    mix = TaskMix(cfg_now.tasks, tokenizer)  # a bad dataset fails here, before the run dir
    mix.check_fits(*cfg.engine.context)
    skip: set[str] = set()
    superseded = 0
    if cfg.resume:  # first: a ledger it refuses leaves the run directory as it was
        skip, superseded = reconcile_ledger(run_dir, resume, group_size=cfg.rollout.group_size)
        reconcile_logs(run_dir, resume)
    prepare_run_dir(cfg, run_dir, resume=cfg.resume)
    files = RunFiles(run_dir)
    async with contextlib.AsyncExitStack() as built:  # unwound only if the build fails
        metrics = Metrics(run_dir, cfg.monitor)
        _close_on_failure(built, metrics.close)
        ledger = Ledger(files.ledger)
        _close_on_failure(built, ledger.close)
        for task_uid, source, reason in mix.rejected():
            log.warning(f"skipped task {task_uid}: {reason}")
            if ledger.status_of(f"{task_uid}#row") is None:  # a resumed run recorded it before
                ledger.record_rejected(task_uid, source, reason)
        for warning in mix.warnings():
            log.warning(warning)
        version = resume.step if resume is not None else 0  # weight version = steps done
        # a LoRA checkpoint is an adapter: engines load the base, then the adapter (below)
        weights = resume.model_dir if resume is not None and not cfg.model.lora else model_path
        training = threading.Event()  # a trainer step computes (set by the controller)
        engines, cluster = build_engines(cfg, weights, version=version, run_dir=run_dir,
                                         training=training.is_set)
        if cluster is not None:  # stopped last: the trainer's ranks and engines live in it
            _close_on_failure(built, cluster.stop)
        for engine in engines:
            _close_on_failure(built, engine.close)
        graders = GraderPool(cfg.reward, resolve,
                             build_workers(cfg, cfg.reward.num_workers, "reward"))
        _close_on_failure(built, graders.close)
        stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        staleness = cfg_now.rollout.staleness_policy()  # one policy: trainer and rollout
        trainer = build_trainer(cfg_now, model_path, cluster.units if cluster else None,
                                staleness=staleness)
        _close_on_failure(built, trainer.close)
        sandbox = install_sandbox(cfg.agent.sandbox)  # started by its first program
        _close_on_failure(built, sandbox.close)
        harnesses = build_harnesses(cfg, tokenizer, sandbox)
        for harness in harnesses.values():
            if (close := getattr(harness, "close", None)) is not None:
                _close_on_failure(built, close)
        loop = build_loop(cfg_now, engines=engines, trainer=trainer, tasks=mix, graders=graders,
                          decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          ledger=ledger, metrics=metrics, clock=WallClock(),
                          params=sampling_params(cfg_now.sampling, stop), span=metrics.span,
                          start_step=version, staleness=staleness, harnesses=harnesses,
                          reconfig_log=files.reconfig,
                          make=engine_maker(cfg, weights, version=version, engines=engines,
                                            training=training.is_set))
        if resume is not None:
            _load_trainer_state(trainer, resume)
            if cfg.model.lora is not None:
                await loop.sync.install(version, trainer.state_dict())
            loop.rollout.restore(resume.state["rollout"], version=version)
            loop.reconfigure.restore(saved, version=version)
        loop.rollout.skip(skip)
        progress = Progress(cfg.monitor, cfg.train.steps)
        _close_on_failure(built, progress.close)
        steps = _build_steps(cfg, files, loop, resume=resume, progress=progress,
                             eval_tasks=mix.eval_tasks(), stop=stop, training=training,
                             tokenizer=tokenizer)
        built.pop_all()  # built whole: the Run owns every component now
    return Run(cfg=cfg, files=files, model_path=model_path, tokenizer=tokenizer, mix=mix,
               metrics=metrics, ledger=ledger, engines=engines, graders=graders,
               trainer=trainer, loop=loop,
               progress=progress, **steps, resumed=resume, superseded_lines=superseded,
               cluster=cluster, sandbox=sandbox)


def _build_steps(cfg: RunConfig, files: RunFiles, loop: Loop, *,
                 resume: durable.Checkpoint | None, progress: Progress, eval_tasks: list[Task],
                 stop: tuple[int, ...], training: threading.Event,
                 tokenizer: Any) -> dict[str, Any]:
    """The run's controller with what it does around its steps (runtime/steps.py): the
    evaluations, totals and checkpoints carried on from ``resume``."""
    saved = resume.state if resume is not None else {}
    evaluations = Evaluations(
        dispatcher=loop.dispatcher, tasks=eval_tasks,
        params=sampling_params(cfg.sampling, stop, temperature=cfg.eval.temperature),
        samples_per_task=cfg.eval.samples_per_task, metrics=loop.metrics,
        next_round=saved.get("eval_rounds", 0))
    totals = TrainTotals(dispatcher=loop.dispatcher, engines=loop.fleet.every_engine,
                         saved=saved.get("totals"))
    pool = trainer_thread()
    checkpoints = Checkpoints(cfg=cfg, run_dir=files.root, loop=loop, trainer=loop.trainer,
                              tokenizer=tokenizer, metrics=loop.metrics, train_pool=pool,
                              evaluations=evaluations, totals=totals,
                              last_step=resume.step if resume else -1)
    controller = build_controller(
        cfg, loop, train_pool=pool, training=training, before_stop=FinalCheckpoint(checkpoints),
        after_step=BetweenSteps(cfg=cfg, progress=progress, evaluations=evaluations,
                                checkpoints=checkpoints))
    return {"controller": controller, "evaluations": evaluations, "totals": totals}


def _close_on_failure(built: contextlib.AsyncExitStack, close: Callable[[], Any]) -> None:
    """Call ``close`` (sync or async) when ``built`` unwinds; an error of its own is logged,
    so the build's error is the one that propagates."""
    async def closing() -> None:
        try:
            res = close()
            if inspect.isawaitable(res):
                await res
        except Exception:  # noqa: BLE001 - fault boundary: cleanup after a failed build
            log.exception("closing %r after a failed build", close)

    built.push_async_callback(closing)


def _load_trainer_state(trainer: Any, ckpt: durable.Checkpoint) -> None:
    """The trainer continues from ``ckpt``; a checkpoint it cannot take (an optimizer state
    of another model, say) is a ValueError naming the files."""
    try:
        trainer.load_training_state(ckpt.model_dir, ckpt.trainer_file)
    except Exception as e:  # noqa: BLE001 - fault boundary: named, the cause kept
        raise ValueError(f"checkpoint {ckpt.path}: the trainer cannot continue from "
                         f"{ckpt.trainer_file} and {ckpt.model_dir} "
                         f"({type(e).__name__}: {e})") from e
