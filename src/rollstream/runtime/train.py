"""``rollstream train``: run the components ``runtime/build.py`` builds from a config.

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
import json
import logging
import math
import os
import random
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.config import ConfigError, RunConfig
from rollstream.config.redact import saved_config
from rollstream.durable import checkpoint as durable
from rollstream.durable.resume import SAFE_CHANGES, config_changes
from rollstream.rollout.rollout import RolloutStopped
from rollstream.runtime.build import Run, build_run, check_inputs
from rollstream.runtime.controller import ControllerResult
from rollstream.runtime.evaluate import evaluate

if TYPE_CHECKING:
    from rollstream.reward.registry import RewardFn

log = logging.getLogger(__name__)


CHECK_PROMPTS = 4  # held-out prompts the final checkpoint's model round trip generates from


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
            if durable.latest(run_dir) is None:
                raise RunStopped(f"{died} before the run's first durable checkpoint: nothing to "
                                 "resume from (train.checkpoint_every)") from e
            restarts += 1
            log.warning(f"trainer: {died}: resuming from the newest checkpoint (restart "
                        f"{restarts} of {cfg.train.fsdp.max_restarts})")
            cfg = cfg.model_copy(update={"resume": True})
            ckpt = resume_point(cfg, run_dir)
    if summary["stalled"]:
        raise RunStopped(summary["stop_reason"])
    return summary


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
    from rollstream.monitor.progress import Progress

    t_start = time.perf_counter()
    run = await build_run(cfg, run_dir, resume=ckpt, rewards=rewards)
    progress = Progress(cfg.monitor, cfg.train.steps)
    dashboard = None
    if cfg.monitor.dashboard:
        from rollstream.monitor.dashboard import Dashboard
        from rollstream.runtime.control import EngineControl

        dashboard = Dashboard(run.metrics, run_dir, cfg.monitor, control=EngineControl(
            run.loop.dispatcher, asyncio.get_running_loop()))
        log.info(f"dashboard: {dashboard.start()}")
    saved = ckpt.state if ckpt is not None else {}
    next_round = saved.get("eval_rounds", 0)  # evaluation rounds (their group ids)

    def new_round() -> int:
        nonlocal next_round
        next_round += 1
        return next_round - 1
    controller, dispatcher = run.loop.controller, run.loop.dispatcher
    for e in run.engines:  # the local engine's pass recorder bins passes during training apart
        if (passes := getattr(e, "passes", None)) is not None:
            passes.training = lambda: controller.training
    totals = dict(saved.get("totals", {"train_wall_s": 0.0, "generated_tokens": 0}))
    result, initial, final = ControllerResult(), {"reward": math.nan}, {"reward": math.nan}
    last_ckpt = ckpt.step if ckpt is not None else -1
    t_train, tokens_before = time.perf_counter(), 0
    work_before: dict[str, dict[str, float]] = {}
    done_totals: dict[str, Any] | None = None
    work_done: dict[str, dict[str, float]] = {}

    def so_far() -> dict[str, Any]:
        return {"train_wall_s": totals["train_wall_s"] + time.perf_counter() - t_train,
                "generated_tokens": totals["generated_tokens"]
                + dispatcher.stats.generated_tokens - tokens_before, "initial": initial}

    async def checkpoint(done: int) -> None:
        nonlocal last_ckpt
        t0 = time.perf_counter()
        await run.loop.sync.wait_applied()  # the engines serve version `done`
        t_hold = time.perf_counter()
        state = {"config": saved_config(cfg), "version": done,
                 "eval_rounds": next_round, "totals": so_far(),
                 "rollout": await run.loop.rollout.snapshot(),
                 "reconfig": run.loop.reconfigure.state()}
        held_s = time.perf_counter() - t_hold
        state["logs"] = run.metrics.sync()  # what a resume finds past these was lost
        state["config_hash"] = durable.config_hash(state["config"])
        path = await controller.in_trainer(
            lambda: durable.write(run_dir, done, state, save_model=lambda d: save_model(run, d),
                                  save_trainer=run.trainer.save_training_state,
                                  keep=cfg.train.keep_checkpoints))
        last_ckpt = done
        run.metrics.record("phase", done, {"checkpoint_step": float(done),
                                           "checkpoint_hold_s": held_s,
                                           "checkpoint_s": time.perf_counter() - t0})
        log.info(f"checkpoint: {path} (generation held {held_s * 1e3:.0f} ms)")

    async def after_step(step: int, values: dict[str, float]) -> None:
        progress.update(step, values)
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.steps:
            await _eval(run, new_round(), done)
        if cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0:
            await checkpoint(done)

    async def before_stop(res: ControllerResult) -> None:
        # a stalled run (no engine alive) checkpoints its stranded partial samples too
        if res.stalled or res.steps_done != last_ckpt:
            await checkpoint(res.steps_done)

    controller.after_step = after_step
    controller.before_stop = before_stop
    loop = asyncio.get_running_loop()
    stop_msg = "SIGTERM received: stopped at a step boundary with a checkpoint"
    with _on_sigterm(loop, lambda: controller.request_stop(stop_msg)), \
            _closed_on_error(run):
        try:
            if ckpt is not None:
                initial = saved["totals"]["initial"]
            else:
                initial = await _eval(run, new_round(), 0)
                if not run.eval_tasks:
                    log.warning("no held-out task: the held-out reward is not measured")
                else:
                    log.info(f"held-out reward at start: {initial['reward']:.3f}")
            t_train = time.perf_counter()
            tokens_before = dispatcher.stats.generated_tokens  # the initial evaluation's
            work_before = engine_work(run)
            result = await controller.run()
            done_totals, work_done = so_far(), engine_work(run)
            if result.stop_reason is not None:
                log.info(f"run stopped early: {result.stop_reason}")
            if not result.stalled and result.stop_reason != stop_msg:
                final = await _eval(run, new_round(), result.steps_done)
        except RolloutStopped as e:  # no engine alive during an evaluation
            result.stop_reason, result.stalled = str(e), True
        finally:
            if done_totals is None:
                done_totals, work_done = so_far(), engine_work(run)
            progress.close()
            await run.close()
            if dashboard is not None:
                dashboard.stop()
    try:
        t_save = time.perf_counter()
        final_dir = save_checkpoint(run, run_dir / "checkpoint")
        save_s = time.perf_counter() - t_save
    finally:
        run.stop()  # the trainer (the fsdp backend's ranks), then the run's Ray
    checked = check_final(run, final_dir)
    summary = _summary(run, result, initial, final, final_dir, time.perf_counter() - t_start,
                       done_totals["train_wall_s"], done_totals["generated_tokens"],
                       engines={k: {n: v - work_before.get(k, {}).get(n, 0.0)
                                    for n, v in w.items()}
                                for k, w in work_done.items()})
    summary["trainer_restarts"] = trainer_restarts  # in this command (train.fsdp.max_restarts)
    summary["checkpoint_save_s"] = save_s
    summary["checkpoint_check"] = checked
    run.ledger.close()
    run.metrics.close()
    write_passes(run, run_dir / "engine_passes.jsonl")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
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


async def _eval(run: Run, round_index: int, step: int) -> dict[str, float]:
    t0 = time.perf_counter()
    res = await evaluate(run.loop.dispatcher, run.eval_tasks, params=run.eval_params,
                         samples_per_task=run.cfg.eval.samples_per_task, round_index=round_index)
    if run.eval_tasks:
        run.metrics.record("eval", step, res)
        run.metrics.record("phase", step, {"eval_s": time.perf_counter() - t0})
    return res


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


def save_model(run: Run, folder: Path) -> Path:
    """The trainer's HF folder, its ``generation_config.json`` stopping at the chat's
    end-of-turn token as well, and its tokenizer checked: ``AutoTokenizer`` reads it as the
    run's (every save; ``models/folder_check.py``)."""
    from rollstream.models.folder_check import check_tokenizer, write_stop_tokens

    run.trainer.save_checkpoint(folder)
    write_stop_tokens(folder, run.tokenizer)
    check_tokenizer(folder, run.tokenizer)
    return folder


