"""An episode split into turn-samples (its chat template rewrote earlier turns) trains as one
sample: laid out so that every response token is predicted from the context it was served,
and weighed as one sample by every loss aggregation, so that splitting changes no gradient
compared with an append-only rendering of the same tokens."""

from __future__ import annotations

import pytest
import torch

from rollstream.config.schema import ISCorrectionConfig, TrainConfig
from rollstream.train.batching import collate
from rollstream.train.losses import LOSS_AGGS
from rollstream.train.trainer import Trainer
from rollstream.trajectory import Context, Group, Segment, SegmentKind, Task
from tests.train.conftest import SYNC

PROMPT = [1, 2, 3]
P0, E0, P1, E1, P2 = [10, 11, 12], [20, 21], [13, 14], [22, 23, 24], [15, 16, 17]


def _policy(ids: list[int], version: int = 0) -> Segment:
    return Segment(kind=SegmentKind.POLICY, token_ids=list(ids),
                   logprobs=[-3.0 - 0.1 * i for i in range(len(ids))],
                   versions=[version] * len(ids), loss_mask=[True] * len(ids))


def _episode(group: Group, i: int, *, split: bool, reward: float) -> None:
    """Sample ``i`` of ``group``: P0 E0 P1 E1 P2, served append-only; or, ``split``, with the
    environment's second answer served as the whole context anew (the same tokens here, as a
    template that rewrote nothing visible would render them)."""
    s = group.samples[i]
    s.segments += [_policy(P0), Segment.env(E0), _policy(P1, 1),
                   Segment.env([] if split else E1), _policy(P2, 1)]
    if split:
        s.contexts.append(Context(num_segments=4, token_ids=tuple(PROMPT + P0 + E0 + P1 + E1)))
    s.reward = reward


def _batch(split: bool) -> list[Group]:
    """Two groups: an episode (split or not) beside a one-turn sample, and a split episode
    whose second context really differs (a rewrite) beside another; the same in both."""
    first = Group.new(Task(uid="a/0", source="a", prompt_ids=tuple(PROMPT), prompt_text="",
                           reference=""), 2)
    _episode(first, 0, split=split, reward=1.0)
    first.samples[1].segments.append(_policy([30, 31, 32, 33]))
    first.samples[1].reward = 0.0
    second = Group.new(Task(uid="b/0", source="b", prompt_ids=(4, 5), prompt_text="",
                            reference=""), 2)
    rewritten = second.samples[0]
    rewritten.segments += [_policy([40, 41]), Segment.env([]), _policy([42, 43, 44])]
    rewritten.contexts.append(Context(num_segments=2, token_ids=(4, 5, 41, 50)))
    rewritten.reward = 0.0
    second.samples[1].segments.append(_policy([45, 46]))
    second.samples[1].reward = 1.0
    return [first, second]


def _step(path, cfg: TrainConfig, split: bool) -> tuple[dict, dict, dict]:
    torch.manual_seed(0)
    trainer = Trainer(cfg, path, staleness=SYNC, max_response_tokens=32)
    result = trainer.step(_batch(split), step=1)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return result.metrics, grads, result.kept


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_a_split_episode_has_the_gradient_of_its_append_only_rendering(tiny_model_path,
                                                                      loss_agg):
    is_cfg = ISCorrectionConfig(level="sequence" if loss_agg == "seq_mean_token_mean"
                                else "token", mode="truncate")
    cfg = TrainConfig(loss_agg=loss_agg, updates_per_step=1, grad_clip=1e9, lr=1e-3,
                      micro_batch_tokens=32, is_correction=is_cfg)
    whole, whole_grads, whole_kept = _step(tiny_model_path, cfg, split=False)
    split, split_grads, split_kept = _step(tiny_model_path, cfg, split=True)
    assert split["num_samples"] == whole["num_samples"] == 4  # a split episode is one sample
    assert split["num_tokens"] == whole["num_tokens"] == 8 + 4 + 5 + 2
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-5)
    assert split_kept == whole_kept
    assert whole_grads.keys() == split_grads.keys() and whole_grads
    for name, g in whole_grads.items():
        assert torch.allclose(split_grads[name], g, rtol=0, atol=1e-5), name
    assert any(float(g.abs().max()) > 1e-4 for g in whole_grads.values())


def test_each_token_is_trained_in_the_context_it_was_served():
    groups = _batch(split=True)
    episode = groups[1].samples[0]  # (4, 5) [40 41] | context (4, 5, 41, 50) [42 43 44]
    mb = collate([episode, groups[0].samples[0]])
    assert mb.targets.shape == (2, 10)  # one row of loss tensors per sample, not per turn
    assert mb.targets[0, :5].tolist() == [40, 41, 42, 43, 44]
    assert mb.input_ids[0, :11].tolist() == [4, 5, 40, 41, 4, 5, 41, 50, 42, 43, 44]
    assert mb.position_ids[0, :8].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # the logits predicting each response token sit just before it, in its own turn-sample
    where = mb.logits_to_keep[mb.logit_index[0, :5] % len(mb.logits_to_keep)]
    assert where.tolist() == [1, 2, 7, 8, 9]
    assert mb.input_ids[0, where + 1].tolist() == [40, 41, 42, 43, 44]
