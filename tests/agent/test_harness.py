"""Agent episodes through the dispatcher, on the real embedded engine: every model turn is a
routed request (gate, interrupts, versions), environment tokens are masked, turns and tool
calls are recorded, a checkpointed episode resumes without running a recorded call again (its
environment replayed, or restored from its snapshot when it can take one), and a failing
environment or an unknown harness fails only its own sample."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollstream.agent.chat import ChatRenderer, check_alignment
from rollstream.agent.environment import ModelTurn, Observation
from rollstream.agent.harness import AGENT, AgentHarness
from rollstream.agent.loop import Budgets, ReplayTools
from rollstream.agent.tools import ToolCall
from rollstream.clock import WallClock
from rollstream.config.schema import RewardConfig
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.durable.state import group_from_dict, group_to_dict
from rollstream.engine import SamplingParams
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.trajectory import Group, SampleStatus, SegmentKind, Task

TOKENIZER = build_char_tokenizer()
RENDERER = ChatRenderer(TOKENIZER)


class Counter:
    """A tool with a side effect: every call is counted (what must not run twice)."""

    name = "count"
    description = "count a call"
    def __init__(self) -> None:
        self.parameters = {"type": "object", "properties": {"x": {"type": "integer"}}}
        self.calls: list[int] = []

    async def __call__(self, x: int) -> str:
        self.calls.append(x)
        return f"n{len(self.calls)}"


@dataclasses.dataclass
class Scripted:
    """Calls ``count`` once per model turn, whatever the model wrote, for ``turns`` turns;
    then ends (reward from the environment when ``reward`` is set, else the grader's)."""

    tools: ReplayTools
    turns: int
    reward: float | None = None
    fail_at: int | None = None
    steps: list[int] = dataclasses.field(default_factory=list)  # turns answered (shared log)
    hold: asyncio.Event | None = None  # each answer waits for it

    async def reset(self):
        return [{"role": "user", "content": "go"}]

    async def step(self, turn: ModelTurn) -> Observation:
        self.steps.append(turn.turn_index)
        if self.hold is not None:
            await self.hold.wait()
        if turn.turn_index == self.fail_at:
            raise RuntimeError("the environment broke")
        if turn.turn_index + 1 >= self.turns:
            return Observation(messages=[], done=True, reward=self.reward)
        calls = [ToolCall(id="call_0", name="count", arguments={"x": turn.turn_index})]
        results = await self.tools.run(calls)
        return Observation(messages=[{"role": "tool", "content": r.content} for r in results],
                           done=False, tool_calls=calls, tool_results=results)


@dataclasses.dataclass
class Drawn(Scripted):
    """Scripted, and each answer also shows a secret drawn at reset: state that the model
    turns and tool results do not determine (a rebuilt environment draws another)."""

    secret: int = 0

    async def reset(self):
        self.secret = random.SystemRandom().randrange(10**6)
        return await Scripted.reset(self)

    async def step(self, turn: ModelTurn) -> Observation:
        obs = await Scripted.step(self, turn)
        secret = {"role": "user", "content": f"s{self.secret}"}
        return obs if obs.done else dataclasses.replace(obs, messages=[*obs.messages, secret])


class SnapshotDrawn(Drawn):
    """Drawn, with the hook that saves and restores its secret."""

    async def snapshot(self) -> dict:
        return {"secret": self.secret}

    async def restore(self, state: dict) -> None:
        self.secret = state["secret"]


@dataclasses.dataclass
class BadSnapshot(Drawn):
    """Drawn, with a snapshot hook whose state a checkpoint cannot hold as it is."""

    state: object = None

    async def snapshot(self):
        return self.state

    async def restore(self, state) -> None:
        raise AssertionError("never restored: its snapshot was refused")


@dataclasses.dataclass
class ScriptedSource:
    name: str = "s"
    turns: int = 3
    reward: float | None = None
    fail_at: int | None = None
    kind: type[Scripted] = Scripted
    counter: Counter = dataclasses.field(default_factory=Counter)
    steps: list[int] = dataclasses.field(default_factory=list)
    hold: asyncio.Event | None = None

    def tool_list(self):
        return [self.counter]

    def environment(self, task: Task, tools: ReplayTools) -> Scripted:
        return self.kind(tools=tools, turns=self.turns, reward=self.reward,
                         fail_at=self.fail_at, steps=self.steps, hold=self.hold)


def _task(i: int = 0, source: str = "s", harness: str = AGENT) -> Task:
    prompt = RENDERER.prompt([{"role": "user", "content": "go"}])
    return Task(uid=f"{source}/{i}", source=source, prompt_ids=tuple(prompt),
                prompt_text="go", reference="zzz", harness=harness)


def _dispatcher(engine, source: ScriptedSource, ledger: Ledger, *,
                budgets: Budgets | None = None) -> tuple[Dispatcher, GraderPool]:
    graders = GraderPool(RewardConfig(num_workers=1), lambda task: get_reward("exact_match"))
    harness = AgentHarness(renderer=RENDERER, tool_timeout_s=5.0, sources={source.name: source},
                           budgets=budgets or Budgets(max_turns=8, max_turn_tokens=12,
                                                      max_total_tokens=400))
    disp = Dispatcher(engines=[engine], params=SamplingParams(temperature=1.0, seed=None),
                      graders=graders, decode=lambda ids: TOKENIZER.decode(
                          ids, skip_special_tokens=True),
                      lifecycle=Lifecycle(ledger, WallClock()), clock=WallClock(), seed=7,
                      harnesses={AGENT: harness})
    return disp, graders


async def test_episodes_run_turn_by_turn_through_the_dispatcher(engine, tmp_path: Path):
    source = ScriptedSource(turns=3)
    ledger = Ledger(tmp_path / "ledger.jsonl")
    disp, graders = _dispatcher(engine, source, ledger)
    group = Group.new(_task(), 4)
    try:
        await asyncio.wait_for(disp.run_group(group), 120)
    finally:
        graders.close()
    for s in group.samples:
        assert s.status is SampleStatus.GRADED and s.reward == 0.0  # graded by exact_match
        assert s.finish_reason == "done"
        kinds = [seg.kind for seg in s.segments]
        assert kinds == [SegmentKind.POLICY, SegmentKind.ENV] * 2 + [SegmentKind.POLICY]
        assert [t.kind for t in s.turns] == kinds
        for seg in s.segments:
            if seg.kind is SegmentKind.ENV:
                assert not any(seg.loss_mask) and set(seg.versions) == {-1}
            else:
                assert all(seg.loss_mask) and set(seg.versions) == {0} and len(seg) <= 12
        env_turns = [t for t in s.turns if t.kind is SegmentKind.ENV]
        assert [r.content for t in env_turns for r in t.tool_results] != []
        # the trained ids are what the chat template renders for the conversation
        messages = [{"role": "user", "content": "go"}]
        for seg, turn in zip(s.segments, s.turns, strict=True):
            if seg.kind is SegmentKind.POLICY:
                ids = seg.token_ids[:-1] if turn.finish_reason == "stop" else seg.token_ids
                messages.append({"role": "assistant", "content": TOKENIZER.decode(ids)})
            else:
                messages += [{"role": "tool", "content": r.content} for r in turn.tool_results]
        check_alignment(RENDERER, messages, list(s.task.prompt_ids) + s.response_ids)
    assert len(source.counter.calls) == 4 * 2  # one call per environment turn, no more
    assert disp.stats.num_requests >= 4 * 3


async def test_the_environment_reward_grades_the_episode(engine, tmp_path: Path):
    disp, graders = _dispatcher(engine, ScriptedSource(turns=2, reward=0.75),
                                Ledger(tmp_path / "l.jsonl"))
    group = Group.new(_task(), 2)
    try:
        await asyncio.wait_for(disp.run_group(group), 120)
    finally:
        graders.close()
    assert [s.reward for s in group.samples] == [0.75, 0.75]


async def test_a_failing_environment_or_harness_fails_only_its_sample(engine, tmp_path: Path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    disp, graders = _dispatcher(engine, ScriptedSource(turns=3, fail_at=1), ledger)
    broken = Group.new(_task(0), 2)
    unknown = Group.new(_task(1, harness="nope"), 1)
    orphan = Group.new(_task(2, source="elsewhere"), 1)
    try:
        await asyncio.wait_for(asyncio.gather(
            disp.run_group(broken), disp.run_group(unknown), disp.run_group(orphan)), 120)
    finally:
        graders.close()
    assert all(s.status is SampleStatus.FAILED for g in (broken, unknown, orphan)
               for s in g.samples)
    assert "the environment broke" in broken.samples[0].failure
    assert "no harness 'nope'" in unknown.samples[0].failure
    assert "has no agent environment" in orphan.samples[0].failure
    ledger.close()
    assert {e.status.value for e in read_ledger(tmp_path / "ledger.jsonl")} == {"failed"}


async def _until_tokens(engine, n: int) -> None:
    start = engine.stats().generated_tokens
    while engine.stats().generated_tokens < start + n:
        await asyncio.sleep(0.002)


async def test_a_turn_interrupted_for_new_weights_continues_with_both_versions(engine, model_dir,
                                                                               tmp_path: Path):
    source = ScriptedSource(turns=2)
    budgets = Budgets(max_turns=4, max_turn_tokens=200, max_total_tokens=400)
    disp, graders = _dispatcher(engine, source, Ledger(tmp_path / "l.jsonl"), budgets=budgets)
    group = Group.new(_task(), 2)
    run = asyncio.create_task(disp.run_group(group))
    await _until_tokens(engine, 6)
    disp.pause()
    await disp.interrupt(None)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
           for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    await engine.load_weights(1, new)
    disp.resume()
    try:
        await asyncio.wait_for(run, 120)
    finally:
        graders.close()
    for s in group.samples:
        assert s.status is SampleStatus.GRADED
        versions = [v for seg in s.segments if seg.kind is SegmentKind.POLICY
                    for v in seg.versions]
        assert versions == sorted(versions) and versions[-1] == 1
    interrupted = [s for s in group.samples if s.num_interrupts]
    assert interrupted, "the interrupt should have caught a turn in flight"
    for s in interrupted:
        turn = next(t for t in s.turns if t.num_interrupts)
        assert turn.kind is SegmentKind.POLICY


async def _checkpoint_after(disp: Dispatcher, group: Group, source: ScriptedSource, *,
                            calls: int) -> dict:
    """Run ``group``; once ``calls`` tool results were recorded in its episode (a call that
    has started but not returned is not recorded yet), copy it as a checkpoint does (hold the
    gate, interrupt, wait for no request in flight); let it finish; the copy."""
    run = asyncio.create_task(disp.run_group(group))
    while sum(len(t.tool_results) for t in group.samples[0].turns) < calls:
        await asyncio.sleep(0.002)
    disp.pause()
    await disp.interrupt(None)
    await disp.wait_idle()
    saved = group_to_dict(group)
    disp.resume()
    await asyncio.wait_for(run, 120)
    return saved


async def test_a_checkpointed_episode_resumes_without_running_a_recorded_call(engine,
                                                                               tmp_path: Path):
    source = ScriptedSource(turns=5)
    disp, graders = _dispatcher(engine, source, Ledger(tmp_path / "a.jsonl"))
    group = Group.new(_task(), 1)
    saved = await _checkpoint_after(disp, group, source, calls=2)
    graders.close()
    done_before = len(source.counter.calls)
    assert done_before == 4

    # a new process: a fresh source (its tools have run nothing) continues the saved episode
    restored = group_from_dict(saved)
    sample = restored.samples[0]
    recorded = sum(len(t.tool_results) for t in sample.turns if t.kind is SegmentKind.ENV)
    assert recorded >= 2 and sample.status is SampleStatus.INTERRUPTED
    fresh = ScriptedSource(turns=5)
    disp2, graders2 = _dispatcher(engine, fresh, Ledger(tmp_path / "b.jsonl"))
    try:
        await asyncio.wait_for(disp2.run_group(restored), 120)
    finally:
        graders2.close()
    assert sample.status is SampleStatus.GRADED
    # the recorded calls were answered from the checkpoint; only later turns ran the tool
    assert fresh.counter.calls == list(range(recorded, 4))
    kinds = [seg.kind for seg in sample.segments]
    assert kinds == [SegmentKind.POLICY, SegmentKind.ENV] * 4 + [SegmentKind.POLICY]
    assert sample.segments[:2 * recorded] == group_from_dict(saved).samples[0].segments[
        :2 * recorded]


async def test_an_environment_that_snapshots_is_restored_instead_of_replayed(engine,
                                                                             tmp_path: Path):
    """Its secret, drawn at reset, comes back from the checkpoint and the episode goes on with
    it, no recorded turn answered again; the same environment without the hook is rebuilt by
    replay, draws another secret and diverges."""
    source = ScriptedSource(turns=5, kind=SnapshotDrawn)
    disp, graders = _dispatcher(engine, source, Ledger(tmp_path / "a.jsonl"))
    saved = await _checkpoint_after(disp, Group.new(_task(), 1), source, calls=2)
    graders.close()
    snapshot = saved["samples"][0]["env_snapshot"]
    secret = snapshot["state"]["secret"]
    recorded = sum(t["kind"] == "env" for t in saved["samples"][0]["turns"])
    assert recorded >= 2 and snapshot["num_segments"] == 2 * recorded
    assert snapshot["messages"][-1] == {"role": "user", "content": f"s{secret}"}

    fresh = ScriptedSource(turns=5, kind=SnapshotDrawn)
    restored = group_from_dict(saved)
    disp2, graders2 = _dispatcher(engine, fresh, Ledger(tmp_path / "b.jsonl"))
    try:
        await asyncio.wait_for(disp2.run_group(restored), 120)
    finally:
        graders2.close()
    sample = restored.samples[0]
    assert sample.status is SampleStatus.GRADED, sample.failure
    assert fresh.steps == list(range(recorded, 5))  # no recorded turn answered again
    assert fresh.counter.calls == list(range(recorded, 4))
    answers = [TOKENIZER.decode(g.token_ids) for g in sample.segments if g.kind is SegmentKind.ENV]
    assert len(answers) == 4 and all(f"s{secret}" in a for a in answers), answers
    assert sample.env_snapshot.state == {"secret": secret}
    assert sample.env_snapshot.num_segments == 8  # taken before the last model turn

    hookless = ScriptedSource(turns=5, kind=Drawn)
    replayed = group_from_dict(saved)
    disp3, graders3 = _dispatcher(engine, hookless, Ledger(tmp_path / "c.jsonl"))
    try:
        await asyncio.wait_for(disp3.run_group(replayed), 120)
    finally:
        graders3.close()
    failed = replayed.samples[0]
    assert failed.status is SampleStatus.FAILED and "ReplayDiverged" in failed.failure
    assert f"s{secret}" in failed.failure and hookless.steps == [0]
    assert hookless.counter.calls == []  # turn 0's call was answered from the checkpoint


async def test_a_snapshot_taken_at_reset_restores_an_episode_saved_in_its_first_turn(
        engine, tmp_path: Path):
    """Saved while the environment answers the first model turn: the snapshot is the one
    taken after reset (no segment before it), and it still carries the drawn secret."""
    hold = asyncio.Event()
    source = ScriptedSource(turns=3, kind=SnapshotDrawn, hold=hold)
    disp, graders = _dispatcher(engine, source, Ledger(tmp_path / "a.jsonl"))
    group = Group.new(_task(), 1)
    run = asyncio.create_task(disp.run_group(group))
    async with asyncio.timeout(60):
        while not source.steps:  # the first answer has begun, and waits
            await asyncio.sleep(0.002)
    disp.pause()
    await disp.interrupt(None)
    await disp.wait_idle()
    saved = group_to_dict(group)
    hold.set()
    disp.resume()
    await asyncio.wait_for(run, 120)
    graders.close()
    snapshot = saved["samples"][0]["env_snapshot"]
    assert snapshot["num_segments"] == 0 and [s["kind"] for s in saved["samples"][0][
        "segments"]] == ["policy"]

    fresh = ScriptedSource(turns=3, kind=SnapshotDrawn)
    restored = group_from_dict(saved)
    disp2, graders2 = _dispatcher(engine, fresh, Ledger(tmp_path / "b.jsonl"))
    try:
        await asyncio.wait_for(disp2.run_group(restored), 120)
    finally:
        graders2.close()
    sample = restored.samples[0]
    assert sample.status is SampleStatus.GRADED, sample.failure
    assert fresh.steps == [0, 1, 2]  # the answer in progress at the checkpoint runs again
    answers = [TOKENIZER.decode(g.token_ids) for g in sample.segments if g.kind is SegmentKind.ENV]
    secret = snapshot["state"]["secret"]
    assert len(answers) == 2 and all(f"s{secret}" in a for a in answers), (secret, answers)


@pytest.mark.parametrize(("state", "error"), [
    ({"at": {1, 2}}, "the snapshot of BadSnapshot is not JSON: Object of type set"),
    ({"x": float("nan")}, "the snapshot of BadSnapshot is not JSON: Out of range float"),
    ({1: "a"}, "does not come back unchanged from JSON .*reads back as {'1': 'a'}"),
    ({"pair": (1, 2)}, "does not come back unchanged from JSON"),
    ([1, 2], r"BadSnapshot.snapshot\(\) returned a list, not a dict"),
])
async def test_a_snapshot_a_checkpoint_cannot_hold_fails_its_sample_with_the_reason(
        engine, tmp_path: Path, state, error):
    """Refused when it is taken (before the first model turn), so the sample fails with the
    reason and the group stays checkpointable, instead of a checkpoint failing later."""
    source = ScriptedSource(turns=3, kind=functools.partial(BadSnapshot, state=state))
    disp, graders = _dispatcher(engine, source, Ledger(tmp_path / "l.jsonl"))
    group = Group.new(_task(), 2)
    try:
        await asyncio.wait_for(disp.run_group(group), 60)
    finally:
        graders.close()
    for s in group.samples:
        assert s.status is SampleStatus.FAILED and s.failure.startswith("episode: TypeError: ")
        assert re.search(error, s.failure), s.failure
        assert s.segments == [] and s.env_snapshot is None and source.steps == []
    json.dumps(group_to_dict(group), allow_nan=False)  # what a checkpoint writes


async def test_a_replay_that_diverges_fails_the_sample(engine, tmp_path: Path):
    source = ScriptedSource(turns=4)
    disp, graders = _dispatcher(engine, source, Ledger(tmp_path / "a.jsonl"))
    group = Group.new(_task(), 1)
    saved = await _checkpoint_after(disp, group, source, calls=1)
    graders.close()
    env = next(s for s in saved["samples"][0]["segments"] if s["kind"] == "env")
    env["token_ids"][-3] = TOKENIZER.convert_tokens_to_ids("q")  # the saved answer, altered
    restored = group_from_dict(saved)
    disp2, graders2 = _dispatcher(engine, ScriptedSource(turns=4), Ledger(tmp_path / "b.jsonl"))
    try:
        await asyncio.wait_for(disp2.run_group(restored), 120)
    finally:
        graders2.close()
    sample = restored.samples[0]
    assert sample.status is SampleStatus.FAILED and "ReplayDiverged" in sample.failure


async def test_a_single_turn_task_still_runs_as_one_request(engine, tmp_path: Path):
    disp, graders = _dispatcher(engine, ScriptedSource(), Ledger(tmp_path / "l.jsonl"))
    group = Group.new(_task(harness="single_turn"), 2)
    try:
        await asyncio.wait_for(disp.run_group(group), 120)
    finally:
        graders.close()
    for s in group.samples:
        assert s.status is SampleStatus.GRADED and s.turns == []
        assert [seg.kind for seg in s.segments] == [SegmentKind.POLICY]
