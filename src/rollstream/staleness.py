"""The staleness policy: which tokens a loss at step ``s`` may keep, and when a sample or a
group is too old to train. One frozen object, built once per run from the config's
``rollout.staleness`` block (``RolloutConfig.staleness_policy``) and handed to admission, the
buffer, the rollout's group life and the trainer's token mask; nobody else writes these
rules. It lives beside the data model (:mod:`rollstream.trajectory`) because both the
rollout and the trainer ask it, and it imports neither of them (nor the config, nor torch).

Ages. A token of policy version ``v`` in a loss at trainer step ``s`` has age ``s - v``
(:func:`age`); a trained sample's age is the age of its oldest kept token. The controller's
metrics, the run log, the simulator and the trainer's age buckets all compute it here.

Three bounds (``s`` = the trainer step that would consume the sample, ``v`` = the policy
version that sampled a token), all in ``rollout.staleness``:

* ``max_staleness`` ``k`` (read with ``rollout.mode: async``; ``sync`` means 0, ``one_step``
  1): admission sizes its capacity by it (a group starts only while
  ``admitted <= (served version + k + 1) * groups_per_step``).
* ``max_token_age`` ``m`` (``m <= k``; null = off): the loss masks tokens with ``s - v > m``,
  and staleness counts only the tokens it keeps. A long sample resumed across many updates
  (partial rollout) trains on its recent tokens instead of being dropped. A sample whose
  every token is masked is DROPPED_STALE (its reward stays in its group's baseline).
* ``max_context_age`` ``H`` (``H >= k``): no trained sample has *seen* a token with
  ``s - v > H``, masked or not. Default ``2k`` with ``m``, ``k`` without
  (:meth:`StalenessPolicy.from_bounds`).

Together they make three semantics for a long sample that spans several versions
(:attr:`StalenessPolicy.rule`):

* ``drop`` (no ``m``, ``H = k``, the default): every token the loss keeps is within ``k``;
  a group holding an older token is DROPPED_STALE whole.
* ``mask`` (``m`` set): the loss keeps only tokens within ``m``; every token seen is within
  ``H``.
* ``admission`` (no ``m``, ``H > k``; AReaL's bound): ``k`` bounds only admission (it stops
  new samples, not old ones); a sample is trained whole, every token within ``H``, its older
  tokens weighted by the loss's importance ratio against their behaviour logprobs (clipped
  by PPO-clip; decoupled PPO's behaviour weight).

``bench modes`` on the long-tail shape with PPO-clip (docs/benchmarks.md, 2026-12-02 at
b93fa5c): reward within noise for the three, admission and drop ~10% more samples/s than
mask, admission dropping the fewest samples; both examples use admission (with PPO-clip). It
is not the library default because the default async loss (``decoupled_ppo``) was unstable
with it and with mask on that shape (one collapse in each pair of runs), and ``drop`` is what
the default loss was validated with.

Verdicts. A group is trained only when every graded sample is within its bounds (kept
tokens within ``m``, all tokens within ``H``) and at least one keeps a token; otherwise the
whole group is DROPPED_STALE with the verdict's reason. A live group whose oldest token is
already older than ``H`` behind the newest version can never be trained (steps only grow),
so it is cancelled at once.

Pure Python on :mod:`rollstream.trajectory` objects; the trainer applies the same rule to a
tensor of versions through :meth:`StalenessPolicy.keeps`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from rollstream.trajectory import Group, KeptTokens, Sample, SegmentKind

A = TypeVar("A")  # an array type with elementwise >= (a torch tensor in the trainer)
V = TypeVar("V")  # a version: an int, or an array of them (a torch tensor in the trainer)

CONTEXT_AGE_PER_K = 2  # the default max_context_age, in multiples of the staleness bound


def age(step: int, version: V) -> V:
    """The age at trainer ``step`` of a token sampled by policy ``version`` (elementwise on an
    array of versions); of a trained sample, with ``version`` its oldest kept token's."""
    return step - version  # type: ignore[operator,return-value]


@dataclass(slots=True, kw_only=True, frozen=True)
class Verdict:
    """Whether a sample or group may be trained at a step, and why not."""

    ok: bool
    reason: str | None = None  # set exactly when not ok
    spoils_group: bool = False  # not ok, and its group may not train either


_OK = Verdict(ok=True)


