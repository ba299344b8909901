"""Off-policy correctness of the trainer: the loss picked per mode, clip fractions by token
age, the truncated support, the failed-reward baseline, dropout, what the loss kept."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.config.schema import ISCorrectionConfig, TrainConfig
from rollstream.staleness import StalenessPolicy
from rollstream.train.advantages import compute_advantages
from rollstream.train.losses import resolve_loss
from rollstream.train.trainer import Trainer
from rollstream.trajectory import KeptTokens, SampleStatus
from tests.train.conftest import SYNC, make_group


def on_policy(trainer: Trainer, groups) -> None:
    """Behaviour logprobs := the trainer's own (finite ones; -5 where it gives -inf)."""
    samples = [s for g in groups for s in g.samples]
    for s, lp in zip(samples, trainer.logprobs(samples)):
        if s.segments:
            s.segments[0].logprobs[:] = [x if math.isfinite(x) else -5.0 for x in lp]


@pytest.mark.parametrize(("k", "loss", "want"), [
    (0, "auto", "ppo_clip"), (1, "auto", "decoupled_ppo"), (3, "auto", "decoupled_ppo"),
    (2, "ppo_clip", "ppo_clip"), (0, "decoupled_ppo", "decoupled_ppo"),
])
def test_loss_auto_is_decoupled_exactly_when_stale_tokens_train(
    tiny_model_path: Path, k: int, loss: str, want: str
) -> None:
    assert resolve_loss(loss, k) == want
    trainer = Trainer(TrainConfig(loss=loss), tiny_model_path,
                      staleness=StalenessPolicy(max_staleness=k))
    assert trainer.loss == want


def test_clip_frac_is_split_by_token_age(tiny_model_path: Path) -> None:
    # ppo_clip against the behaviour policy, one update: a token clips iff its ratio
    # exp(prox - behav) leaves [0.8, 1.2] on the side its advantage pushes
    cfg = TrainConfig(loss="ppo_clip", updates_per_step=1,
                      is_correction=ISCorrectionConfig(mode="none"))
    trainer = Trainer(cfg, tiny_model_path, staleness=StalenessPolicy(max_staleness=1))
    g = make_group("g", [1, 2, 3], [[4, 5, 6, 7, 8, 9], [10, 11]], rewards=[1.0, 0.0],
                   versions=[[5, 5, 4, 4, 3, 3], [5, 5]])  # step 5: ages 0 0 1 1 2 2 | 0 0
    on_policy(trainer, [g])
    lp = g.samples[0].segments[0].logprobs
    lp[2:4] = [x - 1.0 for x in lp[2:4]]  # age 1: ratio e, positive advantage -> clipped
    lp[4:6] = [x + 1.0 for x in lp[4:6]]  # age 2: ratio 1/e, positive advantage -> not
    metrics = trainer.step([g], step=5).metrics
    assert metrics["clip_frac"] == pytest.approx(2 / 8)
    assert metrics["clip_frac/age0"] == 0.0
    assert metrics["clip_frac/age1"] == 1.0
    assert metrics["clip_frac/age_over1"] == 0.0  # older than max_staleness: one bucket
    assert not [k for k in metrics if k.startswith("clip_frac/age") and k[13:] not in
                ("0", "1", "_over1")]
    young = make_group("h", [1, 2], [[3, 4], [5]], rewards=[1.0, 0.0], versions=[[6, 6], [6]])
    on_policy(trainer, [young])
    keys = {k for k in trainer.step([young], step=6).metrics if k.startswith("clip_frac/")}
    assert keys == {"clip_frac/age0"}  # one key per age present


