import pytest

from rollstream.trajectory import (
    Group,
    Sample,
    SampleStatus,
    Segment,
    SegmentKind,
    Task,
    eval_group_id,
)


def _task(uid: str = "src/train/1") -> Task:
    return Task(uid=uid, source="src", prompt_ids=(1, 2, 3), prompt_text="abc", reference="x")


def test_task_needs_uid_and_prompt():
    with pytest.raises(ValueError, match="uid"):
        Task(uid="", source="s", prompt_ids=(1,), prompt_text="", reference="")
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        Task(uid="a", source="s", prompt_ids=(), prompt_text="", reference="")


def test_segment_per_token_lists_share_one_length():
    with pytest.raises(ValueError, match="logprobs has 1 entries, token_ids has 2"):
        Segment(kind=SegmentKind.POLICY, token_ids=[1, 2], logprobs=[0.0], versions=[0, 0],
                loss_mask=[True, True])
    with pytest.raises(ValueError, match="loss_mask"):
        Segment(kind=SegmentKind.POLICY, token_ids=[1], logprobs=[0.0], versions=[0],
                loss_mask=[])
    with pytest.raises(ValueError, match="version >= 0"):
        Segment(kind=SegmentKind.POLICY, token_ids=[1], logprobs=[0.0], versions=[-1],
                loss_mask=[True])
    with pytest.raises(ValueError, match="env tokens"):
        Segment(kind=SegmentKind.ENV, token_ids=[1], logprobs=[0.0], versions=[0],
                loss_mask=[False])
    env = Segment.env([7, 8])
    assert env.versions == [-1, -1] and env.loss_mask == [False, False] and len(env) == 2


def test_sample_concatenates_segments_and_tracks_versions():
    g = Group.new(_task(), 2, k=3)
    s = g.samples[1]
    assert s.uid == "src/train/1#g3/1" and g.group_id == "src/train/1#g3"
    assert s.min_version() is None
    s.append_policy_tokens([10, 11], [-0.5, -0.25], [2, 2])
    s.append_policy_tokens([12], [-1.0], [3])  # resumed on new weights: same segment
    assert len(s.segments) == 1
    s.segments.append(Segment.env([99]))
    s.append_policy_tokens([13], [-0.1], [4])
    assert s.response_ids == [10, 11, 12, 99, 13]
    assert s.versions == [2, 2, 3, -1, 4]
    assert s.loss_mask == [True, True, True, False, True]
    assert s.min_version() == 2 and g.min_version() == 2
    assert s.num_response_tokens == 5


def test_terminal_statuses():
    terminal = {st for st in SampleStatus if st.is_terminal()}
    assert terminal == {SampleStatus.TRAINED, SampleStatus.FILTERED, SampleStatus.DROPPED_STALE,
                        SampleStatus.FAILED, SampleStatus.EVALUATED, SampleStatus.ABORTED}


def test_eval_groups_have_their_own_id_namespace():
    t = _task()
    train_ids = {Group.new(t, 1, k=k).group_id for k in range(2000)}
    assert Group.new(t, 1, group_id=eval_group_id(t.uid, 0)).group_id not in train_ids
    assert eval_group_id(t.uid, 0) != eval_group_id(t.uid, 1)


def test_baseline_rewards_count_failed_samples_only_when_asked():
    g = Group.new(_task(), 3)
    g.samples[0].reward, g.samples[1].reward = 1.0, 0.0
    g.samples[2].status = SampleStatus.FAILED
    assert [r for _, r in g.baseline_rewards(None)] == [1.0, 0.0]
    assert [r for _, r in g.baseline_rewards(0.0)] == [1.0, 0.0, 0.0]


def test_group_checks_its_samples():
    t = _task()
    with pytest.raises(ValueError, match="group size"):
        Group.new(t, 0)
    other = Sample(task=t, group_id="elsewhere", sample_idx=0)
    with pytest.raises(ValueError, match="belongs elsewhere"):
        Group(group_id="g", task=t, samples=[other])
    with pytest.raises(ValueError, match="sample_idx must be 0..n-1"):
        Group(group_id="g", task=t, samples=[Sample(task=t, group_id="g", sample_idx=1)])
