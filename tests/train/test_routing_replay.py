"""``train.routing_replay``: the trainer's forward routes each token to the experts the engine
routed it to, and reports how often its own router agrees.

The disagreement case: a top-1 Qwen2-MoE whose top-k weight is renormalised (always 1.0), so
an expert's output does not depend on the router's logits, only on which expert it is; the
trainer's copy has its routers perturbed. Without replay it routes many tokens elsewhere and
its logprobs leave the engine's; with replay it computes the engine's network exactly."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from rollstream.clock import WallClock
from rollstream.config import EngineConfig, RewardConfig, TrainConfig, load_config
from rollstream.config.schema import LocalEngineConfig
from rollstream.data.ledger import Ledger
from rollstream.durable.state import group_from_dict, group_to_dict
from rollstream.engine.factory import build_engine
from rollstream.engine.local import LocalEngine
from rollstream.engine.protocol import GenerateRequest, SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.sync.weights import WeightSync
from rollstream.train.routing import routing_ids
from rollstream.train.trainer import Trainer
from rollstream.trajectory import Group, Sample, SampleStatus, Task
from tests.engine.helpers import make_tiny_model
from tests.engine.test_local_routing import hf_routing
from tests.train.conftest import SYNC


@pytest.fixture(scope="module")
def top1_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the engine's folder, the trainer's: the same with perturbed routers)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("top1")
    engine_dir = make_tiny_model(root / "engine", arch="qwen2_moe", seed=11,
                                 num_experts_per_tok=1, norm_topk_prob=True)
    model = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=g) * p.abs().mean() * 1.5)
    model.save_pretrained(root / "trainer")
    return engine_dir, root / "trainer"


def _sampled_groups(folder: Path) -> list[Group]:
    engine = LocalEngine(folder, LocalEngineConfig(max_slots=8, max_seq_len=128, threads=1,
                                                   device="cpu"))
    groups = [Group.new(Task(uid=f"t{i}", source="s", prompt_ids=tuple(range(2 + i, 12 + 2 * i)),
                             prompt_text="", reference=""), 4) for i in range(3)]
    samples = [s for g in groups for s in g.samples]
    try:
        outs = engine.generate_many([GenerateRequest(
            request_id=s.uid, prompt_ids=list(s.task.prompt_ids),
            params=SamplingParams(temperature=1.0, max_new_tokens=16, seed=i))
            for i, s in enumerate(samples)])
    finally:
        engine.shutdown()
    for i, (s, o) in enumerate(zip(samples, outs)):
        s.append_policy_tokens(o.token_ids, o.logprobs, o.versions, o.routing)
        s.reward = float(i % 2)
        s.status = SampleStatus.GRADED
    return groups


def _diffs(trainer: Trainer, samples: list[Sample]) -> list[float]:
    ours = trainer.logprobs(samples)
    return [abs(a - b) for s, lp in zip(samples, ours) for a, b in zip(s.logprobs, lp)]


def test_replay_computes_the_engines_network_where_routing_disagrees(top1_dirs) -> None:
    engine_dir, trainer_dir = top1_dirs
    groups = _sampled_groups(engine_dir)
    samples = [s for g in groups for s in g.samples]
    assert all(s.routing is not None
               and s.routing.num_tokens == len(s.task.prompt_ids) + s.num_response_tokens
               for s in samples)
    metrics = {}
    for mode in ("off", "replay"):
        trainer = Trainer(TrainConfig(routing_replay=mode, updates_per_step=1), trainer_dir,
                          staleness=SYNC)
        diffs = _diffs(trainer, samples)
        metrics[mode] = (max(diffs), trainer.step(groups, 0).metrics)
    worst_off, off = metrics["off"]
    worst_replay, replay = metrics["replay"]
    assert worst_off > 1e-2 and off["mismatch"] > 1e-3  # routing disagrees, logprobs differ
    assert worst_replay < 1e-4 and replay["mismatch"] < 1e-5  # the dense path's tolerance
    assert off["routing_agreement"] < 0.9 and replay["routing_agreement"] < 0.9


def test_an_episode_whose_template_rewrote_a_turn_replays_each_turn_samples_routing(
        top1_dirs) -> None:
    """An episode trained as turn-samples (its second turn was served a rewritten context):
    each turn-sample replays the routing of the request that served it (the first the
    sample's, the second its context's), through a checkpoint's JSON, so the perturbed
    trainer computes the engine's network on both; without replay it does not."""
    from rollstream.trajectory import Context, Segment

    engine_dir, trainer_dir = top1_dirs
    engine = LocalEngine(engine_dir, LocalEngineConfig(max_slots=2, max_seq_len=128, threads=1,
                                                       device="cpu"))
    group = Group.new(Task(uid="e", source="s", prompt_ids=tuple(range(2, 14)),
                           prompt_text="", reference=""), 1)
    (sample,) = group.samples
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    try:
        first = engine.generate_many([GenerateRequest(
            request_id="t1", prompt_ids=list(sample.task.prompt_ids), params=params)])[0]
        sample.append_policy_tokens(first.token_ids, first.logprobs, first.versions,
                                    first.routing)
        sample.segments.append(Segment.env([40, 41, 42]))
        # the template rewrote turn 1 (dropped its last tokens) before serving turn 2
        context = (*sample.task.prompt_ids, *first.token_ids[:4], 40, 41, 42)
        sample.contexts.append(Context(num_segments=2, token_ids=context))
        second = engine.generate_many([GenerateRequest(
            request_id="t2", prompt_ids=list(context), params=params)])[0]
        sample.append_policy_tokens(second.token_ids, second.logprobs, second.versions,
                                    second.routing)
    finally:
        engine.shutdown()
    assert sample.routing is first.routing and sample.contexts[0].routing is second.routing
    sample.reward, sample.status = 1.0, SampleStatus.GRADED
    (restored,) = group_from_dict(json.loads(json.dumps(group_to_dict(group)))).samples
    assert restored.contexts == sample.contexts and restored.routing == sample.routing
    model = [i for i, kept in enumerate(restored.loss_mask) if kept]  # the model's turns
    assert len(model) == len(first.token_ids) + len(second.token_ids)
    diffs = {mode: [_diffs(Trainer(TrainConfig(routing_replay=mode), trainer_dir,
                                   staleness=SYNC), [restored])[i] for i in model]
             for mode in ("off", "replay")}
    turn2 = slice(len(first.token_ids), None)
    assert max(diffs["off"][turn2]) > 1e-2 and max(diffs["off"]) > 1e-2
    assert max(diffs["replay"]) < 1e-4