def test_tokens_outside_the_truncated_support_are_masked_and_counted(
    tiny_model_path: Path,
) -> None:
    """The engine sampled a token the trainer's top-2 cut drops (off-policy, or a rounding
    tie): logprob -inf, out of the loss and the mismatch, counted, no NaN."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()

    def greedy(prompt: list[int], n: int, pick) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            with torch.no_grad():
                ids.append(int(pick(model(torch.tensor([ids])).logits[0, -1])))
        return ids[len(prompt):]

    cfg = TrainConfig(updates_per_step=2, kl_coef=0.1, lr=1e-2)
    trainer = Trainer(cfg, tiny_model_path, staleness=SYNC, top_k=2, temperature=0.9)
    inside, outside = greedy([1, 2, 3], 2, torch.argmax), greedy([1, 2, 3], 3, torch.argmin)
    mixed = greedy([1, 2, 3], 1, torch.argmax) + greedy([1, 2, 3, inside[0]], 1, torch.argmin)
    g = make_group("g", [1, 2, 3], [inside, outside, mixed], rewards=[1.0, 0.0, 0.5])
    full = Trainer(TrainConfig(), tiny_model_path, staleness=SYNC, temperature=0.9)
    assert all(math.isfinite(x) for row in full.logprobs(g.samples) for x in row)
    ours = trainer.logprobs(g.samples)
    assert all(math.isfinite(x) for x in ours[0]) and math.isfinite(ours[2][0])
    assert ours[1] == [-math.inf] * 3 and ours[2][1] == -math.inf  # top-2 never holds argmin
    on_policy(trainer, [g])
    result = trainer.step([g], step=0)
    m = result.metrics
    assert all(math.isfinite(v) for v in m.values())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert m["support_masked_frac"] == pytest.approx(4 / 7)
    assert m["num_tokens"] == 3
    assert m["mismatch"] < 1e-5  # the masked tokens do not count as mismatch either
    assert result.kept[g.samples[2].uid] == KeptTokens(num_tokens=1, min_version=0)
    assert result.kept[g.samples[1].uid] == KeptTokens(
        num_tokens=0, min_version=None,
        reason="every token outside the trainer's top-k/top-p support")


@pytest.mark.parametrize("failed_reward", ["exclude", "zero"])
def test_failed_reward_enters_the_baseline_only_when_zero(
    tiny_model_path: Path, failed_reward: str
) -> None:
    cfg = TrainConfig(failed_reward=failed_reward, updates_per_step=1)
    trainer = Trainer(cfg, tiny_model_path, staleness=SYNC)
    g = make_group("g", [1, 2], [[3, 4, 5], [6], [7, 8]], rewards=[1.0, 0.0, None])
    g.samples[2].status = SampleStatus.FAILED  # e.g. its reward timed out
    on_policy(trainer, [g])
    result = trainer.step([g], step=0)
    baseline = [1.0, 0.0] + ([0.0] if failed_reward == "zero" else [])
    adv = compute_advantages(baseline, "grpo")
    # on-policy first update: ratio 1, each kept token's loss is -A (token mean)
    assert result.metrics["loss"] == pytest.approx(-(3 * adv[0] + 1 * adv[1]) / 4, rel=1e-5)
    assert result.metrics["num_samples"] == 2  # the failed sample is never trained
    assert set(result.kept) == {g.samples[0].uid, g.samples[1].uid}


def test_kept_reasons_for_samples_the_loss_keeps_nothing_of(tiny_model_path: Path) -> None:
    policy = StalenessPolicy(max_staleness=2, max_token_age=1)
    trainer = Trainer(TrainConfig(), tiny_model_path, staleness=policy)
    g = make_group("g", [1, 2], [[3, 4], [5, 6], [7]], rewards=[1.0, 0.0, 0.5],
                   versions=[[2, 3], [1, 1], [3]])
    g.samples[2].segments.clear()  # an empty response
    on_policy(trainer, [g])
    kept = trainer.step([g], step=3).kept
    assert kept[g.samples[0].uid] == KeptTokens(num_tokens=2, min_version=2, version_sum=5)
    assert kept[g.samples[1].uid] == KeptTokens(
        num_tokens=0, min_version=None,
        reason=policy.sample_verdict(g.samples[1], 3).reason)
    assert "max_token_age 1" in kept[g.samples[1].uid].reason
    assert kept[g.samples[2].uid] == KeptTokens(num_tokens=0, min_version=None,
                                                reason="empty response")


def test_dropout_is_off(tmp_path: Path) -> None:
    """A model folder whose config asks for dropout: two passes give identical logprobs,
    equal to an eval-mode forward, and an on-policy step sees no mismatch."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         attention_dropout=0.5)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "m")
    trainer = Trainer(TrainConfig(updates_per_step=1), tmp_path / "m", staleness=SYNC)
    g = make_group("g", [1, 2, 3], [[4, 5, 6, 7], [8, 9]], rewards=[1.0, 0.0])
    first, second = trainer.logprobs(g.samples), trainer.logprobs(g.samples)
    assert first == second
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([[1, 2, 3, 4, 5, 6, 7]])).logits[0, 2:-1]
    want = logits.log_softmax(-1).gather(1, torch.tensor([[4], [5], [6], [7]]))[:, 0]
    assert first[0] == pytest.approx(want.tolist(), abs=1e-5)
    on_policy(trainer, [g])
    assert trainer.step([g], step=0).metrics["mismatch"] < 1e-6
