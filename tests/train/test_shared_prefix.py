"""Shared-prefix training: a group's prompt (and the leading tokens an episode's turn-samples
share) computed once per micro-batch gives the flat layout's loss and gradients, for every
loss aggregation, with the proximal and reference forwards on the same layout."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollstream.config.schema import ISCorrectionConfig, TrainConfig
from rollstream.staleness import StalenessPolicy
from rollstream.train.losses import LOSS_AGGS
from rollstream.train.shared_prefix import attention_width, plan_units
from rollstream.train.trainer import Trainer
from rollstream.trajectory import Context, Group, Segment, SegmentKind, Task
from tests import warm
from tests.train.conftest import SYNC, make_group

STALE = StalenessPolicy(max_staleness=1)  # loss auto = decoupled_ppo: a proximal forward
PROMPT_A = [(7 * i) % 60 + 2 for i in range(20)]
PROMPT_B = [(5 * i) % 60 + 3 for i in range(24)]


def _groups() -> list[Group]:
    """Two groups of long-enough prompts, responses of several lengths, stale tokens."""
    a = make_group("a", PROMPT_A, [[4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15], [16]],
                   rewards=[1.0, 0.0, 0.5, 0.0], versions=[[1] * 4, [0] * 2, [1] * 6, [1]])
    b = make_group("b", PROMPT_B, [[20, 21, 22], [23, 24, 25, 26, 27]], rewards=[0.0, 1.0])
    return [a, b]


def _policy(ids: list[int], version: int = 1) -> Segment:
    return Segment(kind=SegmentKind.POLICY, token_ids=list(ids),
                   logprobs=[-3.0 - 0.1 * i for i in range(len(ids))],
                   versions=[version] * len(ids), loss_mask=[True] * len(ids))


def _episodes() -> list[Group]:
    """A group of two episodes whose template rewrote an earlier turn: each turn-sample's
    context starts with the prompt and the first answer, then differs."""
    group = Group.new(Task(uid="e/0", source="e", prompt_ids=tuple(PROMPT_A), prompt_text="",
                           reference=""), 2)
    for i, s in enumerate(group.samples):
        first, env, second = [30 + i, 31, 32], [40, 41], [33, 34 + i, 35]
        s.segments += [_policy(first), Segment.env([]), _policy(second), Segment.env(env),
                       _policy([36, 37])]
        s.contexts += [Context(num_segments=2, token_ids=tuple(PROMPT_A + first + [50 + i])),
                       Context(num_segments=4, token_ids=tuple(PROMPT_A + first + [51] + env))]
        s.reward = float(i)
    return [group]


def _step(path: Path, cfg: TrainConfig, groups: list[Group], staleness: StalenessPolicy
          ) -> tuple[Trainer, dict, dict, dict]:
    torch.manual_seed(0)
    trainer = Trainer(cfg, path, staleness=staleness, max_response_tokens=16)
    result = trainer.step(groups, step=1)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return trainer, result.metrics, grads, result.kept


def _assert_same_step(path: Path, cfg: dict, build, staleness: StalenessPolicy) -> None:
    flat, flat_m, flat_g, flat_kept = _step(path, TrainConfig(shared_prefix="off", **cfg),
                                            build(), staleness)
    shared, m, g, kept = _step(path, TrainConfig(shared_prefix="auto", **cfg), build(),
                               staleness)
    samples = [s for group in build() for s in group.samples]
    layouts = [mb for _, mb in shared._micro_batches(samples)]
    flat_layouts = [mb for _, mb in flat._micro_batches(samples)]
    assert all(mb.attention_mask is not None for mb in layouts)  # a prefix was shared
    assert (sum(int(mb.token_mask.sum()) for mb in layouts)
            < sum(int(mb.token_mask.sum()) for mb in flat_layouts))
    assert m["num_tokens"] == flat_m["num_tokens"] and kept == flat_kept
    assert m["loss"] == pytest.approx(flat_m["loss"], abs=1e-5)
    assert m["kl"] == pytest.approx(flat_m["kl"], abs=1e-6)
    assert g.keys() == flat_g.keys() and flat_g
    for name, want in flat_g.items():
        assert torch.allclose(g[name], want, rtol=0, atol=1e-5), name
    assert any(float(x.abs().max()) > 1e-4 for x in flat_g.values())


def _cfg(loss_agg: str, **extra) -> dict:
    is_cfg = ISCorrectionConfig(level="sequence" if loss_agg == "seq_mean_token_mean"
                                else "token", mode="truncate")
    return dict(loss_agg=loss_agg, updates_per_step=1, grad_clip=1e9, lr=1e-3,
                is_correction=is_cfg, **extra)


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_a_groups_shared_prompt_trains_as_the_flat_layout(tiny_model_path, loss_agg):
    # decoupled PPO (a proximal forward) with a KL term (a reference forward); the budget
    # fits one group, not both: each group is one micro-batch
    _assert_same_step(tiny_model_path, _cfg(loss_agg, kl_coef=0.1, micro_batch_tokens=48),
                      _groups, STALE)


def test_ppo_clip_on_policy_trains_as_the_flat_layout(tiny_model_path):
    _assert_same_step(tiny_model_path, _cfg("token_mean"), _groups, SYNC)


@pytest.mark.parametrize("budget", [8192, 48])  # the group's episodes together; each alone
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_an_episodes_turn_samples_share_their_leading_tokens(tiny_model_path, loss_agg,
                                                             budget):
    _assert_same_step(tiny_model_path, _cfg(loss_agg, kl_coef=0.1, micro_batch_tokens=budget),
                      _episodes, STALE)


def test_logprobs_of_the_shared_layout_equal_the_flat_ones(tiny_model_path):
    samples = [s for g in _groups() + _episodes() for s in g.samples]
    on = Trainer(TrainConfig(shared_prefix="on"), tiny_model_path, staleness=SYNC)
    off = Trainer(TrainConfig(shared_prefix="off"), tiny_model_path, staleness=SYNC)
    for a, b in zip(on.logprobs(samples), off.logprobs(samples), strict=True):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_a_group_too_long_for_one_micro_batch_is_cut_into_chunks(tiny_model_path):
    trainer = Trainer(TrainConfig(shared_prefix="on", micro_batch_tokens=30), tiny_model_path,
                      staleness=SYNC)
    samples = _groups()[0].samples  # 20 + 4 + 2 + 6 + 1 tokens shared: over 30
    batches = trainer._micro_batches(samples)
    assert sorted(i for idx, _ in batches for i in idx) == [0, 1, 2, 3]
    assert len(batches) > 1 and all(mb.input_ids.numel() <= 30 for _, mb in batches)


def test_auto_leaves_short_prompts_flat(tiny_model_path):
    trainer = Trainer(TrainConfig(), tiny_model_path, staleness=SYNC)
    samples = make_group("s", list(range(2, 17)), [[20, 21], [22]]).samples  # 15 tokens
    assert all(mb.attention_mask is None for _, mb in trainer._micro_batches(samples))


def test_auto_leaves_long_answers_to_a_short_prompt_flat_where_sharing_costs_more():
    """A unit's shared row is as wide as all its answers: 8 answers of 180 tokens under a
    20-token prompt would save 140 tokens of 1,600 and make each answer attend over 1,460
    keys (on the agent example's shape that trained 2.2x slower than flat). ``auto`` keeps them
    flat and still shares a 400-token prompt under answers of 30; ``on`` shares both."""
    config = SimpleNamespace(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=384)
    kappa = attention_width(config)  # (2*128*128 + 2*128*64 + 3*128*384) / (4 * 128)
    assert kappa == pytest.approx(384)
    long_answers = make_group("t", PROMPT_A, [[3 + (i + j) % 50 for j in range(180)]
                                              for i in range(8)]).samples
    few_shot = make_group("f", list(range(2, 402)), [[3 + (i + j) % 50 for j in range(30)]
                                                     for i in range(8)]).samples
    for samples, auto_shares in ((long_answers, False), (few_shot, True)):
        on, _ = plan_units(samples, min_tokens=1, budget=8192)
        auto, _ = plan_units(samples, min_tokens=16, budget=8192, kappa=kappa)
        assert [u for u in on if u[1]]  # on: the prefix shared
        assert bool([u for u in auto if u[1]]) is auto_shares
    # a larger model's attention weighs less against its linear layers: there it shares
    big = SimpleNamespace(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                          intermediate_size=4864)
    auto, _ = plan_units(long_answers, min_tokens=16, budget=8192, kappa=attention_width(big))
    assert [u for u in auto if u[1]]


def test_auto_picks_narrower_chunks_where_the_whole_group_costs_more():
    """16 answers of 100 under a 300-token prompt: one shared row of 1,900 tokens is too
    wide, chunks of a few answers each beat both it and the flat layout."""
    samples = make_group("c", list(range(2, 302)), [[3 + (i + j) % 50 for j in range(100)]
                                                    for i in range(16)]).samples
    kappa = 384.0
    whole, _ = plan_units(samples, min_tokens=16, budget=8192)
    auto, lengths = plan_units(samples, min_tokens=16, budget=8192, kappa=kappa)
    shared = [u for u in auto if u[1]]
    assert len(whole) == 1 and len(shared) > 1  # chunks, each sharing the prompt
    assert sorted(b for u in auto for b in u[0]) == list(range(16))
    assert max(lengths) < 1900


@pytest.mark.parametrize("setting", [
    ["train.compile=true"],
    ["train.router_aux_loss_coef=0.01", "model.tiny.arch=qwen2_moe"],
    ["train.routing_replay=replay", "model.tiny.arch=qwen2_moe"]])
def test_on_refuses_what_it_cannot_share_with(setting):
    from rollstream.config import load_config

    key = setting[0].split("=")[0]
    with pytest.raises(ValueError, match=f"train.shared_prefix = on contradicts {key}"):
        load_config(None, ["train.shared_prefix=on", *setting])
    load_config(None, setting)  # auto: flat there, no error
    assert load_config(None, ["train.shared_prefix=off"]).train.shared_prefix == "off"


def test_recorded_routing_is_laid_out_as_the_shared_tokens_are():
    """A prefix laid out once carries its first sample's recorded routing once, then each
    sample's routing past the prefix, beside the very tokens it was recorded for (what
    ``routing_agreement`` counts; replay itself keeps samples flat)."""
    from rollstream.train.batching import collate
    from rollstream.trajectory import Routing

    samples = make_group("r", PROMPT_A, [[4, 5, 6], [8, 9]]).samples
    seqs = [PROMPT_A + s.response_ids for s in samples]
    for k, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        s.routing = Routing(num_layers=1, top_k=1,
                            experts=bytes((50 * k + i) % 200 for i in range(len(seq))))
    prefix = len(PROMPT_A) - 1
    mb = collate(samples, [[0, 1]], shared=[((0, 1), prefix)])
    row = seqs[0] + seqs[1][prefix:]
    assert mb.input_ids[0, : len(row)].tolist() == row
    expected = list(samples[0].routing.experts) + list(samples[1].routing.experts)[prefix:]
    assert mb.experts[0, : len(row), 0, 0].tolist() == expected


def test_cli_trains_with_shared_prefixes(tmp_path):
    """`rollstream train` with every group prompt shared: on-policy the trainer's logprobs
    (on the shared layout) are the engine's."""
    run = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.max_position=128",
           "model.warm_start.steps=2", "model.warm_start.tokens_per_step=256",
           "tasks.sources=[{kind: tick, max_items: 3}]", "tasks.num_eval=4",
           "engine.local.max_slots=16", "engine.local.max_seq_len=128",
           "sampling.max_new_tokens=16", "rollout.mode=sync", "rollout.group_size=4",
           "rollout.filter_zero_variance=false", "train.groups_per_step=2", "train.steps=2",
           "train.shared_prefix=on", "eval.samples_per_task=1", "eval.every=0",
           "monitor.progress=false", "monitor.report=false",
           f"model.cache_dir={tmp_path / 'cache'}", f"run_root={tmp_path}", "name=shared"]
    out = warm.run(["-m", "rollstream", "train", "examples/tick.yaml", *run],
                   cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "shared" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_samples"] > 0
    metrics = [json.loads(line)
               for line in (tmp_path / "shared" / "metrics.jsonl").read_text().splitlines()]
    mismatch = [m["mismatch"] for m in metrics if m["kind"] == "train"]
    assert len(mismatch) == 2 and max(mismatch) < 1e-5
