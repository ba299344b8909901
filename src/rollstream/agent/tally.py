"""``tally``: a multi-turn tool task for the tiny-model kit. Add numbers with a calculator.

The environment deals the numbers one at a time; the model adds each to the running total
with a calculator call, copying the last result and the new number, and answers when the
environment says ``end``::

    user       add 12
    assistant  #calc 0+12           tool  12     user  add 45
    assistant  #calc 12+45          tool  57     user  add 7
    assistant  #calc 57+7           tool  64     user  end
    assistant  =64                  (graded by exact_match against the reference "=64")

Shaped to be learnable by a model of a few hundred thousand parameters (LEARNABILITY.md):
everything a token needs is in the environment's last message, a few tokens back. The tiny
model cannot add reliably, so the calculator matters; what RL improves is copying, turn after
turn (one slip and the answer is wrong). The number of items is long-tailed
(``pareto_items``, capped by ``SourceConfig.max_items``), so is the number of turns. Tool
calls use :class:`CommandToolParser` (``#calc 57+7``): a few tokens where a Hermes
``<tool_call>`` JSON block takes dozens, for a tiny model to learn. Demonstrations for the warm start slip a copied
number by one with probability ``noise``; later turns add on from the calculator's result,
so a slip makes the answer wrong, as a sampling error does.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

from rollstream.agent.chat import ChatRenderer, Message
from rollstream.agent.environment import ModelTurn, Observation, ToolEnvironment
from rollstream.agent.harness import AGENT
from rollstream.agent.proxy import SessionHandle
from rollstream.agent.tools import (
    Calculator,
    CommandToolParser,
    ToolCall,
    ToolCallParser,
    ToolRunner,
    tool_schema,
)
from rollstream.data.sources import Split, _Synthetic, pareto_items
from rollstream.engine import SamplingParams
from rollstream.trajectory import Task

_SCALE = 2.0
_MAX_VALUE = 99
_PROMPT = re.compile(r"tally( \d+)+")


class TallyEnvironment:
    """Deals the numbers of its row's prompt (``tally 12 45 7``) one per turn; runs the
    model's calls; a turn without one answers (graded by the source's reward). Built like any
    user's environment (``SourceConfig.environment``): from the row, with the episode's tool
    runner and the source's parser."""

    def __init__(self, *, row: dict, tools: ToolRunner, parser: ToolCallParser) -> None:
        self.values = values_of(str(row.get("prompt", "")))
        self.tools, self.parser = tools, parser
        self.dealt = 1  # the opening deals the first value

    async def reset(self) -> list[Message]:
        self.dealt = 1
        return [{"role": "user", "content": f"add {self.values[0]}"}]

    async def step(self, turn: ModelTurn) -> Observation:
        env = ToolEnvironment(messages=[], tools=self.tools, parser=self.parser)
        obs = await env.step(turn)
        if obs.done:
            return obs
        deal = f"add {self.values[self.dealt]}" if self.dealt < len(self.values) else "end"
        self.dealt += 1
        return Observation(messages=[*obs.messages, {"role": "user", "content": deal}],
                           done=False, tool_calls=obs.tool_calls,
                           tool_results=obs.tool_results)


def calc() -> Calculator:
    """The tally's tool: the calculator, named ``calc`` (``SourceConfig.tools``)."""
    return Calculator(name="calc")


def command_parser() -> CommandToolParser:
    """The tally's tool-call format, ``#calc 57+7`` (``SourceConfig.tool_parser``)."""
    return CommandToolParser(commands={"calc": "expression"})


@dataclass(slots=True, kw_only=True)
class TallySource(_Synthetic):
    """Agent episodes: add dealt numbers with the ``calc`` tool (module docstring)."""

    harness: str = field(init=False, default=AGENT)  # or OPENAI (SourceConfig.harness)
    renderer: ChatRenderer = field(init=False)
    parser: CommandToolParser = field(init=False)  # writes the demonstrations' calls

    def __post_init__(self) -> None:
        _Synthetic.__post_init__(self)
        self.harness = self.cfg.harness or AGENT
        self.renderer = ChatRenderer(self.tokenizer)
        self.parser = command_parser()

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        n = pareto_items(rng, self.cfg.pareto_alpha, _SCALE, self.cfg.max_items)
        values = [rng.randint(1, _MAX_VALUE) for _ in range(n)]
        return "tally " + " ".join(map(str, values)), f"={sum(values)}"

    def task(self, index: int, split: Split) -> Task:
        """The task's text lists its numbers (``tally 12 45 7``: what makes it unique and
        splits it); its prompt is the chat prompt of the opening, which deals the first."""
        task = _Synthetic.task(self, index, split)
        return Task(uid=task.uid, source=task.source, prompt_text=task.prompt_text,
                    prompt_ids=tuple(self.renderer.prompt(self.opening(task))),
                    reference=task.reference, harness=self.harness)

    def difficulty(self, task: Task) -> str:
        """Its bucket for pass-rate sampling: how many numbers it deals (``n07``)."""
        return f"n{len(_values(task)):02d}"

    def opening(self, task: Task) -> list[Message]:
        return _opening(task)

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> list[Message]:
        """The turns after the opening: a call per number, its result and the next deal,
        then the answer."""
        values = _values(task)
        turns: list[Message] = []
        total = 0
        for i, v in enumerate(values):
            copied_total, copied = total, v
            if rng.random() < noise:
                copied = max(0, v + rng.choice((-1, 1)))
            call = ToolCall(id="", name="calc",
                            arguments={"expression": f"{copied_total}+{copied}"})
            turns.append({"role": "assistant", "content": self.parser.render(call)})
            total = copied_total + copied
            deal = f"add {values[i + 1]}" if i + 1 < len(values) else "end"
            turns += [{"role": "tool", "content": str(total)}, {"role": "user", "content": deal}]
        turns.append({"role": "assistant", "content": f"={total}"})
        return turns


async def openai_agent(session: SessionHandle, task: Task, sampling: SamplingParams) -> None:
    """The same episode written as an ordinary agent with the ``openai`` SDK (the ``openai``
    harness, ``SourceConfig.agent``): it keeps the conversation, deals the numbers and has the
    run execute its calculator calls (``SessionHandle.call_tool``: the episode records them);
    the proxy it talks to turns its calls into the training sample."""
    import openai

    values = _values(task)
    tool = calc()
    messages: list[dict] = _opening(task)
    async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                  max_retries=0) as client:
        for dealt in range(1, len(values) + 2):
            reply = await client.chat.completions.create(
                model="tally", messages=messages, tools=[tool_schema(tool)],
                temperature=sampling.temperature, top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return  # the answer
            for call in message.tool_calls:  # run by rollstream: a resume replays them
                try:
                    arguments = json.loads(call.function.arguments)
                except ValueError as e:
                    result = f"error: {e}"
                else:
                    result = await session.call_tool(call.function.name, arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            deal = f"add {values[dealt]}" if dealt < len(values) else "end"
            messages.append({"role": "user", "content": deal})


def values_of(prompt: str) -> list[int]:
    """The numbers a tally prompt deals (``tally 12 45 7``)."""
    if _PROMPT.fullmatch(prompt) is None:
        raise ValueError(f"not a tally prompt: {prompt!r}")
    return [int(v) for v in prompt.split()[1:]]


def _values(task: Task) -> list[int]:
    try:
        return values_of(task.prompt_text)
    except ValueError as e:
        raise ValueError(f"task {task.uid}: {e}") from None


def _opening(task: Task) -> list[Message]:
    return [{"role": "user", "content": f"add {_values(task)[0]}"}]
