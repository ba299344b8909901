"""The page's headline numbers (its tiles), defined once for the report and the dashboard.

A finished run (its ``summary.json`` written) shows what the run did; a live run shows what
it is doing now, over its last :data:`WINDOW_STEPS` steps. Each tile says which (``scope``).

    tokens/s            generated tokens ÷ wall time. Run: summary.json's ``gen_tok_s``
                        (``generated_tokens`` ÷ ``train_wall_s``). Last N steps: the rollout
                        lines' ``gen_tok_s`` weighted by the seconds each covers.
    staleness           token-weighted mean age of the trained tokens, from the ledger: per
                        trained sample, Σ over the tokens the loss kept of (``trained_at_step``
                        − the token's version) = ``num_trained_tokens`` × ``trained_at_step``
                        − ``trained_version_sum``. Ledgers written before that field existed
                        count each kept token at its sample's oldest kept version
                        (``min_trained_version``: an upper bound, exact unless a sample's
                        tokens span versions).
    gen/trained tokens  Σ ``gen_tokens`` ÷ Σ ``trained_tokens`` of the train lines (the ratio
                        of the totals; per step it is ``gen_tokens_per_trained_token``).
    mixture error pp    mean of the train lines' ``mixture_error_pp`` over the steps.
    trained samples     ledger lines with status ``trained`` (run).
    replayed groups     Σ ``replayed_groups`` of the train lines (run).

`RunTotals` accumulates what these need as lines arrive (``RunLog`` feeds it), in memory
that does not grow with the run: running sums plus the last few steps' lines.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollstream.data.ledger_row import LedgerRow
from rollstream.trajectory import SampleStatus

WINDOW_STEPS = 10  # a live run's tiles cover its last this many steps


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass(slots=True, kw_only=True)
class _Sums:
    gen_tokens: float = 0.0
    trained_tokens: float = 0.0
    mixture_sum: float = 0.0
    mixture_n: int = 0

    def add(self, rec: Mapping[str, Any]) -> None:
        self.gen_tokens += _num(rec.get("gen_tokens")) or 0.0
        self.trained_tokens += _num(rec.get("trained_tokens")) or 0.0
        if (mix := _num(rec.get("mixture_error_pp"))) is not None:
            self.mixture_sum += mix
            self.mixture_n += 1


@dataclass(slots=True, kw_only=True)
class RunTotals:
    """Run-wide sums of the train lines and the trained tokens' ages, and the last steps'."""

    run: _Sums = field(default_factory=_Sums)
    replayed_groups: float = 0.0
    trained_tokens: int = 0  # ledger: Σ num_trained_tokens of trained samples
    token_age: int = 0  # ledger: Σ over kept tokens of (trained_at_step − version)
    recent_train: deque[dict[str, Any]] = field(
        default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    # one more than the window: the first line only marks where the window's time begins
    recent_rollout: deque[tuple[float, float]] = field(
        default_factory=lambda: deque(maxlen=WINDOW_STEPS + 1))  # (t_s, gen_tok_s)
    age_by_step: dict[int, list[int]] = field(default_factory=dict)  # step -> [tokens, age]

    def add_record(self, rec: Mapping[str, Any]) -> None:
        kind, step = rec.get("kind"), rec.get("step")
        if not isinstance(step, int):
            return
        if kind == "train":
            self.run.add(rec)
            self.replayed_groups += _num(rec.get("replayed_groups")) or 0.0
            self.recent_train.append({k: rec.get(k) for k in (
                "step", "gen_tokens", "trained_tokens", "mixture_error_pp")})
        elif kind == "rollout":
            t_s, rate = _num(rec.get("t_s")), _num(rec.get("gen_tok_s"))
            if t_s is not None and rate is not None:
                self.recent_rollout.append((t_s, rate))

    def add_ledger(self, row: LedgerRow) -> None:
        if row.status is not SampleStatus.TRAINED:
            return
        step, version = row.trained_at_step, row.trained_version
        # older ledgers lack num_trained_tokens: the response tokens
        tokens = row.num_trained_tokens if row.num_trained_tokens is not None else row.num_tokens
        if step is None or version is None:
            return
        version_sum = row.trained_version_sum
        if version_sum is None:  # older ledgers: all at the oldest kept version
            version_sum = tokens * version
        self.trained_tokens += tokens
        self.token_age += tokens * step - version_sum
        at = self.age_by_step.setdefault(step, [0, 0])
        at[0] += tokens
        at[1] += tokens * step - version_sum
        if len(self.age_by_step) > 2 * WINDOW_STEPS:  # keep the newest steps only
            for old in sorted(self.age_by_step)[:-WINDOW_STEPS]:
                del self.age_by_step[old]

    def tiles(self, summary: Mapping[str, Any] | None, *,
              trained_samples: int) -> list[dict[str, Any]]:
        """The tiles: ``{"key", "value" (a number or None), "scope"}`` each;
        ``trained_samples``: the ledger summary's count."""
        if summary is not None:
            scope, sums = "run", self.run
            tok_s = _num(summary.get("gen_tok_s"))
            age = _ratio(self.token_age, self.trained_tokens)
        else:
            window = list(self.recent_train)
            scope = (f"last {len(window)} steps" if len(window) > 1
                     else "last step" if window else "no step yet")
            sums = _Sums()
            for rec in window:
                sums.add(rec)
            tok_s = self._recent_tok_s()
            first = window[0]["step"] if window else 0
            recent = [v for s, v in self.age_by_step.items() if s >= first]
            age = _ratio(sum(a for _, a in recent), sum(n for n, _ in recent))
        return [
            {"key": "tokens/s", "value": tok_s, "scope": scope},
            {"key": "staleness", "value": age, "scope": scope},
            {"key": "gen/trained tokens", "value": _ratio(sums.gen_tokens, sums.trained_tokens),
             "scope": scope},
            {"key": "mixture error pp", "value": _ratio(sums.mixture_sum, sums.mixture_n),
             "scope": scope},
            {"key": "trained samples", "value": trained_samples, "scope": "run"},
            {"key": "replayed groups", "value": self.replayed_groups, "scope": "run"},
        ]

    def _recent_tok_s(self) -> float | None:
        lines = list(self.recent_rollout)
        if len(lines) == 1:
            return lines[0][1]
        span_s = lines[-1][0] - lines[0][0] if lines else 0.0
        if span_s <= 0:
            return None
        tokens = sum(rate * (t - prev) for (prev, _), (t, rate) in zip(lines, lines[1:]))
        return tokens / span_s


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None
