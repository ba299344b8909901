"""Build the components a config names: the embedded runtime's wiring, in one place.

:func:`check_inputs` validates what a run reads (model folder, dataset paths, reward names)
at once; :func:`build_run` builds every component for a run directory (the run directory is
prepared only after the model and the datasets have loaded, so bad input never costs an
earlier run's files) and returns them as one :class:`Run`; ``runtime/train.py`` runs them. The sampling parameters
(:func:`sampling_params`) and the trainer (:func:`build_trainer`) are built from the config
here and only here, for runs and benchmarks alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.clock import Clock, WallClock
from rollstream.config import RunConfig, SamplingConfig
from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import Engine, SamplingParams
from rollstream.monitor.rollout_meter import RolloutMeter
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.rollout.rollout import Rollout, TaskStream
from rollstream.rollout.staleness import StalenessPolicy
from rollstream.runtime.controller import Controller, MetricsLike, TrainerLike
from rollstream.sync.weights import WeightSync, sync_policy

if TYPE_CHECKING:
    from rollstream.data.sources import TaskMix
    from rollstream.monitor.metrics import Metrics
    from rollstream.reward.pool import GraderPool
    from rollstream.train.trainer import Trainer
    from rollstream.trajectory import Task


def check_inputs(cfg: RunConfig) -> None:
    """Fail early, naming the setting, when a model folder, a dataset file or a reward name is
    unusable (runs call this before touching their run directory)."""
    from rollstream.data.sources import check_source_paths, source_rewards
    from rollstream.models.warmstart import validate_model_folder
    from rollstream.reward.registry import build_resolver

    if cfg.model.path is not None:
        validate_model_folder(Path(cfg.model.path))
    check_source_paths(cfg.tasks)
    build_resolver(cfg.reward, source_rewards(cfg.tasks))


def sampling_params(cfg: SamplingConfig, stop_token_ids: tuple[int, ...], *,
                    temperature: float | None = None) -> SamplingParams:
    """The engines' sampling parameters for a config (``temperature`` overrides: eval)."""
    return SamplingParams(
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=stop_token_ids,
    )


def build_trainer(cfg: RunConfig, model_path: Path) -> Trainer:
    from rollstream.train.trainer import Trainer

    return Trainer(cfg.train, model_path, staleness=StalenessPolicy.from_config(cfg.rollout, cfg.train),
                   max_response_tokens=cfg.sampling.max_new_tokens,
                   temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                   top_k=cfg.sampling.top_k)


