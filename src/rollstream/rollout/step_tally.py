"""What the generation of a step became: its waste and the length bias of what trained.

The rollout reports each group twice: when its generation is over (:meth:`StepTally.ended`)
and when it is resolved, trained or retired (:meth:`StepTally.resolved`); :meth:`read` returns
the step's numbers since the previous read and starts the next step.

* ``gen_tokens_per_trained_token`` = ``gen_tokens`` ÷ ``trained_tokens``: policy tokens of
  every group whose generation ended in the step (trained, filtered, dropped stale, failed,
  cancelled part-way: all the generation spent) ÷ policy tokens of the samples trained in the
  step. 1 is no waste; a group filtered for zero variance is all waste.
* ``length_bias``: mean response length of the samples trained in the step ÷ mean response
  length of every sample of the groups resolved in the step except groups filtered for zero
  variance (those never were candidates), dropped-stale, failed and aborted samples included.
  Below 1: training sees shorter responses than the rollout made for it. What keeps it near 1
  is that a group is trained only whole: it enters the buffer when its last sample is graded,
  so early returns cannot fill a batch ahead of their long siblings; what can tilt it is
  whole groups or single samples dropped for staleness (long ones are older). A sample
  cancelled part-way counts with the tokens it had, a lower bound of its length, so the
  measure can understate such a tilt, not invent one; samples that never started count not.
* ``early_stopped_groups`` / ``early_stopped_samples`` / ``early_stopped_lost_groups``
  (``rollout.early_stop``): groups cancelled as likely zero variance (filtered as such: not
  candidates of the length bias), their samples cancelled before grading, and the sum of each
  one's measured chance of having trained.
* ``replayed_groups`` / ``replayed_tokens`` (``rollout.replay``): groups of the step that were
  replays, and the policy tokens of their samples the loss kept. Replayed tokens count in
  ``trained_tokens`` (they were trained; reusing generation is what replay is for), not in
  ``length_bias`` (a replay is no candidate of the step's generation).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollstream.trajectory import Group, Sample, SampleStatus, SegmentKind


def policy_tokens(sample: Sample) -> int:
    """Tokens the policy generated for ``sample`` (an agent's environment tokens excluded)."""
    return sum(len(seg) for seg in sample.segments if seg.kind is SegmentKind.POLICY)


@dataclass(slots=True)
class StepTally:
    gen_tokens: int = 0
    trained_tokens: int = 0
    trained_len: int = 0  # response tokens of trained samples
    num_trained: int = 0
    candidate_len: int = 0  # response tokens of the resolved groups' samples (not zero variance)
    num_candidates: int = 0
    replayed_groups: int = 0
    replayed_tokens: int = 0
    stopped_groups: int = 0  # rollout.early_stop
    stopped_lost: float = 0.0  # sum of 1 - P over the stopped groups
    stopped_samples: int = 0  # samples of stopped groups cancelled before they were graded

    def ended(self, group: Group) -> None:
        """``group``'s generation is over (whatever becomes of it)."""
        self.gen_tokens += sum(policy_tokens(s) for s in group.samples)

    def resolved(self, group: Group, *, zero_variance: bool) -> None:
        """``group`` trained (its samples' statuses say which) or was retired."""
        if zero_variance:
            return
        for s in group.samples:
            if s.num_response_tokens == 0 and s.status is not SampleStatus.TRAINED:
                continue  # never started: no length to count
            self.candidate_len += s.num_response_tokens
            self.num_candidates += 1
            if s.status is SampleStatus.TRAINED:
                self.trained_len += s.num_response_tokens
                self.num_trained += 1
                self.trained_tokens += policy_tokens(s)

    def stopped_early(self, group: Group, chance: float) -> None:
        """``group`` was stopped early (``rollout.early_stop``); ``chance``: predicted, that
        its cancelled samples would have agreed with its graded ones."""
        self.stopped_groups += 1
        self.stopped_lost += 1.0 - chance
        self.stopped_samples += sum(not s.status.is_terminal() and s.status is not
                                    SampleStatus.GRADED for s in group.samples)

    def replayed(self, samples: list[Sample]) -> None:
        """A replayed group trained again; ``samples``: those the loss kept tokens of."""
        self.replayed_groups += 1
        tokens = sum(policy_tokens(s) for s in samples)
        self.replayed_tokens += tokens
        self.trained_tokens += tokens

    def read(self) -> dict[str, float]:
        """The step's numbers (a ratio is left out when its denominator is 0); then reset."""
        out = {"gen_tokens": float(self.gen_tokens), "trained_tokens": float(self.trained_tokens),
               "replayed_groups": float(self.replayed_groups),
               "replayed_tokens": float(self.replayed_tokens)}
        if self.stopped_groups:
            out |= {"early_stopped_groups": float(self.stopped_groups),
                    "early_stopped_lost_groups": self.stopped_lost,
                    "early_stopped_samples": float(self.stopped_samples)}
        if self.trained_tokens:
            out["gen_tokens_per_trained_token"] = self.gen_tokens / self.trained_tokens
        if self.num_trained and self.candidate_len:
            out["length_bias"] = ((self.trained_len / self.num_trained)
                                  / (self.candidate_len / self.num_candidates))
        for name in self.__slots__:
            setattr(self, name, 0)
        return out
