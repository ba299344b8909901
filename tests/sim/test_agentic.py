"""Agentic scenarios: episodes run by the real agent harness on simulated engines and time,
with heavy-tailed tool latency on the virtual clock."""

from __future__ import annotations

import time

import pytest

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.harness import AGENT, AgentHarness
from rollstream.agent.tools import ToolManager
from rollstream.data.ledger import read_ledger
from rollstream.engine import FinishReason
from rollstream.rollout.dispatcher import sample_seed
from rollstream.sim.agentic import AgentWorkload, latency_quantile
from rollstream.sim.profile import load_profile
from rollstream.sim.run import build_sim, simulate_mode
from rollstream.sim.scenario import Scenario, ToolLatencyConfig
from rollstream.sim.vloop import run_virtual
from rollstream.trajectory import SegmentKind


@pytest.fixture
def agentic() -> Scenario:
    """Episodes of a few short turns on 3 engines: each mode runs in about a second."""
    return Scenario.model_validate({
        "name": "agentic", "seed": 1, "profile": "gpu_h100_7b", "engines": 3, "token_block": 16,
        "steps": 3, "groups_per_step": 4, "group_size": 4, "trainer_devices": 2,
        "workload": {"prompt_tokens": 256, "mean_response_tokens": 400,
                     "max_response_tokens": 65536,  # never binds: 8 turns of at most 2,048
                     "agent": {"turns_median": 3, "max_turns": 8, "max_turn_tokens": 2048,
                               "tool_output_tokens": 64,
                               "tool_latency": {"median_s": 2.0, "p99_s": 60.0}}},
        "modes": [{"name": "sync", "mode": "sync"},
                  {"name": "k1_partial", "mode": "async",
                   "staleness": {"max_staleness": 1}}],
    })


def _run_with_ledger(sc: Scenario, mode_index: int, tmp_path):
    path = tmp_path / "ledger.jsonl"

    async def main():
        loop, controller, engines, *_, ledger = await build_sim(
            sc, sc.modes[mode_index], load_profile(sc.profile), path)
        result = await controller.run()
        ledger.close()
        return loop, engines, result

    loop, engines, result = run_virtual(main())
    return loop, engines[0].workload, result, list(read_ledger(path))


def test_episodes_run_through_the_real_harness_loop_and_tool_manager(agentic, tmp_path):
    loop, workload, result, rows = _run_with_ledger(agentic, 0, tmp_path)
    harness = loop.dispatcher.harnesses[AGENT]
    assert type(harness) is AgentHarness and type(harness.renderer) is ChatRenderer
    assert all(type(m) is ToolManager for m in harness.tools.values())
    assert isinstance(workload, AgentWorkload) and result.steps_done == agentic.steps
    trained = [r for r in rows if r.status == "trained"]
    assert len(trained) == agentic.steps * agentic.groups_per_step * agentic.group_size
    for r in trained:  # every turn the workload drew was a turn of the real agent loop
        assert r.finish_reason == "done" and r.reward in (0.0, 1.0), r
        index = int(r.task_uid.removeprefix("sim-"))
        assert r.num_turns == _expected_turns(workload, index,
                                              sample_seed(agentic.seed, r.sample_uid)), r
    assert max(r.num_turns for r in trained) > 2
    # a tool call after each model turn but an episode's last, in episodes of every status
    assert workload.tool.num_calls == sum(r.num_turns - 1 for r in rows) > len(rows)


def _expected_turns(workload: AgentWorkload, index: int, seed: int) -> int:
    """The episode's drawn turns, or fewer when a turn was longer than max_turn_tokens (the
    loop closes it; without a call it is the answer)."""
    turns = workload.num_turns(index, seed)
    for t in range(turns):
        length, _ = workload._turn_drawn[(index, seed, t)]  # as drawn at its first request
        if length - 1 > workload.turn_blocks:  # the cut lost the call (it ends `CALL, draw,
            return t + 1  # END`: a cut before END alone keeps it, and the episode goes on)
    return turns


