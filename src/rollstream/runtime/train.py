"""``rollstream train``: run the components ``runtime/build.py`` builds from a config.

The embedded runtime: one process, one asyncio loop; engines run their step loops in their own
threads, the trainer in a dedicated thread, synchronous rewards in worker processes. A run:
check the inputs (before the run directory is touched), build, evaluate the held-out tasks,
train (evaluating every ``eval.every`` steps and checkpointing every
``train.checkpoint_every``), evaluate again, save the final checkpoint, write the summary and
the report (docs/run-dir.md). A run the rollout cannot feed (no engine alive, a stream of
untrainable groups) ends early with the diagnostic in ``summary.json``'s ``stop_reason`` and
raises :class:`RunStopped` after everything was written.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from rollstream.config import RunConfig
from rollstream.rollout.rollout import RolloutStopped
from rollstream.runtime.build import Run, build_run, check_inputs
from rollstream.runtime.controller import ControllerResult
from rollstream.runtime.evaluate import evaluate


class RunStopped(RuntimeError):
    """The run ended before its steps because it could not train; the message says why."""


def run_training(cfg: RunConfig) -> dict[str, Any]:
    """Run one training job; returns (and writes) the summary."""
    import torch

    check_inputs(cfg)
    run_dir = Path(cfg.run_root) / cfg.name
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    summary = asyncio.run(_run(cfg, run_dir))
    if summary["stalled"]:
        raise RunStopped(summary["stop_reason"])
    return summary


async def _run(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    from rollstream.monitor.progress import Progress

    t_start = time.perf_counter()
    run = build_run(cfg, run_dir)
    progress = Progress(cfg.monitor, cfg.train.steps)
    dashboard = None
    if cfg.monitor.dashboard:
        from rollstream.monitor.dashboard import Dashboard

        dashboard = Dashboard(run.metrics, run_dir, cfg.monitor)
        print(f"dashboard: {dashboard.start()}", flush=True)
    rounds = itertools.count()  # evaluation rounds (their group ids)
    controller, dispatcher = run.loop.controller, run.loop.dispatcher

    async def after_step(step: int, values: dict[str, float]) -> None:
        progress.update(step, values)
        done = step + 1
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.steps:
            await _eval(run, next(rounds), done)
        if cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0:
            path = await controller.in_trainer(
                save_checkpoint, run.trainer, run_dir / "checkpoints" / f"step_{done:06d}")
            run.metrics.record("phase", done, {"checkpoint_step": float(done)})
            print(f"checkpoint: {path}", flush=True)

    controller.after_step = after_step
    result, initial, final = ControllerResult(), {"reward": math.nan}, {"reward": math.nan}
    train_wall_s, train_tokens = 0.0, 0
    try:
        initial = await _eval(run, next(rounds), 0)
        if not run.eval_tasks:
            print("warning: no held-out task: the held-out reward is not measured", flush=True)
        else:
            print(f"held-out reward at start: {initial['reward']:.3f}", flush=True)
        t_train = time.perf_counter()
        tokens_before = dispatcher.stats.generated_tokens  # the initial evaluation's
        result = await controller.run()
        train_wall_s = time.perf_counter() - t_train
        train_tokens = dispatcher.stats.generated_tokens - tokens_before
        if result.stop_reason is not None:
            print(f"run stopped early: {result.stop_reason}", flush=True)
        if not result.stalled:
            final = await _eval(run, next(rounds), result.steps_done)
    except RolloutStopped as e:  # no engine alive during an evaluation
        result.stop_reason, result.stalled = str(e), True
    finally:
        progress.close()
        await run.close()
        if dashboard is not None:
            dashboard.stop()
    ckpt = save_checkpoint(run.trainer, run_dir / "checkpoint")
    summary = _summary(run, result, initial, final, ckpt, time.perf_counter() - t_start,
                       train_wall_s, train_tokens)
    run.ledger.close()
    run.metrics.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"held-out reward {summary['reward_initial']:.3f} -> {summary['reward_final']:.3f} in "
        f"{summary['wall_s']:.0f} s ({summary['trained_samples']} trained samples); run dir: {run_dir}",
        flush=True,
    )
    if summary["unfinished_samples"]:
        raise AssertionError(f"{len(summary['unfinished_samples'])} samples never reached a "
                             "terminal status")
    if cfg.monitor.report:
        from rollstream.monitor.report import write_report

        print(f"report: {write_report(run_dir)}", flush=True)
    return summary


async def _eval(run: Run, round_index: int, step: int) -> dict[str, float]:
    t0 = time.perf_counter()
    res = await evaluate(run.loop.dispatcher, run.eval_tasks, params=run.eval_params,
                         samples_per_task=run.cfg.eval.samples_per_task, round_index=round_index)
    if run.eval_tasks:
        run.metrics.record("eval", step, res)
        run.metrics.record("phase", step, {"eval_s": time.perf_counter() - t0})
    return res


def save_checkpoint(trainer: Any, final: Path) -> Path:
    """The trainer's HF folder at ``final``, written atomically: into a temporary folder
    beside it, then renamed into place (an older one is replaced only after the new one is
    complete), so a crash never leaves half a checkpoint under the final name."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.save_checkpoint(tmp)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _summary(run: Run, result: ControllerResult, initial: dict[str, float],
             final: dict[str, float], ckpt: Path, wall_s: float, train_wall_s: float,
             train_tokens: int) -> dict[str, Any]:
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
        "trained_samples": result.trained_samples,
        "generated_tokens": train_tokens,
        "gen_tok_s": train_tokens / max(train_wall_s, 1e-9),
        "interrupts": run.loop.dispatcher.stats.num_interrupts,
        "ledger": dict(run.ledger.counts),
        "unfinished_samples": [s.uid for s in unfinished],
        "stop_reason": result.stop_reason,
        "stalled": result.stalled,
        "checkpoint": str(ckpt),
    }
