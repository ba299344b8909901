"""The typed ledger row: what a line holds, checked when it is read; old lines still read."""

from __future__ import annotations

import json

import pytest

from rollstream.data.ledger import Ledger, read_ledger
from rollstream.data.ledger_row import FORMAT, EnvTurn, LedgerRow, PolicyTurn
from rollstream.durable.audit import audit_run
from rollstream.monitor.runlog import RunDirReader
from rollstream.trajectory import Group, SampleStatus, Task

# lines as the ledger wrote them before rows carried a format (an agent episode and a
# rejected dataset row)
OLD_LINES = [
    {"sample_uid": "t/0#g0/0", "task_uid": "t/0", "source": "t", "status": "trained",
     "reason": None, "reward": 1, "num_tokens": 42, "prompt_tokens": 5, "min_version": 0,
     "max_version": 1, "num_interrupts": 1, "finish_reason": "done", "num_turns": 2,
     "turns": [{"kind": "policy", "num_tokens": 9, "started_s": 0.0, "duration_s": 0.25,
                "finish_reason": "stop", "num_interrupts": 0},
               {"kind": "env", "num_tokens": 30, "started_s": 0.26, "duration_s": 0.5,
                "num_tool_calls": 2, "tool_s": 0.375},
               {"kind": "policy", "num_tokens": 3, "started_s": 0.8, "duration_s": 0.1,
                "finish_reason": "length", "num_interrupts": 1}],
     "trained_at_step": 1, "min_trained_version": 0, "num_trained_tokens": 12,
     "taken_at_step": 1, "restored_tokens": 0, "t_s": 3.5},
    {"sample_uid": "ds/line3#row", "task_uid": "ds/line3", "source": "ds", "status": "failed",
     "reason": "bad dataset row: not JSON", "reward": None, "num_tokens": 0,
     "min_version": None, "max_version": None, "num_interrupts": 0, "trained_at_step": None,
     "min_trained_version": None, "num_trained_tokens": None, "t_s": 0.0},
]


def _write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_an_old_ledger_reads_as_typed_rows_in_every_reader(tmp_path):
    _write(tmp_path / "ledger.jsonl", OLD_LINES)
    episode, bad_row = read_ledger(tmp_path / "ledger.jsonl")
    assert episode.format == 1 and episode.status is SampleStatus.TRAINED
    assert episode.reward == 1.0 and episode.turns == [
        PolicyTurn(num_tokens=9, started_s=0.0, duration_s=0.25, finish_reason="stop"),
        EnvTurn(num_tokens=30, started_s=0.26, duration_s=0.5, num_tool_calls=2, tool_s=0.375),
        PolicyTurn(num_tokens=3, started_s=0.8, duration_s=0.1, finish_reason="length",
                   num_interrupts=1)]
    assert bad_row.is_dataset_row and bad_row.turns == [] and bad_row.restored_tokens == 0
    ledger = Ledger(tmp_path / "ledger.jsonl")  # a resume reads it back
    assert ledger.counts["trained"] == 1 and ledger.counts["rejected_rows"] == 1
    ledger.close()
    audit = audit_run(tmp_path, group_size=1, eval_group_size=1, groups_per_step=1, steps=2)
    assert audit["samples"] == 1 and audit["duplicated_samples"] == 0
    summary = RunDirReader(tmp_path).refresh().ledger_summary()
    assert summary["by_status"] == {"trained": 1, "failed": 1}
    assert summary["staleness"] == {"1": 1}


def test_lines_carry_the_format_and_a_bad_field_is_an_error_naming_line_and_field(tmp_path):
    task = Task(uid="t/0", source="t", prompt_ids=(1, 2), prompt_text="", reference="")
    sample = Group.new(task, 1, k=0).samples[0]
    sample.status = SampleStatus.FILTERED
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    ledger.open(sample)
    ledger.write(sample)
    ledger.close()
    written = json.loads(path.read_text())
    assert written["format"] == FORMAT == 2 and written["status"] == "filtered"
    assert "token_extras" not in written and "turn_samples" not in written  # until set
    _write(path, [*OLD_LINES, {**OLD_LINES[0], "num_tokens": "many"}, OLD_LINES[1]])
    with pytest.raises(ValueError, match=r"ledger.jsonl line 3: not a ledger row "
                                         r"\(Expected `int`, got `str` - at `\$.num_tokens`\)"):
        read_ledger(path)


def test_per_token_extras_hold_one_value_per_response_token():
    row = LedgerRow(sample_uid="t/0#g0/0", task_uid="t/0", source="t",
                    status=SampleStatus.TRAINED, num_tokens=2,
                    token_extras={"entropy": [0.5, 0.25]})
    assert row.token_extras == {"entropy": [0.5, 0.25]}
    with pytest.raises(ValueError, match=r"token_extras\['entropy'\] has 1 values for 2"):
        LedgerRow(sample_uid="t/0#g0/0", task_uid="t/0", source="t",
                  status=SampleStatus.TRAINED, num_tokens=2, token_extras={"entropy": [0.5]})
