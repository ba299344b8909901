"""A run joins a cluster started from the shell (``runtime.ray.address``): a head started
with ``ray start --head`` and a worker node with ``ray start --address``, both on 127.0.0.1,
each in a process group of its own and a session folder of the test's. The worker node has
the engines' custom resource; the run's engine actor is placed there by
``runtime.ray.nodes.engines``, the run trains, and its ledger audits clean.

Loopback only, as docs/distributed.md ("One host") says: the head is started with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (which keeps its node address 127.0.0.1, so its GCS,
raylet and agents listen there only), and the worker through the ``ray`` entry point with
Ray's rewrite of 127.0.0.1 to the machine's routable address turned off (the ``ray start``
command line has no switch for it: a joining node given 127.0.0.1 looks for the head on the
routable address, where nothing listens). Ray's token authentication is on, as
``ray start`` turns it on whenever ``~/.ray/auth_token`` exists: the test makes sure the token
exists (``ray get-auth-token --generate`` where it does not) and starts every process with
``RAY_AUTH_MODE=token``. At the end the test stops only the two process groups it started
(never ``ray stop``: that would end every Ray on the machine) and checks none of their
processes is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollstream.bench.tiny_run import tiny_run_config
from rollstream.config import load_config
from rollstream.config.runtime import MIN_OBJECT_STORE_BYTES
from rollstream.runtime.train import run_training
from tests.runtime.test_ray import STEPS, _check_ledger

pytestmark = pytest.mark.ray
ENGINES = "rs_engines"
START_TIMEOUT_S = 120.0  # a `ray start` on a loaded machine (~5 s each when idle)
# `ray start` for a node joining on loopback: Ray's CLI, with its rewrite of 127.0.0.1 to the
# machine's routable address off (module docstring)
JOIN = ("import sys\nfrom ray._private import services\n"
        "services.resolve_ip_for_localhost = lambda host: host\n"
        "from ray.scripts.scripts import main\nsys.argv[0] = 'ray'\nsys.exit(main())")


def _ray(*args: str) -> list[str]:
    """``ray ARGS`` with this interpreter's Ray."""
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(pgid: int) -> set[int]:
    """The live processes of process group ``pgid``."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.add(int(d.name))
    return out


def _stop(pgids: list[int], timeout_s: float = 5.0) -> None:
    """SIGTERM each group, SIGKILL what is left after ``timeout_s`` (Ray's GCS outlives a
    SIGTERM by more than 20 s here; `ray stop` too ends it with SIGKILL, after 16 s)."""
    for pgid in pgids:
        if _group(pgid):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(_group(g) for g in pgids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pgid in pgids:
        if _group(pgid):
            os.killpg(pgid, signal.SIGKILL)
    # a killed process is gone once the kernel has torn it down (its memory, a loaded
    # machine: up to seconds), not when the signal is sent
    deadline = time.monotonic() + 15.0
    while any(_group(g) for g in pgids) and time.monotonic() < deadline:
        time.sleep(0.2)


def _start(cmd: list[str], env: dict[str, str], log: Path) -> int:
    """Run a ``ray start`` in a new session (its Ray processes stay in that process group
    after it exits); its process group id."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        code = proc.wait(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    if code != 0:
        _stop([proc.pid])
        raise AssertionError(f"{' '.join(cmd)} -> {code}:\n{log.read_text()[-3000:]}")
    return proc.pid


@dataclass(kw_only=True)
class ShellCluster:
    address: str  # the head's GCS on 127.0.0.1
    groups: list[int]  # the process groups of the head and the worker node
    temp_dir: Path


