"""``rollstream train``: build the components a config names and run the controller.

The embedded runtime: one process, one asyncio loop; engines run their step loops in their own
threads, the trainer in a dedicated thread. Writes the run directory (docs/run-dir.md).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import yaml

from rollstream.clock import WallClock
from rollstream.config import RunConfig
from rollstream.data.ledger import Ledger
from rollstream.engine.protocol import SamplingParams
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.runtime.controller import Controller
from rollstream.runtime.evaluate import evaluate


def run_training(cfg: RunConfig) -> dict[str, Any]:
    """Run one training job; returns (and writes) the summary."""
    import torch

    run_dir = Path(cfg.run_root) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("ledger.jsonl", "metrics.jsonl", "timeline.jsonl", "summary.json"):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    return asyncio.run(_run(cfg, run_dir))


async def _run(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from rollstream.data.sources import TaskMix
    from rollstream.engine.factory import build_engine
    from rollstream.models.warmstart import prepare_model
    from rollstream.monitor.metrics import Metrics
    from rollstream.monitor.progress import Progress
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.train.trainer import Trainer

    hf_logging.disable_progress_bar()
    t_start = time.perf_counter()
    model_path = Path(prepare_model(cfg.model, cfg.tasks))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    mix = TaskMix(cfg.tasks, tokenizer)
    metrics = Metrics(run_dir, cfg.monitor)
    clock = WallClock()
    ledger = Ledger(run_dir / "ledger.jsonl")
    for task_uid, source, reason in mix.rejected():
        print(f"warning: skipped task {task_uid}: {reason}", flush=True)
        ledger.record_rejected(task_uid, source, reason)
    engines = [
        build_engine(cfg.engine, model_path, engine_id=f"{cfg.engine.kind}-{i}", version=0)
        for i in range(cfg.engine.num_engines)
    ]
    resolve = (
        (lambda task: mix.source(task.source).score)
        if cfg.reward.name == "auto"
        else (lambda task, fn=get_reward(cfg.reward.name): fn)
    )
    graders = GraderPool(cfg.reward, resolve)
    eos = tokenizer.eos_token_id
    params = SamplingParams(
        temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
        max_new_tokens=cfg.sampling.max_new_tokens, stop_token_ids=(eos,) if eos is not None else (),
    )
    eval_params = SamplingParams(
        temperature=cfg.eval.temperature, max_new_tokens=cfg.sampling.max_new_tokens,
        stop_token_ids=params.stop_token_ids,
    )
    dispatcher = Dispatcher(
        engines=engines, params=params, graders=graders, ledger=ledger, clock=clock,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False), span=metrics.span,
    )
    trainer = Trainer(cfg.train, model_path, max_response_tokens=cfg.sampling.max_new_tokens,
                      temperature=cfg.sampling.temperature or 1.0)
    progress = Progress(cfg.monitor, cfg.train.steps)
    dashboard = None
    if cfg.monitor.dashboard:
        from rollstream.monitor.dashboard import Dashboard

        dashboard = Dashboard(metrics, run_dir, cfg.monitor)
        print(f"dashboard: {dashboard.start()}", flush=True)
    eval_tasks = mix.eval_tasks()

    async def run_eval(round_index: int, step: int) -> dict[str, float]:
        if not eval_tasks:
            return {"reward": float("nan")}
        t0 = time.perf_counter()
        res = await evaluate(dispatcher, eval_tasks, params=eval_params, ledger=ledger,
                             samples_per_task=cfg.eval.samples_per_task, round_index=round_index)
        metrics.record("eval", step, res)
        metrics.record("phase", step, {"eval_s": time.perf_counter() - t0})
        return res

    try:
        initial = await run_eval(0, 0)
        print(f"held-out reward at start: {initial['reward']:.3f}", flush=True)
        controller = Controller(
            rollout=cfg.rollout, train=cfg.train, tasks=mix, dispatcher=dispatcher,
            trainer=trainer, ledger=ledger, metrics=metrics, clock=clock,
            on_step=progress.update, max_wall_s=cfg.max_wall_s,
        )
        t_train = time.perf_counter()
        tokens_before = dispatcher.stats.generated_tokens  # the initial evaluation's
        result = await controller.run()
        train_wall_s = time.perf_counter() - t_train
        train_tokens = dispatcher.stats.generated_tokens - tokens_before
        final = await run_eval(1, result.steps_done)
        ckpt = trainer.save_checkpoint(run_dir / "checkpoint")
    finally:
        progress.close()
        for e in engines:
            close = getattr(e, "close", None)
            if close is not None:
                await close()
        await _maybe_await(getattr(graders, "close", None))
        if dashboard is not None:
            dashboard.stop()
    unfinished = ledger.unfinished()
    summary = {
        "name": cfg.name,
        "mode": cfg.rollout.mode,
        "reward_initial": initial["reward"],
        "reward_final": final["reward"],
        "reward_initial_by_source": {k: v for k, v in initial.items() if k != "reward"},
        "reward_final_by_source": {k: v for k, v in final.items() if k != "reward"},
        "wall_s": time.perf_counter() - t_start,
        "train_wall_s": train_wall_s,
        "steps": result.steps_done,
        "trained_samples": result.trained_samples,
        "generated_tokens": train_tokens,
        "gen_tok_s": train_tokens / max(train_wall_s, 1e-9),
        "interrupts": dispatcher.stats.num_interrupts,
        "ledger": dict(ledger.counts),
        "unfinished_samples": [s.uid for s in unfinished],
        "checkpoint": str(ckpt),
    }
    ledger.close()
    metrics.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"held-out reward {summary['reward_initial']:.3f} -> {summary['reward_final']:.3f} in "
        f"{summary['wall_s']:.0f} s ({summary['trained_samples']} trained samples); run dir: {run_dir}",
        flush=True,
    )
    if unfinished:
        raise AssertionError(f"{len(unfinished)} samples never reached a terminal status")
    if cfg.monitor.report:
        from rollstream.monitor.report import write_report

        print(f"report: {write_report(run_dir)}", flush=True)
    return summary


async def _maybe_await(fn: Any) -> None:
    if fn is None:
        return
    res = fn()
    if asyncio.iscoroutine(res):
        await res
