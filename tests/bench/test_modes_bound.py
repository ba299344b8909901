"""bench modes' bound on this machine and each row's share of it as a product of factors."""

from __future__ import annotations

import pytest

from rollstream.bench.modes_bound import factors_line, machine_bound, share_of_bound


def row(*, wall: float, steps: int = 4, trainer_step: float, generated: int, trained: int,
        idle: float = 0.1) -> dict:
    return {"train_wall_s": wall, "steps": steps, "trainer_step_s": trainer_step,
            "generated_tokens": generated, "gen_tok_s": generated / wall,
            "trained_tokens": trained, "trained_tok_s": trained / wall,
            "engine_idle_share": idle}


def test_a_trainer_bound_run_splits_its_share_into_stepping_and_cost_per_token():
    # sync: 4 steps of 10 s, 6 of them training; generating its tokens at 1000 tok/s takes 2 s
    rows = {"sync": row(wall=40.0, trainer_step=6.0, generated=8000, trained=4000),
            "async": row(wall=28.0, trainer_step=6.6, generated=8000, trained=3600)}
    b = machine_bound(rows, saturated_tok_s=1000.0)
    assert b.bound_by == "trainer" and b.bound == pytest.approx(10 / 6)
    s = share_of_bound(rows["async"], rows["sync"], b)
    assert s["share"] == pytest.approx((3600 / 28) / (4000 / 40) / (10 / 6))
    assert s["trainer_stepping"] == pytest.approx(4 * 6.6 / 28)
    assert s["trainer_cost_per_token_vs_sync"] == pytest.approx((6.6 / 900) / (6.0 / 1000))
    assert s["trainer_stepping"] / s["trainer_cost_per_token_vs_sync"] == pytest.approx(s["share"])
    assert "trainer stepping 0.94" in factors_line("async", s)


def test_a_generation_bound_run_splits_its_share_into_the_engine_rate_and_the_yield():
    # sync generates 40,000 tokens a step: 10 s at the best rate, against a 2 s trainer step
    rows = {"sync": row(wall=60.0, trainer_step=2.0, generated=160_000, trained=60_000),
            "async": row(wall=45.0, trainer_step=2.4, generated=150_000, trained=63_000,
                         idle=0.2)}
    b = machine_bound(rows, saturated_tok_s=4000.0)
    assert b.bound_by == "generation" and b.best_rate == 4000.0
    assert b.bound == pytest.approx(15 / 10)
    s = share_of_bound(rows["async"], rows["sync"], b)
    rate = 150_000 / 45 / 4000
    assert s["engine_rate_vs_best"] == pytest.approx(rate)
    assert s["engine_busy"] * s["engine_rate_while_busy_vs_best"] == pytest.approx(rate)
    assert s["trained_per_generated_vs_sync"] == pytest.approx((63 / 150) / (60 / 160))
    assert rate * s["trained_per_generated_vs_sync"] == pytest.approx(s["share"])
    # a row faster than the probe raises the best rate, and with it the bound
    rows["async"] = row(wall=30.0, trainer_step=2.4, generated=150_000, trained=63_000)
    assert machine_bound(rows, saturated_tok_s=4000.0).best_rate == pytest.approx(5000.0)
