"""Trainer backend ``fsdp``: 2 gloo ranks on CPU against the single-process trainer.

Same tiny model, same batch: the loss, the gradient norm, every parameter's gradient and the
weights after the step agree within float32 summation-order rounding (tolerances below),
and so does what the loss kept of each sample. The batch packs into an odd number of
micro-batches, so one rank computes a padding micro-batch.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollstream.config.schema import ISCorrectionConfig, TrainConfig
from rollstream.staleness import StalenessPolicy
from rollstream.train.fsdp import FsdpTrainer, RankTrainer, rank_cores
from rollstream.train.trainer import Trainer
from tests.engine.helpers import make_tiny_model
from tests.train.conftest import VOCAB, make_group
from tests.train.fsdp_runs import assert_resumed_whole, tiny_fsdp_run

STALE1 = StalenessPolicy(max_staleness=1)  # loss auto = decoupled_ppo; tokens of age 0 and 1
WORLD = 2
LOSS_RTOL = 1e-5  # relative, loss and grad norm
GRAD_ATOL = 1e-6  # absolute, per gradient element (gradients here are O(1e-3 .. 1))
WEIGHT_ATOL = 1e-6  # absolute, per weight after the AdamW step(s)

CONFIGS = {
    "token_mean": TrainConfig(micro_batch_tokens=24, updates_per_step=2, grad_clip=1e6),
    "seq_mean_kl_masked_is": TrainConfig(
        micro_batch_tokens=24, updates_per_step=1, grad_clip=0.5, kl_coef=0.1,
        loss_agg="seq_mean_token_mean", is_correction=ISCorrectionConfig(mode="mask")),
    # each group's prompt laid out once under a block attention mask, one group per micro-batch
    "shared_prefix": TrainConfig(micro_batch_tokens=24, updates_per_step=1, grad_clip=1e6,
                                 kl_coef=0.1, shared_prefix="on"),
}
MOE_CONFIGS = {  # a rank's padding micro-batch has a balance loss of 0 (no token), not NaN
    "token_mean_balance": TrainConfig(micro_batch_tokens=24, updates_per_step=2, grad_clip=1e6,
                                      router_aux_loss_coef=0.05),
}


def batch() -> list:
    """Three groups of mixed lengths, behaviour logprobs off the policy (IS is active), token
    versions 0 and 1 (ages 1 and 0 at step 1)."""
    def lp(n: int, k: int) -> list[float]:
        return [-4.2 + 0.35 * ((i + k) % 5 - 2) for i in range(n)]  # the policy: about -4.2

    def ver(n: int, k: int) -> list[int]:
        return [(i + k) % 2 for i in range(n)]

    shapes = [([1, 2, 3], [[4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16]], [1.0, 0.0, 0.5]),
              ([20, 21], [[22, 23], [24, 25, 26, 27, 28], [29]], [0.0, 1.0, 1.0]),
              ([30, 31, 32, 33], [[34, 35, 36], [37, 38, 39, 40, 41, 42, 43]], [0.2, 0.9])]
    groups = []
    for g, (prompt, responses, rewards) in enumerate(shapes):
        groups.append(make_group(
            f"g{g}", prompt, responses, rewards=rewards,
            logprobs=[lp(len(r), g + i) for i, r in enumerate(responses)],
            versions=[ver(len(r), g + i) for i, r in enumerate(responses)]))
    return groups


def _rank(rank: int, world: int, store: str, model_path: Path, out: Path,
          configs: dict[str, TrainConfig]) -> None:
    """One rank: every config's step on the batch; rank 0 saves the results."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for name, cfg in configs.items():
        trainer = RankTrainer(cfg, model_path, rank=rank, world_size=world, staleness=STALE1)
        res = trainer.step(batch(), step=1)
        grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
                 for n, p in trainer.model.named_parameters()}
        sharded = any(hasattr(p, "full_tensor") for p in trainer.model.parameters())
        results[name] = (res, grads, trainer.state_dict(), sharded)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.parametrize(("world", "arch"), [(1, "qwen2"), (WORLD, "qwen2"), (WORLD, "qwen2_moe")])
