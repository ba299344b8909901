"""Token-level policy losses on ``[B, T]`` tensors: PPO-clip, decoupled PPO, IS correction.

Three log-probabilities meet here, per response token (``[B, T]``, float32):

* ``logp_behav``: what the engine reported when it sampled the token (behaviour policy);
* ``logp_prox``: the trainer's own logprob before this step's first update (proximal policy);
* ``logp``: the current policy during an update (carries the gradient).

Their split is the engine–trainer *mismatch* ``w = exp(logp_prox - logp_behav)`` (different
kernels, precision, stale weights in async mode). :func:`mismatch_correction` turns ``w`` into a
detached weight ``m`` per ``ISCorrectionConfig``, at token level or at sequence level (``w`` of
a sequence = geometric mean of its token ratios, i.e. ``exp(mean log w)``, broadcast to its
tokens):

* ``none``: ``m = w``;
* ``truncate``: ``m = min(w, cap)`` (truncated IS);
* ``mask``: ``m = w`` where ``lower <= w <= cap``, else the token (token level) or the whole
  sequence (sequence level) is dropped from the loss and from the token count (masked IS).

The two losses (``TrainConfig.loss``; ``auto`` is resolved by the trainer) (:func:`build_targets`):

* ``ppo_clip``: ``ratio = exp(logp - logp_behav)``, clipped to ``[1-eps, 1+eps]``. This ratio
  already contains the mismatch ``w`` (``ratio = (pi/pi_prox) * w``), so multiplying by ``m``
  would count it twice; instead the surrogate is multiplied by ``m / w`` (computed in log
  space), which makes the unclipped gradient weight exactly ``(pi/pi_prox) * m``. So
  ``none`` leaves plain PPO-clip against the behaviour policy; ``truncate`` caps the mismatch
  part of the ratio at ``cap``; ``mask`` drops tokens/sequences out of bounds.
* ``decoupled_ppo`` (AReaL, Fu et al. 2025): ``ratio = exp(logp - logp_prox)`` clipped, times
  the behaviour importance weight ``m`` (detached).

Optional KL to a reference policy uses the k3 estimator ``exp(ref - logp) - (ref - logp) - 1``
(Schulman), added per token with ``kl_coef``, over the tokens inside both policies' truncated
supports (with top-p/top-k a logprob can be ``-inf``; such a token adds no KL term).

Loss aggregation (``TrainConfig.loss_agg``, verl's names). Per-token losses ``l_it`` (sample
``i``, kept token ``t``, ``n_i`` kept tokens) are weighted here by a step-fixed per-sequence
weight (:func:`aggregation_weights`) and summed; the trainer divides the sum by one
step-wide :func:`normaliser`, so gradient accumulation over micro-batches gives exactly the
full-batch loss:

* ``token_mean``: ``sum_it l_it / sum_i n_i`` (every kept token weighs the same);
* ``seq_mean_token_mean``: ``mean_i (sum_t l_it / n_i)`` (every sequence weighs the same);
* ``seq_mean_token_sum``: ``mean_i sum_t l_it`` (longer sequences weigh more);
* ``seq_mean_token_sum_norm``: ``sum_it l_it / (N * L)`` with ``N`` the step's trained
  samples and ``L`` the response budget (``sampling.max_new_tokens``): Dr.GRPO's constant
  normaliser, which no mask or length changes.

The sequence means count the sequences that keep at least one token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollstream.config.schema import ISCorrectionConfig


@dataclass(slots=True, kw_only=True)
class Correction:
    """Engine–trainer mismatch correction of one micro-batch (all ``[B, T]``, detached)."""

    log_ratio: Tensor  # log w at the configured level (0 outside the base mask)
    weight: Tensor  # m: the corrected importance weight (0 where dropped)
    weight_over_ratio: Tensor  # m / w, computed stably (the ppo_clip multiplier)
    keep: Tensor  # bool: False where masked IS drops the token


@dataclass(slots=True, kw_only=True)
class LossTargets:
    """Everything one micro-batch's loss needs besides ``logp``; fixed for a whole step."""

    anchor: Tensor  # [B, T] logprob the PPO ratio is taken against
    coef: Tensor  # [B, T] detached multiplier of the clipped surrogate
    advantages: Tensor  # [B]
    mask: Tensor  # [B, T] bool: tokens that are trained
    agg_weight: Tensor  # [B, 1] weight of each sequence's token losses (loss aggregation)
    logp_ref: Tensor | None  # [B, T] reference policy, when kl_coef > 0


