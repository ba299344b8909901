"""Replay of a recorded agent run: a real multi-turn run (tally, the tiny model, a few
seconds) is simulated episode by episode through the real agent harness, with its recorded
turns, tool answers and tool waits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollstream.agent.harness import AGENT, AgentHarness
from rollstream.bench.tiny_run import tiny_run_config
from rollstream.data.ledger import read_ledger
from rollstream.data.ledger_row import EnvTurn, LedgerRow, PolicyTurn
from rollstream.sim.calibrate import RunRecord, replay_scenario
from rollstream.sim.profile import load_profile
from rollstream.sim.replay import AgentReplayWorkload
from rollstream.sim.run import build_sim, simulate_mode
from rollstream.sim.scenario import ModeConfig
from rollstream.sim.vloop import run_virtual
from rollstream.trajectory import SampleStatus

DONE = ("done", "max_turns", "max_tokens")  # how a recorded episode may have ended


@pytest.fixture(scope="session")
def agent_run(tmp_path_factory, tiny_run_cache) -> Path:
    """A real agent run: tally episodes (calculator calls) by the tiny run's model, async
    k = 2, 2 steps of 3 groups x 8 (the cheap warm start writes the call format but adds
    badly: the episodes have 2-6 model turns; filtering is off so every group trains)."""
    from rollstream.config import load_config
    from rollstream.runtime.train import run_training

    root = tmp_path_factory.mktemp("agent-replay")
    cfg = tiny_run_config("agent", root, steps=2, checkpoint_every=100,
                          cache_dir=tiny_run_cache, max_slots=32)
    cfg["model"]["tiny"]["max_position"] = 256  # the kill test's agent run: one warm start
    cfg["tasks"] = {"sources": [{"kind": "tally", "max_items": 4}], "num_eval": 2}
    cfg["engine"]["local"]["max_seq_len"] = 256
    cfg["sampling"]["max_new_tokens"] = 224
    cfg["agent"] = {"max_turns": 6, "max_turn_tokens": 16}
    cfg["rollout"]["filter_zero_variance"] = False
    cfg["train"]["groups_per_step"] = 3
    path = root / "config.json"
    path.write_text(json.dumps(cfg))
    run_training(load_config(path, []))
    return root / "agent"


def _simulate(run_dir: Path, tmp_path: Path, mode: ModeConfig | None = None):
    """The run's replay in its own mode (or ``mode``), on the CPU profile; the simulated
    ledger's rows and the workload."""
    sc = replay_scenario(RunRecord(run_dir), "cpu_this_machine")
    if mode is not None:
        sc = sc.model_copy(update={"modes": (mode,)})
    path = tmp_path / "sim-ledger.jsonl"

    async def main():
        loop, controller, engines, *_, ledger = await build_sim(
            sc, sc.modes[0], load_profile(sc.profile), path)
        result = await controller.run()
        ledger.close()
        return loop, engines[0].workload, result

    loop, workload, result = run_virtual(main())
    assert result.steps_done == sc.steps
    return loop, workload, list(read_ledger(path))


def _recorded(run_dir: Path) -> dict[tuple[int, int], LedgerRow]:
    """The run's training samples by (admission index, sample index)."""
    out = {}
    for r in read_ledger(run_dir / "ledger.jsonl"):
        if "#g" in r.sample_uid:
            k, i = r.sample_uid.split("#g")[1].split("/")
            out[(int(k), int(i))] = r
    return out


def _shape(turns: list[PolicyTurn | EnvTurn]) -> list[tuple[str, int]]:
    return [(type(t).__name__, t.num_tokens) for t in turns]


@pytest.mark.parametrize("mode", [None, ModeConfig(name="sync", mode="sync")])
def test_each_episode_replays_its_recorded_turns_and_tool_waits(agent_run, tmp_path, mode):
    loop, workload, rows = _simulate(agent_run, tmp_path, mode)
    assert isinstance(workload, AgentReplayWorkload)
    assert type(loop.dispatcher.harnesses[AGENT]) is AgentHarness  # the real harness
    recorded = _recorded(agent_run)
    assert max(r.num_turns for r in recorded.values()) >= 4  # several tool calls
    trained = [r for r in rows if r.status == "trained"]
    assert len(trained) >= 2 * 3 * 8
    # the simulation's task n replays the run's n-th recorded group in admission order (the
    # run trained the groups that finished first, and held the rest in its last checkpoint)
    order = sorted({k for k, _ in recorded})
    compared = 0
    for r in trained:
        n, i = (int(x) for x in r.sample_uid.split("#g")[1].split("/"))
        real = recorded[(order[n % len(order)], i)]
        if real.finish_reason not in DONE:
            continue  # the run stopped it mid-way (aborted): the replay ends it
        assert _shape(r.turns) == _shape(real.turns), r.sample_uid
        assert r.num_turns == real.num_turns and r.num_tokens == real.num_tokens
        assert r.prompt_tokens == real.prompt_tokens
        assert (r.reward > 0.5) == ((real.reward or 0.0) > 0.5)
        waits = [t.tool_s for t in r.turns if isinstance(t, EnvTurn)]
        assert waits == pytest.approx([t.tool_s for t in real.turns
                                       if isinstance(t, EnvTurn)], abs=2e-6)
        compared += 1
    assert compared >= 0.75 * len(trained)  # the run's aborted samples (none seen) are not
    calls = sum(t.num_tool_calls for r in rows for t in r.turns if isinstance(t, EnvTurn))
    assert workload.tool.num_calls == calls > len(trained)


