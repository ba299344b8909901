"""The tiny run the fsdp tests train (a 2-layer model of width 32, no warm start, tick tasks
of up to 4 items, 2 groups of 4 a step, 2 ranks): one definition for the process and Ray
rank tests."""

from __future__ import annotations

from pathlib import Path


def tiny_fsdp_run(tmp_path: Path, name: str, *, mode: str, steps: int,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """Overrides of a ``steps``-step ``mode`` run named ``name`` under ``tmp_path``."""
    return [
        "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.tiny.max_position=64", "model.warm_start.steps=0",
        f"model.cache_dir={tmp_path / 'cache'}", f"run_root={tmp_path}", f"name={name}",
        "tasks.sources=[{kind: tick, max_items: 4}]", "tasks.num_eval=0",
        "engine.local.max_seq_len=64", "sampling.max_new_tokens=16", f"rollout.mode={mode}",
        "rollout.group_size=4", "rollout.filter_zero_variance=false", f"train.steps={steps}",
        "train.groups_per_step=2", "train.micro_batch_tokens=64", "train.backend=fsdp",
        "train.fsdp.world_size=2", "monitor.progress=false", *extra]


def assert_resumed_whole(run_dir: Path, steps: int) -> None:
    """A run that lost its trainer mid-way and resumed: every step trained once (what the
    lost process trained past its checkpoint is superseded), no sample lost or repeated."""
    import json

    from rollstream.durable.audit import audit_run

    trained = [m["step"] for m in map(json.loads, (run_dir / "metrics.jsonl").open())
               if m["kind"] == "train"]
    assert trained == list(range(steps)), trained
    audit = audit_run(run_dir, group_size=4, eval_group_size=4, groups_per_step=2, steps=steps)
    assert audit["lost_samples"] == audit["duplicated_samples"] == 0, audit
    assert audit["steps_repeated"] == audit["steps_missing"] == 0, audit
