"""The training section's options and the settings that contradict each other."""

from __future__ import annotations

import pytest

from rollstream.config.loader import ConfigError, validate
from rollstream.train.losses import resolve_loss_agg


def test_defaults_are_the_verl_trl_expectations() -> None:
    train = validate({}).train
    assert train.loss == "auto" and train.loss_agg == "auto"
    assert train.advantage_std == "sample" and train.failed_reward == "exclude"
    assert resolve_loss_agg("auto", "grpo") == "token_mean"
    assert resolve_loss_agg("auto", "dr_grpo") == "seq_mean_token_sum_norm"
    assert resolve_loss_agg("seq_mean_token_mean", "rloo") == "seq_mean_token_mean"


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_dr_grpo_with_another_aggregation_names_both_fields(agg: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate({"train": {"advantage": "dr_grpo", "loss_agg": agg}})
    msg = str(info.value)
    assert f"train.loss_agg = {agg}" in msg and "train.advantage = dr_grpo" in msg
    ok = validate({"train": {"advantage": "dr_grpo", "loss_agg": "seq_mean_token_sum_norm"}})
    assert ok.train.loss_agg == "seq_mean_token_sum_norm"
    # the constant normaliser on its own is a valid choice with the other estimators
    assert validate({"train": {"advantage": "grpo", "loss_agg": "seq_mean_token_sum_norm"}})


@pytest.mark.parametrize("advantage", ["dr_grpo", "rloo"])
def test_population_std_without_grpo_names_both_fields(advantage: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate({"train": {"advantage": advantage, "advantage_std": "population"}})
    msg = str(info.value)
    assert "train.advantage_std = population" in msg and f"train.advantage = {advantage}" in msg
    assert validate({"train": {"advantage": "grpo", "advantage_std": "population"}})


def test_unknown_values_list_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match="train.loss_agg") as info:
        validate({"train": {"loss_agg": "mean"}})
    assert "seq_mean_token_sum_norm" in str(info.value)
    with pytest.raises(ConfigError, match="train.failed_reward"):
        validate({"train": {"failed_reward": "drop"}})


def test_fsdp_settings_need_the_fsdp_backend() -> None:
    with pytest.raises(ConfigError) as info:
        validate({"train": {"fsdp": {"world_size": 4}}})
    msg = str(info.value)
    assert "train.fsdp.world_size = 4" in msg and "train.backend = fsdp (it is local)" in msg
    with pytest.raises(ConfigError, match="train.backend"):
        validate({"train": {"backend": "ddp"}})
    ok = validate({"train": {"backend": "fsdp", "fsdp": {"world_size": 4}}}).train
    assert ok.backend == "fsdp" and ok.fsdp.world_size == 4
    assert validate({"train": {"fsdp": {"world_size": 2}}}).train.backend == "local"  # default
