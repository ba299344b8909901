"""Smoke test of ``rollstream bench modes --quick`` on a tiny model: it runs every config and
writes the documented keys (it measures nothing)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rollstream.bench.modes import (
    DRAIN_PAIR,
    HEADLINE_ASYNC,
    main,
    merge_repeats,
    mode_configs,
    ratio_by_seed,
    row_config,
    run_order,
)

TINY = [
    "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
    "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64", "model.tiny.max_position=96",
    "model.warm_start.steps=3", "model.warm_start.tokens_per_step=256",
    "tasks.sources=[{kind: tick, max_items: 4}]", "tasks.num_eval=8",
    "engine.local.max_slots=16", "engine.local.max_seq_len=96", "sampling.max_new_tokens=24",
    "rollout.group_size=4", "train.groups_per_step=2", "train.updates_per_step=1",
    "rollout.filter_zero_variance=false",
]


def test_bench_modes_quick_writes_json(tmp_path, tiny_run_cache):
    out = tmp_path / "modes.json"
    result = main(json_out=out, quick=True, run_root=tmp_path / "runs",
                  overrides=[*TINY, f"model.cache_dir={tiny_run_cache}"])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    for key in ("async_partial_vs_sync_throughput", "engine_utilization_async", "reward_sync",
                "reward_async", "async_ceiling_vs_sync", "reward_noise_2se", "reward_noise"):
        assert key in written and not isinstance(written[key], str), key
    assert written["async_config"] == HEADLINE_ASYNC
    assert set(written["rows"]) == {label for label, _ in mode_configs("admission")}
    samples = {r["trained_samples"] for r in written["rows"].values()}
    assert samples == {2 * 2 * 4}, samples  # steps x groups x group size, every config
    for label, row in written["rows"].items():
        assert row["trained_tok_s"] > 0 and row["gen_tok_s"] >= row["trained_tok_s"], label
        assert 0 <= row["reward_final"] <= 1, label
        for key in ("dropped_stale", "filtered", "aborted", "interrupts"):
            assert row[key] >= 0, (label, key)
        # the run's end after its last generated token: at least the last trainer step
        assert 0 < row["end_tail_s"] < row["train_wall_s"], label
        assert row["engine_busy_before_tail"] > 1 - row["engine_idle_share"], label
        tok = row["tokens"]  # the parts of the generated tokens add up
        assert tok["generated"] == sum(v for k, v in tok.items() if k != "generated") > 0, tok
        assert tok["kept"] == row["trained_tokens"], label
        work = row["engine_work"]  # the engine's busy time splits into its kinds of work
        assert work["prefill_count"] > 0 and work["decode_count"] > 0, work
        assert work["fused_prefill_count"] >= 0
        parts = sum(work[k] for k in ("prefill_s", "recompute_s", "sort_s", "decode_s"))
        assert 0 < parts <= work["busy_s"] + 1e-6, work
        # chunked attention reads at least what the rows hold, in at least a chunk a pass
        assert work["attention_work"] >= work["attention_positions"] > 0, work
        assert work["attention_chunks"] >= work["decode_count"], work
        assert 0 <= row["engine_idle_share"] < 1 and 0 <= row["trainer_idle_share"] < 1
        assert 0 <= row["staleness_blocked"] <= 1 and 0 <= row["gate_blocked"] <= 1, label
    # sync admits one batch, then waits at its staleness limit until that batch has trained
    assert written["rows"]["sync"]["staleness_blocked"] > 0
    assert set(written["trainer_process_vs_thread"]) == {HEADLINE_ASYNC, "async_k2_drain"}
    assert all(r > 0 for r in written["trainer_process_vs_thread"].values())
    assert written["rows"]["sync"]["max_staleness"] == 0
    assert written["rows"]["async_k4_drain"]["max_staleness"] == 4
    assert written["rows"]["async_k4_drain"]["on_update"] == "drain"
    assert written["rows"][HEADLINE_ASYNC]["on_update"] == "continue"  # tick_long.yaml's
    assert written["probe"]["saturated_tok_s"] > 0
    # each row's share of the bound, a product of its two factors (rows run once: exactly)
    shares, by = written["share_of_bound"], written["async_bound_by"]
    assert set(shares) == set(written["rows"]) and by in ("trainer", "generation")
    assert shares[written["async_best_async_config"]]["share"] == \
        written["async_best_share_of_bound"]
    for s in shares.values():
        product = (s["trainer_stepping"] / s["trainer_cost_per_token_vs_sync"]
                   if by == "trainer" else
                   s["engine_rate_vs_best"] * s["trained_per_generated_vs_sync"])
        assert product == pytest.approx(s["share"], rel=1e-9)
    assert math.isfinite(written["engine_utilization_async"])
    head, probe = written["rows"][HEADLINE_ASYNC], written["probe"]
    assert written["engine_busy_async"] == pytest.approx(1 - head["engine_idle_share"])
    assert written["targets"]["engine_busy_async_ge_0.85"] == (written["engine_busy_async"] >= 0.85)
    assert written["engine_utilization_async_contended"] == pytest.approx(
        head["gen_tok_s"] / probe["engine_tok_s_with_trainer"])
    assert 0 <= written["rollout_share_sync"] <= 1
    assert written["config"].endswith("examples/tick_long.yaml")
    assert 1 <= written["async_bound_vs_sync"] <= written["async_ceiling_vs_sync"] + 1e-9
    assert written["async_best_config"] in written["rows"]
    assert written["async_best_async_config"] != "sync"
    assert written["async_best_share_of_bound"] > 0 and written["async_partial_vs_drain"] > 0
    assert written["samples_per_s_run_to_run"] == {}  # quick: every row runs once
    assert written["async_partial_vs_drain_by_seed"] == {}
    assert set(written["probe"]["tok_s_by_batch"]) == {"1", "4", "16", "64"}
    sem = written["staleness_semantics"]  # each semantics has its row, the base's headlines
    assert set(sem) == {"drop", "mask", "admission"}
    assert sem["admission"]["row"] == HEADLINE_ASYNC
    for rule, r in sem.items():
        assert written["rows"][r["row"]]["staleness_rule"] == rule
        assert written["rows"][r["row"]]["loss"] == written["rows"][HEADLINE_ASYNC]["loss"]
    assert sem["drop"]["masked_tokens"] == sem["admission"]["masked_tokens"] == 0
    assert written["rows"][sem["admission"]["row"]]["max_context_age"] == 4
    assert written["rows"][sem["drop"]["row"]]["max_context_age"] == 2
    assert written["rows"][sem["mask"]["row"]]["max_token_age"] == 2
    ages = {label: row["max_token_age"] for label, row in written["rows"].items()
            if label != sem["mask"]["row"]}
    assert set(ages.values()) == {None}  # the base does not mask: no other row does


def test_bench_config_is_an_option_of_modes_and_pair_only(capsys):
    from rollstream.cli import main as cli

    assert cli(["bench", "engine", "--config", "examples/tick_long.yaml"]) == 2
    assert "--config is an option of `modes` and `pair` only" in capsys.readouterr().err
    assert cli(["bench", "modes", "--seeds", "3"]) == 2
    assert "--seeds is an option of `pair` only" in capsys.readouterr().err


def test_rows_take_the_base_on_update_and_drain_rows_drain():
    """Partial rows keep the base YAML's partial-rollout policy (interrupt when it drains);
    drain rows drain; every row loads over both examples without a contradiction."""
    def on_update(base: str) -> dict[str, str]:
        return {label: dict(s.split("=", 1) for s in row)["rollout.on_update"]
                for label, row in mode_configs("admission", base)}

    for base, partial in (("continue", "continue"), ("interrupt", "interrupt"),
                          ("drain", "interrupt")):
        rows = on_update(base)
        assert {rows[x] for x in rows if "drain" in x} == {"drain"}
        assert {rows[x] for x in rows if "drain" not in x} == {partial}, base
    for example in ("examples/tick.yaml", "examples/tick_long.yaml"):
        for label, row in mode_configs("admission", "continue"):
            cfg = row_config(Path(example), [], row)
            assert cfg.rollout.on_update == ("drain" if "drain" in label else "continue")


def test_the_pair_partial_rollout_is_judged_by_runs_twice_around_the_others():
    """Full runs: sync, the headline and its drain pair run first and again last in mirrored
    order (A B C ... C B A), every other row once."""
    labels = [label for label, _ in mode_configs("admission")]
    order = run_order(False, labels)
    twice = ["sync", HEADLINE_ASYNC, DRAIN_PAIR]
    assert order[:3] == twice and order[-3:] == twice[::-1]
    assert sorted(order) == sorted(labels + twice)
    assert run_order(True, labels) == labels


def test_a_row_run_with_two_seeds_reports_the_mean_of_its_runs():
    def run(seed: int, wall: float, gen: int, se: float) -> dict:
        return {"seed": seed, "train_wall_s": wall, "trained_samples_per_s": 2048 / wall,
                "trained_tok_s": 1.0, "gen_tok_s": gen / wall, "generated_tokens": gen,
                "reward_final": 0.5 + seed / 10, "reward_final_se": se, "runq_share": 0.0,
                "on_update": "continue", "max_token_age": None, "steps": 16,
                "tokens": {"generated": gen, "kept": 100}, "threads": {"engine": {"run": seed}}}

    row = merge_repeats([run(0, 16.0, 1000, 0.03), run(1, 20.0, 3000, 0.04)])
    assert row["train_wall_s"] == 18.0 and row["trained_samples_per_s"] == (128 + 102.4) / 2
    assert row["tokens"] == {"generated": 2000, "kept": 100}  # nested counts: their mean
    assert row["threads"] == {"engine": {"run": 0.5}}
    assert row["reward_final"] == pytest.approx(0.55)
    assert row["reward_final_se"] == pytest.approx(0.025)  # of the mean of two runs
    assert (row["on_update"], row["max_token_age"], row["steps"]) == ("continue", None, 16)
    assert [r["seed"] for r in row["repeats"]] == [0, 1]
    assert merge_repeats([run(0, 16.0, 1000, 0.03)]) == run(0, 16.0, 1000, 0.03)
    partial = merge_repeats([run(0, 16.0, 1000, 0.03), run(1, 16.0, 1000, 0.03)])
    assert ratio_by_seed(partial, row) == {"0": 1.0, "1": 1.25}  # seed by seed, not the means
    assert ratio_by_seed(partial, run(0, 16.0, 1000, 0.03)) == {}  # a row run once: none