def save_checkpoint(run: Run, final: Path) -> Path:
    """:func:`save_model` at ``final``, written atomically: into a temporary folder beside it,
    then renamed into place (an older one is replaced only after the new one is complete), so
    a crash never leaves half a checkpoint under the final name. A folder that fails its
    check stays in the temporary folder the error names."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(run, tmp)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def check_final(run: Run, folder: Path) -> dict[str, Any]:
    """The model round trip on the final checkpoint: ``AutoModelForCausalLM``'s greedy tokens
    for a few held-out prompts equal the embedded engine's (``check_model``); logged, and
    returned for the summary."""
    from rollstream.models.folder_check import check_model, probe_prompts

    t0 = time.perf_counter()
    prompts = ([list(t.prompt_ids) for t in run.eval_tasks[:CHECK_PROMPTS]]
               or probe_prompts(run.tokenizer))
    ties = check_model(folder, prompts, threads=run.cfg.engine.local.threads)
    for tie in ties:
        log.info(f"checkpoint check: {tie}")
    log.info(f"checkpoint check: AutoTokenizer and AutoModelForCausalLM read {folder} as "
             f"trained ({len(prompts)} prompts, {len(ties)} near ties)")
    return {"num_prompts": len(prompts), "ties": [str(t) for t in ties],
            "check_s": time.perf_counter() - t0}


def engine_work(run: Run) -> dict[str, dict[str, float]]:
    """Each engine's busy seconds and where they went (``EngineStats.work``), totals so far."""
    return {e.engine_id: {"busy_s": (st := e.stats()).busy_s, **st.work} for e in run.engines}


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


def _summary(run: Run, result: ControllerResult, initial: dict[str, float],
             final: dict[str, float], ckpt: Path, wall_s: float, train_wall_s: float,
             train_tokens: int, engines: dict[str, dict[str, float]]) -> dict[str, Any]:
    unfinished = run.ledger.unfinished()
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
        "engines": engines,
        "ledger": dict(run.ledger.counts),
        "unfinished_samples": [s.uid for s in unfinished],
        "stop_reason": result.stop_reason,
        "stalled": result.stalled,
        "checkpoint": str(ckpt),
    }
