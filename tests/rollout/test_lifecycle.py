"""The sample state machine and the ledger it writes: legal transitions only, exactly once."""

from __future__ import annotations

import itertools

import pytest

from rollstream.clock import WallClock
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.rollout.lifecycle import _NEXT, Lifecycle
from rollstream.trajectory import Group, SampleStatus, Task

S = SampleStatus


def _group(n: int = 2) -> Group:
    task = Task(uid="t/0", source="t", prompt_ids=(1, 2), prompt_text="x", reference="y")
    return Group.new(task, n)


def test_the_happy_path_and_its_ledger_line(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    life = Lifecycle(ledger, WallClock())
    g = _group()
    for s in g.samples:
        life.open(s)
    a, b = g.samples
    for status in (S.RUNNING, S.INTERRUPTED, S.RUNNING, S.GENERATED, S.GRADED):
        life.move(a, status)
    a.append_policy_tokens([5, 6], [-0.1, -0.2], [0, 1])
    life.move(a, S.TRAINED)
    assert [s.uid for s in ledger.unfinished()] == [b.uid]
    life.move(b, S.FAILED, "reward: boom")
    ledger.close()
    rows = read_ledger(tmp_path / "ledger.jsonl")
    assert [r.status for r in rows] == ["trained", "failed"]
    assert rows[1].reason == "reward: boom" and rows[0].max_version == 1
    assert not ledger.unfinished() and ledger.counts == {"trained": 1, "failed": 1}


def test_every_illegal_transition_raises_and_terminal_is_final():
    """Exhaustive over (from, to): a move is allowed exactly when the table says so, and a
    sample never gets a second terminal status (nor a second ledger line)."""
    for src, dst in itertools.product(S, S):
        ledger = Ledger()
        life = Lifecycle(ledger, WallClock())
        s = _group(1).samples[0]
        life.open(s)
        s.status = src  # set up the starting point directly (the test's own business)
        if dst in _NEXT.get(src, frozenset()):
            life.move(s, dst, "why" if dst.is_terminal() else None)
            assert s.status is dst
            assert ledger.num_recorded == int(dst.is_terminal())
        else:
            with pytest.raises(AssertionError):
                life.move(s, dst)
            assert s.status is src and ledger.num_recorded == 0
    for t in S:
        if t.is_terminal():
            assert not _NEXT.get(t), f"{t} must be final"


def test_the_ledger_refuses_a_second_line_for_one_uid(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    life = Lifecycle(ledger, WallClock())
    a = _group(1).samples[0]
    twin = _group(1).samples[0]  # another object with the same uid
    life.open(a)
    life.move(a, S.ABORTED, "run ended")
    with pytest.raises(AssertionError, match="already recorded"):
        life.move(twin, S.FILTERED, "again")
    with pytest.raises(AssertionError, match="dispatched twice"):
        life.open(twin)


def test_ledger_reads_a_torn_last_line(tmp_path):
    p = tmp_path / "ledger.jsonl"
    p.write_text('{"sample_uid": "a", "task_uid": "t", "source": "s", "status": "trained"}\n'
                 '{"sample_uid": "b", "sta')
    assert [r.sample_uid for r in read_ledger(p)] == ["a"]
