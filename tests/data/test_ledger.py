"""The ledger's exactly-once index: flat memory over a long run, duplicates still caught."""

from __future__ import annotations

import pytest

from rollstream.data import ledger as ledger_mod
from rollstream.data.ledger import Ledger, read_jsonl, read_ledger
from rollstream.trajectory import Group, SampleStatus, Task


def _terminal_group(k: int) -> Group:
    task = Task(uid="t/0", source="t", prompt_ids=(1, 2), prompt_text="", reference="")
    group = Group.new(task, 2, k=k)
    for s in group.samples:
        s.status = SampleStatus.FILTERED
    return group


def test_memory_is_bounded_and_recent_duplicates_raise(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_mod, "RECENT", 4)
    ledger = Ledger(tmp_path / "ledger.jsonl")
    groups = [_terminal_group(k) for k in range(10)]
    for g in groups:
        for s in g.samples:
            ledger.open(s)
            ledger.write(s)
    assert len(ledger._terminal) == 4 and ledger.num_recorded == 20
    assert ledger.counts["filtered"] == 20 and not ledger.unfinished()
    last = groups[-1].samples[-1]
    with pytest.raises(AssertionError, match="already recorded"):
        ledger.write(last)
    with pytest.raises(AssertionError, match="dispatched twice"):
        ledger.open(last)
    ledger.record_rejected("ds/line3", "ds", "not JSON")
    assert ledger.status_of("ds/line3#row") is SampleStatus.FAILED
    ledger.close()
    assert len(read_ledger(tmp_path / "ledger.jsonl")) == 21
    again = Ledger(tmp_path / "ledger.jsonl")  # a resumed run reads the file back
    assert again.num_recorded == 21 and again.counts["rejected_rows"] == 1
    assert len(again._terminal) == 4 and again.status_of("ds/line3#row") is SampleStatus.FAILED
    again.close()


def test_an_episodes_line_lists_its_turns_and_the_longest_tool_wait_of_each_answer(tmp_path):
    from rollstream.trajectory import SegmentKind, ToolCall, ToolResult, Turn

    group = _terminal_group(0)
    sample = group.samples[0]
    calls = [ToolCall(id=f"call_{j}", name="calc", arguments={}) for j in range(2)]
    sample.turns = [
        Turn(kind=SegmentKind.POLICY, num_tokens=9, started_s=0.0, duration_s=0.25,
             finish_reason="stop"),
        Turn(kind=SegmentKind.ENV, num_tokens=30, started_s=0.26, duration_s=0.5,
             tool_calls=calls,
             tool_results=[ToolResult(call=c, content="1", ok=True, error=None, duration_s=d)
                           for c, d in zip(calls, (0.125, 0.375), strict=True)]),
        Turn(kind=SegmentKind.POLICY, num_tokens=3, started_s=0.8, duration_s=0.1,
             finish_reason="length", num_interrupts=1),
    ]
    ledger = Ledger(tmp_path / "ledger.jsonl")
    for s in group.samples:
        ledger.open(s)
        ledger.write(s)
    ledger.close()
    episode, single = read_jsonl(tmp_path / "ledger.jsonl")  # the lines as on disk
    assert episode["num_turns"] == 2 and single["turns"] == []
    assert episode["turns"] == [
        {"kind": "policy", "num_tokens": 9, "started_s": 0.0, "duration_s": 0.25,
         "finish_reason": "stop", "num_interrupts": 0, "num_tool_calls": 0},
        {"kind": "env", "num_tokens": 30, "started_s": 0.26, "duration_s": 0.5,
         "num_tool_calls": 2, "tool_s": 0.375},  # the calls ran concurrently
        {"kind": "policy", "num_tokens": 3, "started_s": 0.8, "duration_s": 0.1,
         "finish_reason": "length", "num_interrupts": 1, "num_tool_calls": 0}]
