"""The replay pool: informative groups already trained, kept while they may train again.

With ``rollout.replay.max_share > 0`` the rollout offers each group it trained to the pool
(:meth:`ReplayPool.offer`); a group whose baseline rewards vary and of which a sample trained
is kept. When a step's batch is short of fresh groups, the rollout asks for the missing ones
(:meth:`ReplayPool.draw`), at most ``floor(max_share x n)`` of a batch of ``n``: a replay
never displaces a fresh group that is ready, and a step always trains a fresh one.

Staleness is not decided here: a group is drawn only while
:meth:`StalenessPolicy.group_verdict` accepts it at the step, and the trainer's token mask and
importance ratios treat its tokens like any stale tokens (they carry their sampling versions
and behaviour logprobs). After each step the pool drops what the policy rejects at the next
one (staleness only grows) and what was used ``max_uses`` times, so it holds at most the
groups trained within the context bound: ``context_bound x groups_per_step``.

A replay is not a second terminal status: the sample keeps its one ledger line, and each
replay that the loss kept tokens of adds a line to ``replays.jsonl`` (:meth:`Ledger.replayed`).
The pool is in the rollout's snapshot, uses and all, so a resume neither loses nor repeats a
replay the checkpoint saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollstream.config.replay import ReplayConfig
from rollstream.durable.state import group_from_dict, group_to_dict
from rollstream.staleness import StalenessPolicy
from rollstream.trajectory import Group, SampleStatus


@dataclass(slots=True, kw_only=True)
class _Entry:
    group: Group
    uses: int = 0  # replays so far


def _newest_first(e: _Entry) -> tuple[int, int]:
    v = e.group.min_version()
    return (-(v if v is not None else -1), e.uses)


class ReplayPool:
    def __init__(self, cfg: ReplayConfig, policy: StalenessPolicy,
                 failed_reward: float | None = None) -> None:
        self.cfg, self.policy, self.failed_reward = cfg, policy, failed_reward
        self._entries: dict[str, _Entry] = {}  # group id -> entry

    def __len__(self) -> int:
        return len(self._entries)

    def max_groups(self, n: int) -> int:
        """Replays a batch of ``n`` groups may hold."""
        return int(self.cfg.max_share * n)

    def offer(self, group: Group) -> None:
        """``group`` was trained for the first time: keep it if it may teach again."""
        if self.cfg.max_share == 0 or not any(s.status is SampleStatus.TRAINED
                                              for s in group.samples):
            return
        if len({r for _, r in group.baseline_rewards(self.failed_reward)}) > 1:
            self._entries[group.group_id] = _Entry(group=group)

    def evict(self, step: int) -> None:
        """Drop the groups the staleness policy rejects at ``step`` (later steps reject them
        too) and those used ``max_uses`` times."""
        self._entries = {gid: e for gid, e in self._entries.items()
                         if e.uses < self.cfg.max_uses
                         and self.policy.group_verdict(e.group, step).ok}

    def draw(self, k: int, step: int) -> list[Group] | None:
        """``k`` groups to replay at ``step``, the least stale first (each counts a use); None,
        drawing nothing, while fewer than ``k`` are replayable."""
        self.evict(step)
        if k <= 0 or len(self._entries) < k:
            return None
        chosen = sorted(self._entries.values(), key=_newest_first)[:k]
        for e in chosen:
            e.uses += 1
        self.evict(step)  # used up: out (they are in this step's batch)
        return [e.group for e in chosen]

    def state(self) -> list[dict[str, Any]]:
        return [{"group": group_to_dict(e.group), "uses": e.uses}
                for e in self._entries.values()]

    def restore(self, state: list[dict[str, Any]]) -> None:
        self._entries = {}
        for d in state:
            group = group_from_dict(d["group"])
            self._entries[group.group_id] = _Entry(group=group, uses=d["uses"])
