"""A checkpoint's groups as JSON: an episode's environment snapshot, and the record of a
finished episode its group's reward has still to read, survive the round trip through the
file, and checkpoints written before snapshots existed still load."""

from __future__ import annotations

import json

from rollstream.durable.state import group_from_dict, group_to_dict
from rollstream.trajectory import (
    EnvSnapshot,
    Group,
    SampleStatus,
    Segment,
    SegmentKind,
    Task,
    Turn,
)


def _group() -> Group:
    task = Task(uid="s/0", source="s", prompt_ids=(1, 2, 3), prompt_text="go",
                reference="=1", harness="agent")
    group = Group.new(task, 2)
    episode = group.samples[0]
    episode.append_policy_tokens([4, 5], [-0.5, -0.25], [3, 3])
    episode.segments.append(Segment.env([6, 7, 8]))
    episode.turns += [Turn(kind=SegmentKind.POLICY, num_tokens=2, started_s=0.0, duration_s=0.1,
                           finish_reason="stop"),
                      Turn(kind=SegmentKind.ENV, num_tokens=3, started_s=0.1, duration_s=0.0)]
    episode.env_snapshot = EnvSnapshot(
        num_segments=2, state={"secret": 41, "seen": [1, 2], "rng": {"s": [0.5, None]}},
        messages=[{"role": "user", "content": "go"}, {"role": "assistant", "content": "ab"},
                  {"role": "user", "content": "s41"}])
    episode.status = SampleStatus.INTERRUPTED
    return group


def test_an_episode_snapshot_round_trips_through_json():
    group = _group()
    restored = group_from_dict(json.loads(json.dumps(group_to_dict(group))))
    episode, other = restored.samples
    assert episode.env_snapshot == group.samples[0].env_snapshot
    assert episode.segments == group.samples[0].segments and episode.turns == group.samples[0].turns
    assert episode.status is SampleStatus.INTERRUPTED and episode.num_restored_tokens == 5
    assert other.env_snapshot is None and other.segments == []


def test_a_checkpoint_without_snapshots_still_loads():
    saved = group_to_dict(_group())
    for sample in saved["samples"]:
        del sample["env_snapshot"]  # as written before environments could snapshot
    old = group_from_dict(json.loads(json.dumps(saved)))
    assert [s.env_snapshot for s in old.samples] == [None, None]
    assert len(old.samples[0].segments) == 2 and len(old.samples[0].turns) == 2


def test_a_finished_episodes_record_round_trips_until_its_group_grades_it():
    """A GENERATED episode waits in a checkpoint for its group's reward (a verifiers rubric
    that scores the group), which reads its record: the record is kept as it was."""
    group = _group()
    done = group.samples[1]
    done.append_policy_tokens([9], [-0.1], [3])
    done.status = SampleStatus.GENERATED
    done.episode_record = {"input": {"prompt": [{"role": "user", "content": "go"}]},
                           "completion": [{"role": "assistant", "content": "ab"}],
                           "trajectory": [{"reward": None, "extras": {"n": 1.5}}]}
    restored = group_from_dict(json.loads(json.dumps(group_to_dict(group))))
    assert restored.samples[1].episode_record == done.episode_record
    assert restored.samples[1].status is SampleStatus.GENERATED
    assert restored.samples[0].episode_record is None