def test_replay_across_an_interrupt_a_resume_on_new_weights_and_a_checkpoint(
        tmp_path: Path) -> None:
    """A weight sync interrupts running samples and resumes them on the new weights: their
    routing is then the whole sequence's under the new weights; it survives the checkpoint's
    JSON; and on-policy (sync mode) the replaying trainer's logprobs of fresh samples are the
    engine's, its routing agreeing everywhere (same weights, float32)."""
    model = make_tiny_model(tmp_path / "m", arch="qwen2_moe", seed=2)

    async def parity(task: Task, text: str) -> float:
        return float(int(text.split()[0]) % 2)

    async def main() -> tuple[list[Group], list[Group], Trainer, dict[str, torch.Tensor]]:
        engine = build_engine(EngineConfig(local={"max_slots": 8, "max_seq_len": 160}), model)
        graders = GraderPool(RewardConfig(), lambda task: get_reward(parity))
        disp = Dispatcher(engines=[engine], params=SamplingParams(max_new_tokens=120),
                          graders=graders, decode=lambda ids: " ".join(map(str, ids)),
                          lifecycle=Lifecycle(Ledger(), WallClock()), clock=WallClock())
        trainer = Trainer(TrainConfig(lr=5e-2, updates_per_step=1, routing_replay="replay"),
                          model, staleness=SYNC)
        sync = WeightSync([engine], disp, "interrupt", lambda v, s: None)
        sync_task = asyncio.create_task(sync.run())
        tasks = [Task(uid=f"c/{i}", source="c", prompt_ids=tuple(range(3 + i, 9 + i)),
                      prompt_text="", reference="") for i in range(2)]
        first = [Group.new(t, 2, k=0) for t in tasks]
        running = asyncio.gather(*(disp.run_group(g) for g in first))
        while engine.stats().generated_tokens < 20:
            await asyncio.sleep(0.001)
        new = {k: v + 0.2 * torch.randn_like(v) if k.startswith("model.layers.") else v.clone()
               for k, v in trainer.state_dict().items()}  # tied embeddings left as they are
        sync.publish(1, new)
        await running
        trainer.model.load_state_dict(new)
        later = [Group.new(t, 4, k=1) for t in tasks]
        await asyncio.gather(*(disp.run_group(g) for g in later))
        sync_task.cancel()
        graders.close()
        await engine.close()
        return first, later, trainer, new

    first, later, trainer, new = asyncio.run(main())
    resumed = [s for g in first for s in g.samples if s.num_interrupts]
    assert any(set(s.versions) == {0, 1} for s in resumed)
    for s in resumed:
        ids = [*s.task.prompt_ids, *s.response_ids]
        got = routing_ids(s.routing)
        assert got.shape[0] == len(ids) and (got[-1] == -1).all()
        assert torch.equal(got[:-1].sort(-1).values, hf_routing(new, model, ids)[:-1])
    restored = [group_from_dict(json.loads(json.dumps(group_to_dict(g)))) for g in first]
    assert [s.routing for g in restored for s in g.samples] == \
        [s.routing for g in first for s in g.samples]
    samples = [s for g in later for s in g.samples]
    assert max(_diffs(trainer, samples)) < 1e-4
    assert trainer.step(later, 1).metrics["routing_agreement"] == 1.0