def test_ranks_match_the_single_process_trainer(tiny_model_path: Path, tmp_path: Path,
                                                world: int, arch: str) -> None:
    """Two ranks, and one: the trainer in a process of its own, its parameters plain (one
    rank has nothing to shard with); and two ranks training a mixture of experts with its
    load-balancing loss."""
    configs = CONFIGS
    if arch == "qwen2_moe":
        configs = MOE_CONFIGS
        tiny_model_path = make_tiny_model(tmp_path / "moe", arch="qwen2_moe", vocab_size=VOCAB,
                                          initializer_range=0.02)
    out = tmp_path / "ranks.pt"
    mp.spawn(_rank, args=(world, str(tmp_path / "store"), tiny_model_path, out, configs),
             nprocs=world)
    ranks = torch.load(out, weights_only=False)
    for name, cfg in configs.items():
        local = Trainer(cfg, tiny_model_path, staleness=STALE1)
        assert len(local._micro_batches(
            [s for g in batch() for s in g.samples])) % WORLD == 1  # with two: one rank pads
        want = local.step(batch(), step=1)
        got, grads, weights, sharded = ranks[name]
        assert sharded == (world > 1)
        for key in ("loss", "grad_norm", "kl", "clip_frac", "is_weight_mean", "entropy",
                    "is_masked_frac", "num_tokens", "num_samples",
                    *(["router_aux_loss"] if cfg.router_aux_loss_coef else [])):
            assert math.isclose(got.metrics[key], want.metrics[key], rel_tol=LOSS_RTOL,
                                abs_tol=1e-9), (name, key, got.metrics[key], want.metrics[key])
        assert want.metrics["num_tokens"] > 0 and want.metrics["loss"] != 0
        assert got.kept == want.kept
        for n, p in local.model.named_parameters():
            assert torch.allclose(grads[n], p.grad, rtol=0, atol=GRAD_ATOL), (name, n)
        for n, w in local.model.state_dict().items():
            assert torch.allclose(weights[n], w, rtol=0, atol=WEIGHT_ATOL), (name, n)


