"""What one trainer step measured and what its loss kept.

* :class:`Prepared`: a micro-batch with its step-fixed loss targets, each token's age bucket
  and, per sample, how many tokens survive each mask in turn (loss mask, token age, the
  trainer's truncated support, masked IS).
* :func:`kept_tokens`: per sample, what the loss kept (its row of the final mask), and when
  nothing, the first mask that emptied it: the ledger's trained-token counts come from here.
* :class:`StepSums` and :func:`step_metrics`: running sums over micro-batches and updates,
  turned into the step's metrics (the list is in :mod:`rollstream.train.trainer`), with
  ``clip_frac`` split by token age.

Simplified: ages above the staleness bound share one bucket (``clip_frac/age_over{k}``); only
ages present in the step get a key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rollstream.train.batching import MicroBatch
from rollstream.train.losses import LossTargets
from rollstream.trajectory import KeptTokens, Sample

if TYPE_CHECKING:
    from rollstream.staleness import StalenessPolicy


@dataclass(slots=True, kw_only=True)
class Prepared:
    """A micro-batch with its step-fixed loss targets."""

    mb: MicroBatch
    targets: LossTargets
    age_bucket: Tensor  # [B, T] long: min(step - version, max_staleness + 1) per token
    stage_counts: list[list[int]]  # [B][4] tokens left after: loss mask, age, support, IS


class StepSums:
    """Running sums of named statistics (floats)."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, **kv: float) -> None:
        for k, v in kv.items():
            self.values[k] = self.values.get(k, 0.0) + float(v)

    def ratio(self, num: str, den: str) -> float:
        d = self.values.get(den, 0.0)
        return self.values.get(num, 0.0) / d if d else 0.0

    def add_clips_by_age(self, p: Prepared, clipped: Tensor, num_buckets: int) -> None:
        """Trained and clipped tokens of one micro-batch's update, per age bucket."""
        tokens = torch.bincount(p.age_bucket[p.targets.mask], minlength=num_buckets).tolist()
        clips = torch.bincount(p.age_bucket[clipped], minlength=num_buckets).tolist()
        self.add(**{f"age_tokens{a}": c for a, c in enumerate(tokens) if c},
                 **{f"age_clipped{a}": c for a, c in enumerate(clips) if c})


def kept_tokens(samples: list[Sample], p: Prepared, step: int,
                staleness: StalenessPolicy) -> dict[str, KeptTokens]:
    """What the loss keeps of each sample of one micro-batch (row ``b`` is ``samples[b]``);
    when nothing, the reason is the first mask that emptied the row (for token age, the
    staleness policy's own verdict)."""
    mask, versions = p.targets.mask, p.mb.versions
    oldest = torch.where(mask, versions, torch.iinfo(versions.dtype).max).min(dim=-1).values
    version_sum = torch.where(mask, versions, 0).sum(dim=-1)
    out = {}
    for b, s in enumerate(samples):
        n_loss, n_young, n_base, n_kept = p.stage_counts[b]
        if n_kept:
            out[s.uid] = KeptTokens(num_tokens=n_kept, min_version=int(oldest[b]),
                                    version_sum=int(version_sum[b]))
            continue
        if not n_loss:
            why = "no loss-masked token"
        elif not n_young:
            why = staleness.sample_verdict(s, step).reason or "every token too old"
        elif not n_base:
            why = "every token outside the trainer's top-k/top-p support"
        else:
            why = "every token masked by masked IS"
        out[s.uid] = KeptTokens(num_tokens=0, min_version=None, reason=why)
    return out


def step_metrics(sums: StepSums, *, num_samples: int, step_s: float,
                 max_staleness: int) -> dict[str, float]:
    """The step's metrics from its sums (names and meanings: the trainer's docstring)."""
    k = max_staleness
    by_age = {
        f"clip_frac/age{a}" if a <= k else f"clip_frac/age_over{k}":
            sums.ratio(f"age_clipped{a}", f"age_tokens{a}")
        for a in range(k + 2) if f"age_tokens{a}" in sums.values
    }
    return {
        "loss": sums.ratio("loss", "num_updates"),
        "clip_frac": sums.ratio("clipped", "update_tokens"),
        **by_age,
        "kl": sums.ratio("kl", "update_tokens"),
        "is_weight_mean": sums.ratio("is_weight", "num_tokens"),
        "is_masked_frac": sums.ratio("is_masked", "base_tokens"),
        "age_masked_frac": sums.ratio("age_masked", "loss_mask_tokens"),
        "support_masked_frac": sums.ratio("support_masked", "loss_mask_tokens"),
        "mismatch": sums.ratio("mismatch_abs", "base_tokens"),
        "mismatch_kl": sums.ratio("mismatch_kl", "base_tokens"),
        "entropy": sums.ratio("entropy", "num_tokens"),
        "grad_norm": sums.ratio("grad_norm", "num_updates"),
        "num_tokens": float(sums.values.get("num_tokens", 0)),
        "num_samples": float(num_samples),
        "step_s": step_s,
        # with train.router_aux_loss_coef > 0: the load-balancing loss, per trained token
        **({"router_aux_loss": sums.ratio("router_aux", "update_tokens")}
           if "router_aux" in sums.values else {}),
        # mixture of experts: share of recorded (token, layer) top-k sets the trainer's own
        # router picks too, in the step's first forward (train/routing.py)
        **({"routing_agreement": sums.ratio("routing_agree", "routing_tokens")}
           if sums.values.get("routing_tokens") else {}),
    }
