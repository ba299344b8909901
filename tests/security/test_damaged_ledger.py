"""A corrupt line in the checkpointed part of the ledger is an error, not a silent loss; the
reconcile that a resume does survives a crash at any moment and streams the ledger."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

import rollstream
from rollstream.data.ledger import read_ledger
from rollstream.durable import checkpoint as durable
from rollstream.durable.checkpoint import Checkpoint
from rollstream.durable.resume import reconcile_ledger
from tests.security.conftest import small, snapshot

ROOT = Path(__file__).resolve().parents[2]


def test_a_corrupt_line_inside_the_checkpointed_ledger_is_refused(run_copy: Path,
                                                                  kit_model: Path) -> None:
    """It used to be skipped, losing its sample at this resume and one more at each later
    one; the resume is refused naming the line, and nothing changes."""
    ledger = run_copy / "ledger.jsonl"
    lines = ledger.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"sample_uid": "tick/train/1#g0/1", "sta\n'
    ledger.write_bytes(b"".join(lines))
    before = snapshot(run_copy)
    with pytest.raises(ValueError, match=rf"{ledger} line 3: not JSON .*inside the \d+ lines"):
        rollstream.run(None, small(run_copy.parent, kit_model, "resume=true"))
    assert snapshot(run_copy) == before
    with pytest.raises(ValueError, match=rf"{ledger} line 3: not JSON"):
        read_ledger(ledger)  # the readers (audit, report) do not skip it either


CRASH = '''
import os, sys
from pathlib import Path
real = os.replace
def crash(src, dst, *args, **kwargs):  # the process dies where the ledger would be replaced
    if str(dst).endswith("/ledger.jsonl"):
        os._exit(9)
    return real(src, dst, *args, **kwargs)
os.replace = crash
import json
from rollstream.durable.checkpoint import Checkpoint
from rollstream.durable.resume import reconcile_ledger
run_dir = Path(sys.argv[1])
ckpt = run_dir / "checkpoints" / "step_000001"  # read without torch: the process starts fast
state = json.loads((ckpt / "state.json").read_text())
reconcile_ledger(run_dir, Checkpoint(path=ckpt, state=state), group_size=2)
'''


def test_a_crash_between_superseding_and_replacing_the_ledger_repeats_nothing(
        run_copy: Path, finished_run: Path, tmp_path: Path) -> None:
    """A process killed after appending to ledger.superseded.jsonl and before replacing
    ledger.jsonl used to leave the lines in both, and the next resume appended them again."""
    ckpt_dir = durable.folder(run_copy) / "step_000001"
    state = json.loads((ckpt_dir / durable.STATE).read_text())
    state["rollout"]["replay_lines"] = 2  # as if two replays had been checkpointed
    (ckpt_dir / durable.STATE).write_text(json.dumps(state))
    replays = "".join(json.dumps({"sample_uid": f"tick/train/{i}#g{i}/0", "event": "replayed",
                                  "replayed_at_step": 1}) + "\n" for i in range(3))
    (run_copy / "replays.jsonl").write_text(replays)
    done = subprocess.run([sys.executable, "-c", CRASH, str(run_copy)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr[-2000:]
    standing, moved = reconcile_ledger(run_copy, Checkpoint.read(ckpt_dir), group_size=2)
    clean = tmp_path / "clean"  # the same reconcile, never interrupted
    clean_run = clean / "r"
    clean_run.mkdir(parents=True)
    (clean_run / "ledger.jsonl").write_bytes((finished_run / "ledger.jsonl").read_bytes())
    (clean_run / "replays.jsonl").write_text(replays)
    want = reconcile_ledger(clean_run, Checkpoint.read(ckpt_dir), group_size=2)
    assert (standing, moved) == want and moved > 0
    for name in ("ledger.jsonl", "ledger.superseded.jsonl", "replays.jsonl",
                 "replays.superseded.jsonl"):
        assert (run_copy / name).read_bytes() == (clean_run / name).read_bytes(), name
    assert len((run_copy / "replays.jsonl").read_text().splitlines()) == 2
    assert not [p.name for p in run_copy.iterdir() if ".reconcile" in p.name]
    uids = [r.sample_uid for r in read_ledger(run_copy / "ledger.superseded.jsonl")]
    assert len(uids) == len(set(uids)) == moved - 1  # and one replay event


def _ledger(path: Path, num_lines: int) -> None:
    row = {"task_uid": "tick/train/0", "source": "tick", "status": "trained", "reason": None,
           "reward": 0.0, "num_tokens": 8, "turns": [], "pad": "x" * 100}
    with path.open("w") as f:
        for i in range(num_lines):
            f.write(json.dumps({"sample_uid": f"tick/train/{i}#g{i}/0", **row}) + "\n")


def _peak_bytes(run_dir: Path, num_lines: int) -> int:
    run_dir.mkdir()
    _ledger(run_dir / "ledger.jsonl", num_lines)
    ckpt = Checkpoint(path=run_dir / "ckpt", state={
        "step": 5, "rollout": {"ledger_lines": num_lines - 10, "held_groups": []}})
    tracemalloc.start()
    try:
        _, moved = reconcile_ledger(run_dir, ckpt, group_size=1)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        assert moved == 10


def test_reconciling_a_long_ledger_holds_only_its_tail(tmp_path: Path) -> None:
    """The memory a resume needs does not grow with the run: 5,000 and 50,000 checkpointed
    lines (1.3 and 13 MB) ahead of the same 10-line tail peak alike."""
    short = _peak_bytes(tmp_path / "short", 5_000)
    long = _peak_bytes(tmp_path / "long", 50_000)
    assert long < 2 * short + (1 << 20), (short, long)


def test_a_resumed_runs_metrics_read_the_ledger_in_chunks(tmp_path: Path) -> None:
    """The run's metrics (the dashboard's view) read the ledger a resumed run starts from
    in chunks of 1 MB: 50,000 lines (13 MB) peak well below the file's size (it used to
    peak at 93 MB)."""
    from rollstream.config.schema import MonitorConfig
    from rollstream.monitor.metrics import Metrics

    _ledger(tmp_path / "ledger.jsonl", 50_000)
    tracemalloc.start()
    try:
        metrics = Metrics(tmp_path, MonitorConfig(progress=False))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert metrics.latest()["ledger"]["num_samples"] == 50_000
    metrics.close()
    assert peak < (tmp_path / "ledger.jsonl").stat().st_size // 2, peak
