"""Engines that join and leave a live run on the embedded runtime, operated as a user would:
``rollstream engines RUN --add 1`` and ``--remove ID`` against a running ``rollstream.run``
(its dashboard over real HTTP on 127.0.0.1), real local engines on a kit model.

The joining engine is built from the run's model folder (version 0); it must load the version
the others serve before its first request, so its first request's tokens carry that version
(the timeline's span of that request) and its weights equal theirs. The removed engine's
requests continue elsewhere from their tokens, its thread ends, and the ledger audit finds
nothing lost or duplicated."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx

import rollstream
from rollstream.cli import main
from rollstream.durable.audit import audit_run
from rollstream.run_files import DASHBOARD_URL
from tests.security.conftest import small

STEPS, GROUPS, GROUP = 40, 4, 4
HOLD_AT = 2  # the run waits after this step until the engine was added


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(list(args))
    return rc, out.getvalue()


def _rows(run_dir: Path) -> dict[str, list[str]]:
    """``rollstream engines RUN`` table: engine id -> its columns."""
    rc, out = _cli("engines", str(run_dir))
    assert rc == 0, out
    return {line.split()[0]: line.split() for line in out.splitlines()[1:]}


def _spans(run_dir: Path) -> list[dict]:
    path = run_dir / "timeline.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _until(check, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return got


def _operate(run_dir: Path, seen: dict) -> None:
    """While the run trains: once the engines serve version >= 2, add an engine (the run
    waits after step ``HOLD_AT`` until it joined), wait for its requests, then remove the
    first engine while it has requests in flight (slowed down, so that they still are when
    the command reaches it)."""
    _until(lambda: (run_dir / DASHBOARD_URL).exists())
    _until(lambda: int(_rows(run_dir)["local-0"][3]) >= 2)
    seen["add"] = _cli("engines", str(run_dir), "--add", "1")
    seen["rows_after_add"] = _rows(run_dir)
    url = (run_dir / DASHBOARD_URL).read_text().strip()
    seen["poll"] = httpx.get(url + "api/poll", timeout=30).json()  # one snapshot
    seen["weights_equal"] = _until(seen["engines_equal"], 10)  # a load may be under way
    seen["added"].set()
    seen["slow"]("local-0")  # its requests now last long enough to be caught in flight
    _until(lambda: sum(s["engine_id"] == "local-1" for s in _spans(run_dir)) >= 3)
    seen["add_too_many"] = _cli("engines", str(run_dir), "--add", "17")
    seen["add_none"] = _cli("engines", str(run_dir), "--add", "0")
    seen["remove_unknown"] = _cli("engines", str(run_dir), "--remove", "local-9")
    _until(lambda: int(_rows(run_dir)["local-0"][4]) > 0)  # requests in flight on it
    seen["thread"] = seen["thread_of"]("local-0")
    seen["remove"] = _cli("engines", str(run_dir), "--remove", "local-0")
    seen["rows_after_remove"] = _rows(run_dir)
    seen["thread_alive"] = seen["thread"].is_alive()
    seen["remove_last"] = _cli("engines", str(run_dir), "--remove", "local-1")


def test_engines_join_and_leave_a_live_local_run(tmp_path: Path, kit_model: Path,
                                                 monkeypatch) -> None:
    import torch

    from rollstream.runtime import fleet as fleet_module
    from rollstream.runtime import steps as steps_module

    run_dir = tmp_path / "r"
    seen: dict = {"added": threading.Event()}
    fleets: list = []
    real_init, real_after = fleet_module.Fleet.__init__, steps_module.BetweenSteps.__call__

    def spy_init(self, **kwargs):  # the run's fleet, to read its engines' weights
        real_init(self, **kwargs)
        fleets.append(self)

    async def holding(self, step, values):  # the run goes on once the engine was added
        await real_after(self, step, values)
        if step == HOLD_AT:
            await asyncio.to_thread(seen["added"].wait, 120)

    monkeypatch.setattr(fleet_module.Fleet, "__init__", spy_init)
    monkeypatch.setattr(steps_module.BetweenSteps, "__call__", holding)

    def engines_equal() -> bool:
        a, b = (fleets[0].dispatcher.router.by_id[i] for i in ("local-0", "local-1"))
        sa, sb = a._weights.hf_views, b._weights.hf_views
        return all(torch.equal(sa[k], sb[k]) for k in sa)

    def thread_of(engine_id: str) -> threading.Thread:
        return fleets[0].dispatcher.router.by_id[engine_id]._thread

    def slow(engine_id: str) -> None:
        """Each decode step of ``engine_id`` takes 30 ms more, so that a request on it is
        still running when the remove command arrives (24 tokens: about 0.7 s)."""
        engine = fleets[0].dispatcher.router.by_id[engine_id]
        step = engine._step

        def slow_step() -> None:
            time.sleep(0.03)
            step()

        engine._step = slow_step

    seen["engines_equal"], seen["thread_of"], seen["slow"] = engines_equal, thread_of, slow
    def operate() -> None:
        seen["error"] = _catch(_operate, run_dir, seen)
        seen["added"].set()  # a failed operation holds the run no longer

    op = threading.Thread(target=operate, daemon=True)
    op.start()
    summary = rollstream.run(None, small(tmp_path, kit_model, "monitor.dashboard=true",
                                         "engine.num_engines=1", f"train.steps={STEPS}",
                                         "train.checkpoint_every=0", "sampling.max_new_tokens=24",
                                         f"train.groups_per_step={GROUPS}",
                                         f"rollout.group_size={GROUP}",
                                         "engine.local.max_seq_len=64"))
    op.join(timeout=60)
    assert seen.get("error") is None, seen.get("error")
    assert summary["steps"] == STEPS
    work = summary["engines"]  # per engine, the one that left included
    assert work["local-0"]["busy_s"] > 0 and work["local-1"]["busy_s"] > 0, work

    rc, out = seen["add"]
    assert rc == 0 and "added local-1" in out, out
    rows = seen["rows_after_add"]
    assert rows["local-1"][5] == "serving" and rows["local-1"][3] == rows["local-0"][3]
    assert rows["local-0"][6] == rows["local-1"][6] == "local", "the NODE column"
    _check_cluster(seen["poll"])
    assert seen["weights_equal"], "the joining engine holds the weights the others serve"
    joined_at = int(rows["local-1"][3])
    first = min((s for s in _spans(run_dir) if s["engine_id"] == "local-1"),
                key=lambda s: s["t_start_s"])
    assert first["num_tokens"] > 0 and first["version_start"] >= joined_at >= 2, first

    rc, out = seen["remove"]
    assert rc == 0 and re.search(r"removed local-0: [1-9]\d* requests handed back", out), out
    assert "local-0" not in seen["rows_after_remove"]
    assert not seen["thread_alive"], "a removed local engine's thread has ended"
    assert seen["remove_last"][0] == 2 and "last live engine" in seen["remove_last"][1]
    assert seen["remove_unknown"][0] == 2 and "no engine 'local-9'" in seen["remove_unknown"][1]
    assert seen["add_too_many"][0] == 2 and "from 1 to 16" in seen["add_too_many"][1]
    assert seen["add_none"][0] == 2 and "count" in seen["add_none"][1]

    audit = audit_run(run_dir, group_size=GROUP, eval_group_size=1, groups_per_step=GROUPS,
                      steps=STEPS)
    assert audit["lost_samples"] == audit["duplicated_samples"] == 0, audit
    assert audit["steps_missing"] == audit["steps_repeated"] == 0, audit


def _check_cluster(poll: dict) -> None:
    """The dashboard's nodes view of an embedded run: one node, this host, with every
    engine; each engine's last sync moved the bytes the run's ``sync_bytes`` metric records
    (a full version, in process), the node the sum of its engines'."""
    [node] = poll["nodes"]
    engines = {e["engine_id"]: e for e in poll["engines"]}
    assert node["node_id"] == "local" and node["address"] is None, node
    assert node["hostname"] == socket.gethostname()
    assert [e["engine_id"] for e in node["engines"]] == sorted(engines) == ["local-0", "local-1"]
    assert node["transports"] == ["in_process"] and node["dtypes"] == ["float32"], node
    per_sync = {m["sync_bytes"] for m in poll["metrics"] if m.get("sync_bytes") is not None}
    assert len(per_sync) == 1 and (num_bytes := per_sync.pop()) > 0, per_sync  # one model
    for e in engines.values():
        assert e["sync_bytes_last"] == num_bytes and e["sync_kind"] == "full", e
        assert e["sync_bytes_total"] == e["syncs"] * num_bytes > 0, e
    at_last = [e for e in engines.values() if e["sync_version"] == node["sync_version"]]
    assert node["sync_bytes_last"] == len(at_last) * num_bytes > 0, node
    assert node["sync_bytes_total"] == sum(e["sync_bytes_total"] for e in engines.values())


