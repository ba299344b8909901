"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import itertools
import math

import pytest

from rollstream.train.advantages import GRPO_EPS, compute_advantages


def close(a: list[float], b: list[float], tol: float = 1e-9) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def test_grpo_hand_computed() -> None:
    # rewards 1, 0, 0, 1: mean 0.5; sample std sqrt(1/3) (the default), population std 0.5
    got = compute_advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    s = 0.5 / (math.sqrt(1 / 3) + GRPO_EPS)
    assert close(got, [s, -s, -s, s])
    got = compute_advantages([1.0, 0.0, 0.0, 1.0], "grpo", std="population")
    s = 0.5 / (0.5 + GRPO_EPS)
    assert close(got, [s, -s, -s, s])
    # rewards 0, 1, 2: mean 1, sample std 1, population std sqrt(2/3)
    got = compute_advantages([0.0, 1.0, 2.0], "grpo", std="sample")
    assert close(got, [-1 / (1 + GRPO_EPS), 0.0, 1 / (1 + GRPO_EPS)])
    got = compute_advantages([0.0, 1.0, 2.0], "grpo", std="population")
    std = math.sqrt(2 / 3)
    assert close(got, [-1 / (std + GRPO_EPS), 0.0, 1 / (std + GRPO_EPS)])


def test_dr_grpo_hand_computed() -> None:
    assert close(compute_advantages([0.0, 1.0, 2.0], "dr_grpo"), [-1.0, 0.0, 1.0])
    assert close(compute_advantages([1.0, 0.0, 0.0, 0.0], "dr_grpo"), [0.75, -0.25, -0.25, -0.25])


def test_rloo_hand_computed() -> None:
    # r_i - mean(others): 1 - 0 = 1; 0 - 1/3; ...
    got = compute_advantages([1.0, 0.0, 0.0, 0.0], "rloo")
    assert close(got, [1.0, -1 / 3, -1 / 3, -1 / 3])
    assert close(compute_advantages([2.0, 4.0], "rloo"), [-2.0, 2.0])


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("std", ["sample", "population"])
def test_all_equal_and_singleton_groups_are_zero(kind: str, std: str) -> None:
    assert compute_advantages([0.7, 0.7, 0.7], kind, std=std) == [0.0, 0.0, 0.0]
    assert compute_advantages([3.0], kind, std=std) == [0.0]  # no n - 1 = 0 division


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_exhaustive_small_groups_sum_to_zero_and_keep_order(kind: str) -> None:
    for n in range(1, 5):
        for rewards in itertools.product([0.0, 0.5, 1.0], repeat=n):
            adv = compute_advantages(list(rewards), kind)
            assert abs(sum(adv)) < 1e-9
            for i, j in itertools.combinations(range(n), 2):  # monotone in the reward
                if rewards[i] > rewards[j]:
                    assert adv[i] > adv[j]
            if n > 1 and kind == "rloo":  # the leave-one-out definition
                loo = [r - (sum(rewards) - r) / (n - 1) for r in rewards]
                assert close(adv, loo)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown advantage kind 'ppo'"):
        compute_advantages([1.0], "ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        compute_advantages([], "grpo")
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([1.0, float("nan")], "grpo")
    with pytest.raises(ValueError, match="unknown std kind 'n'"):
        compute_advantages([1.0, 0.0], "grpo", std="n")  # type: ignore[arg-type]