def test_an_agent_replay_is_deterministic_for_its_seed(agent_run):
    sc = replay_scenario(RunRecord(agent_run), "cpu_this_machine")
    profile = load_profile(sc.profile)

    def run(scenario):
        out = simulate_mode(scenario, scenario.modes[0], profile)
        out.pop("wall_s"), out.pop("cpu_s")
        return out

    a = run(sc)
    assert a == run(sc) and a["tool_calls"] > 0 and a["turns_mean"] > 1.5
    # the tool's virtual waits are the recorded ones (microseconds of a calculator)
    assert 0 < a["tool_s_mean"] < 0.05


def _broken_copy(run_dir: Path, tmp_path: Path, edit) -> Path:
    """A copy of the run whose first multi-turn ledger line is changed by ``edit``."""
    copy = tmp_path / "broken"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoint*"))
    lines = (copy / "ledger.jsonl").read_text().splitlines()
    n = next(j for j, line in enumerate(lines)
             if "#g" in line and json.loads(line)["num_turns"] >= 2)
    row = json.loads(lines[n])
    edit(row)
    lines[n] = json.dumps(row)
    (copy / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    return copy


def _drop_tool_s(row):
    next(t for t in row["turns"] if t["kind"] == "env").pop("tool_s")


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda row: row.pop("turns"), "has no 'turns'"),
    (lambda row: row.update(num_turns=row["num_turns"] + 1), "'num_turns' says"),
    (_drop_tool_s, "missing required field `tool_s`"),
    (lambda row: row["turns"].pop(1), "two model turns in a row"),
])
def test_a_bad_agent_recording_fails_naming_the_field(agent_run, tmp_path, edit, expected):
    broken = _broken_copy(agent_run, tmp_path, edit)
    with pytest.raises(ValueError) as e:
        _simulate(broken, tmp_path)
    assert expected in str(e.value) and "ledger" in str(e.value)


def test_an_agent_run_without_its_agent_budgets_fails_naming_them(agent_run, tmp_path):
    broken = tmp_path / "no-agent"
    shutil.copytree(agent_run, broken, ignore=shutil.ignore_patterns("checkpoint*"))
    config = (broken / "config.yaml").read_text()
    (broken / "config.yaml").write_text(config.replace("max_turns:", "max_turnz:"))
    with pytest.raises(ValueError, match="config.yaml has no agent.max_turns"):
        _simulate(broken, tmp_path)


def _row(uid: str, **kw) -> LedgerRow:
    return LedgerRow(sample_uid=uid, task_uid="t", source="s", status=SampleStatus.TRAINED,
                     **kw)


def test_turn_costs_split_an_episodes_time_into_model_tool_and_harness():
    from rollstream.sim.calibrate import turn_costs

    class Recorded:  # what turn_costs reads of a RunRecord
        ledger = [
            _row("t#g0/0", turns=[
                PolicyTurn(num_tokens=9, started_s=0.5, duration_s=2.0),
                EnvTurn(num_tokens=30, started_s=3.0, duration_s=1.5, tool_s=1.0),
                PolicyTurn(num_tokens=4, started_s=5.0, duration_s=1.0)]),
            _row("t#g0/1"),  # a single-turn sample of another source
        ]

    # harness: 0.5 before the first turn, 0.5 gap, 0.5 of the answer beyond its tool, 0.5 gap
    assert turn_costs(Recorded()) == {"model_turns": 2, "model_s_per_turn": 1.5,
                                      "tool_s_per_turn": 0.5, "harness_s_per_turn": 1.0,
                                      "harness_share": 2.0 / 6.0}
    Recorded.ledger = [_row("t#g0/0")]
    assert turn_costs(Recorded()) is None
