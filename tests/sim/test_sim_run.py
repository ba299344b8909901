"""The simulator runs the real loop: real classes, staleness bounds, virtual time, seeds."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time

import pytest

import rollstream.sim.run as sim_run
from rollstream.cli import main as cli_main
from rollstream.data.ledger_row import LedgerRow
from rollstream.engine.protocol import Engine
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.rollout.rollout import Rollout
from rollstream.runtime.build import build_loop
from rollstream.runtime.controller import Controller
from rollstream.sim.profile import load_profile
from rollstream.sim.report import run_scenario
from rollstream.sim.run import build_sim, simulate_mode
from rollstream.sim.vloop import run_virtual
from rollstream.sim.workload import Workload, capped_lognormal_mean
from rollstream.staleness import StalenessPolicy
from rollstream.sync.weights import WeightSync
from rollstream.trajectory import SampleStatus


def test_the_simulation_is_built_from_the_real_components(small):
    assert sim_run.build_loop is build_loop  # the run's own wiring, not a copy

    async def main():
        loop, controller, engines, *_ = await build_sim(
            small, small.modes[1], load_profile(small.profile), None)
        return loop, controller, engines

    loop, controller, engines = run_virtual(main())
    assert type(loop.dispatcher) is Dispatcher and type(loop.rollout) is Rollout
    assert type(loop.sync) is WeightSync and type(controller) is Controller
    assert type(loop.lifecycle) is Lifecycle and type(loop.rollout.policy) is StalenessPolicy
    assert loop.rollout.dispatcher is loop.dispatcher and controller.rollout is loop.rollout
    assert loop.dispatcher.engines == engines and all(isinstance(e, Engine) for e in engines)


def test_sync_is_on_policy_and_async_never_exceeds_its_bound(small):
    result = run_scenario(small)
    # the largest age of a token the loss keeps: k, or max_token_age, or max_context_age
    bounds = {"sync": 0, "k1_partial": 1, "k3_partial": 3, "k2_continue": 2, "k2_drain": 2,
              "k2_mask": 1, "k1_admission": 3}
    for name, row in result["rows"].items():
        assert row["steps_done"] == small.steps and row["stop_reason"] is None, name
        hist = {int(k): v for k, v in row["staleness_hist"].items()}
        assert sum(hist.values()) == row["trained_samples"] > 0
        assert max(hist) <= bounds[name], (name, hist)
        assert 0 < row["engine_utilization"] <= 1 and row["trained_tok_s"] > 0
    assert set(result["rows"]["sync"]["staleness_hist"]) == {"0"}
    assert result["rows"]["sync"]["interrupts"] == 0
    assert result["rows"]["k1_partial"]["interrupts"] > 0  # weight updates interrupted samples
    assert max(int(k) for k in result["rows"]["k1_admission"]["staleness_hist"]) > 1
    # async overlaps rollout with training: more trained tokens per simulated second
    assert result["rows"]["k3_partial"]["trained_tok_s"] > result["rows"]["sync"]["trained_tok_s"]


def test_same_seed_same_result_other_seed_other_result(small):
    profile = load_profile(small.profile)

    def run(sc):
        out = simulate_mode(sc, sc.modes[1], profile)
        out.pop("wall_s"), out.pop("cpu_s")  # measured, not simulated
        return out

    assert run(small) == run(small)
    assert run(small.model_copy(update={"seed": 4})) != run(small)


@pytest.mark.parametrize("drift", [0.1, -0.1, 0.0])
def test_length_drift_shows_in_the_lengths_trained_at_each_step(small, drift):
    """Sync: step s trains samples of weight version s, whose median is (1 + drift) ** s times
    version 0's; under the cap (12,288 tokens) the mean grows as E[min(L_s, cap)]. The growth
    per step fitted to the simulated means (log-linear, 8 steps of 256 samples) is the
    expected one within 0.04 (sampling noise: 0.02-0.03 over seeds 3-5)."""
    sc = small.model_copy(update={"steps": 8, "groups_per_step": 64, "modes": small.modes[:1],
                                  "workload": small.workload.model_copy(
                                      update={"length_drift_per_step": drift})})
    out = simulate_mode(sc, sc.modes[0], load_profile(sc.profile))
    by_step = [out["response_tokens_by_step"][str(s)] for s in range(8)]
    mu = Workload(sc.workload, seed=sc.seed, token_block=sc.token_block).mu
    sigma = math.hypot(sc.workload.sigma_prompt, sc.workload.sigma_within)
    expected = [capped_lognormal_mean(mu + s * math.log1p(drift), sigma,
                                      sc.workload.max_response_tokens) for s in range(8)]

    def growth(means: list[float]) -> float:
        fit = statistics.linear_regression(range(8), [math.log(m) for m in means])
        return math.exp(fit.slope) - 1

    assert growth(by_step) == pytest.approx(growth(expected), abs=0.04), by_step


def test_virtual_time_advances_without_wall_time(small):
    # long samples on 1 engine: over an hour of simulated time
    sc = small.model_copy(update={
        "engines": 1, "steps": 10, "modes": small.modes[:1],
        "workload": small.workload.model_copy(update={"mean_response_tokens": 12000,
                                                      "max_response_tokens": 32768})})
    t0 = time.perf_counter()
    out = simulate_mode(sc, sc.modes[0], load_profile(sc.profile))
    wall = time.perf_counter() - t0
    assert out["sim_s"] > 3600 and wall < 20, (out["sim_s"], wall)
    assert out["sim_s"] > 100 * wall


def test_cli_writes_the_comparison_as_json(tmp_path, small, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(small.model_copy(update={"modes": small.modes[:2]})
                               .model_dump(mode="json")))
    assert cli_main(["sim", str(path), "--json", str(tmp_path / "out.json")]) == 0
    data = json.loads((tmp_path / "out.json").read_text())
    assert list(data["rows"]) == ["sync", "k1_partial"]
    for key in ("step_s_mean", "engine_utilization", "tail_share_mean", "staleness_hist",
                "trained_tok_s", "vs_first"):
        assert key in data["rows"]["sync"]
    assert "k1_partial" in capsys.readouterr().out


def test_a_deadlocked_simulation_fails_instead_of_hanging():
    async def main():
        await asyncio.Event().wait()  # nothing will ever set it, and no timer is due

    t0 = time.perf_counter()
    try:
        run_virtual(main())
    except TimeoutError:
        pass
    else:
        raise AssertionError("a deadlock must end the run")
    assert time.perf_counter() - t0 < 30


def test_the_collector_is_off_during_a_simulation_and_restored_after():
    import gc

    async def main():
        return gc.isenabled()

    assert gc.isenabled()
    assert run_virtual(main()) is False
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        assert run_virtual(main()) is False
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_in_a_loop_callback_stops_the_simulation():
    from rollstream.sim.vloop import SimulationError

    async def main():
        asyncio.get_running_loop().call_later(5.0, lambda: 1 / 0)
        await asyncio.sleep(3600)

    try:
        run_virtual(main())
    except SimulationError as e:
        assert isinstance(e.__cause__, ZeroDivisionError)
    else:
        raise AssertionError("a failing callback must end the simulation")


def _row(uid: str, taken_at_step: int) -> LedgerRow:
    return LedgerRow(sample_uid=uid, task_uid="t", source="s", status=SampleStatus.TRAINED,
                     taken_at_step=taken_at_step)


def test_tail_share_is_the_last_tenth_of_a_batch_over_its_rollout():
    spans = sim_run.Spans()
    rows = []
    for i in range(20):  # step 0: finishes at 1..19, one straggler at 40, all start at 0
        spans(sample_uid=f"a{i}", t_start_s=0.0, t_end_s=40.0 if i == 19 else float(i + 1))
        rows.append(_row(f"a{i}", 0))
    for i in range(10):  # step 1: start at 100, finish at 101..110, evenly
        spans(sample_uid=f"b{i}", t_start_s=100.0, t_end_s=101.0 + i)
        rows.append(_row(f"b{i}", 1))
    rows.append(_row("never-dispatched", 1))
    # step 0: the 90th percentile finish is the 18th (18.0): (40 - 18) / 40; step 1: the 9th
    # (109): (110 - 109) / 10
    assert sim_run._tail_share(rows, spans) == (22 / 40 + 1 / 10) / 2


def test_contention_slows_only_what_overlaps_the_trainer(small, tmp_path):
    """Profile.contention: a sync run never computes in engines and trainer at once, so it
    is unchanged; an async run overlaps them, and both slowdowns lengthen its steps."""
    base = load_profile("cpu_this_machine")
    sc = small.model_copy(update={"profile": "cpu_this_machine", "token_block": 1,
                                  "trainer_devices": 1, "modes": small.modes[:2]})
    sc = sc.model_validate({**sc.model_dump(), "workload": {"prompt_tokens": 8,
                            "mean_response_tokens": 60, "max_response_tokens": 240}})

    def run(engine: float, trainer: float) -> dict:
        path = tmp_path / f"p{engine}-{trainer}.yaml"
        path.write_text(json.dumps({**base.model_dump(mode="json"),
                                    "contention": {"engine": engine, "trainer": trainer}}))
        return run_scenario(sc.model_copy(update={"profile": str(path)}))["rows"]

    plain, engine_only, trainer_only = run(0, 0), run(1.0, 0), run(0, 1.0)
    for key in ("sim_s", "engine_utilization"):
        assert engine_only["sync"][key] == trainer_only["sync"][key] == plain["sync"][key]
    # engines twice as slow while the trainer computes: busier (the trainer is the
    # bottleneck here, so the steps hardly change); a slowed trainer: longer steps
    assert engine_only["k1_partial"]["engine_utilization"] > \
        1.5 * plain["k1_partial"]["engine_utilization"]
    assert trainer_only["k1_partial"]["sim_s"] > 1.2 * plain["k1_partial"]["sim_s"]