def test_tool_latency_advances_virtual_time_not_wall_time(agentic):
    # tool calls of 20 minutes median, up to hours: a step lasts hours of simulated time
    slow = agentic.model_copy(update={"steps": 2, "workload": agentic.workload.model_copy(
        update={"agent": agentic.workload.agent.model_copy(update={
            "tool_latency": ToolLatencyConfig(median_s=1200.0, p99_s=14400.0),
            "tool_timeout_s": 36000.0})})})
    t0 = time.perf_counter()
    out = simulate_mode(slow, slow.modes[0], load_profile(slow.profile))
    wall = time.perf_counter() - t0
    assert out["steps_done"] == 2 and out["tool_calls"] > 0 and out["tool_timeouts"] == 0
    assert out["tool_s_mean"] > 600 and out["sim_s"] > 3 * 3600, out
    assert out["tool_time_share"] > 0.9  # the engines are fast: episodes wait on the tool
    assert wall < 20 and out["sim_s"] > 1000 * wall, (out["sim_s"], wall)


def test_a_tool_call_past_the_timeout_is_cut_and_the_episode_goes_on(agentic):
    cut = agentic.model_copy(update={"workload": agentic.workload.model_copy(
        update={"agent": agentic.workload.agent.model_copy(update={"tool_timeout_s": 3.0})})})
    out = simulate_mode(cut, cut.modes[0], load_profile(cut.profile))
    assert out["steps_done"] == cut.steps and 0 < out["tool_timeouts"] < out["tool_calls"]
    assert out["tool_s_mean"] <= 3.0 + 1e-9  # no call waited past the timeout
    assert out["turns_mean"] > 1.5  # the model read the error and went on


def test_agentic_is_deterministic_for_a_seed_and_async_resumes_episode_turns(agentic):
    profile = load_profile(agentic.profile)

    def run(sc, mode_index):
        out = simulate_mode(sc, sc.modes[mode_index], profile)
        out.pop("wall_s"), out.pop("cpu_s")
        return out

    a = run(agentic, 1)
    assert a == run(agentic, 1)
    assert run(agentic.model_copy(update={"seed": 2}), 1) != a
    assert a["interrupts"] > 0 and a["staleness_max"] <= 1  # turns cut by weight updates
    assert a["trained_tok_s"] > run(agentic, 0)["trained_tok_s"]


@pytest.mark.parametrize("distribution", ["lognormal", "pareto"])
def test_tool_latency_has_the_configured_median_and_p99(distribution):
    q = latency_quantile(ToolLatencyConfig(distribution=distribution, median_s=0.5, p99_s=30.0))
    assert q(0.5) == pytest.approx(0.5, rel=1e-9) and q(0.99) == pytest.approx(30.0, rel=1e-9)
    assert q(0.999) > 30.0 and q(0.01) < 0.5


def test_pareto_has_the_heavier_tail_beyond_the_p99():
    def q(d):
        return latency_quantile(ToolLatencyConfig(distribution=d, median_s=0.5, p99_s=30.0))
    assert q("pareto")(0.9999) > 2 * q("lognormal")(0.9999)


@pytest.mark.parametrize(("workload", "expected"), [
    ({"agent": {"max_turn_tokens": 70000}},
     "agent.max_turn_tokens (70000) must not exceed max_response_tokens (65536)"),
    ({"mean_response_tokens": 5000, "agent": {"max_turn_tokens": 4096}},
     "mean_response_tokens (5000) must be below agent.max_turn_tokens (4096)"),
    ({"mean_response_tokens": 500, "agent": {"tool_latency": {"median_s": 3, "p99_s": 2}}},
     "p99_s (2) must be above median_s (3)"),
    ({"mean_response_tokens": 500, "agent": {"tool_latency": {"distribution": "weibull"}}},
     "distribution"),
    ({"length_drift_per_step": -1}, "length_drift_per_step"),
    ({"mean_response_tokens": 500, "agent": {"turns_median": 20, "max_turns": 12}},
     "turns_median (20) must not exceed max_turns (12)"),
])
def test_bad_agentic_or_drift_settings_name_the_field(workload, expected):
    with pytest.raises(ValueError) as e:
        Scenario.model_validate({"workload": workload})
    assert expected in str(e.value)


