"""``rollstream train``: run the components ``runtime/run.py`` builds from a config.

The embedded runtime: one process, one asyncio loop; engines run their step loops in their own
threads, the trainer in a dedicated thread, synchronous rewards in worker processes. A run:
check the inputs (before the run directory is touched), build, evaluate the held-out tasks,
train (evaluating every ``eval.every`` steps, a durable checkpoint every
``train.checkpoint_every``), evaluate again, save the final HF checkpoint, write the summary and
the report (docs/run-dir.md). A run the rollout cannot feed (no engine alive, a stream of
untrainable groups) ends early with the diagnostic in ``summary.json``'s ``stop_reason`` and
raises :class:`RunStopped` after everything was written.

Durable runs (``rollstream.durable``): a checkpoint holds generation only while the rollout
snapshots its in-flight samples; the weights and optimizer are written on the trainer's
thread while the engines go on. One is also written when the run ends or stops (its last
step, ``max_wall_s``, SIGTERM, no engine alive: the samples it was generating are kept with
their tokens), so ``resume=true`` continues any run that was not killed
with nothing lost, and a killed one from its newest checkpoint. SIGTERM stops at the next step
boundary (at once while waiting for a batch), checkpoints, skips the final evaluation and
exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import random
import shutil
import signal
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.config import ConfigError, RunConfig
from rollstream.config.redact import saved_config
from rollstream.durable import checkpoint as durable
from rollstream.durable.resume import SAFE_CHANGES, config_changes
from rollstream.rollout.rollout import RolloutStopped
from rollstream.runtime.build import check_inputs
from rollstream.runtime.controller import ControllerResult
from rollstream.runtime.run import Run, build_run
from rollstream.runtime.steps import save_model

if TYPE_CHECKING:
    from rollstream.reward.registry import RewardFn

log = logging.getLogger(__name__)


CHECK_PROMPTS = 4  # held-out prompts the final checkpoint's model round trip generates from
MERGED = "merged"  # a LoRA run's merged model in its final checkpoint (model.lora.export_merged)


SIGTERM_STOP = "SIGTERM received: stopped at a step boundary with a checkpoint"


class RunStopped(RuntimeError):
    """The run ended before its steps because it could not train; the message says why."""


def run_training(cfg: RunConfig, *,
                 rewards: Mapping[str, RewardFn] | None = None) -> dict[str, Any]:
    """Run one training job; returns (and writes) the summary. ``rewards``: source name -> a
    reward callable given as an object, in place of its source's named reward (the Python API,
    :func:`rollstream.run`)."""
    import torch

    check_inputs(cfg, rewards)
    run_dir = cfg.run_dir
    ckpt = resume_point(cfg, run_dir) if cfg.resume else None
    restarts = 0
    while True:
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        try:
            summary = asyncio.run(_run(cfg, run_dir, ckpt, rewards, trainer_restarts=restarts))
            break
        except BaseException as e:
            died = _rank_death(e)
            if died is None or cfg.train.backend != "fsdp":
                raise
            if restarts >= cfg.train.fsdp.max_restarts:
                raise RunStopped(f"{died}; train.fsdp.max_restarts = "
                                 f"{cfg.train.fsdp.max_restarts} restarts used") from e
            newest = durable.latest(run_dir)
            if newest is None:
                raise RunStopped(f"{died} before the run's first durable checkpoint: nothing to "
                                 "resume from (train.checkpoint_every)") from e
            if (missing := _missing_nodes(cfg)) is not None:
                raise RunStopped(
                    f"{died}; its ranks cannot start again: {missing}. The newest checkpoint "
                    f"is step {newest.step}: once such a node is up, run the same command with "
                    "--resume (resume=true) to continue from it") from e
            restarts += 1
            log.warning(f"trainer: {died}: resuming from the newest checkpoint (restart "
                        f"{restarts} of {cfg.train.fsdp.max_restarts})")
            cfg = cfg.model_copy(update={"resume": True})
            ckpt = resume_point(cfg, run_dir)
    if summary["stalled"]:
        raise RunStopped(summary["stop_reason"])
    return summary


def _missing_nodes(cfg: RunConfig) -> str | None:
    """Why a Ray run's resume could not place its actors: a role of ``runtime.ray.nodes``
    whose every node left the cluster (the trainer's, whose loss ended the run); None when
    each role has a live node, or the run has no roles (its Ray places actors anywhere)."""
    import sys

    ray = sys.modules.get("ray")
    if cfg.runtime.kind != "ray" or not cfg.runtime.ray.nodes.roles() or ray is None or \
            not ray.is_initialized():
        return None
    from rollstream.runtime.ray.nodes import check_cluster_has

    try:
        check_cluster_has(cfg.runtime.ray.nodes)
    except ValueError as e:
        return str(e)
    return None


def _rank_death(exc: BaseException) -> BaseException | None:
    """The :class:`~rollstream.train.fsdp.TrainerRankDied` that ended a run, found in the
    exception groups (the controller's task group) and causes around it; None if another
    error did."""
    from rollstream.train.fsdp import TrainerRankDied

    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, TrainerRankDied):
            return e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def resume_point(cfg: RunConfig, run_dir: Path) -> durable.Checkpoint | None:
    """The checkpoint ``cfg`` resumes (None: there is none, the run starts at step 0), read
    whole before anything in the run directory changes; a config that changed what the run
    means is refused, naming the fields, and so are checkpoint folders none of which is whole
    (a damaged newer one is skipped with a warning)."""
    def skipped(path: Path, why: str) -> None:
        log.warning(f"resume: skipped the damaged checkpoint {path.name}: {why}")

    try:
        ckpt = durable.latest(run_dir, on_skip=skipped)
    except durable.DamagedCheckpoint as e:
        raise durable.DamagedCheckpoint(
            f"resume=true: {e}. Nothing was changed. Restore a checkpoint, or move "
            f"{durable.folder(run_dir)} away to resume from step 0 (the ledger's lines then "
            "move to ledger.superseded.jsonl), or start a run of another name") from None
    if ckpt is None:
        log.info(f"resume: no checkpoint in {durable.folder(run_dir)}: starting at step 0")
        return None
    changed = config_changes(ckpt.state["config"], saved_config(cfg))
    if changed:
        raise ConfigError(
            f"resume=true: {ckpt.path} was written by a run whose config differs in "
            f"{', '.join(changed)}; resuming would not continue that run. Restore those "
            f"settings or start a new run (another name). A resume may change: "
            f"{', '.join(SAFE_CHANGES)}")
    if ckpt.step > cfg.train.steps:
        raise ConfigError(f"resume=true: {ckpt.path} has trained {ckpt.step} steps, more than "
                          f"train.steps = {cfg.train.steps}")
    log.info(f"resume: continuing from {ckpt.path} (step {ckpt.step})")
    return ckpt


async def _run(cfg: RunConfig, run_dir: Path, ckpt: durable.Checkpoint | None,
               rewards: Mapping[str, RewardFn] | None = None, *,
               trainer_restarts: int = 0) -> dict[str, Any]:
    t_start = time.perf_counter()
    run = await build_run(cfg, run_dir, resume=ckpt, rewards=rewards)
    on_sigterm = functools.partial(run.controller.request_stop, SIGTERM_STOP)
    with _on_sigterm(asyncio.get_running_loop(), on_sigterm), _closed_on_error(run):
        result, final = await _train(run)
    try:
        t_save = time.perf_counter()
        final_dir = save_checkpoint(run, run.files.final_checkpoint)
        save_s = time.perf_counter() - t_save
    finally:
        run.stop()  # the trainer (the fsdp backend's ranks), then the run's Ray
    checked = check_final(run, final_dir)
    summary = _summary(run, result, final, final_dir, time.perf_counter() - t_start)
    summary["trainer_restarts"] = trainer_restarts  # in this command (train.fsdp.max_restarts)
    summary["checkpoint_save_s"] = save_s
    summary["checkpoint_check"] = checked
    run.ledger.close()
    run.metrics.close()
    write_passes(run, run.files.engine_passes)
    run.files.summary.write_text(json.dumps(summary, indent=2))
    log.info(
        f"held-out reward {summary['reward_initial']:.3f} -> {summary['reward_final']:.3f} in "
        f"{summary['wall_s']:.0f} s ({summary['trained_samples']} trained samples); run dir: "
        f"{run_dir}")
    if summary["unfinished_samples"]:
        raise AssertionError(f"{len(summary['unfinished_samples'])} samples never reached a "
                             "terminal status")
    if cfg.monitor.report:
        from rollstream.monitor.report import write_report

        log.info(f"report: {write_report(run_dir)}")
    return summary


async def _train(run: Run) -> tuple[ControllerResult, dict[str, float]]:
    """Evaluate, train, evaluate again: the controller's result and the final held-out
    reward (NaN where the run stalled or was stopped by SIGTERM, which skip that evaluation).
    The engines, graders and harnesses are closed whatever happens."""
    result, final = ControllerResult(), {"reward": math.nan}
    async with _dashboard(run):
        try:
            run.totals.start(await _initial_eval(run))
            result = await run.controller.run()
            run.totals.stop()
            if result.stop_reason is not None:
                log.info(f"run stopped early: {result.stop_reason}")
            if not result.stalled and result.stop_reason != SIGTERM_STOP:
                final = await run.evaluations(result.steps_done)
        except RolloutStopped as e:  # no engine alive during an evaluation
            result.stop_reason, result.stalled = str(e), True
        finally:
            run.totals.stop()
            run.progress.close()
            await run.close()
    return result, final


async def _initial_eval(run: Run) -> dict[str, float]:
    """The held-out reward before training (a resumed run's checkpoint holds it)."""
    if run.resumed is not None:
        return run.totals.initial
    initial = await run.evaluations(0)
    if not run.evaluations.tasks:
        log.warning("no held-out task: the held-out reward is not measured")
    else:
        log.info(f"held-out reward at start: {initial['reward']:.3f}")
    return initial


@contextlib.asynccontextmanager
async def _dashboard(run: Run) -> AsyncIterator[None]:
    """The live dashboard (``monitor.dashboard``) serves while the block runs."""
    if not run.cfg.monitor.dashboard:
        yield
        return
    from rollstream.monitor.dashboard import Dashboard
    from rollstream.runtime.control import EngineControl

    dashboard = Dashboard(run.metrics, run.files.root, run.cfg.monitor, control=EngineControl(
        run.loop.fleet, asyncio.get_running_loop()))
    log.info(f"dashboard: {dashboard.start()}")
    try:
        yield
    finally:
        dashboard.stop()


@contextlib.contextmanager
def _closed_on_error(run: Run) -> Any:
    """A run that fails (a trainer rank died: ``run_training`` may resume it in this process)
    leaves its files closed, its trainer and its Ray stopped."""
    try:
        yield
    except BaseException:
        try:
            run.stop()
        finally:
            run.ledger.close()
            run.metrics.close()
        raise


@contextlib.contextmanager
def _on_sigterm(loop: asyncio.AbstractEventLoop, handler: Any) -> Any:
    """``handler`` runs on SIGTERM while the block runs (where the loop can take signals: the
    main thread)."""
    try:
        loop.add_signal_handler(signal.SIGTERM, handler)
    except (RuntimeError, ValueError, NotImplementedError):  # not the main thread
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def save_checkpoint(run: Run, final: Path) -> Path:
    """:func:`~rollstream.runtime.steps.save_model` at ``final``, written atomically: into a
    temporary folder beside it, then renamed into place (an older one is replaced only after
    the new one is complete), so a crash never leaves half a checkpoint under the final name.
    A folder that fails its check stays in the temporary folder the error names."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(run.trainer, run.tokenizer, tmp)
    if run.cfg.model.lora is not None and run.cfg.model.lora.export_merged:
        from rollstream.models.adapter import save_merged

        save_merged(tmp, tmp / MERGED)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def check_final(run: Run, folder: Path) -> dict[str, Any]:
    """The model round trip on the final checkpoint: ``AutoModelForCausalLM``'s greedy tokens
    for a few held-out prompts equal the embedded engine's (``check_model``); logged, and
    returned for the summary. A LoRA run's checkpoint is an adapter: its merged model is
    checked (``MERGED`` when exported, else written beside it for the check)."""
    from rollstream.models.adapter import is_adapter_folder, save_merged
    from rollstream.models.folder_check import check_model, probe_prompts

    if is_adapter_folder(folder) and not (folder / MERGED).is_dir():
        scratch = folder.with_name(f".{folder.name}.merged-{os.getpid()}")
        try:
            return check_final(run, save_merged(folder, scratch))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if is_adapter_folder(folder):
        folder = folder / MERGED

    t0 = time.perf_counter()
    prompts = ([list(t.prompt_ids) for t in run.evaluations.tasks[:CHECK_PROMPTS]]
               or probe_prompts(run.tokenizer))
    ties = check_model(folder, prompts, threads=run.cfg.engine.local.threads)
    for tie in ties:
        log.info(f"checkpoint check: {tie}")
    log.info(f"checkpoint check: AutoTokenizer and AutoModelForCausalLM read {folder} as "
             f"trained ({len(prompts)} prompts, {len(ties)} near ties)")
    return {"num_prompts": len(prompts), "ties": [str(t) for t in ties],
            "check_s": time.perf_counter() - t0}


def write_passes(run: Run, path: Path) -> None:
    """Append the forward-pass times of the engines that record them (the local engine's
    ``passes``, read after it stopped), the input of ``rollstream.sim.calibrate``."""
    from rollstream.engine.local.passes import PassTimes  # torch: loaded by now

    lines = [{"engine_id": e.engine_id, **line} for e in run.engines
             if isinstance(passes := getattr(e, "passes", None), PassTimes)
             for line in passes.lines()]
    if lines:
        with path.open("a") as fh:
            fh.writelines(json.dumps(line) + "\n" for line in lines)


def _summary(run: Run, result: ControllerResult, final: dict[str, float], ckpt: Path,
             wall_s: float) -> dict[str, Any]:
    unfinished = run.ledger.unfinished()
    initial, done = run.totals.initial, run.totals.done
    assert done is not None  # _train stopped the totals
    train_wall_s, train_tokens = done["train_wall_s"], done["generated_tokens"]
    return {
        "name": run.cfg.name,
        "mode": run.cfg.rollout.mode,
        "reward_initial": initial["reward"],
        "reward_final": final["reward"],
        "reward_initial_by_source": {k: v for k, v in initial.items() if k != "reward"},
        "reward_final_by_source": {k: v for k, v in final.items() if k != "reward"},
        "wall_s": wall_s,
        "train_wall_s": train_wall_s,
        "steps": result.steps_done,
        "trained_samples": run.ledger.counts["trained"],  # the whole run's, resumes included
        "resumed_from_step": run.resumed.step if run.resumed is not None else None,
        "superseded_ledger_lines": run.superseded_lines,
        "generated_tokens": train_tokens,
        "gen_tok_s": train_tokens / max(train_wall_s, 1e-9),
        "interrupts": run.loop.dispatcher.stats.num_interrupts,
        "engines": run.totals.work,
        "ledger": dict(run.ledger.counts),
        "unfinished_samples": [s.uid for s in unfinished],
        "stop_reason": result.stop_reason,
        "stalled": result.stalled,
        "checkpoint": str(ckpt),
    }
