"""The live dashboard against a web page that rebinds its own name to 127.0.0.1 (DNS
rebinding) and against anyone without the run's token, over real HTTP."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import httpx

from rollstream.config import RunConfig, TrainConfig
from rollstream.config.schema import MonitorConfig
from rollstream.data.ledger import Ledger
from rollstream.monitor.dashboard import Dashboard
from rollstream.monitor.metrics import Metrics
from rollstream.run_files import DASHBOARD_TOKEN as TOKEN_FILE
from rollstream.run_files import DASHBOARD_URL as URL_FILE
from rollstream.runtime.control import EngineControl
from tests.rollout.fakes import CountingTrainer
from tests.rollout.test_control import _cli
from tests.rollout.test_controller import Tasks, rollout_cfg
from tests.rollout.test_resume import _loop

CFG = MonitorConfig(progress=False, dashboard=True)


def test_control_routes_need_the_runs_token_and_the_bound_host(tmp_path: Path) -> None:
    cfg = RunConfig(rollout=rollout_cfg(mode="async", k=1, on_update="continue"),
                    train=TrainConfig(steps=2, groups_per_step=2))
    seen: dict = {}

    async def run() -> None:
        ledger = Ledger(tmp_path / "ledger.jsonl")
        loop, graders = _loop(cfg, seed=2, ledger=ledger, tasks=Tasks(), trainer=CountingTrainer(
            2, cfg.rollout.staleness_policy()))
        metrics = Metrics(tmp_path, MonitorConfig(progress=False))
        dash = Dashboard(metrics, tmp_path, CFG, control=EngineControl(
            loop.fleet, asyncio.get_running_loop()))
        url = dash.start()
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        token = (tmp_path / TOKEN_FILE).read_text().strip()
        seen["mode"] = stat.S_IMODE((tmp_path / TOKEN_FILE).stat().st_mode)
        drain = "/api/engines/rand-0/drain"

        def calls() -> None:
            with httpx.Client(base_url=url, timeout=30) as http:
                auth = {"Authorization": f"Bearer {token}"}
                seen["none"] = http.post(drain).status_code
                seen["add_none"] = http.post("/api/engines/add?count=1").status_code
                seen["remove_none"] = http.post("/api/engines/rand-0/remove").status_code
                seen["wrong"] = http.post(drain, headers={"Authorization": "Bearer x"})
                seen["list"] = http.get("/api/engines").status_code
                for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}"):
                    seen[host] = (http.post(drain, headers=auth | {"Host": host}).status_code,
                                  http.get("/api/config", headers={"Host": host}).status_code)
                seen["drained_by_then"] = [r["routing"] for r in
                                           http.get("/api/engines", headers=auth).json()]
                seen["ok"] = http.post(drain, headers=auth | {"Host": f"localhost:{port}"})
                seen["v6"] = http.post("/api/engines/rand-0/undrain",
                                       headers=auth | {"Host": f"[::1]:{port}"}).status_code
            seen["cli"] = _cli("engines", str(tmp_path), "--drain", "rand-1")
            (tmp_path / TOKEN_FILE).write_text("not-this-runs\n")
            seen["cli_wrong"] = _cli("engines", str(tmp_path))

        try:
            await asyncio.to_thread(calls)
        finally:
            dash.stop()
            metrics.close()
            graders.close()
            ledger.close()
        seen["left"] = [(tmp_path / f).exists() for f in (URL_FILE, TOKEN_FILE)]

    asyncio.run(run())
    assert seen["mode"] == 0o600, oct(seen["mode"])
    assert seen["none"] == 401 and seen["wrong"].status_code == 401 and seen["list"] == 401
    assert seen["add_none"] == seen["remove_none"] == 401, "adding and removing need it too"
    assert TOKEN_FILE in seen["wrong"].json()["detail"]
    for host in [k for k in seen if "evil" in k or k.startswith("127.")]:
        assert seen[host] == (403, 403), (host, seen[host])  # DNS rebinding reaches nothing
    assert seen["drained_by_then"] == ["routed", "routed"]
    assert seen["ok"].status_code == 200 and seen["ok"].json()["engine_id"] == "rand-0"
    assert seen["v6"] == 200
    rc, out = seen["cli"]
    assert rc == 0 and "drained rand-1" in out, out
    rc, out = seen["cli_wrong"]
    assert rc == 2 and TOKEN_FILE in out, out
    assert seen["left"] == [False, False], "stop() removes the URL and token files"