def test_drift_grows_each_model_turn_by_the_version_of_its_first_request():
    from rollstream.sim.agentic import ASSISTANT, END, TOOL
    from rollstream.sim.scenario import WorkloadConfig
    from rollstream.sim.workload import TOKEN

    cfg = WorkloadConfig(mean_response_tokens=400, max_response_tokens=65536,
                         length_drift_per_step=0.3, agent={"max_turn_tokens": 2048})

    def fresh() -> AgentWorkload:
        return AgentWorkload(cfg, seed=0, token_block=1)

    first = list(fresh().task(2).prompt_ids)
    second = first + [TOKEN] * 9 + [END, TOOL, END, ASSISTANT]  # after turn 0 and its tool
    for seed in range(20):
        for prompt in (first, second):
            base, grown = fresh().outcome(prompt, seed, 0), fresh().outcome(prompt, seed, 5)
            assert grown[0] == 0 and grown[2] == base[2]  # a new turn; the same call or answer
            assert grown[1] == pytest.approx(base[1] * 1.3 ** 5, abs=4)  # blocks rounded up
        w = fresh()
        _, length, tail = w.outcome(second, seed, 5)
        assert w.outcome(second + [TOKEN] * 3, seed, 8) == (3, length, tail)  # a resumed turn


class _HourLongTool:
    """An environment whose every answer takes an hour of the event loop's time; it grades
    after ``replies`` answers."""

    def __init__(self, replies: int) -> None:
        self.replies, self.answers = replies, 0

    async def reset(self):
        return [{"role": "user", "content": "go"}]

    async def step(self, turn):
        import asyncio

        from rollstream.agent.environment import Observation

        await asyncio.sleep(3600.0)
        self.answers += 1
        if self.answers > self.replies:
            return Observation(messages=[], done=True, reward=1.0)
        return Observation(messages=[{"role": "tool", "content": "ok"}], done=False)


def _one_token_turns(token: int):
    from rollstream.rollout.harness import TurnOutput
    from rollstream.trajectory import append_policy_tokens

    async def generate(ep, params, *, rid, episode_id, deadline):
        ids = [token, params.stop_token_ids[0]]
        append_policy_tokens(ep.segments, ids, [-1.0] * 2, [0] * 2)
        return TurnOutput(finish_reason=FinishReason.STOP, num_tokens=2)

    return generate


def test_the_agent_loop_keeps_time_and_its_wall_budget_on_the_event_loops_clock():
    """Turn records and ``max_wall_s`` follow the loop's clock: virtual hours in a
    simulation, not the milliseconds of wall time the episode takes."""
    from rollstream.agent.loop import AgentLoop, Budgets, EpisodeEnd
    from rollstream.models.tokenizer import build_char_tokenizer

    renderer = ChatRenderer(build_char_tokenizer())
    token = renderer.tokenizer.encode("7", add_special_tokens=False)[0]
    t0 = time.perf_counter()
    ep = run_virtual(AgentLoop(renderer=renderer).run(
        _HourLongTool(replies=2), episode_id="e", generate=_one_token_turns(token)))
    assert ep.end is EpisodeEnd.DONE and ep.num_model_turns == 3
    env_turns = [t for t in ep.turns if t.kind is SegmentKind.ENV]
    assert [round(t.duration_s) for t in env_turns] == [3600, 3600]
    assert round(ep.duration_s) == 3 * 3600  # the last answer grades after its hour too
    assert time.perf_counter() - t0 < 5
    budget = AgentLoop(renderer=renderer, budgets=Budgets(max_wall_s=5400.0))
    ep = run_virtual(budget.run(_HourLongTool(replies=5), episode_id="w",
                                generate=_one_token_turns(token)))
    assert ep.end is EpisodeEnd.MAX_WALL and round(ep.duration_s) == 5400  # in the 2nd answer
