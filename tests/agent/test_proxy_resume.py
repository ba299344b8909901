"""A restored OpenAI-SDK episode goes on: its agent runs again from its task and is answered
from the episode's record (model turns without an engine call, rollstream's tool calls without
running them) until it reaches where the checkpoint left it, then live; an agent whose calls
differ from the record fails its sample with the first differing message."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from rollstream.agent.loop import Budgets
from rollstream.agent.tools import Calculator, CommandToolParser
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.durable.state import group_from_dict, group_to_dict
from rollstream.trajectory import Group, SampleStatus, SegmentKind
from tests.agent import sdk_agents
from tests.agent.test_proxy_harness import _dispatcher, _task

BUDGETS = Budgets(max_turns=8, max_turn_tokens=12, max_total_tokens=400)


@dataclasses.dataclass
class CountingCalc(Calculator):
    """The run's ``calc`` tool, counting its executions."""

    runs: list[str] = dataclasses.field(default_factory=list)

    async def __call__(self, expression: str) -> str:
        self.runs.append(expression)
        return await Calculator.__call__(self, expression)


@dataclasses.dataclass
class ToolSource:
    """The scripted agent's source, with the ``calc`` tool its agents run through the run."""

    calc: CountingCalc
    name: str = "s"
    agent: str = "tests.agent.sdk_agents:scripted"
    parser: CommandToolParser = dataclasses.field(
        default_factory=lambda: CommandToolParser(commands={"calc": "expression"}))

    def tool_list(self) -> list:
        return [self.calc]


class CountingEngine:
    """The engine, counting the requests it is sent."""

    def __init__(self, engine) -> None:
        self.engine, self.requests = engine, 0
        self.engine_id = engine.engine_id

    async def generate(self, request):
        self.requests += 1
        return await self.engine.generate(request)

    def __getattr__(self, name):
        return getattr(self.engine, name)


async def _episodes(engine, groups, tmp_path, name: str):
    calc = CountingCalc(name="calc")
    counting = CountingEngine(engine)
    disp, (graders, harness) = _dispatcher(counting, [ToolSource(calc)],
                                           Ledger(tmp_path / f"{name}.jsonl"), BUDGETS)
    try:
        await asyncio.wait_for(asyncio.gather(*(disp.run_group(g) for g in groups)), 120)
    finally:
        await harness.close()
        graders.close()
    return counting.requests, calc.runs, read_ledger(tmp_path / f"{name}.jsonl")


