"""Replay of a recorded run's samples: the simulated workload is what the run's ledger saw.

The run's training groups (``<task_uid>#g<k>/<i>`` in ``ledger.jsonl``), in admission order
``k``, become the simulation's tasks 0, 1, 2, ...: task ``n`` has the prompt length of the
run's ``n``-th group, and its sample ``i`` the response length, the answer (reward above 0.5)
and the way it ended of that group's sample ``i``. Beyond the recorded groups the replay wraps
around (an async simulation may admit a few more groups than the run did). A sample the run
never finished (``aborted``: the run ended first) replays with the tokens it had.

Same interface as :class:`rollstream.sim.workload.Workload` (``task``, ``outcome``,
``block``, ``max_blocks``): the simulated engine does not know which it serves. A request's
sample is found by its seed, which the real dispatcher derives from the run seed and the
sample uid (``dispatcher.sample_seed``); the simulation's group of task ``n`` is admitted
``n``-th (the task stream draws each task once), so its uids are known in advance.

**Agent runs** (the ledger's samples have model turns, ``num_turns``): each episode replays
its recorded ``turns`` (docs/run-dir.md) through the real agent harness, as an agentic
scenario's (``sim/agentic.py``: its tokenizer, template, call format and tool): model turn
``t`` is as long as the recorded one; one that the environment answered ends with a call
whose draw names the recorded answer, and the tool sleeps that answer's ``tool_s`` on the
virtual clock and returns what makes the environment's tokens as many as recorded (the
template's markers included); the last model turn ends with the answer (correct when the
reward was above 0.5). The harness's budgets are the run's (``agent.max_turns``,
``agent.max_turn_tokens``, ``sampling.max_new_tokens``); ``agent.max_wall_s`` is not applied
(the recorded turns are what the run did within it). Exact at ``token_block: 1``; with blocks
each length is rounded up to whole blocks and an answer has at least the template's markers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.harness import AGENT, AgentHarness
from rollstream.agent.loop import Budgets
from rollstream.data.ledger import read_ledger
from rollstream.data.ledger_row import LedgerRow, PolicyTurn
from rollstream.run_files import RunFiles
from rollstream.rollout.dispatcher import sample_seed
from rollstream.sim.agentic import (
    ARG_BASE,
    ARG_BITS,
    ASSISTANT,
    END,
    TOOL_OUT,
    LatencyTool,
    SimTokenizer,
    agent_harness,
)
from rollstream.sim.workload import CORRECT, SOURCE, TASK_TOKEN_OFFSET, TOKEN, WRONG
from rollstream.trajectory import Task, group_id_of

_TRAIN_UID = re.compile(r"^(?P<group>.+#g(?P<k>\d+))/(?P<i>\d+)$")


@dataclass(slots=True, frozen=True)
class ReplayTurn:
    """A recorded model turn and the environment's answer to it, if one followed."""

    model_tokens: int
    env_tokens: int | None  # None: no answer followed (the episode ended)
    tool_s: float  # seconds the episode waited on its tools for that answer (0: none)


@dataclass(slots=True, frozen=True)
class ReplaySample:
    response_tokens: int
    correct: bool
    turns: tuple[ReplayTurn, ...] = ()  # an agent episode's model turns (empty: single-turn)


@dataclass(slots=True, frozen=True)
class ReplayGroup:
    prompt_tokens: int
    samples: tuple[ReplaySample, ...]


def read_groups(run_dir: Path, group_size: int) -> list[ReplayGroup]:
    """The training groups of ``run_dir/ledger.jsonl`` in admission order (ValueError when it
    has none, or a group's size is not ``group_size``). In an agent run (a sample with model
    turns) every sample holds its episode's turns."""
    by_k: dict[int, dict[int, LedgerRow]] = {}
    for row in read_ledger(RunFiles(run_dir).ledger):
        m = _TRAIN_UID.match(row.sample_uid)
        if m is not None:
            by_k.setdefault(int(m["k"]), {})[int(m["i"])] = row
    agent = any(r.num_turns for rows in by_k.values() for r in rows.values())
    groups = []
    for k in sorted(by_k):
        rows = by_k[k]
        if sorted(rows) != list(range(group_size)):
            raise ValueError(f"replay {run_dir}: group #g{k} has samples {sorted(rows)}, "
                             f"not 0..{group_size - 1} (group_size must be the run's)")
        if rows[0].prompt_tokens is None:
            raise ValueError(f"replay {run_dir}: the ledger has no prompt_tokens (recorded "
                             "since the simulator's calibration; rerun the training run)")
        groups.append(ReplayGroup(
            prompt_tokens=rows[0].prompt_tokens,
            samples=tuple(ReplaySample(response_tokens=max(1, r.num_tokens),
                                       correct=(r.reward or 0.0) > 0.5,
                                       turns=episode_turns(r, run_dir) if agent else ())
                          for _, r in sorted(rows.items()))))
    if not groups:
        raise ValueError(f"replay {run_dir}: no training group in ledger.jsonl")
    return groups


