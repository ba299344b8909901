"""bench/sampling.py's accounting of where generation went, on a constructed ledger: the parts
sum to what was generated, zero-variance groups are told apart from other filtered ones, and
the bucket model drawn as the run drew reproduces the run's ratio."""

from __future__ import annotations

import pytest

from rollstream.bench.sampling import bucket_model, waste_breakdown
from rollstream.data.ledger_row import LedgerRow
from rollstream.trajectory import SampleStatus


def _row(group: str, i: int, status: str, tokens: int, reward: float | None,
         reason: str | None = None) -> LedgerRow:
    return LedgerRow(sample_uid=f"{group}/{i}", task_uid=group.split("#")[0], source="s",
                     status=SampleStatus(status), num_tokens=tokens, reward=reward,
                     reason=reason)


def _ledger() -> list[LedgerRow]:
    zero = "zero reward variance in group (every reward 1)"
    return [
        # bucket a: one group trained (10 + 30 tokens), one all correct (2 x 5)
        _row("s/train/0#g0", 0, "trained", 10, 1.0), _row("s/train/0#g0", 1, "trained", 30, 0.0),
        _row("s/train/1#g1", 0, "filtered", 5, 1.0, zero),
        _row("s/train/1#g1", 1, "filtered", 5, 1.0, zero),
        # bucket b: one all wrong (2 x 50), one with a sample dropped stale (trained 20, 40)
        _row("s/train/2#g2", 0, "filtered", 50, 0.0, zero.replace("1)", "0)")),
        _row("s/train/2#g2", 1, "filtered", 50, 0.0, zero.replace("1)", "0)")),
        _row("s/train/3#g3", 0, "trained", 20, 1.0),
        _row("s/train/3#g3", 1, "dropped_stale", 40, 0.0),
        # a group filtered because nothing was graded is not zero variance; eval is left out
        _row("s/train/4#g4", 0, "filtered", 7, None, "no sample of the group was graded"),
        _row("s/eval/0#eval0", 0, "evaluated", 99, 1.0),
    ]


def _bucket(task_uid: str) -> str:
    return "a" if task_uid.endswith(("/0", "/1", "/4")) else "b"


def test_waste_breakdown_splits_generated_tokens():
    got = waste_breakdown(_ledger(), _bucket)
    tokens = got["tokens"]
    assert tokens == {"generated": 217, "trained": 60, "all_correct": 10, "all_wrong": 100,
                      "other": 47}
    assert sum(v for k, v in tokens.items() if k != "generated") == tokens["generated"]
    a, b = got["buckets"]["a"], got["buckets"]["b"]
    assert a["groups"] == 3 and a["zero_variance"] == pytest.approx(1 / 3)
    assert a["gen_per_group"] == pytest.approx((40 + 10 + 7) / 3)
    assert a["trained_per_group"] == pytest.approx(40 / 3)
    assert b["groups"] == 2 and b["zero_variance"] == 0.5
    assert (b["gen_per_group"], b["trained_per_group"]) == (80, 10)


def test_bucket_model_as_drawn_is_the_runs_ratio_and_pass_rates_favour_informative():
    buckets = waste_breakdown(_ledger(), _bucket)["buckets"]
    model = bucket_model(buckets)
    assert model["as_drawn"] == pytest.approx(217 / 60)
    # weights 3 x 2/3 and 2 x 1/2: (2 x 57/3 + 160/2) / (2 x 40/3 + 20/2)
    assert model["by_pass_rate"] == pytest.approx((38 + 80) / (80 / 3 + 10))
    assert model["by_pass_rate"] < model["as_drawn"]
