"""``bench scale``'s multi-node rows, on a 3-node Ray cluster on this host
(``bench/cluster.py``: each node its own raylet and object store):

    head    4 CPUs  rs_head      the driver's node (the runs join the cluster from the bench)
    node 1  2 CPUs  rs_engines
    node 2  1 CPU   rs_engines

Each run is the bench's run (``scale.py``'s common overrides) with two engine actors in two
scale units and its reward workers on the head, trained in the bench's process (it joins the
cluster by ``runtime.ray.address``; the trainer runs in the driver, on the head):

* ``ray_multinode``: ``runtime.ray.nodes.engines=rs_engines``: the engines on nodes 1 and 2,
  none on the driver's node;
* ``ray_single_node``: ``runtime.ray.nodes.engines=rs_head``: every actor on the driver's node.

``multinode_vs_single_node_samples_per_s`` is the first's trained samples/s over the second's
(the rows alternate as ``scale.py``'s do). The nodes share this host's cores, ``/dev/shm`` and
loopback: on one host the ratio measures what more processes, raylets and object stores
cost, not a network.

An **operated run** (``ray_multinode`` with the dashboard on and ``operated_steps`` steps):
once its first step trained, ``rollstream engines RUN --add 1``'s request (``POST
/api/engines/add``) adds an engine (it goes to node 1's free CPU); ``engine_join_s`` runs from
sending that request until the dashboard's engine table (polled every ``POLL_S``) shows the
new engine's first generated token. Then node 2, with the engine it holds, is removed
(``Cluster.remove_node``) while requests stream; the run goes on with the other engines (the
lost one's replacement waits: no node has room for its unit) and ends at its step count.
``node_loss_lost_samples`` and ``node_loss_duplicated_samples`` are the ledger audit's
(``durable/audit.py``) of that run. A benchmark measures; it does not assert.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from rollstream.bench.cluster import LocalCluster, NodeSpec

HEAD, ENGINES = "rs_head", "rs_engines"
NODES = (NodeSpec(num_cpus=4, resources={HEAD: 1}), NodeSpec(num_cpus=2, resources={ENGINES: 1}),
         NodeSpec(num_cpus=1, resources={ENGINES: 1}))
LOST = 2  # the node the operated run loses
ON_NODES, ONE_NODE = "ray_multinode", "ray_single_node"
ROW_ENGINES = {ON_NODES: ENGINES, ONE_NODE: HEAD}
NOTE = ("nodes of one host (shared cores, /dev/shm, loopback): this measures process and "
        "object-store overhead, not a network")
POLL_S = 0.02  # the operator's poll of the dashboard's engine table
OPERATE_TIMEOUT_S = 300.0


def row_overrides(address: str, engines: str) -> list[str]:
    """A multi-node row's settings: two engines in two scale units on the ``engines`` nodes,
    reward workers on the head; no core pinning (the nodes' actors share the host)."""
    return ["runtime.kind=ray", f"runtime.ray.address={address}", "engine.num_engines=2",
            "runtime.ray.scale_units=2", f"runtime.ray.nodes.engines={engines}",
            f"runtime.ray.nodes.rewards={HEAD}", "engine.local.cpu_affinity=[]",
            "train.cpu_affinity=[]"]


def on_nodes(common: Sequence[str], order: Sequence[str], operated_steps: int) -> dict[str, Any]:
    """The multi-node rows (``order``: the row of each run) and the operated run, on one
    cluster started and stopped here."""
    from rollstream.bench.run_reading import row_numbers
    from rollstream.bench.sampling import collect

    t0 = time.perf_counter()
    with LocalCluster.start(NODES) as nodes:
        start_s = time.perf_counter() - t0
        runs: dict[str, list[dict[str, Any]]] = {}
        for i, row in enumerate(order):
            load = os.getloadavg()[0]
            cfg, _ = _train(common, [*row_overrides(nodes.address, ROW_ENGINES[row]),
                                     f"name={row}-{i}"])
            runs.setdefault(row, []).append({**row_numbers(cfg.run_dir, collect(cfg)),
                                             "load_before": load})
        operated = operated_run(nodes, common, operated_steps)
    rows = {row: {**max(r, key=lambda x: x["samples_per_s"]), "runs": r}
            for row, r in runs.items()}
    by_round = [a["samples_per_s"] / b["samples_per_s"]
                for a, b in zip(runs[ON_NODES], runs[ONE_NODE], strict=True)]
    return {"nodes": [{"node_id": node_id, "num_cpus": s.num_cpus, "resources": s.resources,
                       "object_store_bytes": s.object_store_bytes}
                      for node_id, s in zip(nodes.ids, NODES, strict=False)],
            "note": NOTE, "rows": rows, "cluster_start_s": start_s,
            "wall_s": time.perf_counter() - t0,
            "multinode_vs_single_node_samples_per_s":
                rows[ON_NODES]["samples_per_s"] / rows[ONE_NODE]["samples_per_s"],
            "by_round": by_round, "operated": operated}


def _train(common: Sequence[str], extra: Sequence[str]) -> tuple[Any, dict[str, Any]]:
    from rollstream.bench.modes import row_config
    from rollstream.bench.sampling import DEMO_YAML
    from rollstream.runtime.train import run_training

    cfg = row_config(DEMO_YAML, common, extra)
    print(f"bench scale: training run {cfg.name} on the cluster ({cfg.run_dir}) ...",
          flush=True)
    return cfg, run_training(cfg)


def operated_run(nodes: LocalCluster, common: Sequence[str], steps: int) -> dict[str, Any]:
    """The run an engine joins and a node leaves (module docstring): the join's seconds, the
    loss's step, and the ledger audit."""
    from rollstream.bench.modes import row_config
    from rollstream.bench.sampling import DEMO_YAML
    from rollstream.durable.audit import audit_run

    extra = [*row_overrides(nodes.address, ENGINES), f"train.steps={steps}",
             "monitor.dashboard=true", "name=ray_operated"]
    run_dir = row_config(DEMO_YAML, common, extra).run_dir
    seen: dict[str, Any] = {}
    operator = threading.Thread(target=_operate, args=(run_dir, nodes, seen), daemon=True)
    operator.start()
    try:
        cfg, summary = _train(common, extra)
    finally:
        seen["run_over"] = True
        operator.join(timeout=OPERATE_TIMEOUT_S)
    audit = audit_run(run_dir, group_size=cfg.rollout.group_size,
                      eval_group_size=cfg.eval.samples_per_task,
                      groups_per_step=cfg.train.groups_per_step, steps=summary["steps"])
    return {**seen, "steps": summary["steps"], "trained_samples": summary["trained_samples"],
            "audit": audit}


def _operate(run_dir: Path, nodes: LocalCluster, seen: dict[str, Any]) -> None:
    """The operator of the operated run: an error is recorded, not raised (the run goes on)."""
    try:
        with Operator(run_dir, seen) as op:
            added = op.add()
            op.first_token(added)
            op.lose(nodes)
    except Exception as e:  # noqa: BLE001 - a bench records what failed and reports it
        seen["error"] = f"{type(e).__name__}: {e}"


class Operator:
    """What ``rollstream engines RUN`` does, through the run's dashboard, timed; and the loss
    of a node. Each step records into ``seen``."""

    def __init__(self, run_dir: Path, seen: dict[str, Any]) -> None:
        import httpx

        from rollstream.run_files import RunFiles

        self.run_dir, self.seen, files = run_dir, seen, RunFiles(run_dir)
        self.metrics = files.metrics
        _until(lambda: files.dashboard_url.exists() and self.trained_steps() >= 1)
        token = files.dashboard_token.read_text().strip() \
            if files.dashboard_token.exists() else ""
        self.client = httpx.Client(base_url=files.dashboard_url.read_text().strip().rstrip("/"),
                                   headers={"Authorization": f"Bearer {token}"},
                                   timeout=OPERATE_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def trained_steps(self) -> int:
        """Steps the run trained so far; RuntimeError once it ended."""
        from rollstream.bench.run_reading import read_metrics

        if self.seen.get("run_over"):
            raise RuntimeError("the run ended before the operator was done")
        if not self.metrics.exists():
            return 0
        return sum(1 for m in read_metrics(self.run_dir) if m.get("kind") == "train")

    def table(self) -> dict[str, dict[str, Any]]:
        r = self.client.get("/api/engines")
        r.raise_for_status()
        return {row["engine_id"]: row for row in r.json()}

    def add(self) -> str:
        """``--add 1``: the new engine's id once it serves."""
        self.seen["join_at_step"] = self.trained_steps()
        self._t0 = time.perf_counter()
        answer = self.client.post("/api/engines/add", params={"count": 1})
        answer.raise_for_status()
        self.seen["engine_join_serving_s"] = time.perf_counter() - self._t0
        (added,) = answer.json()["added"]
        return added

    def first_token(self, engine_id: str) -> None:
        """Until ``engine_id`` generated a token: ``engine_join_s`` from the add."""
        def ready() -> bool:
            self.trained_steps()  # raises once the run is over
            return self.table()[engine_id]["generated_tokens"] > 0

        _until(ready)
        self.seen["engine_join_s"] = time.perf_counter() - self._t0
        self.seen["joined"] = {"engine_id": engine_id,
                               "node_id": self.table()[engine_id]["node_id"]}

    def lose(self, nodes: LocalCluster) -> None:
        """Node :data:`LOST` leaves, with the engines it holds, while requests stream."""
        lost = nodes.ids[LOST]
        self.seen["engines_on_lost_node"] = sorted(
            e for e, r in self.table().items() if r["node_id"] == lost)
        self.seen["lost_at_step"] = self.trained_steps()
        nodes.remove(LOST)
        self.seen["node_lost"] = True


def _until(ready: Any, timeout_s: float = OPERATE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready within {timeout_s:g} s")
        time.sleep(POLL_S)


def headline(nodes: dict[str, Any]) -> dict[str, Any]:
    """The multi-node keys of ``bench scale``'s JSON; a loss or join the operator did not
    get to (its ``error`` says why) is None."""
    op = nodes["operated"]
    lost = op.get("node_lost", False)
    return {"multinode_vs_single_node_samples_per_s":
            nodes["multinode_vs_single_node_samples_per_s"],
            "node_loss_lost_samples": op["audit"]["lost_samples"] if lost else None,
            "node_loss_duplicated_samples": op["audit"]["duplicated_samples"] if lost else None,
            "engine_join_s": op.get("engine_join_s")}


def print_nodes(result: dict[str, Any]) -> None:
    nodes, op = result["nodes"], result["nodes"]["operated"]
    runs = {row: " / ".join(f"{x['samples_per_s']:.1f}" for x in r["runs"])
            for row, r in nodes["rows"].items()}
    print(f"multinode_vs_single_node_samples_per_s "
          f"{result['multinode_vs_single_node_samples_per_s']:.2f} ({ON_NODES} {runs[ON_NODES]}"
          f", {ONE_NODE} {runs[ONE_NODE]} samples/s; {NOTE})")
    if op.get("error"):
        print(f"operated run: the operator stopped: {op['error']}")
    audit = op["audit"]
    print(f"operated run ({op['steps']} steps): engine_join_s {result['engine_join_s']} "
          f"(add answered after {op.get('engine_join_serving_s')} s); node {LOST} lost after "
          f"step {op.get('lost_at_step')} with {op.get('engines_on_lost_node')}: "
          f"node_loss_lost_samples {result['node_loss_lost_samples']}, duplicated "
          f"{result['node_loss_duplicated_samples']} (ledger audit: {audit['samples']} "
          f"samples, steps missing {audit['steps_missing']}, repeated "
          f"{audit['steps_repeated']})")