@pytest.fixture
def launch(request: pytest.FixtureRequest):
    """How the ranks start: spawned processes (``runtime.kind: embedded``), or Ray actors in
    one scale unit (1 engine of 1 CPU + 2 ranks of 0.5) of a local Ray of 2 CPUs, which the
    fixture stops; with a function returning each rank's pid."""
    if request.param == "process":
        from rollstream.train.rank_processes import ProcessRanks

        yield ProcessRanks, lambda trainer: [p.pid for p in trainer.ranks.procs]
        return
    from functools import partial

    import ray

    from rollstream.config import load_config
    from rollstream.config.runtime import RayConfig
    from rollstream.runtime.ray.cluster import RayCluster
    from rollstream.runtime.ray.ranks import RayRanks
    from rollstream.runtime.ray.units import ScaleUnits

    cfg = load_config(None, ["runtime.kind=ray", "runtime.ray.num_cpus=2",
                             "engine.num_engines=1", "train.backend=fsdp",
                             "runtime.ray.rank_num_cpus=0.5"])
    cluster = RayCluster.start(RayConfig(num_cpus=2, object_store_bytes=100 << 20))
    try:
        units = ScaleUnits.reserve(cfg)
        assert ray.available_resources().get("CPU", 0) == 0  # the unit holds both CPUs

        def pids(trainer):  # and every rank runs inside the unit
            where = ray.get([a.placement.remote() for a in trainer.ranks.actors])
            assert {w["placement_group"] for w in where} == {units.group.id.hex()}, where
            return [w["pid"] for w in where]

        yield partial(RayRanks, num_cpus=0.5, units=units), pids
        units.remove()
    finally:
        cluster.stop()


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    """Every process of ``pids`` has exited (Ray ends a killed actor's process shortly)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                   for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("launch", ["process", pytest.param("ray", marks=pytest.mark.ray)],
                         indirect=True)
def test_driver_trains_syncs_and_cleans_up(tiny_model_path: Path, tmp_path: Path,
                                           launch) -> None:
    """The controller-side handle, on either rank transport: step, logprobs, state_dict and
    a reconfiguration (follow_rollout) as the local trainer's; checkpoints round-trip; close
    leaves no rank running; a rank's error is raised here. ``cpu_affinity`` pins each rank's
    compute thread to its share of the cores."""
    make, rank_pids = launch
    cfg = TrainConfig(micro_batch_tokens=24, backend="fsdp")
    cores = tuple(sorted(os.sched_getaffinity(0))[:2])
    trainer = FsdpTrainer(cfg.model_copy(update={"cpu_affinity": cores}), tiny_model_path,
                          staleness=STALE1, launch=make)
    pids = rank_pids(trainer)
    try:
        local = Trainer(cfg, tiny_model_path, staleness=STALE1)
        samples = [s for g in batch() for s in g.samples]
        got_lp, want_lp = trainer.logprobs(samples), local.logprobs(samples)
        assert [len(x) for x in got_lp] == [len(x) for x in want_lp]
        assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-5
        got, want = trainer.step(batch(), 1), local.step(batch(), 1)
        assert math.isclose(got.metrics["loss"], want.metrics["loss"], rel_tol=LOSS_RTOL)
        assert math.isclose(got.metrics["grad_norm"], want.metrics["grad_norm"],
                            rel_tol=LOSS_RTOL)
        assert got.kept == want.kept
        for rank, pid in enumerate(pids):  # the thread that computes: the main one (tid = pid)
            status = Path(f"/proc/{pid}/status").read_text()
            allowed = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list"))
            assert allowed.split()[-1] == ",".join(map(str, rank_cores(cores, rank, 2))), allowed
        weights = trainer.state_dict()
        assert weights.keys() == local.state_dict().keys()  # tied weights under both names
        for n, w in local.state_dict().items():
            assert torch.allclose(weights[n], w, rtol=0, atol=WEIGHT_ATOL), n
        for t in (trainer, local):  # a reconfiguration reaches every rank
            t.follow_rollout(staleness=STALE1, max_response_tokens=64, temperature=0.7)
        got_lp, want_lp = trainer.logprobs(samples), local.logprobs(samples)
        assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-5
        trainer.save_checkpoint(tmp_path / "ckpt")
        trainer.save_training_state(tmp_path / "trainer.pt")
        trainer.load_training_state(tmp_path / "ckpt", tmp_path / "trainer.pt")
        again = trainer.state_dict()
        assert all(torch.equal(again[n], w) for n, w in weights.items())
        with pytest.raises(RuntimeError, match="fsdp rank 0 failed"):
            trainer.step([make_group("bad", [1], [[999]], rewards=[1.0])], 2)  # id > vocab
        # (an error, not a death: runtime/train.py restarts ranks only for TrainerRankDied)
        assert _gone(pids)  # an error ends every rank
        with pytest.raises(RuntimeError, match="closed"):
            trainer.logprobs(samples)
    finally:
        trainer.close()
    assert _gone(pids)
    assert not multiprocessing.active_children()
    if make is None:
        assert not Path(trainer.ranks._folder).exists()


@pytest.mark.slow
def test_embedded_run_with_fsdp_trains_and_syncs_weights(tmp_path: Path) -> None:
    """A 2-step sync run of a tiny model with ``train.backend: fsdp``: every step trains,
    and the engines sample step 1 with the weights the ranks produced at step 0 (the
    trainer's own logprobs of those tokens equal the engine's: mismatch ~ 0)."""
    import json

    from rollstream.config import load_config
    from rollstream.runtime.train import run_training

    cfg = load_config(None, tiny_fsdp_run(tmp_path, "fsdp", mode="sync", steps=2))
    summary = run_training(cfg)
    assert summary["steps"] == 2 and summary["trained_samples"] == 16, summary
    steps = [m for m in map(json.loads, (tmp_path / "fsdp" / "metrics.jsonl").open())
             if m["kind"] == "train"]
    assert [m["step"] for m in steps] == [0, 1]
    assert all(m["num_tokens"] > 0 for m in steps)
    assert steps[1]["mismatch"] < 1e-4, steps[1]  # engine weights == trainer weights (v1)
    assert (tmp_path / "fsdp" / "checkpoint" / "model.safetensors").exists()
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_a_killed_rank_loses_its_step_and_the_run_resumes_from_its_checkpoint(
        tmp_path: Path) -> None:
    """Rank 1 is killed (SIGKILL) after the step-2 checkpoint: the step it was computing is
    not published, every rank is started again, and the same command resumes from the
    checkpoint and finishes, every sample recorded exactly once."""
    import os
    import signal
    import threading
    import time

    from rollstream.config import load_config
    from rollstream.runtime.train import run_training

    cfg = load_config(None, tiny_fsdp_run(tmp_path, "kill", mode="async", steps=6,
                                      extra=("train.checkpoint_every=2",)))
    run_dir = tmp_path / "kill"
    killed: list[int] = []

    def kill_rank_1() -> None:  # once the step-2 checkpoint is whole
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            if (run_dir / "checkpoints" / "step_000002" / "state.json").exists():
                for p in multiprocessing.active_children():
                    if p.name == "rollstream-fsdp-1":
                        os.kill(p.pid, signal.SIGKILL)
                        killed.append(p.pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    summary = run_training(cfg)
    killer.join()
    assert killed and summary["trainer_restarts"] == 1, summary
    assert summary["steps"] == 6 and summary["resumed_from_step"] in (2, 4), summary
    assert_resumed_whole(run_dir, 6)
    assert not multiprocessing.active_children()



def test_rank_cores_share_out_the_trainers_cores() -> None:
    assert [rank_cores((4, 5, 6, 7, 8), r, 2) for r in range(2)] == [(4, 5, 6), (7, 8)]
    assert [rank_cores((1,), r, 2) for r in range(2)] == [(1,), (1,)]
    assert [rank_cores((3, 1), r, 3) for r in range(3)] == [(1,), (3,), (1,)]
    assert [rank_cores((0, 1, 2, 3), r, 4) for r in range(4)] == [(0,), (1,), (2,), (3,)]