def test_a_dead_engines_partial_is_replayed_as_the_engine_that_finished_it_routed_it(
        top1_dirs) -> None:
    """An engine dies mid-stream (its step loop raises): its samples come back with their
    partial tokens and no routing, and are finished on the other engine, whose prefill of
    prompt + partial routes every earlier token again. Each such sample's routing then covers
    its whole sequence (the last token's none), and the perturbed trainer replaying it computes
    the engines' network on every token, those the dead engine sampled included."""
    from rollstream.reward.pool import GraderPool
    from tests.engine.test_local_faults import _Decode

    engine_dir, trainer_dir = top1_dirs
    cfg = LocalEngineConfig(max_slots=8, max_seq_len=96, threads=1, device="cpu",
                            max_restarts=0)
    spans: list[dict] = []

    async def one(task: Task, text: str) -> float:
        return 1.0

    async def main() -> list[Group]:
        a, b = LocalEngine(engine_dir, cfg, engine_id="a"), LocalEngine(engine_dir, cfg,
                                                                         engine_id="b")
        _Decode(a, fail_at=8)  # a's step loop raises on its 8th decode
        graders = GraderPool(RewardConfig(), lambda task: get_reward(one))
        disp = Dispatcher(engines=[a, b], params=SamplingParams(max_new_tokens=24, seed=None),
                          graders=graders, decode=lambda ids: "", clock=WallClock(),
                          lifecycle=Lifecycle(Ledger(), WallClock()),
                          span=lambda **kw: spans.append(kw))
        groups = [Group.new(Task(uid=f"d/{i}", source="s", prompt_ids=(3 + i, 5, 7, 9, 11),
                                 prompt_text="", reference=""), 2) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(disp.run_group(g) for g in groups)), 120)
        await a.close()
        await b.close()
        graders.close()
        return groups

    groups = asyncio.run(main())
    on = {e: {sp["sample_uid"] for sp in spans if sp["engine_id"] == e and sp["num_tokens"]}
          for e in ("a", "b")}
    moved = [s for g in groups for s in g.samples if s.uid in on["a"] & on["b"]]
    assert moved, "samples with tokens from the dead engine were finished on the other"
    for s in moved:
        got = routing_ids(s.routing)
        assert got.shape[0] == len(s.task.prompt_ids) + s.num_response_tokens
        assert (got[:-1] >= 0).all() and (got[-1] == -1).all()
        s.status = SampleStatus.GRADED
    diffs = {mode: _diffs(Trainer(TrainConfig(routing_replay=mode), trainer_dir,
                                  staleness=SYNC), moved) for mode in ("off", "replay")}
    assert max(diffs["off"]) > 1e-2 and max(diffs["replay"]) < 1e-4



def test_replay_is_refused_where_it_cannot_work(tiny_model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train.routing_replay = replay needs a "
                                         "mixture-of-experts model"):
        Trainer(TrainConfig(routing_replay="replay"), tiny_model_path, staleness=SYNC)
    base = ["train.routing_replay=replay", f"run_root={tmp_path}"]
    with pytest.raises(ValueError, match="model.tiny.arch is 'qwen2'"):
        load_config(None, base)
    moe = [*base, "model.tiny.arch=qwen2_moe"]
    for extra, field in (("engine.kind=vllm", "engine.kind = vllm .vLLM's CPU build cannot "
                                              "return routed experts"),
                         ("train.compile=true", "train.compile = true")):
        with pytest.raises(ValueError, match=f"not supported with {field}"):
            load_config(None, [*moe, extra])
    assert load_config(None, moe).train.routing_replay == "replay"
    ray = load_config(None, [*moe, "runtime.kind=ray"])  # engine actors send routing back
    assert ray.train.routing_replay == "replay" and ray.runtime.kind == "ray"


def test_the_bench_bound_splits_tokens_by_where_the_routers_agree(top1_dirs):
    """``bench models``' bound (bench/models_moe.py) classes each sampled token by whether
    the trainer's own router picked the engine's experts at every layer up to where it is
    predicted. The trainer's copy of the engine's weights agrees everywhere: nothing for
    replay to remove (bound 1). The perturbed copy disagrees within the first tokens of
    every sample: replay brings them to float32's floor, so the bound is about 0."""
    from rollstream.bench.models_moe import _agreement, _bound

    engine_dir, trainer_dir = top1_dirs
    samples = [s for g in _sampled_groups(engine_dir) for s in g.samples]
    tokens = sum(len(s.response_ids) for s in samples)
    for folder, agreeing in ((engine_dir, tokens), (trainer_dir, 0)):
        off = Trainer(TrainConfig(routing_replay="off"), folder, staleness=SYNC)
        replay = Trainer(TrainConfig(routing_replay="replay"), folder, staleness=SYNC)
        out = _bound(samples, off.logprobs(samples), replay.logprobs(samples),
                     _agreement(off, samples))
        assert (out["agreeing_tokens"], out["disagreeing_tokens"]) == (agreeing,
                                                                       tokens - agreeing)
        if agreeing:
            assert out["mismatch_agreeing"] < 1e-4
            assert out["mismatch_replay_vs_none_bound"] == pytest.approx(1.0)
        else:
            assert out["mismatch_disagreeing"] > 0.1
            assert out["disagreeing_replay_vs_none"] < 1e-3
            assert out["mismatch_replay_vs_none_bound"] < 1e-3
