"""``bench weightsync --quick``: every path timed on the tiny model, full and delta sync to
bfloat16 engines, on the driver's node and on another node of a 2-node cluster (seconds and
MB per sync for shared memory, cross-node full and cross-node delta), its Rays stopped
after."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.ray


def test_quick_weightsync_bench_times_every_path(tmp_path):
    import ray

    from rollstream.bench import weightsync

    out = tmp_path / "ws.json"
    result = weightsync.main(json_out=out, quick=True)
    assert json.loads(out.read_text()) == result
    tiny = result["models"]["tiny"]
    assert tiny["num_bytes"] > 0 and set(tiny["paths"]) == set(weightsync.PATHS)
    for row in tiny["paths"].values():
        assert len(row["times_s"]) == weightsync.NUM_SYNCS and row["median_s"] > 0
    assert tiny["paths"]["object_store"]["vs_object_store"] == 1.0
    delta = result["delta"]["tiny"]["rows"]["bfloat16 lr 1e-06"]  # full vs delta sync, every path
    assert set(delta) == set(weightsync.PATHS)
    assert all(row["delta"]["median_bytes"] < row["full"]["median_bytes"] for row in delta.values())
    cross = result["cross_node"]["tiny"]
    assert cross["engines_off_the_driver_node"] and len(cross["engine_nodes"]) == 1, cross
    assert set(cross["paths"]) == {"object_store", "broadcast"}
    per_sync = result["per_sync"]["tiny"]
    assert per_sync["engine_dtype"] == "bfloat16"
    for key in ("shared_memory", "cross_node_full", "cross_node_delta"):
        assert per_sync[key]["s"] > 0 and per_sync[key]["mb"] > 0, (key, per_sync)
    assert per_sync["cross_node_delta"]["mb"] < per_sync["cross_node_full"]["mb"]
    assert per_sync["delta_bytes_vs_full"] == pytest.approx(
        per_sync["cross_node_delta"]["mb"] / per_sync["cross_node_full"]["mb"])
    assert not ray.is_initialized()
