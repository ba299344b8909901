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
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from rollstream.data.ledger import read_ledger
from rollstream.rollout.dispatcher import sample_seed
from rollstream.sim.workload import CORRECT, TASK_TOKEN_OFFSET, TOKEN, WRONG
from rollstream.trajectory import Task, group_id_of

_TRAIN_UID = re.compile(r"^(?P<group>.+#g(?P<k>\d+))/(?P<i>\d+)$")


@dataclass(slots=True, frozen=True)
class ReplaySample:
    response_tokens: int
    correct: bool


@dataclass(slots=True, frozen=True)
class ReplayGroup:
    prompt_tokens: int
    samples: tuple[ReplaySample, ...]


def read_groups(run_dir: Path, group_size: int) -> list[ReplayGroup]:
    """The training groups of ``run_dir/ledger.jsonl`` in admission order (ValueError when it
    has none, or a group's size is not ``group_size``)."""
    by_k: dict[int, dict[int, dict]] = {}
    for row in read_ledger(Path(run_dir) / "ledger.jsonl"):
        m = _TRAIN_UID.match(row["sample_uid"])
        if m is not None:
            by_k.setdefault(int(m["k"]), {})[int(m["i"])] = row
    groups = []
    for k in sorted(by_k):
        rows = by_k[k]
        if sorted(rows) != list(range(group_size)):
            raise ValueError(f"replay {run_dir}: group #g{k} has samples {sorted(rows)}, "
                             f"not 0..{group_size - 1} (group_size must be the run's)")
        if rows[0].get("prompt_tokens") is None:
            raise ValueError(f"replay {run_dir}: the ledger has no prompt_tokens (recorded "
                             "since the simulator's calibration; rerun the training run)")
        groups.append(ReplayGroup(
            prompt_tokens=rows[0]["prompt_tokens"],
            samples=tuple(ReplaySample(response_tokens=max(1, r["num_tokens"]),
                                       correct=(r["reward"] or 0.0) > 0.5)
                          for _, r in sorted(rows.items()))))
    if not groups:
        raise ValueError(f"replay {run_dir}: no training group in ledger.jsonl")
    return groups


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
        seeds = self._seeds.get(index)
        if seeds is None:
            gid = group_id_of(f"sim-{index}", index)
            size = len(self._group(index).samples)
            seeds = {sample_seed(self.seed, f"{gid}/{i}"): i for i in range(size)}
            self._seeds[index] = seeds
        if seed not in seeds:
            raise ValueError(f"replay: a request of task {index} is not one of its group's "
                             "samples (the group was not admitted as the task's index)")
        s = self._group(index).samples[seeds[seed]]
        return (len(prompt_ids) - self._prompt_blocks(index),
                max(1, math.ceil(s.response_tokens / self.block)),
                (CORRECT,) if s.correct else (WRONG,))
