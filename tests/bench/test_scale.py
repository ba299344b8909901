"""Smoke test of ``rollstream bench scale --quick`` on a tiny model: the embedded row and the
disaggregated Ray rows (token payloads on the calls, and all out of band) train, and the JSON has the scale-out keys with positive, finite values
(a smoke run: its numbers mean nothing, so no target is checked). The multi-node rows train on
a 3-node cluster, and on the operated run an engine joins and an engine node leaves; that run
is held at two step boundaries until the operator is done (a tiny run's 5 steps end before an
engine actor starts). Its Rays are stopped after."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest

pytestmark = pytest.mark.ray

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
        "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64",
        "model.tiny.max_position=96", "model.warm_start.steps=3",
        "model.warm_start.tokens_per_step=256", "tasks.sources=[{kind: tick, max_items: 4}]",
        "engine.local.max_slots=16", "engine.local.max_seq_len=96",
        "sampling.max_new_tokens=24", "train.updates_per_step=1"]


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _hold_until_operated(monkeypatch) -> None:
    """The operated run waits after its first step until the engine it is given serves, and
    after its third until the node is removed (the operator measures the first token in
    between, while the run generates the next steps' groups): its 5 steps outlast the
    operator."""
    from rollstream.bench import scale_nodes
    from rollstream.runtime import steps as steps_module

    operating = threading.Event()  # the operated run is the one that started the operator
    done = {"add": threading.Event(), "lose": threading.Event()}
    real_after, real_operate = steps_module.BetweenSteps.__call__, scale_nodes._operate

    def operate(*args):
        operating.set()
        try:
            real_operate(*args)
        finally:  # a failed operator (the bench reports it) holds the run no longer
            for event in done.values():
                event.set()

    def marking(name):
        real = getattr(scale_nodes.Operator, name)

        def marked(self, *args):
            try:
                return real(self, *args)
            finally:
                done[name].set()
        return marked

    async def after(self, step, values):
        await real_after(self, step, values)
        if operating.is_set() and step in (0, 2):
            await asyncio.to_thread(done["add" if step == 0 else "lose"].wait, 120)

    monkeypatch.setattr(scale_nodes, "_operate", operate)
    for name in done:
        monkeypatch.setattr(scale_nodes.Operator, name, marking(name))
    monkeypatch.setattr(steps_module.BetweenSteps, "__call__", after)


def test_quick_scale_bench_writes_every_key(tmp_path, tiny_run_cache, monkeypatch):
    import ray

    from rollstream.bench.scale import DISAGGREGATED, EMBEDDED, OUT_OF_BAND, QUICK, main
    from rollstream.bench.scale_nodes import ON_NODES, ONE_NODE
    from rollstream.bench.weightsync import PATHS

    _hold_until_operated(monkeypatch)

    out = tmp_path / "scale.json"
    result = main(json_out=out, quick=True, run_root=tmp_path / "runs",
                  overrides=[*TINY, f"model.cache_dir={tiny_run_cache}"])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    assert set(written["rows"]) == {EMBEDDED, DISAGGREGATED, OUT_OF_BAND}
    for label, row in written["rows"].items():
        assert row["trained_samples"] == 2 * 2 * 4, label  # steps x groups x group size
        for key in ("samples_per_s", "train_wall_s", "gen_tok_s", "engine_busy_share"):
            assert _positive(row[key]), (label, key, row[key])
        assert 0 <= row["reward_final"] <= 1 and 0 < row["wait_share"] < 1, label
        assert row["generated_samples"] >= row["trained_samples"], label
    # only the proxies of Ray engines count the control plane; every kind of call shows
    assert written["rows"][EMBEDDED]["wire_calls"] == 0
    ray_row = written["rows"][DISAGGREGATED]
    assert ray_row["wire_calls"] > 0 and ray_row["wire_sent_bytes"] > 0
    assert ray_row["wire_received_bytes"] > ray_row["wire_sent_bytes"]  # tokens come back
    # at the default threshold the tiny run's payloads ride the calls; at 0 every one goes
    # out of band: each trained sample's prompt and tokens at least
    planes = written["bytes_per_trained_sample_by_plane"]
    assert set(planes) == {DISAGGREGATED, OUT_OF_BAND}
    assert planes[DISAGGREGATED]["data"] == 0 and planes[DISAGGREGATED]["data_objects"] == 0
    oob = planes[OUT_OF_BAND]
    assert _positive(oob["data_sent"]) and _positive(oob["data_received"]), oob
    assert oob["data_objects"] >= 2 and oob["episode_misses"] == 0, oob
    trips = written["payload_round_trips"]["by_bytes"]
    assert set(trips) == {str(1 << 10), str(1 << 20)}
    assert all(_positive(t["inline_s"]) and _positive(t["out_of_band_s"])
               for t in trips.values())
    assert _positive(written["ray_vs_embedded_samples_per_s"])
    assert written["ray_vs_embedded_samples_per_s"] == pytest.approx(
        ray_row["samples_per_s"] / written["rows"][EMBEDDED]["samples_per_s"])
    assert written["ray_colocated_vs_embedded_samples_per_s"] is None  # not in a quick run
    assert set(written["weight_sync_s_per_mb"]) == set(PATHS)
    assert all(_positive(v) for v in written["weight_sync_s_per_mb"].values())
    ctl = written["control_plane_bytes_per_sample"]
    for key in ("per_trained_sample", "per_generated_sample", "calls_per_trained_sample"):
        assert _positive(ctl[key]), key
    assert ctl["per_trained_sample"] >= ctl["per_generated_sample"]
    restart = written["actor_restart"]
    assert _positive(written["actor_restart_s"]) and len(restart["trials"]) == 1
    trial = restart["trials"][0]
    assert trial["detect_s"] + trial["replace_s"] <= trial["actor_restart_s"]
    # the multi-node rows: both trained, the ratio is theirs
    nodes = written["nodes"]
    assert set(nodes["rows"]) == {ON_NODES, ONE_NODE} and "not a network" in nodes["note"]
    for label, row in nodes["rows"].items():
        assert row["trained_samples"] == 2 * 2 * 4 and _positive(row["samples_per_s"]), label
    assert written["multinode_vs_single_node_samples_per_s"] == pytest.approx(
        nodes["rows"][ON_NODES]["samples_per_s"] / nodes["rows"][ONE_NODE]["samples_per_s"])
    # the operated run: an engine joined and served, then a node with an engine left while
    # the run went on to its last step, and the ledger audit counts what was lost: nothing
    op = nodes["operated"]
    assert "error" not in op, op
    assert op["steps"] == QUICK.operated_steps and op["lost_at_step"] < op["steps"], op
    assert op["engines_on_lost_node"] and op["joined"]["engine_id"] == "ray-2", op
    assert 0 < op["engine_join_serving_s"] <= written["engine_join_s"], op
    assert written["node_loss_lost_samples"] == op["audit"]["lost_samples"] == 0, op
    assert written["node_loss_duplicated_samples"] == 0, op
    assert op["audit"]["steps_missing"] == op["audit"]["steps_repeated"] == 0, op
    assert not ray.is_initialized()