@dataclass(slots=True, kw_only=True)
class LossStats:
    """Sums over the trained tokens of one micro-batch (divide by num_tokens for means)."""

    num_tokens: int
    loss_sum: float  # weighted by the aggregation weights
    num_clipped: int
    kl_sum: float
    clipped: Tensor  # [B, T] bool: the clipped tokens (for per-age counts)


LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
             "seq_mean_token_sum_norm")


def _sequence_log_ratio(log_w: Tensor, mask: Tensor) -> Tensor:
    """Mean of log w over each row's masked tokens (log of the geometric mean), broadcast."""
    num = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq = log_w.sum(dim=-1, keepdim=True) / num
    return torch.where(mask, seq.expand_as(log_w), 0.0)


def _no_correction(log_w: Tensor, mask: Tensor, cfg: ISCorrectionConfig) -> Correction:
    one = torch.ones_like(log_w)
    return Correction(log_ratio=log_w, weight=log_w.exp(), weight_over_ratio=one, keep=mask)


def _truncate(log_w: Tensor, mask: Tensor, cfg: ISCorrectionConfig) -> Correction:
    log_cap = math.log(cfg.cap)
    weight = log_w.clamp(max=log_cap).exp()
    over = (log_cap - log_w).clamp(max=0.0).exp()  # min(1, cap / w)
    return Correction(log_ratio=log_w, weight=weight, weight_over_ratio=over, keep=mask)


def _mask(log_w: Tensor, mask: Tensor, cfg: ISCorrectionConfig) -> Correction:
    keep = mask & (log_w >= math.log(cfg.lower)) & (log_w <= math.log(cfg.cap))
    weight = torch.where(keep, log_w.exp(), 0.0)
    return Correction(log_ratio=log_w, weight=weight, weight_over_ratio=keep.float(), keep=keep)


_MODES: dict[str, Callable[[Tensor, Tensor, ISCorrectionConfig], Correction]] = {
    "none": _no_correction,
    "truncate": _truncate,
    "mask": _mask,
}


def mismatch_correction(
    logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, cfg: ISCorrectionConfig
) -> Correction:
    """The detached IS weight ``m`` per ``cfg`` for the tokens in ``mask`` (module docstring)."""
    log_w = torch.where(mask, (logp_prox - logp_behav).detach().float(), 0.0)
    if cfg.level == "sequence":
        log_w = _sequence_log_ratio(log_w, mask)
    return _MODES[cfg.mode](log_w, mask, cfg)


AnchorFn = Callable[[Tensor, Tensor, Correction], tuple[Tensor, Tensor]]


def _ppo_clip_anchor(prox: Tensor, behav: Tensor, c: Correction) -> tuple[Tensor, Tensor]:
    return behav, c.weight_over_ratio


def _decoupled_anchor(prox: Tensor, behav: Tensor, c: Correction) -> tuple[Tensor, Tensor]:
    return prox, c.weight


_ANCHORS: dict[str, AnchorFn] = {"ppo_clip": _ppo_clip_anchor, "decoupled_ppo": _decoupled_anchor}


def anchor_fn(loss: str) -> AnchorFn:
    """The (anchor, coefficient) rule of a loss kind; raises ValueError for unknown kinds."""
    try:
        return _ANCHORS[loss]
    except KeyError:
        raise ValueError(f"unknown loss {loss!r}; known: {', '.join(sorted(_ANCHORS))}") from None


def aggregation_weights(loss_agg: str, mask: Tensor) -> Tensor:
    """``[B, 1]`` weight of each sequence's token losses: ``1 / n_i`` for
    ``seq_mean_token_mean``, else 1 (module docstring)."""
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; known: {', '.join(LOSS_AGGS)}")
    num = mask.sum(dim=-1, keepdim=True)
    if loss_agg == "seq_mean_token_mean":
        return 1.0 / num.clamp(min=1).to(torch.float32)
    return torch.ones_like(num, dtype=torch.float32)


def resolve_loss(loss: str, max_staleness: int) -> str:
    """``auto``: ``decoupled_ppo`` when stale tokens may be trained, ``ppo_clip`` in sync."""
    if loss != "auto":
        return loss
    return "decoupled_ppo" if max_staleness > 0 else "ppo_clip"


def resolve_loss_agg(loss_agg: str, advantage: str) -> str:
    """``auto``: Dr.GRPO's constant normaliser for ``dr_grpo``, else ``token_mean``."""
    if loss_agg != "auto":
        return loss_agg
    return "seq_mean_token_sum_norm" if advantage == "dr_grpo" else "token_mean"


