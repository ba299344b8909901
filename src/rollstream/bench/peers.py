"""Benchmark: rollstream async vs TRL's ``GRPOTrainer`` on the same model, task and batch shape.

    rollstream bench peers [--json OUT] [--quick]

Both sides train the cached warm-started tiny model of examples/tick.yaml (CPU; rollstream at
the example's fp32, TRL in fp32 and in bf16) on tick prompts for the same number of steps; a
step is 16 prompts x 8 samples (128 samples), up to 240 new tokens at temperature 1.0,
group-normalised advantages, clipped token-mean objective (eps 0.2), no KL, AdamW lr 2e-4
(constant), grad clip 1.0, two optimizer updates per generated batch. The reward is the tick
source's registered reward (``exact_match``) called as a run calls it (text decoded with
special tokens skipped, ``finish_reason`` "stop" when the completion ended in eos), so a
properly ended answer scores 1 on both sides.

* rollstream: examples/tick.yaml's rollout (``async``, max_staleness 2, partial rollout), the
  engine thread pinned to core 0 and the trainer thread to core 1 with one torch thread each,
  and the bench setting of ``rollstream bench modes`` (``train.micro_batch_tokens=1024``).
* TRL (optional dependency of this benchmark only: ``pip install trl``; tested with 1.16.0):
  its default generation (Hugging Face ``generate`` on the whole 128-sample batch), one
  process, run four times: with one torch thread and with two (both cores, what its users
  would choose; on a busy shared machine one thread was faster), each in fp32 and in bf16
  (TRL's default mixed precision); the fastest run is the one compared and all are reported;
  ``num_generations=8``, 16 x 8 micro-batches
  x 8 accumulation steps = one update per 128 samples, ``num_iterations=2`` (two updates per
  generated batch, like ``updates_per_step: 2``), ``loss_type="dapo"`` (token mean over the
  batch), ``beta=0``, ``scale_rewards="group"``, ``lr_scheduler_type="constant"``. Set away
  from TRL's defaults: ``bf16=False`` in the fp32 runs, ``gradient_checkpointing=
  False`` (its default recomputes activations: slower, and no memory to save here),
  ``shuffle_dataset=False`` (both sides see the task stream in order), ``report_to="none"``,
  ``save_strategy="no"``, ``disable_tqdm=True``. The reward function rebuilds rollstream's
  grading input from the ``completion_ids`` it also receives (they keep the first eos, which
  gives ``finish_reason``).

Two shapes, each side run on both: ``tick`` (examples/tick.yaml: 16 prompts x 8 samples, 240
new tokens) and ``g16x8`` (8 prompts x 16 samples, 256 new tokens; ``--quick`` keeps the base's
token limit, which a test's tiny model can hold).

Samples/s = samples trained / training wall time (rollstream: the controller's run; TRL:
``trainer.train()``), model loading and evaluation excluded on both sides. A benchmark
measures; it does not assert. If TRL cannot run, the JSON says why.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollstream.bench.modes import bench_overrides, run_config
from rollstream.config import RunConfig, load_config
from rollstream.run_files import RunFiles

TICK_YAML = Path(__file__).resolve().parents[3] / "examples" / "tick.yaml"

# TRL's runs per shape, (torch threads, precision); the fastest is compared. Two threads were
# 10-30x slower than one on a busy VM and ~1.5x faster on a quiet one; bf16 is TRL's default.
TRL_RUNS: tuple[tuple[int, str], ...] = ((1, "fp32"), (2, "fp32"), (1, "bf16"), (2, "bf16"))
SHAPES: dict[str, tuple[str, ...]] = {
    "tick": (),
    "g16x8": ("rollout.group_size=16", "train.groups_per_step=8", "sampling.max_new_tokens=256"),
}


def run_rollstream(base: RunConfig, folder: Path, steps: int, run_root: Path,
                   overrides: Sequence[str], name: str = "peers-rollstream") -> dict[str, Any]:
    settings = [*bench_overrides(folder, run_root), f"name={name}",
                f"train.steps={steps}", "tasks.num_eval=16", "eval.samples_per_task=1"]
    cfg = load_config(TICK_YAML, [*overrides, *settings])
    row = run_config(cfg)
    metrics = [json.loads(x) for x in RunFiles(cfg.run_dir).metrics
               .read_text().splitlines() if x.strip()]
    rewards = [m["reward_mean"] for m in metrics if m.get("kind") == "train"]
    return {
        "config": f"{cfg.rollout.mode} k={cfg.rollout.staleness_bound} "
                  f"on_update={cfg.rollout.on_update}",
        "steps": row["steps"],
        "trained_samples": row["trained_samples"],
        "train_wall_s": row["train_wall_s"],
        "samples_per_s": row["trained_samples_per_s"],
        "gen_tok_s": row["gen_tok_s"],
        "trained_tok_s": row["trained_tok_s"],
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
        "load_after": os.getloadavg()[0],
        "overrides": settings,  # on top of examples/tick.yaml
    }


def trl_label(threads: int, precision: str) -> str:
    return f"{threads}t-{precision}"


def run_trl(base: RunConfig, folder: Path, steps: int, out_dir: Path,
            threads: int, precision: str = "fp32") -> dict[str, Any]:
    """TRL's GRPOTrainer for ``steps`` generated batches on ``threads`` torch threads, in
    ``precision`` (``fp32``, or ``bf16``: TRL's default mixed precision); raises ImportError
    without TRL."""
    import warnings

    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PrinterCallback,
        TrainerCallback,
    )

    with warnings.catch_warnings():  # TRL warns about the vLLM version it does not use here
        warnings.simplefilter("ignore", UserWarning)
        import trl
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

    from rollstream.data.mix import TaskMix
    from rollstream.data.sources import source_rewards
    from rollstream.reward import build_resolver, decode_response

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    mix = TaskMix(base.tasks, tokenizer)
    resolve = build_resolver(base.reward, source_rewards(base.tasks))
    g, n = base.rollout.group_size, base.train.groups_per_step
    tasks = [mix.next_task() for _ in range(steps * n)]
    data = Dataset.from_dict({"prompt": [t.prompt_text for t in tasks],
                              "task_index": list(range(len(tasks)))})
    batches: list[tuple[int, float]] = []  # (generated tokens, mean reward) per reward call

    def tick_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                    task_index: list[int], **_: Any) -> list[float]:
        eos = tokenizer.eos_token_id
        scores = []
        for i, ids in zip(task_index, completion_ids, strict=True):
            stop = "stop" if ids and ids[-1] == eos else "length"
            response = decode_response(tokenizer, ids, finish_reason=stop)
            scores.append(resolve(tasks[i]).score(tasks[i], response))
        batches.append((sum(map(len, completion_ids)), statistics.fmean(scores)))
        return scores

    micro = math.gcd(16, g * n)  # 16-sample micro-batches for the 128-sample step
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=precision == "bf16", fp16=False,
        gradient_checkpointing=False, seed=base.seed, data_seed=base.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=g * n // micro,
        num_generations=g, max_completion_length=base.sampling.max_new_tokens,
        temperature=base.sampling.temperature, top_p=1.0, top_k=0,
        num_iterations=base.train.updates_per_step, max_steps=steps * base.train.updates_per_step,
        learning_rate=base.train.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=base.train.weight_decay, max_grad_norm=base.train.grad_clip,
        beta=0.0, epsilon=base.train.clip_eps, loss_type="dapo", scale_rewards="group",
        shuffle_dataset=False, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    log_rows: list[dict[str, float]] = []

    class KeepLogs(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
                   **kw: Any) -> None:
            log_rows.append(dict(logs or {}))

    trainer = GRPOTrainer(model=model, reward_funcs=tick_reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[KeepLogs()])
    trainer.remove_callback(PrinterCallback)  # no log dict printed per step
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    samples = len(batches) * g * n
    return {
        "trl_version": trl.__version__,
        "torch_threads": threads,
        "precision": precision,
        "steps": len(batches),
        "optimizer_updates": trainer.state.global_step,
        "trained_samples": samples,
        "train_wall_s": wall,
        "samples_per_s": samples / wall,
        "gen_tok_s": sum(b[0] for b in batches) / wall,
        "train_reward_first": batches[0][1] if batches else None,
        "train_reward_last": batches[-1][1] if batches else None,
        "step_time_s_logged": [x["step_time"] for x in log_rows if "step_time" in x],
        "load_after": os.getloadavg()[0],
    }


def main(json_out: Path | None = None, quick: bool = False, *, run_root: Path | None = None,
         overrides: Sequence[str] = ()) -> dict[str, Any]:
    import torch

    from rollstream.models.warmstart import prepare_model

    # One torch thread here (a warm start that is not cached yet runs on it): two OpenMP
    # threads on a shared 2-core machine slow down many times when one core is busy.
    torch.set_num_threads(1)

    steps = 2 if quick else 10
    run_root = Path(run_root or tempfile.mkdtemp(prefix="bench-peers-"))
    load_before = os.getloadavg()
    shapes: dict[str, dict[str, Any]] = {}
    for shape, extra in SHAPES.items():
        extra = tuple(x for x in extra if not (quick and x.startswith("sampling.")))
        shape_overrides = [*overrides, *extra]
        base = load_config(TICK_YAML, shape_overrides)
        folder = prepare_model(base.model, base.tasks)
        print(f"bench peers [{shape}]: rollstream, {steps} steps ...", flush=True)
        ours = run_rollstream(base, folder, steps, run_root, shape_overrides,
                              name=f"peers-rollstream-{shape}")
        by_setting: dict[str, dict[str, Any]] = {}
        for threads, precision in TRL_RUNS:
            label = trl_label(threads, precision)
            print(f"bench peers [{shape}]: TRL GRPOTrainer, {threads} torch thread(s), "
                  f"{precision}, {steps} steps ...", flush=True)
            by_setting[label] = _trl_or_error(base, folder, steps,
                                              run_root / f"trl-{shape}-{label}", threads, precision)
        ran = [r for r in by_setting.values() if "samples_per_s" in r]
        theirs = max(ran, key=lambda r: r["samples_per_s"]) if ran else by_setting[
            trl_label(*TRL_RUNS[0])]
        shapes[shape] = {
            "overrides": list(extra), "samples_per_step": base.train.groups_per_step
            * base.rollout.group_size, "max_new_tokens": base.sampling.max_new_tokens,
            "model": str(folder), "rollstream": ours, "trl": theirs, "trl_by_setting": by_setting,
            "samples_per_s_vs_trl": ours["samples_per_s"] / theirs["samples_per_s"]
            if "samples_per_s" in theirs else None,
            "samples_per_s_vs_trl_by_setting": {
                k: ours["samples_per_s"] / r["samples_per_s"]
                for k, r in by_setting.items() if "samples_per_s" in r},
        }
    first = shapes["tick"]
    ratios = [sh["samples_per_s_vs_trl"] for sh in shapes.values()]
    worst = None if None in ratios else min(ratios)
    result = {
        "benchmark": "peers",
        "quick": quick,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "load_before": list(load_before),
                    "load_after": list(os.getloadavg())},
        "steps": steps,
        # the tick shape at top level (as before); every shape under "shapes"
        "samples_per_step": first["samples_per_step"],
        "model": first["model"],
        "rollstream": first["rollstream"],
        "trl": first["trl"],
        "samples_per_s_vs_trl": first["samples_per_s_vs_trl"],
        "samples_per_s_vs_trl_min_over_shapes": worst,
        "shapes": shapes,
        "target_ge_3x": None if worst is None else worst >= 3.0,
        "goal_ge_5x": None if worst is None else worst >= 5.0,
    }
    _print_table(result)
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result


def _trl_or_error(base: RunConfig, folder: Path, steps: int, out_dir: Path,
                  threads: int, precision: str) -> dict[str, Any]:
    try:
        return run_trl(base, folder, steps, out_dir, threads, precision)
    except ImportError as e:
        return {"error": f"TRL is not installed ({e}); `pip install trl` (tested: 1.16.0)"}
    except Exception as e:  # noqa: BLE001 - fault boundary: the JSON says why TRL did not run
        traceback.print_exc()
        return {"error": f"TRL failed: {type(e).__name__}: {e}"}


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)
    load = result["machine"]["load_before"][0]
    t = Table(title=f"rollstream vs TRL GRPOTrainer on tick ({result['steps']} steps per side; "
              f"load {load:.1f}{', quick' if result['quick'] else ''})")
    for col in ("shape", "system", "train s", "samples/s", "gen tok/s",
                "train reward first -> last", "rollstream x"):
        t.add_column(col, justify="right")
    for shape, sh in result["shapes"].items():
        label = f"{shape} ({sh['samples_per_step']} x {sh['max_new_tokens']} tok)"
        rows = [("rollstream", sh["rollstream"], None)]
        rows += [(f"TRL {k}", r, sh["samples_per_s_vs_trl_by_setting"].get(k))
                 for k, r in sh["trl_by_setting"].items()]
        for name, r, x in rows:
            if "error" in r:
                t.add_row(label, name, "-", "-", "-", r["error"], "-")
                continue
            t.add_row(label, name, f"{r['train_wall_s']:.1f}", f"{r['samples_per_s']:.1f}",
                      f"{r['gen_tok_s']:,.0f}",
                      f"{r['train_reward_first']:.3f} -> {r['train_reward_last']:.3f}",
                      "" if x is None else f"{x:.2f}")
    console.print(t)
    if result["samples_per_s_vs_trl_min_over_shapes"] is not None:
        console.print("samples/s vs TRL at its fastest setting: " + ", ".join(
            f"{shape} x{sh['samples_per_s_vs_trl']:.2f}" for shape, sh in result["shapes"].items()))
