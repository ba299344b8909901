"""Draining an engine of a live run from outside it: ``rollstream engines RUN_DIR --drain
ID`` reaches the run's dashboard over real HTTP on 127.0.0.1, the dispatcher preempts that
engine (its requests continue on the other from their tokens), nothing more is routed to it
until ``--undrain``, and the run finishes with every sample recorded once."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from pathlib import Path

import httpx

from rollstream.cli import main
from rollstream.config import RunConfig, TrainConfig
from rollstream.config.schema import MonitorConfig
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.monitor.dashboard import Dashboard
from rollstream.monitor.metrics import Metrics
from rollstream.run_files import DASHBOARD_URL as URL_FILE
from rollstream.runtime.build import build_controller
from rollstream.runtime.control import EngineControl

from .fakes import CountingTrainer
from .test_controller import Tasks, rollout_cfg
from .test_resume import _loop


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(list(args))
    return rc, out.getvalue()


def test_drain_and_undrain_a_live_runs_engine_over_http(tmp_path: Path) -> None:
    cfg = RunConfig(rollout=rollout_cfg(mode="async", k=1, on_update="continue"),
                    train=TrainConfig(steps=30, groups_per_step=2))
    policy = cfg.rollout.staleness_policy()
    seen: dict = {}

    async def run() -> None:
        ledger = Ledger(tmp_path / "ledger.jsonl")
        loop, graders = _loop(cfg, seed=2, ledger=ledger, tasks=Tasks(),
                              trainer=CountingTrainer(2, policy))
        for e in loop.dispatcher.engines:
            e.max_delay_s = 0.004  # the run lasts a few seconds
        metrics = Metrics(tmp_path, MonitorConfig(progress=False))
        dash = Dashboard(metrics, tmp_path, MonitorConfig(progress=False),
                         control=EngineControl(loop.fleet, asyncio.get_running_loop()))
        url = dash.start()
        a, b = loop.dispatcher.engines

        async def operate() -> None:
            while a.generated < 50:
                await asyncio.sleep(0.01)
            seen["drain"] = await asyncio.to_thread(_cli, "engines", str(tmp_path),
                                                    "--drain", "rand-0")
            seen["after_drain"], seen["b_at_drain"] = a.generated, b.generated
            seen["page"] = (await asyncio.to_thread(httpx.get, url + "api/poll")).json()
            await asyncio.sleep(0.5)
            seen["a_running"], seen["a_idle"] = len(a._running), a.generated
            seen["b_during"] = b.generated
            seen["undrain"] = await asyncio.to_thread(_cli, "engines", str(tmp_path),
                                                      "--undrain", "rand-0")
            seen["unknown"] = await asyncio.to_thread(_cli, "engines", str(tmp_path),
                                                      "--drain", "nope")
            seen["add"] = await asyncio.to_thread(_cli, "engines", str(tmp_path), "--add", "1")
            seen["remove"] = await asyncio.to_thread(_cli, "engines", str(tmp_path),
                                                     "--remove", "nope")

        try:
            op = asyncio.create_task(operate())
            seen["result"] = await build_controller(cfg, loop).run()
            await op
        finally:
            dash.stop()
            metrics.close()
            graders.close()
            ledger.close()
        seen["a_end"], seen["url_left"] = a.generated, (tmp_path / URL_FILE).exists()

    asyncio.run(run())
    rc, out = seen["drain"]
    assert rc == 0 and "drained rand-0" in out, out
    assert re.search(r"^rand-0 +up +drained ", out, re.M), out  # the table's row
    assert [(e["engine_id"], e["routing"], e["member"]) for e in seen["page"]["engines"]] == \
        [("rand-0", "drained", "serving"), ("rand-1", "routed", "serving")], "the page's table"
    assert seen["a_running"] == 0 and seen["a_idle"] == seen["after_drain"], \
        "nothing is routed to a drained engine"
    assert seen["b_during"] > seen["b_at_drain"], "the other engine does the work meanwhile"
    rc, out = seen["undrain"]
    assert rc == 0 and "undrained rand-0" in out, out
    assert seen["a_end"] > seen["a_idle"], "undrained, it takes work again"
    rc, out = seen["unknown"]
    assert rc == 2 and "no engine 'nope'" in out, out
    rc, out = seen["add"]  # its engines were given to it: nothing builds another
    assert rc == 2 and "this run cannot add engines" in out, out
    rc, out = seen["remove"]
    assert rc == 2 and "no engine 'nope'" in out, out
    assert seen["result"].steps_done == 30
    rows = read_ledger(tmp_path / "ledger.jsonl")
    assert len({r.sample_uid for r in rows}) == len(rows)
    assert not seen["url_left"], "the dashboard removes its URL file when it stops"


def test_engines_without_a_live_run_says_why(tmp_path: Path) -> None:
    rc, out = _cli("engines", str(tmp_path))
    assert rc == 2 and "monitor.dashboard=true" in out
    (tmp_path / URL_FILE).write_text("http://127.0.0.1:9/\n")  # a killed run's left-over
    rc, out = _cli("engines", str(tmp_path))
    assert rc == 2 and "no run answers" in out