def prepare_run_dir(cfg: RunConfig, run_dir: Path) -> None:
    """A fresh run directory: the previous run's files of that name go, the config is saved."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("ledger.jsonl", "metrics.jsonl", "timeline.jsonl", "summary.json"):
        (run_dir / stale).unlink(missing_ok=True)
    dumped = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    (run_dir / "config.yaml").write_text(dumped)


@dataclass(slots=True, kw_only=True)
class Loop:
    """The rollout side and the controller around given engines, trainer and tasks."""

    lifecycle: Lifecycle
    dispatcher: Dispatcher
    rollout: Rollout
    sync: WeightSync
    controller: Controller


def build_loop(cfg: RunConfig, *, engines: list[Engine], trainer: TrainerLike, tasks: TaskStream,
               graders: GraderPool, decode: Callable[[list[int]], str], ledger: Ledger,
               metrics: MetricsLike, clock: Clock, params: SamplingParams,
               span: Callable[..., None] | None = None) -> Loop:
    """Wire dispatcher, rollout, weight sync and controller as ``cfg`` says (tests use this
    with their own engines and trainers at the process edges)."""
    lifecycle = Lifecycle(ledger, clock)
    dispatcher = Dispatcher(engines=engines, params=params, graders=graders, decode=decode,
                            lifecycle=lifecycle, clock=clock, span=span)
    rollout = Rollout(
        cfg=cfg.rollout, policy=StalenessPolicy.from_config(cfg.rollout, cfg.train),
        groups_per_step=cfg.train.groups_per_step,
        total_groups=cfg.train.steps * cfg.train.groups_per_step, tasks=tasks,
        dispatcher=dispatcher, lifecycle=lifecycle,
        failed_reward=0.0 if cfg.train.failed_reward == "zero" else None,
    )

    async def on_applied(version: int, sync_s: float) -> None:
        metrics.record("phase", version, {"sync_s": sync_s})
        rollout.on_version(version)

    policy = sync_policy(cfg.rollout.partial_rollout, cfg.rollout.on_update)
    sync = WeightSync(engines, dispatcher, policy, on_applied)
    meter = RolloutMeter(engines, dispatcher.stats, lambda: len(dispatcher.in_flight),
                         rollout.stats)
    controller = Controller(
        rollout=rollout, trainer=trainer, sync=sync, meter=meter, metrics=metrics,
        steps=cfg.train.steps, groups_per_step=cfg.train.groups_per_step,
        max_wall_s=cfg.max_wall_s,
    )
    return Loop(lifecycle=lifecycle, dispatcher=dispatcher, rollout=rollout, sync=sync,
                controller=controller)


@dataclass(slots=True, kw_only=True)
class Run:
    """Every component of one run (built by :func:`build_run`, closed by :meth:`close`)."""

    cfg: RunConfig
    run_dir: Path
    model_path: Path
    mix: TaskMix
    metrics: Metrics
    ledger: Ledger
    engines: list[Engine]
    graders: GraderPool
    trainer: Trainer
    loop: Loop
    eval_tasks: list[Task]
    eval_params: SamplingParams

    async def close(self) -> None:
        for e in self.engines:
            close = getattr(e, "close", None)
            if close is not None:
                await close()
        res: Any = self.graders.close()
        if asyncio.iscoroutine(res):
            await res


def build_run(cfg: RunConfig, run_dir: Path) -> Run:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rollstream.data.sources import TaskMix, source_rewards
    from rollstream.engine.factory import build_engine
    from rollstream.models.warmstart import prepare_model
    from rollstream.monitor.metrics import Metrics
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import build_resolver

    hf_logging.disable_progress_bar()
    resolve = build_resolver(cfg.reward, source_rewards(cfg.tasks))  # unknown rewards fail first
    model_path = Path(prepare_model(cfg.model, cfg.tasks))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    mix = TaskMix(cfg.tasks, tokenizer)  # a bad dataset fails here, before the run dir
    prepare_run_dir(cfg, run_dir)
    metrics = Metrics(run_dir, cfg.monitor)
    ledger = Ledger(run_dir / "ledger.jsonl")
    for task_uid, source, reason in mix.rejected():
        print(f"warning: skipped task {task_uid}: {reason}", flush=True)
        ledger.record_rejected(task_uid, source, reason)
    for warning in mix.warnings():
        print(f"warning: {warning}", flush=True)
    engines = [build_engine(cfg.engine, model_path, engine_id=f"{cfg.engine.kind}-{i}", version=0)
               for i in range(cfg.engine.num_engines)]
    graders = GraderPool(cfg.reward, resolve)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    trainer = build_trainer(cfg, model_path)
    loop = build_loop(cfg, engines=engines, trainer=trainer, tasks=mix, graders=graders,
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      ledger=ledger, metrics=metrics, clock=WallClock(),
                      params=sampling_params(cfg.sampling, stop), span=metrics.span)
    return Run(
        cfg=cfg, run_dir=run_dir, model_path=model_path, mix=mix, metrics=metrics,
        ledger=ledger, engines=engines, graders=graders, trainer=trainer, loop=loop,
        eval_tasks=mix.eval_tasks(),
        eval_params=sampling_params(cfg.sampling, stop, temperature=cfg.eval.temperature),
    )
