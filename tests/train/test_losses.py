"""Policy losses, IS correction and token masks against hand-computed tensors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rollstream.config.schema import ISCorrectionConfig
from rollstream.staleness import StalenessPolicy
from rollstream.train.losses import (
    aggregation_weights,
    anchor_fn,
    build_targets,
    mismatch_correction,
    normaliser,
    policy_loss,
)

EPS = 0.2
NO_IS = ISCorrectionConfig(mode="none")
POS = torch.tensor([1.0], dtype=torch.float64)  # advantage of the single row
NEG = torch.tensor([-1.0], dtype=torch.float64)


def t(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def run(loss: str, logp, behav, prox, adv, mask=None, is_cfg=NO_IS, ref=None, kl_coef=0.0):
    """(loss sum, d loss / d logp, stats, correction)."""
    logp = logp.clone().requires_grad_(True)
    mask = torch.ones_like(behav, dtype=torch.bool) if mask is None else mask
    targets, corr = build_targets(
        anchor_fn(loss), logp_behav=behav, logp_prox=prox, advantages=adv, base_mask=mask,
        is_cfg=is_cfg, logp_ref=ref,
    )
    value, stats = policy_loss(logp, targets, clip_eps=EPS, kl_coef=kl_coef)
    value.backward()
    return value.item(), logp.grad, stats, corr


def reference_ppo(r: float, a: float) -> tuple[float, float]:
    """-min(rA, clip(r)A) and its derivative wrt log r, written out by cases."""
    clipped_r = min(max(r, 1 - EPS), 1 + EPS)
    if r * a <= clipped_r * a:
        return -r * a, -r * a
    return -clipped_r * a, 0.0


def test_ppo_clip_hand_computed() -> None:
    behav = t([[math.log(0.5), math.log(0.4), math.log(0.3), math.log(0.2)]])
    # ratios 1.1 (inside), 1.5 (A>0: clipped), 0.5 (A>0: not clipped, min picks r*A), 0.95
    logp = behav + t([[math.log(1.1), math.log(1.5), math.log(0.5), math.log(0.95)]])
    value, grad, stats, _ = run("ppo_clip", logp, behav, behav, POS)
    assert value == pytest.approx(-(1.1 + 1.2 + 0.5 + 0.95))
    assert grad.tolist()[0] == pytest.approx([-1.1, 0.0, -0.5, -0.95])
    assert stats.num_clipped == 1 and stats.num_tokens == 4
    # negative advantage: ratio 1.5 is not clipped (gradient -A*r = 1.5), 0.5 is clipped
    value, grad, stats, _ = run("ppo_clip", logp, behav, behav, NEG)
    assert value == pytest.approx(1.1 + 1.5 + 0.8 + 0.95)
    assert grad.tolist()[0] == pytest.approx([1.1, 1.5, 0.0, 0.95])
    assert stats.num_clipped == 1


def test_ppo_clip_exhaustive_against_case_analysis() -> None:
    ratios = [0.5, 0.79, 0.9, 1.0, 1.1, 1.21, 1.5, 3.0]
    for a, r in itertools.product([-2.0, -0.5, 0.0, 0.5, 2.0], ratios):
        behav = t([[-1.3]])
        logp = behav + math.log(r)
        adv = torch.tensor([a], dtype=torch.float64)
        value, grad, _, _ = run("ppo_clip", logp, behav, behav, adv)
        want_value, want_grad = reference_ppo(r, a)
        assert value == pytest.approx(want_value, abs=1e-12), (a, r)
        assert grad.item() == pytest.approx(want_grad, abs=1e-12), (a, r)


def test_masked_tokens_contribute_nothing_even_when_extreme() -> None:
    behav = t([[-1.0, -1.0, -1.0]])
    logp = t([[-1.0, 500.0, -1.0]])  # exp(501) overflows if it were used
    mask = torch.tensor([[True, False, True]])
    value, grad, stats, _ = run("ppo_clip", logp, behav, behav, POS, mask)
    assert value == pytest.approx(-2.0)
    assert grad.tolist()[0] == [-1.0, 0.0, -1.0]
    assert stats.num_tokens == 2 and torch.isfinite(grad).all()


def test_decoupled_ppo_hand_computed() -> None:
    # behav 0.5, prox 0.6 -> w = 1.2; current 0.66 -> ratio to prox 1.1 (inside the clip)
    behav, prox = t([[math.log(0.5)]]), t([[math.log(0.6)]])
    logp = t([[math.log(0.66)]])
    adv = POS
    cap2 = ISCorrectionConfig(cap=2.0)
    value, grad, _, _ = run("decoupled_ppo", logp, behav, prox, adv, is_cfg=cap2)
    assert value == pytest.approx(-1.2 * 1.1)
    assert grad.item() == pytest.approx(-1.2 * 1.1)
    # behav 0.2 -> w = 3, truncated at cap 2; ratio 1.5 to prox is clipped at 1.2 for A > 0
    behav = t([[math.log(0.2)]])
    logp = t([[math.log(0.9)]])
    value, grad, stats, _ = run("decoupled_ppo", logp, behav, prox, adv, is_cfg=cap2)
    assert value == pytest.approx(-2.0 * 1.2)
    assert grad.item() == 0.0 and stats.num_clipped == 1
    # mode none: the full behaviour weight 3
    value, _, _, _ = run("decoupled_ppo", t([[math.log(0.6)]]), behav, prox, adv)
    assert value == pytest.approx(-3.0)


def test_ppo_clip_truncated_is_matches_decoupled_on_the_unclipped_branch() -> None:
    # w = prox/behav = 3; at logp = prox the behaviour ratio is 3; A < 0 keeps it unclipped
    behav, prox = t([[math.log(0.2)]]), t([[math.log(0.6)]])
    adv = NEG
    cfg = ISCorrectionConfig(mode="truncate", cap=2.0)
    value, grad, _, corr = run("ppo_clip", prox, behav, prox, adv, is_cfg=cfg)
    # coefficient min(w, cap) / w = 2/3 on ratio 3: gradient weight (pi/pi_prox) * min(w, cap)
    assert corr.weight_over_ratio.item() == pytest.approx(2 / 3)
    assert value == pytest.approx(2.0) and grad.item() == pytest.approx(2.0)
    d_value, d_grad, _, _ = run("decoupled_ppo", prox, behav, prox, adv, is_cfg=cfg)
    assert (d_value, d_grad.item()) == pytest.approx((value, grad.item()))
    # without correction ppo_clip uses the raw behaviour ratio 3
    value, grad, _, _ = run("ppo_clip", prox, behav, prox, adv)
    assert value == pytest.approx(3.0) and grad.item() == pytest.approx(3.0)


def test_token_level_truncate_and_mask() -> None:
    w = [0.4, 1.0, 1.5, 2.5]
    behav = t([[-1.0] * 4])
    prox = behav + t([[math.log(x) for x in w]])
    mask = torch.ones_like(behav, dtype=torch.bool)
    trunc = mismatch_correction(prox, behav, mask, ISCorrectionConfig(mode="truncate", cap=2.0))
    assert trunc.weight.tolist()[0] == pytest.approx([0.4, 1.0, 1.5, 2.0])
    assert trunc.weight_over_ratio.tolist()[0] == pytest.approx([1.0, 1.0, 1.0, 0.8])
    assert trunc.keep.all()
    masked = mismatch_correction(
        prox, behav, mask, ISCorrectionConfig(mode="mask", cap=2.0, lower=0.5)
    )
    assert masked.keep.tolist()[0] == [False, True, True, False]
    assert masked.weight.tolist()[0] == pytest.approx([0.0, 1.0, 1.5, 0.0])
    assert masked.weight_over_ratio.tolist()[0] == [0.0, 1.0, 1.0, 0.0]
    # through the loss: dropped tokens are neither counted nor differentiated
    adv = POS
    cfg = ISCorrectionConfig(mode="mask", cap=2.0, lower=0.5)
    value, grad, stats, _ = run("ppo_clip", prox, behav, prox, adv, is_cfg=cfg)
    assert stats.num_tokens == 2
    assert grad.tolist()[0] == pytest.approx([0.0, -1.0, 0.0, 0.0])  # ratio 1.5 is clipped
    assert value == pytest.approx(-(1.0 + 1.2))


def test_sequence_level_uses_geometric_mean_of_masked_tokens() -> None:
    behav = t([[-1.0] * 4, [-1.0] * 4])
    log_w = t([[math.log(2), math.log(0.5), math.log(4), 50.0],  # last token masked out
               [math.log(4), math.log(4), 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    prox = behav + log_w
    geo = 4 ** (1 / 3)  # (2 * 0.5 * 4) ** (1/3)
    trunc = mismatch_correction(
        prox, behav, mask, ISCorrectionConfig(level="sequence", mode="truncate", cap=2.0)
    )
    assert trunc.weight[0, :3].tolist() == pytest.approx([geo] * 3)
    assert trunc.weight[1, :2].tolist() == pytest.approx([2.0, 2.0])  # geometric mean 4 -> cap
    assert trunc.weight_over_ratio[1, :2].tolist() == pytest.approx([0.5, 0.5])
    masked = mismatch_correction(
        prox, behav, mask, ISCorrectionConfig(level="sequence", mode="mask", cap=2.0, lower=0.5)
    )
    assert masked.keep.tolist() == [[True, True, True, False], [False] * 4]  # row 2 dropped whole
    assert masked.weight[0, :3].tolist() == pytest.approx([geo] * 3)


def test_staleness_policy_keeps_is_the_trainers_token_age_mask() -> None:
    versions = torch.tensor([[3, 4, 5, -1]])  # -1: environment tokens and padding

    def keeps(m: int | None) -> list[list[bool]]:
        return StalenessPolicy(max_staleness=3, max_token_age=m).keeps(versions, 6).tolist()

    assert keeps(None) == [[True, True, True, False]]
    assert keeps(1) == [[False, False, True, False]]
    assert keeps(2) == [[False, True, True, False]]
    assert keeps(0) == [[False] * 4]
    early = StalenessPolicy(max_staleness=3, max_token_age=2).keeps(torch.tensor([[0, -1]]), 1)
    assert early.tolist() == [[True, False]]  # step - m < 0 never admits version -1


def test_k3_kl_value_and_gradient() -> None:
    logp = t([[-1.0, -2.0]])
    ref = logp + t([[math.log(2.0), 0.0]])  # d = log 2, 0
    adv = torch.tensor([0.0], dtype=torch.float64)  # no policy gradient
    value, grad, stats, _ = run("ppo_clip", logp, logp, logp, adv, ref=ref, kl_coef=0.1)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert stats.kl_sum == pytest.approx(k3)
    assert value == pytest.approx(0.1 * k3)
    assert grad.tolist()[0] == pytest.approx([0.1 * (1 - 2.0), 0.0])  # d/dlogp = c (1 - e^d)


def test_normaliser_and_aggregation_weights() -> None:
    def norm(agg: str, **kw) -> float:
        args = dict(num_tokens=37, num_sequences=3, num_samples=4, max_response_tokens=100)
        return normaliser(agg, **(args | kw))

    assert norm("token_mean") == 37 and norm("token_mean", num_tokens=0) == 1
    assert norm("seq_mean_token_mean") == 3 and norm("seq_mean_token_sum") == 3
    assert norm("seq_mean_token_sum", num_sequences=0) == 1
    assert norm("seq_mean_token_sum_norm") == 400  # Dr.GRPO: samples x budget, masks aside
    with pytest.raises(ValueError, match="max_response_tokens"):
        norm("seq_mean_token_sum_norm", max_response_tokens=None)
    with pytest.raises(ValueError, match="unknown loss_agg 'mean'"):
        norm("mean")
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        anchor_fn("ppo")
    mask = torch.tensor([[True, True, False, True], [False] * 4, [True, False, False, False]])
    got = aggregation_weights("seq_mean_token_mean", mask).tolist()
    assert got == [[pytest.approx(1 / 3)], [1.0], [1.0]]
    for agg in ("token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        assert aggregation_weights(agg, mask).tolist() == [[1.0]] * 3


def test_sequence_weights_scale_each_rows_token_losses() -> None:
    behav = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    for agg, want in (("token_mean", -4.0), ("seq_mean_token_mean", -2.0)):
        logp = behav.clone().requires_grad_(True)
        targets, _ = build_targets(anchor_fn("ppo_clip"), logp_behav=behav, logp_prox=behav,
                                   advantages=adv, base_mask=mask, is_cfg=NO_IS, loss_agg=agg)
        value, stats = policy_loss(logp, targets, clip_eps=EPS)
        value.backward()
        assert value.item() == pytest.approx(want)  # on-policy: each token's loss is -A
        row0 = 1 / 3 if agg == "seq_mean_token_mean" else 1.0
        assert logp.grad[0].tolist() == pytest.approx([-row0] * 3)
        assert logp.grad[1].tolist() == pytest.approx([-1.0, 0.0, 0.0])
        assert stats.num_tokens == 4


def test_minus_inf_logprobs_give_no_nan() -> None:
    """With top-p/top-k a token can leave the current policy's truncated support during a
    step (logp = -inf); the loss, its gradient and the KL stay finite."""
    behav = t([[-1.0, -1.0]])
    ref = t([[-1.0, -float("inf")]])
    for a in (POS, NEG):
        logp = t([[-1.0, -float("inf")]]).requires_grad_(True)
        targets, _ = build_targets(anchor_fn("decoupled_ppo"), logp_behav=behav,
                                   logp_prox=behav, advantages=a,
                                   base_mask=torch.ones_like(behav, dtype=torch.bool),
                                   is_cfg=NO_IS, logp_ref=ref)
        value, stats = policy_loss(logp, targets, clip_eps=EPS, kl_coef=0.1)
        value.backward()
        assert math.isfinite(value.item()) and torch.isfinite(logp.grad).all()
        assert logp.grad[0, 1].item() == 0.0 and math.isfinite(stats.kl_sum)