def _checkpointed(group: Group, num_segments: int, *, cut_turn: bool = False,
                  tool_results: int | None = None) -> Group:
    """``group`` as a checkpoint taken when its episode held its first ``num_segments``
    segments: through the checkpoint's own (de)serialization, the sample INTERRUPTED;
    ``cut_turn``: the last model turn was cut mid-way (half its tokens, no turn record);
    ``tool_results``: the last model turn's tool calls recorded so far."""
    saved = group_to_dict(group)
    s = saved["samples"][0]
    s["segments"], s["turns"] = s["segments"][:num_segments], s["turns"][:num_segments]
    s.update(status="interrupted", reward=None, finish_reason=None)
    if cut_turn:
        s["turns"].pop()
        last = s["segments"][-1]
        for key in ("token_ids", "logprobs", "versions", "loss_mask"):
            last[key] = last[key][:max(1, len(last[key]) // 2)]
    if tool_results is not None:
        for key in ("tool_calls", "tool_results"):
            s["turns"][-1][key] = s["turns"][-1][key][:tool_results]
    return group_from_dict(json.loads(json.dumps(saved)))


async def test_a_restored_sdk_episode_is_replayed_from_its_record_then_goes_on_live(
        engine, tmp_path):
    """Restore points of one 4-turn episode (the agent runs a tool after each reply): after a
    model turn and its tool call, before that call, with the turn cut mid-way, and after the
    agent's answer to a later turn. The
    agent runs again from its task; the engine is sent only the turns the record lacks, and
    the tool runs only for calls it lacks; the recorded tokens stay as they were."""
    original = Group.new(_task(0, text="4 tools"), 1)
    requests, runs, _ = await _episodes(engine, [original], tmp_path, "original")
    (done,) = original.samples
    assert done.status is SampleStatus.GRADED, done.failure
    assert requests == 4 and runs == ["0+100", "1+100", "2+100", "3+100"]
    assert [len(t.tool_calls) for t in done.turns] == [1, 0, 1, 0, 1, 0, 1]
    assert [r.content for t in done.turns for r in t.tool_results if r.call.name] == [
        "100", "101", "102", "103"]
    points = {  # restore point -> (engine requests, tool runs) the resumed episode needs
        "after turn 2, its tool called": (dict(num_segments=3), 2, ["2+100", "3+100"]),
        "turn 2 cut mid-way": (dict(num_segments=3, cut_turn=True), 3,
                               ["1+100", "2+100", "3+100"]),
        "turn 2's tool not yet called": (dict(num_segments=3, tool_results=0), 2,
                                         ["1+100", "2+100", "3+100"]),
        "after the answer to turn 3": (dict(num_segments=6), 1, ["3+100"]),
    }
    for i, (point, (cut, engine_calls, tool_runs)) in enumerate(points.items()):
        restored = _checkpointed(original, **cut)
        (s,) = restored.samples
        before = [(seg.kind, list(seg.token_ids)) for seg in s.segments]
        effects = len(sdk_agents.SIDE_EFFECTS)
        requests, runs, _ = await _episodes(engine, [restored], tmp_path, f"resumed{i}")
        assert s.status is SampleStatus.GRADED and s.finish_reason == "done", (point, s.failure)
        assert requests == engine_calls and runs == tool_runs, point
        kinds = [seg.kind for seg in s.segments]
        assert kinds == [SegmentKind.POLICY, SegmentKind.ENV] * 3 + [SegmentKind.POLICY]
        assert [(seg.kind, seg.token_ids[:len(ids)]) for seg, (_, ids) in
                zip(s.segments, before, strict=False)] == before, point  # the record kept
        assert [r.content for t in s.turns for r in t.tool_results if r.call.name] == [
            "100", "101", "102", "103"], point  # each tool call recorded once
        assert len(sdk_agents.SIDE_EFFECTS) - effects == 4, point  # the agent's own: again
        assert s.num_restored_tokens == sum(len(ids) for _, ids in before)


async def test_an_agent_that_diverges_from_the_record_fails_with_the_first_difference(
        engine, tmp_path):
    """The agent's user message carries a nonce of its process: resumed in a process whose
    agent says another, its second call differs from the record at that message. An agent
    asking another tool call, or stopping before the recorded point, fails the same way."""
    recorded = Group.new(_task(0, text="3 tools nonce"), 1)
    await _episodes(engine, [recorded], tmp_path, "recorded")
    assert recorded.samples[0].status is SampleStatus.GRADED, recorded.samples[0].failure
    restored = _checkpointed(recorded, 3)
    sdk_agents.NONCE, was = "zzzzzz", sdk_agents.NONCE  # as a new process would
    try:
        requests, runs, rows = await _episodes(engine, [restored], tmp_path, "diverged")
    finally:
        sdk_agents.NONCE = was
    (s,) = restored.samples
    assert s.status is SampleStatus.FAILED and requests == 0 and runs == []
    assert s.failure.startswith(
        "episode refused: replay diverged from the recorded episode: call 2: new message 1 "
        "(user: 'more 0 nonce zzzzzz') is not what the episode recorded"), s.failure
    assert rows[-1].status is SampleStatus.FAILED and rows[-1].reason == s.failure

    shorter = _checkpointed(recorded, 5)
    shorter.task = dataclasses.replace(shorter.task, prompt_text="2 tools nonce")
    for sample in shorter.samples:
        sample.task = shorter.task
    _, runs, _ = await _episodes(engine, [shorter], tmp_path, "shorter")
    assert runs == [] and shorter.samples[0].failure == (
        "episode refused: replay diverged from the recorded episode: the agent ended after 3 "
        "of the 5 recorded segments")
