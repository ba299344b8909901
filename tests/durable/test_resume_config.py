"""A resume refuses a config that would make it another run, naming the fields."""

from __future__ import annotations

import pytest

from rollstream.config import ConfigError, RunConfig, load_config
from rollstream.durable import checkpoint as durable
from rollstream.durable.resume import config_changes
from rollstream.runtime.train import resume_point
from tests.durable.whole import ROLLOUT, model_saver, save_trainer


def _dump(*overrides: str) -> dict:
    return load_config(None, list(overrides)).model_dump(mode="json")


def test_only_safe_changes_pass():
    base = _dump("train.steps=10")
    assert config_changes(base, _dump("train.steps=40", "max_wall_s=60", "eval.every=5",
                                      "monitor.progress=false", "engine.local.threads=2",
                                      "resume=true", "train.checkpoint_every=3",
                                      "runtime.kind=ray")) == []
    changed = config_changes(base, _dump("train.steps=10", "rollout.group_size=4",
                                         "model.tiny.hidden_size=32", "train.lr=1e-3"))
    assert changed == ["model.tiny.hidden_size", "rollout.group_size", "train.lr"]
    tasks = config_changes(base, _dump("tasks.sources=[{kind: digits}]"))
    assert any(f.startswith("tasks.sources") for f in tasks), tasks


def test_a_field_added_since_the_checkpoint_is_not_a_change_at_its_default():
    saved = _dump("tasks.sources=[{kind: tick}, {kind: math, weight: 2}]")
    del saved["tasks"]["mix"]  # as written before tasks.mix and the source caps existed
    for source in saved["tasks"]["sources"]:
        del source["max_in_flight"]
    new = _dump("tasks.sources=[{kind: tick}, {kind: math, weight: 2}]")
    assert config_changes(saved, new) == []
    assert config_changes(saved, _dump("tasks.sources=[{kind: tick}, {kind: math, weight: 2}]",
                                       "tasks.mix=weighted")) == ["tasks.mix"]


def test_resume_point_names_the_fields_and_the_allowed_ones(tmp_path, kit_model):
    run_dir = tmp_path / "r"
    saved = RunConfig(name="r", run_root=str(tmp_path)).model_dump(mode="json")
    durable.write(run_dir, 4, {"config": saved, "rollout": ROLLOUT},
                  save_model=model_saver(kit_model), save_trainer=save_trainer, keep=2)
    ok = load_config(None, ["name=r", f"run_root={tmp_path}", "resume=true", "train.steps=90"])
    assert resume_point(ok, run_dir).step == 4
    bad = load_config(None, ["name=r", f"run_root={tmp_path}", "resume=true",
                             "rollout.group_size=4"])
    with pytest.raises(ConfigError, match=r"differs in rollout\.group_size.*may change: resume"):
        resume_point(bad, run_dir)
    few = load_config(None, ["name=r", f"run_root={tmp_path}", "resume=true", "train.steps=2"])
    with pytest.raises(ConfigError, match="trained 4 steps, more than train.steps = 2"):
        resume_point(few, run_dir)
    assert resume_point(ok, tmp_path / "none") is None  # no checkpoint: start at step 0


def test_a_fresh_run_of_the_same_name_keeps_nothing_of_the_last_one(tmp_path):
    """Every file a run appends to or reads back (the ledger and its replay events, metrics,
    timeline, reconfigurations, engine passes) is removed when a run of that name starts
    afresh; a resumed run keeps them."""
    from rollstream.runtime.build import prepare_run_dir

    cfg = RunConfig()
    names = ("ledger.jsonl", "replays.jsonl", "replays.superseded.jsonl", "metrics.jsonl",
             "timeline.jsonl", "reconfig.jsonl", "engine_passes.jsonl", "summary.json")
    for name in names:
        (tmp_path / name).write_text("{}\n")
    prepare_run_dir(cfg, tmp_path, resume=True)
    assert all((tmp_path / name).exists() for name in names)
    prepare_run_dir(cfg, tmp_path)
    assert not [name for name in names if (tmp_path / name).exists()]
    assert (tmp_path / "config.yaml").exists()