@dataclass(slots=True, kw_only=True, frozen=True)
class StalenessPolicy:
    max_staleness: int  # k
    max_token_age: int | None = None  # m (<= k), None = keep every token
    max_context_age: int | None = None  # H (>= k); None = k

    def __post_init__(self) -> None:
        k, m = self.max_staleness, self.max_token_age
        if k < 0 or (m is not None and not 0 <= m <= k):
            raise ValueError(f"staleness bounds need 0 <= max_token_age <= max_staleness, "
                             f"got max_staleness={k}, max_token_age={m}")
        if self.max_context_age is not None and self.max_context_age < k:
            raise ValueError(f"max_context_age {self.max_context_age} < max_staleness {k}")

    @classmethod
    def from_bounds(cls, *, max_staleness: int, max_token_age: int | None,
                    max_context_age: int | None) -> StalenessPolicy:
        """The policy a config's bounds mean: an unset ``max_context_age`` is ``2k`` with a
        token age and ``k`` without."""
        if max_context_age is None and max_token_age is not None:
            max_context_age = CONTEXT_AGE_PER_K * max_staleness
        return cls(max_staleness=max_staleness, max_token_age=max_token_age,
                   max_context_age=max_context_age)

    @property
    def context_bound(self) -> int:
        return self.max_staleness if self.max_context_age is None else self.max_context_age

    @property
    def kept_bound(self) -> int:
        """No token the loss keeps is older than this: ``m``, else ``H``."""
        return self.context_bound if self.max_token_age is None else self.max_token_age

    @property
    def rule(self) -> str:
        """``drop``, ``mask`` or ``admission`` (see the module docstring)."""
        if self.max_token_age is not None:
            return "mask"
        return "admission" if self.context_bound > self.max_staleness else "drop"

    # ---- tokens ----------------------------------------------------------------------------
    def oldest_kept_version(self, step: int) -> int:
        """Tokens of a version below this are masked out of a loss at ``step``."""
        return 0 if self.max_token_age is None else step - self.max_token_age

    def keeps(self, versions: A, step: int) -> A:
        """Elementwise: may a loss at ``step`` keep a token of this version? (Environment
        tokens and padding carry version -1 and are never kept.)"""
        return versions >= max(self.oldest_kept_version(step), 0)  # type: ignore[operator]

    def kept_tokens(self, sample: Sample, step: int) -> KeptTokens:
        """The loss-masked policy tokens a loss at ``step`` keeps by age (before any
        importance-sampling mask the trainer may add)."""
        since = max(self.oldest_kept_version(step), 0)
        num, oldest, total = 0, None, 0
        for seg in sample.segments:  # per segment: min/all/sum in C for the common whole ones
            if seg.kind is not SegmentKind.POLICY or not seg.versions:
                continue  # environment tokens are never in a loss
            low = min(seg.versions)
            if low >= since and all(seg.loss_mask):
                n, vsum = len(seg.versions), sum(seg.versions)
            else:
                kept = [v for v, m in zip(seg.versions, seg.loss_mask, strict=True)
                        if m and v >= since]
                n, low, vsum = len(kept), min(kept, default=None), sum(kept)
            if n:
                num, total = num + n, total + vsum
                oldest = low if oldest is None else min(oldest, low)
        return KeptTokens(num_tokens=num, min_version=oldest, version_sum=total)

    # ---- verdicts --------------------------------------------------------------------------
    def sample_verdict(self, sample: Sample, step: int) -> Verdict:
        oldest = sample.min_version()
        if oldest is None:
            return _OK
        if age(step, oldest) > self.context_bound:
            return Verdict(ok=False, reason=self._too_old(step, oldest), spoils_group=True)
        kept = self.kept_tokens(sample, step)
        num_kept, oldest_kept = kept.num_tokens, kept.min_version
        if num_kept == 0:
            if self.max_token_age is None:  # nothing to train (no loss-masked token)
                return _OK
            return Verdict(ok=False, reason=(
                f"every token older than max_token_age {self.max_token_age} (trainer step "
                f"{step})"))
        assert oldest_kept is not None and age(step, oldest_kept) <= self.kept_bound, (
            "kept tokens are within max_token_age, or all tokens within H")
        return _OK

    def group_verdict(self, group: Group, step: int) -> Verdict:
        """Train the group at ``step``? Its graded samples decide (see module docstring)."""
        graded = [s for s in group.samples if s.reward is not None]
        verdicts = [self.sample_verdict(s, step) for s in graded]
        for v in verdicts:
            if v.spoils_group:
                return v
        if verdicts and not any(v.ok for v in verdicts):
            return verdicts[0]
        return _OK

    def live_verdict(self, group: Group, version: int) -> Verdict:
        """Can a group still generating under weights ``version`` ever be trained? Not when a
        token is already older than the context bound: every later step is later still."""
        oldest = group.min_version()
        if oldest is not None and age(version, oldest) > self.context_bound:
            return Verdict(ok=False, reason=self._too_old(version, oldest), spoils_group=True)
        return _OK

    def _too_old(self, step: int, oldest: int) -> str:
        if self.rule == "drop":
            return (f"staleness {age(step, oldest)} > max_staleness {self.max_staleness} (oldest "
                    f"token version {oldest}, trainer step {step})")
        return (f"context age {age(step, oldest)} > max_context_age {self.context_bound} (oldest "
                f"token version {oldest}, trainer step {step})")