def episode_turns(row: LedgerRow, run_dir: Path) -> tuple[ReplayTurn, ...]:
    """An agent episode's model turns from its ledger line (ValueError naming the field when
    the line lacks them or they contradict ``num_turns``; the row's types were checked when it
    was read). A sample that never had a turn (it failed first, or a single-turn sample of
    another source) replays as one model turn of its tokens."""
    uid = row.sample_uid
    if row.num_turns and not row.turns:
        raise ValueError(f"replay {run_dir}: ledger line of {uid} has no 'turns' (an agent "
                         "run's lines list each episode's turns since the simulator replays "
                         "them; rerun the training run)")
    out: list[ReplayTurn] = []
    for j, t in enumerate(row.turns):
        where = f"replay {run_dir}: ledger line of {uid}, turns[{j}]"
        if isinstance(t, PolicyTurn):
            if out and out[-1].env_tokens is None:
                raise ValueError(f"{where}: two model turns in a row (the 'turns' must "
                                 "alternate model and environment)")
            out.append(ReplayTurn(model_tokens=t.num_tokens, env_tokens=None, tool_s=0.0))
        else:
            if not out or out[-1].env_tokens is not None:
                raise ValueError(f"{where}: an environment turn that follows no model turn")
            out[-1] = ReplayTurn(model_tokens=out[-1].model_tokens, env_tokens=t.num_tokens,
                                 tool_s=t.tool_s)
    if len(out) != row.num_turns:
        raise ValueError(f"replay {run_dir}: ledger line of {uid}: 'turns' holds {len(out)} "
                         f"model turns, 'num_turns' says {row.num_turns}")
    if not out:
        out.append(ReplayTurn(model_tokens=max(1, row.num_tokens), env_tokens=None,
                              tool_s=0.0))
    return tuple(out)


class ReplayWorkload:
    """Tasks and sample outcomes from recorded groups (module docstring)."""

    def __init__(self, groups: list[ReplayGroup], *, seed: int, max_response_tokens: int,
                 token_block: int = 1) -> None:
        self.groups, self.seed, self.block = groups, seed, token_block
        self.max_blocks = math.ceil(max_response_tokens / token_block)
        self._seeds: dict[int, dict[int, int]] = {}  # task index -> request seed -> sample

    def _group(self, index: int) -> ReplayGroup:
        return self.groups[index % len(self.groups)]

    def _prompt_blocks(self, index: int) -> int:
        return max(1, math.ceil(self._group(index).prompt_tokens / self.block))

    def task(self, index: int) -> Task:
        prompt = (TASK_TOKEN_OFFSET + index,) + (TOKEN,) * (self._prompt_blocks(index) - 1)
        return Task(uid=f"sim-{index}", source="replay", prompt_ids=prompt, prompt_text="",
                    reference="")

    def outcome(self, prompt_ids: list[int], seed: int | None,
                version: int) -> tuple[int, int, tuple[int, ...]]:
        """(response blocks already in the prompt, the sample's length in blocks, the token it
        ends with: its answer) for a request (``version`` is not used: a replay has the
        recorded lengths)."""
        index = prompt_ids[0] - TASK_TOKEN_OFFSET
        s = self._sample(index, seed)
        return (len(prompt_ids) - self._prompt_blocks(index),
                max(1, math.ceil(s.response_tokens / self.block)),
                (CORRECT,) if s.correct else (WRONG,))

    def _sample(self, index: int, seed: int | None) -> ReplaySample:
        """The recorded sample a request of task ``index`` with ``seed`` belongs to."""
        return self._group(index).samples[self._sample_index(index, seed)]

    def _sample_index(self, index: int, seed: int | None) -> int:
        """Its index in the group."""
        seeds = self._seeds.get(index)
        if seeds is None:
            gid = group_id_of(f"sim-{index}", index)
            size = len(self._group(index).samples)
            seeds = {sample_seed(self.seed, f"{gid}/{i}"): i for i in range(size)}
            self._seeds[index] = seeds
        if seed not in seeds:
            raise ValueError(f"replay: a request of task {index} is not one of its group's "
                             "samples (the group was not admitted as the task's index)")
        return seeds[seed]