def build_targets(
    anchor: AnchorFn,
    *,
    logp_behav: Tensor,
    logp_prox: Tensor,
    advantages: Tensor,
    base_mask: Tensor,
    is_cfg: ISCorrectionConfig,
    logp_ref: Tensor | None = None,
    loss_agg: str = "token_mean",
) -> tuple[LossTargets, Correction]:
    """Loss targets of one micro-batch; ``base_mask`` = loss mask & token age & real tokens
    (& inside the trainer's truncated support)."""
    corr = mismatch_correction(logp_prox, logp_behav, base_mask, is_cfg)
    anchor_logp, coef = anchor(logp_prox.detach(), logp_behav.detach(), corr)
    targets = LossTargets(
        anchor=anchor_logp,
        coef=coef,
        advantages=advantages.detach(),
        mask=corr.keep,
        agg_weight=aggregation_weights(loss_agg, corr.keep),
        logp_ref=None if logp_ref is None else logp_ref.detach(),
    )
    return targets, corr


def policy_loss(
    logp: Tensor, t: LossTargets, *, clip_eps: float, kl_coef: float = 0.0
) -> tuple[Tensor, LossStats]:
    """Sum over trained tokens of ``agg_weight * (-coef * min(ratio*A, clip(ratio)*A) +
    kl_coef * k3)``. A ``logp`` of ``-inf`` (the token left the current policy's truncated
    support during the step) gives ratio 0: no gradient, no NaN."""
    mask = t.mask
    log_ratio = torch.where(mask, logp - t.anchor, 0.0)  # 0 off-mask keeps exp() finite
    ratio = log_ratio.exp()
    adv = t.advantages[:, None].to(ratio.dtype)
    clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
    clipped = clipped & mask
    # where(clipped, ...) is min(r*A, clip(r)*A) without torch.minimum's tie-splitting grads
    surrogate = torch.where(clipped, ratio.detach().clamp(1 - clip_eps, 1 + clip_eps), ratio) * adv
    per_token = -t.coef * surrogate
    kl_sum = 0.0
    if t.logp_ref is not None:
        both = mask & torch.isfinite(t.logp_ref) & torch.isfinite(logp.detach())
        d = torch.where(both, t.logp_ref - logp, 0.0)
        k3 = d.exp() - d - 1
        kl_sum = float(k3.detach()[both].sum())
        per_token = per_token + kl_coef * k3
    loss = torch.where(mask, per_token * t.agg_weight, 0.0).sum()
    stats = LossStats(
        num_tokens=int(mask.sum()),
        loss_sum=float(loss.detach()),
        num_clipped=int(clipped.sum()),
        kl_sum=kl_sum,
        clipped=clipped.detach(),
    )
    return loss, stats


def normaliser(
    loss_agg: str,
    *,
    num_tokens: int,
    num_sequences: int,
    num_samples: int,
    max_response_tokens: int | None,
) -> float:
    """Divisor of the step's summed (aggregation-weighted) loss (module docstring):
    ``num_tokens`` kept tokens, ``num_sequences`` samples keeping at least one token,
    ``num_samples`` trained samples, ``max_response_tokens`` the response budget."""
    if loss_agg == "seq_mean_token_sum_norm":
        if max_response_tokens is None:
            raise ValueError("loss_agg seq_mean_token_sum_norm (Dr.GRPO) needs "
                             "max_response_tokens (the response length budget)")
        return float(max(1, num_samples * max_response_tokens))
    if loss_agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return float(max(1, num_sequences))
    if loss_agg == "token_mean":
        return float(max(1, num_tokens))
    raise ValueError(f"unknown loss_agg {loss_agg!r}; known: {', '.join(LOSS_AGGS)}")


def router_balance_loss(router_logits: Sequence[Tensor], token_mask: Tensor, num_experts: int,
                        top_k: int) -> Tensor:
    """A mixture of experts' load-balancing loss over the real tokens of a micro-batch
    (``token_mask`` [R, W]; ``router_logits``: per layer with experts, [R * W, experts]):
    transformers' ``load_balancing_loss_func`` (Switch Transformer: experts x the sum over
    experts of the share of tokens routed to it x its mean router probability, pooled over
    layers); 0, in the graph, for a micro-batch without a token (a rank's padding)."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    if not bool(token_mask.any()):
        return torch.stack([logits.sum() for logits in router_logits]).sum() * 0.0
    return load_balancing_loss_func(tuple(router_logits), num_experts, top_k, token_mask)