@pytest.fixture
def shell_cluster(monkeypatch) -> Iterator[ShellCluster]:
    import ray
    from ray._raylet import Config

    assert not ray.is_initialized(), "another test's Ray is still up: the run would use it"
    if not (Path.home() / ".ray" / "auth_token").exists():  # Ray's default token file
        subprocess.run(_ray("get-auth-token", "--generate"), check=True, capture_output=True)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # this process's (the driver's) too:
    Config.initialize("")  # Ray reads it once, so it is read again
    temp_dir = Path(tempfile.mkdtemp(prefix="rs-rst-"))  # short: Ray's Unix sockets
    port, groups = _free_port(), []
    common = ["--temp-dir", str(temp_dir), "--disable-usage-stats",
              f"--object-store-memory={MIN_OBJECT_STORE_BYTES}"]
    env = dict(os.environ, RAY_AUTH_MODE="token")
    try:
        groups.append(_start(_ray(
            "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--ray-client-server-port={_free_port()}", "--num-cpus=2",
            "--include-dashboard=false", *common),
            dict(env, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"), temp_dir / "head.log"))
        groups.append(_start(
            [sys.executable, "-c", JOIN, "start", f"--address=127.0.0.1:{port}",
             "--node-ip-address=127.0.0.1", "--num-cpus=1",
             f"--resources={json.dumps({ENGINES: 1})}", *common],
            env, temp_dir / "worker.log"))
        yield ShellCluster(address=f"127.0.0.1:{port}", groups=groups, temp_dir=temp_dir)
    finally:
        ray.shutdown()  # the run joined the cluster: this process is still connected
        _stop(groups)
        left = {g: _group(g) for g in groups}
        shutil.rmtree(temp_dir, ignore_errors=True)
    monkeypatch.undo()
    Config.initialize("")
    assert not any(left.values()), f"processes of the nodes outlived the test: {left}"


def _listening(pids: set[int]) -> set[str]:
    """The TCP addresses ``pids`` listen on (``ss -ltnp``)."""
    out = subprocess.run(["ss", "-Hltnp"], check=True, capture_output=True, text=True).stdout
    return {line.split()[3] for line in out.splitlines()
            if any(f"pid={pid}," in line for pid in pids)}


def _actor_nodes() -> dict[str, str]:
    """Every actor of the cluster: class name + id -> its node id (Ray's actor table)."""
    from ray._private.state import actors

    return {a["ActorClassName"] + aid: a["Address"]["NodeID"] for aid, a in actors().items()}


def test_a_run_joins_a_cluster_started_with_ray_start_and_its_engines_take_their_node(
        shell_cluster, tmp_path, tiny_run_cache):
    import ray

    cfg = tiny_run_config("joined", tmp_path, steps=STEPS, checkpoint_every=0,
                          cache_dir=tiny_run_cache, max_slots=8)
    cfg["model"]["warm_start"]["steps"] = 0  # the run need not learn
    (tmp_path / "joined.yaml").write_text(json.dumps(cfg))
    cfg = load_config(tmp_path / "joined.yaml", [
        "runtime.kind=ray", f"runtime.ray.address={shell_cluster.address}",
        f"runtime.ray.nodes.engines={ENGINES}", "engine.num_engines=1",
        "reward.num_workers=1"])
    summary = run_training(cfg, rewards={"tick": _parity})
    assert summary["steps"] == STEPS and not summary["unfinished_samples"]
    rows = _check_ledger(tmp_path / "joined")
    assert sum(r.status == "trained" for r in rows) == summary["trained_samples"] > 0
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    [worker] = [i for i, n in nodes.items() if ENGINES in n["Resources"]]
    assert len(nodes) == 2 and ray.get_runtime_context().get_node_id() != worker
    engines = [node for name, node in _actor_nodes().items() if name.startswith("EngineActor")]
    assert engines == [worker], (engines, worker)
    # every server of the two nodes listens on loopback only
    pids = set().union(*(_group(g) for g in shell_cluster.groups))
    addresses = _listening(pids)
    assert addresses and all(a.rsplit(":", 1)[0] in ("127.0.0.1", "[::ffff:127.0.0.1]")
                             for a in addresses), addresses


def _parity(task, text: str) -> float:
    """A sync reward (it runs in the reward worker actor) with variance in every group."""
    return float(len(text) % 2)
