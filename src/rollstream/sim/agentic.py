"""Agentic scenarios: multi-turn episodes with heavy-tailed tool latency, run by the real
agent harness.

A task of an agentic workload is an episode, as in a training run with an agent source: its
``Task.harness`` is ``agent``, so the real :class:`~rollstream.agent.harness.AgentHarness`
runs it with the real :class:`~rollstream.agent.loop.AgentLoop`, which generates every model
turn with ``Dispatcher.episode_turn`` (the gate, routing, interrupt and resume with per-token
versions, the staleness rules) and answers it with the real
:class:`~rollstream.agent.environment.ToolEnvironment`, whose calls the real
:class:`~rollstream.agent.tools.ToolManager` runs (its ``tool_timeout_s`` on the loop's
virtual clock). Simulated, at the edges:

* the tokenizer and its chat template (:class:`SimTokenizer`): one character per token (the
  token id is the code point), a ChatML-like template whose markers are single characters:
  ``ASSISTANT`` opens a model turn, ``END`` closes a turn (the stop token), ``TOOL`` opens a
  tool result. The real :class:`~rollstream.agent.chat.ChatRenderer` renders with it;
* the model's tool-call format (:class:`SimToolParser`): a turn that calls the tool ends with
  ``CALL`` and one character whose code point carries the call's latency draw;
* the tool (:class:`LatencyTool`): it sleeps its latency on the virtual clock and returns
  ``tool_output_tokens`` of output;
* the engine (``sim/engine.py``), which reads from a request's prompt which turn it serves.

An episode (the generator of ``sim/workload.py`` per turn): ``T ~ round(LogNormal(ln
turns_median, turns_sigma))`` model turns within ``1..max_turns`` (drawn per sample from its
request seed); turn ``t``'s length is the task's difficulty times ``LogNormal(0,
sigma_within)`` (grown by the length drift at the weight version of the turn's first
request), capped by ``max_turn_tokens``; turns ``0..T-2`` end with a tool call, the last with
the answer (correct with the task's pass rate), then ``END``. The tool's latency is the
configured distribution's quantile at the call's 16-bit draw (``(draw + 0.5) / 2**16``): a
function of the sample and the turn, so a run is deterministic for a seed. A turn cut by
``max_turn_tokens`` holds no call: the environment takes it as the (wrong) answer.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

from rollstream.agent.chat import ChatRenderer, Message
from rollstream.agent.environment import ToolEnvironment
from rollstream.agent.harness import AGENT, AgentHarness
from rollstream.agent.loop import Budgets, ReplayTools
from rollstream.agent.tools import ParsedTurn, Tool
from rollstream.sim.scenario import ToolLatencyConfig, WorkloadConfig
from rollstream.sim.workload import CORRECT, SOURCE, TASK_TOKEN_OFFSET, TOKEN, WRONG, Workload
from rollstream.trajectory import Task, ToolCall

ASSISTANT, END, TOOL, CALL, TOOL_OUT = 4, 5, 6, 7, 8  # below TASK_TOKEN_OFFSET
ARG_BASE, ARG_BITS = 0xF0000, 16  # a call's draw: one character of Unicode's plane 15
TOOL_NAME = "sim_tool"
_Z99 = NormalDist().inv_cdf(0.99)


class SimTokenizer:
    """Characters as tokens and a ChatML-like template of one-character markers (module
    docstring): what :class:`ChatRenderer` needs of a Hugging Face tokenizer."""

    all_special_ids = (END,)
    eos_token_id = END

    def apply_chat_template(self, messages: Sequence[Message], tools: Any = None,
                            tokenize: bool = False, add_generation_prompt: bool = False) -> str:
        marks = {"assistant": chr(ASSISTANT), "tool": chr(TOOL)}
        text = "".join(m["content"] if m["role"] not in marks  # the task's prompt, as is
                       else marks[m["role"]] + m["content"] + chr(END) for m in messages)
        return text + chr(ASSISTANT) if add_generation_prompt else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


@dataclass(slots=True, frozen=True)
class SimToolParser:
    """The simulated model's call: a turn's text ending with ``CALL`` and its draw (a replay's
    call, ``sim/replay.py``, is the draw alone: a recorded turn of two tokens may call)."""

    def parse(self, text: str) -> ParsedTurn:
        if text and ord(text[-1]) >= ARG_BASE:  # a replay's call may be its draw alone
            call = ToolCall(id="call_0", name=TOOL_NAME,
                            arguments={"draw": ord(text[-1]) - ARG_BASE})
            called = len(text) >= 2 and text[-2] == chr(CALL)
            return ParsedTurn(content=text[:-2] if called else text[:-1], calls=[call],
                              errors=[])
        return ParsedTurn(content=text, calls=[], errors=[])

    def render(self, call: ToolCall) -> str:
        return chr(CALL) + chr(ARG_BASE + int(call.arguments["draw"]))


def latency_quantile(cfg: ToolLatencyConfig) -> Callable[[float], float]:
    """The latency at probability ``u`` of the configured distribution (scenario docs)."""
    ratio = cfg.p99_s / cfg.median_s
    if cfg.distribution == "lognormal":
        sigma, normal = math.log(ratio) / _Z99, NormalDist()
        return lambda u: cfg.median_s * math.exp(sigma * normal.inv_cdf(u))
    alpha = math.log(50.0) / math.log(ratio)  # Pareto: p99 / median = 50 ** (1 / alpha)
    x_min = cfg.median_s / 2.0 ** (1 / alpha)
    return lambda u: x_min * (1.0 - u) ** (-1 / alpha)


@dataclass(slots=True, kw_only=True)
class LatencyTool:
    """The simulated tool: answers a call's draw after ``latency_s(draw)`` on the virtual
    clock with ``output(draw)``. Counts its calls, those the manager's ``timeout_s`` cut, and
    the virtual seconds they waited in all."""

    latency_s: Callable[[int], float]
    output: Callable[[int], str]
    timeout_s: float  # the manager's (agent.tool_timeout_s), to tell its cuts from cancels
    name: str = TOOL_NAME
    description: str = "a simulated tool with a heavy-tailed latency"
    parameters: dict[str, Any] = field(default_factory=lambda: {
        "type": "object", "properties": {"draw": {"type": "integer"}}, "required": ["draw"]})
    num_calls: int = 0
    num_timeouts: int = 0
    waited_s: float = 0.0

    async def __call__(self, draw: int) -> str:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        self.num_calls += 1
        try:
            await asyncio.sleep(self.latency_s(draw))
        except asyncio.CancelledError:
            if loop.time() - t0 >= self.timeout_s * (1 - 1e-9):
                self.num_timeouts += 1
            raise
        finally:
            self.waited_s += loop.time() - t0
        return self.output(draw)


def _grade(answer: str) -> float:
    return 1.0 if answer.endswith(chr(CORRECT)) else 0.0


@dataclass(slots=True, kw_only=True)
class SimAgentSource:
    """The agent source of a simulated run (``agent.harness.AgentSource``)."""

    tool: LatencyTool
    name: str = SOURCE

    def tool_list(self) -> list[Tool]:
        return [self.tool]

    def environment(self, task: Task, tools: ReplayTools) -> ToolEnvironment:
        """The real tool environment (``tools``: the harness's ReplayTools, as ``tally``)."""
        return ToolEnvironment(messages=[{"role": "user", "content": task.prompt_text}],
                               tools=tools, grade=_grade,  # type: ignore[arg-type]
                               parser=SimToolParser())


class AgentWorkload(Workload):
    """Episodes instead of single responses (module docstring); ``tool`` is their tool."""

    def __init__(self, cfg: WorkloadConfig, *, seed: int, token_block: int) -> None:
        super().__init__(cfg, seed=seed, token_block=token_block)
        assert cfg.agent is not None
        self.agent = cfg.agent
        self.turn_blocks = math.ceil(cfg.agent.max_turn_tokens / token_block)
        quantile = latency_quantile(cfg.agent.tool_latency)
        output = chr(TOOL_OUT) * math.ceil(cfg.agent.tool_output_tokens / token_block)
        self.tool = LatencyTool(latency_s=lambda draw: quantile((draw + 0.5) / (1 << ARG_BITS)),
                                output=lambda draw: output, timeout_s=cfg.agent.tool_timeout_s)
        self._turns: dict[tuple[int, int], int] = {}  # (task, seed) -> model turns
        self._turn_drawn: dict[tuple[int, int, int], tuple[int, tuple[int, ...]]] = {}

    def task(self, index: int) -> Task:
        if index >= ARG_BASE - TASK_TOKEN_OFFSET:
            raise ValueError(f"an agentic simulation has at most {ARG_BASE - TASK_TOKEN_OFFSET}"
                             " tasks (one character each)")
        text = chr(TASK_TOKEN_OFFSET + index) + chr(TOKEN) * (self.prompt_blocks - 1)
        return Task(uid=f"sim-{index}", source=SOURCE, prompt_ids=(*map(ord, text), ASSISTANT),
                    prompt_text=text, reference="", harness=AGENT)

    def num_turns(self, index: int, seed: int) -> int:
        """Model turns of the sample with request seed ``seed`` of task ``index``."""
        turns = self._turns.get((index, seed))
        if turns is None:
            a = self.agent
            drawn = random.Random(f"{seed}/turns").lognormvariate(math.log(a.turns_median),
                                                                   a.turns_sigma)
            turns = min(a.max_turns, max(1, round(drawn)))
            self._turns[(index, seed)] = turns
        return turns

    def outcome(self, prompt_ids: list[int], seed: int | None,
                version: int) -> tuple[int, int, tuple[int, ...]]:
        """(blocks of this model turn already in the prompt, the turn's length in blocks
        before the cap, the tokens it ends with: a call or the answer, then ``END``)."""
        if seed is None:
            raise ValueError("simulated engines need a per-request seed (a run seed)")
        index = prompt_ids[0] - TASK_TOKEN_OFFSET
        turn = prompt_ids.count(ASSISTANT) - 1  # every model turn opens with ASSISTANT
        done = prompt_ids[::-1].index(ASSISTANT)  # tokens of this turn after its opening
        drawn = self._turn_drawn.get((index, seed, turn))
        if drawn is None:
            rng = random.Random(f"{seed}/{turn}")
            length = max(1, math.ceil(self.length_tokens(index, rng, version) / self.block))
            if turn + 1 < self.num_turns(index, seed):
                tail: tuple[int, ...] = (CALL, ARG_BASE + rng.getrandbits(ARG_BITS), END)
            else:
                tail = (CORRECT if rng.random() < self.spec(index).pass_rate else WRONG, END)
            drawn = (length, tail)
            self._turn_drawn[(index, seed, turn)] = drawn
        return done, drawn[0], drawn[1]


    def harness(self) -> AgentHarness:
        """The real agent harness for these episodes (budgets in blocks, as their tokens)."""
        a = self.agent
        return agent_harness(self.tool, Budgets(max_turns=a.max_turns,
                                                max_turn_tokens=self.turn_blocks,
                                                max_total_tokens=self.max_blocks))


def agent_harness(tool: LatencyTool, budgets: Budgets) -> AgentHarness:
    """The real agent harness for simulated episodes that call ``tool`` (its manager cuts a
    call at ``tool.timeout_s``)."""
    return AgentHarness(renderer=ChatRenderer(SimTokenizer()), budgets=budgets,
                        sources={SOURCE: SimAgentSource(tool=tool)},
                        tool_timeout_s=tool.timeout_s)
