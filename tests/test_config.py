from pathlib import Path

import pytest

from rollstream.config import ConfigError, RunConfig, load_config

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_example_config_loads_and_overrides_apply():
    cfg = load_config(EXAMPLES / "tick.yaml", ["train.lr=1e-3", "rollout.mode=sync",
                                               "tasks.sources.0.max_items=8", "engine.local.threads=2"])
    assert cfg.train.lr == 1e-3 and cfg.rollout.mode == "sync"
    assert cfg.tasks.sources[0].max_items == 8 and cfg.tasks.sources[0].kind == "tick"
    assert cfg.engine.local.threads == 2
    assert cfg.name == "tick-demo"  # untouched keys keep the file's values


def test_defaults_without_a_file():
    assert load_config(None) == RunConfig()


@pytest.mark.parametrize(
    "override, expected",
    [
        (["rollout.mode=fast"], ["rollout.mode", "'fast'", "'sync', 'one_step' or 'async'"]),
        (["train.lr=-1"], ["train.lr", "-1", "> 0"]),
        (["train.lrr=1"], ["unknown key 'train.lrr'", "did you mean 'lr'"]),
        (["engine.local.max_slot=3"], ["engine.local.max_slot", "did you mean 'max_slots'"]),
        (["rollout.group_size=zero"], ["rollout.group_size", "'zero'", "integer"]),
        (["nonsense=1"], ["unknown key 'nonsense'", "known keys under the top level"]),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    for text in expected:
        assert text in str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.lr=-1", "rollout.max_staleness=-2"])
    assert "2 problems" in str(info.value)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="not an index"):
        load_config(None, ["tasks.sources.5.kind=tick"])


def test_cross_field_check():
    with pytest.raises(ConfigError, match="multiple of model.tiny.num_kv_heads"):
        load_config(None, ["model.tiny.num_heads=4", "model.tiny.num_kv_heads=3"])


def test_config_is_frozen_and_light():
    import subprocess
    import sys

    cfg = RunConfig()
    with pytest.raises(Exception):
        cfg.train.lr = 1.0  # type: ignore[misc]
    out = subprocess.run([sys.executable, "-c", "import sys, rollstream.config; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True)
    assert out.stdout.strip() == "False"