def _catch(fn, *args) -> str | None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported by the test's assertion
        import traceback

        return "".join(traceback.format_exception(e))
    return None


def test_autoscale_grows_and_shrinks_a_live_local_run(tmp_path: Path, kit_model: Path,
                                                      caplog) -> None:
    """``runtime.autoscale`` on a live run: one engine of two slots makes requests wait (it
    grows), the staleness bound then leaves the engines idle part of each window (with the
    threshold at 1 it shrinks); each change one window apart, ids never reused, the ledger
    audit clean."""
    import logging

    run_dir = tmp_path / "r"
    with caplog.at_level(logging.INFO, logger="rollstream.runtime.autoscale"):
        summary = rollstream.run(None, small(
            tmp_path, kit_model, "engine.num_engines=1", "engine.local.max_slots=2",
            f"train.steps={STEPS}", "train.checkpoint_every=0", "sampling.max_new_tokens=24",
            f"train.groups_per_step={GROUPS}", f"rollout.group_size={GROUP}",
            "runtime.autoscale={max_engines: 2, grow_after_s: 0.2, window_s: 0.6, "
            "shrink_busy_below: 1.0}"))
    assert summary["steps"] == STEPS
    changes = [m.split(":")[1].split() for m in caplog.messages if m.startswith("autoscale: ")]
    assert changes[0] == ["added", "local-1"] and changes[1][0] == "removed", changes
    assert all(a[0] != b[0] for a, b in itertools.pairwise(changes)), "back and forth"
    added = [engine_id for verb, engine_id in changes if verb == "added"]
    assert added == [f"local-{i}" for i in range(1, len(added) + 1)], "ids are never reused"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sizes = [m["num_engines"] for m in lines if "num_engines" in m]
    assert sizes[:2] == [2, 1] and max(sizes) <= 2 and min(sizes) >= 1, sizes
    audit = audit_run(run_dir, group_size=GROUP, eval_group_size=1, groups_per_step=GROUPS,
                      steps=STEPS)
    assert audit["lost_samples"] == audit["duplicated_samples"] == 0, audit