class AgentReplayWorkload(ReplayWorkload):
    """Recorded agent episodes (module docstring, "Agent runs"). ``tool`` answers the
    recorded environment turns, each named by the draw its call carries."""

    def __init__(self, groups: list[ReplayGroup], *, seed: int, max_response_tokens: int,
                 token_block: int, max_turns: int, max_turn_tokens: int,
                 tool_timeout_s: float) -> None:
        super().__init__(groups, seed=seed, max_response_tokens=max_response_tokens,
                         token_block=token_block)
        self.budgets = Budgets(max_turns=max_turns,
                               max_turn_tokens=math.ceil(max_turn_tokens / token_block),
                               max_total_tokens=self.max_blocks)
        answers: list[ReplayTurn] = []
        self._draws: dict[tuple[int, int, int], int] = {}  # (group, sample, turn) -> draw
        for k, g in enumerate(groups):
            for i, s in enumerate(g.samples):
                for t, turn in enumerate(s.turns):
                    if turn.env_tokens is not None:
                        self._draws[(k, i, t)] = len(answers)
                        answers.append(turn)
        if len(answers) > 1 << ARG_BITS:
            raise ValueError(f"replay: {len(answers)} recorded tool answers; a replay holds at "
                             f"most {1 << ARG_BITS} (a call's draw is one character)")
        # the template's tokens around a tool answer (its markers), the rest is the tool's
        renderer = ChatRenderer(SimTokenizer())
        markers = len(renderer.extend([{"role": "user", "content": ""},
                                       {"role": "assistant", "content": ""}],
                                      [{"role": "tool", "content": ""}], model_ended_turn=True))
        output = [chr(TOOL_OUT) * max(0, math.ceil((a.env_tokens or 0) / token_block) - markers)
                  for a in answers]
        # the recorded waits hold the run's own timeouts: this manager must not cut them again
        timeout_s = tool_timeout_s + max((a.tool_s for a in answers), default=0.0)
        self.tool = LatencyTool(latency_s=lambda draw: answers[draw].tool_s,
                                output=output.__getitem__, timeout_s=timeout_s)

    def harness(self) -> AgentHarness:
        """The real agent harness with the run's budgets (in blocks)."""
        return agent_harness(self.tool, self.budgets)

    def task(self, index: int) -> Task:
        if index >= ARG_BASE - TASK_TOKEN_OFFSET:
            raise ValueError(f"an agentic simulation has at most {ARG_BASE - TASK_TOKEN_OFFSET}"
                             " tasks (one character each)")
        blocks = max(2, self._prompt_blocks(index))  # the task's character, ..., ASSISTANT
        text = chr(TASK_TOKEN_OFFSET + index) + chr(TOKEN) * (blocks - 2)
        return Task(uid=f"sim-{index}", source=SOURCE, prompt_ids=(*map(ord, text), ASSISTANT),
                    prompt_text=text, reference="", harness=AGENT)

    def outcome(self, prompt_ids: list[int], seed: int | None,
                version: int) -> tuple[int, int, tuple[int, ...]]:
        """(blocks of this model turn already in the prompt, the recorded turn's length in
        blocks, the tokens it ends with: the call of the recorded answer, or the episode's
        answer; then ``END``). A turn past the recorded ones (the run cut the episode by its
        wall time after a tool answer) is a 1-block empty answer."""
        index = prompt_ids[0] - TASK_TOKEN_OFFSET
        turn = prompt_ids.count(ASSISTANT) - 1  # every model turn opens with ASSISTANT
        done = prompt_ids[::-1].index(ASSISTANT)  # tokens of this turn after its opening
        i = self._sample_index(index, seed)
        s = self._group(index).samples[i]
        if turn >= len(s.turns):
            return done, 1, (END,)
        t = s.turns[turn]
        length = max(1, math.ceil(t.model_tokens / self.block))
        if t.env_tokens is not None:
            draw = self._draws[(index % len(self.groups), i, turn)]
            return done, length, (ARG_BASE + draw, END)
        if length == 1:  # a turn of its end token alone: an empty (wrong) answer
            return done, 1, (END,)
        return done, length, (CORRECT if s.correct else WRONG, END)
