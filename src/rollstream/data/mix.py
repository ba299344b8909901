"""The task mix: which source, and which of its tasks, the next training group comes from.

``TaskMix.next_task`` picks a source by ``tasks.mix`` and takes that source's next task
(pass-rate-aware with ``tasks.pass_rate``, :mod:`rollstream.data.pass_rates`). The rollout
tells the mix what became of every group it admitted (:meth:`TaskMix.ended`: generation is
over, with its rewards; :meth:`TaskMix.resolved`: trained, with how many samples, or retired),
which the quota, the in-flight caps and the pass rates need.

**quota** (the default), deficit-corrected. Per source ``s`` with target share ``w_s`` (the
weights normalised), count the samples it had trained, ``T_s``, and expect from its groups not
yet resolved::

    E_s = T_s + waiting_s * g + generating_s * y_s
    y_s = (T_s + g) / (resolved_s + 1)       trained samples per resolved group, a prior of
                                             one group trained whole
    deficit_s = w_s * sum_r E_r - E_s

where ``waiting_s`` are groups graded and not yet trained (they train whole, bar a stale
drop), ``generating_s`` groups still generating, ``g`` the group size. The next group comes
from the source with the largest deficit (ties: the first in the config). Counting the
expected yield of groups in flight keeps an async rollout, with several steps of groups in
flight, from overshooting a source that is behind; the yield measured online is what
corrects for different lengths and pass rates. Without feedback (warm start, benchmarks)
nothing resolves and the rule is a smooth weighted round robin. ``max_oversample`` bounds
the correction: source ``s`` is not drawn while its drawn groups are at ``max_oversample *
w_s`` of all draws, so a source that never trains cannot take the rollout (its trained
share falls short instead, and ``mixture_error_pp`` shows it).

**weighted**: draw ``k`` picks a source with a generator seeded by (seed, k), with
probability proportional to weight, as before feedback existed: the draw mixture is the
weights, the trained mixture drifts toward the sources whose groups are filtered less.

Caps, in both rules: a source with ``max_in_flight`` groups generating is passed over, and so
is a dataset row with ``max_in_flight_per_task``; when nothing can be drawn ``next_task``
returns None and the rollout waits for a group to end.

Weights and caps may change between steps (:meth:`TaskMix.reweight`, called by
``runtime.reconfigure``): a new cap holds for the next draws (groups in flight above it are
not taken back), and new weights restart the quota's count, so the samples trained from then
on follow them (``mix_share`` counts from the change too).

``state()`` is the whole cursor and the counters (JSON); an older state without the counters
restores with them at zero. After a resume the draws depend on the feedback, which need not
repeat the lost process's: a group the ledger already retired is skipped only when the same
task comes at the same admission index again (``durable.resume``); otherwise the task is
simply drawn afresh.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from rollstream.config.schema import SourceConfig, TasksConfig
from rollstream.config.tasks import PassRateConfig
from rollstream.data.kinds import build_source
from rollstream.data.pass_rates import PassRates
from rollstream.data.sources import (
    EVAL_BUCKETS,
    Bucketed,
    PromptTokenizer,
    TaskSource,
    check_source_paths,
)
from rollstream.trajectory import Group, Task

_MAX_OFFERS = 1_000_000  # a generated source's offers for one draw: never near (module doc)


@dataclass(slots=True)
class _Counts:
    """One source's groups (and trained samples) by where they are."""

    drawn: int = 0  # groups drawn since the run began
    generating: int = 0  # drawn, generation not over
    pending: int = 0  # drawn, not resolved (generating, or graded and waiting for the trainer)
    resolved: int = 0  # trained or retired
    trained: int = 0  # samples trained


def demonstration_config(cfg: TasksConfig) -> TasksConfig:
    """``cfg`` for a consumer that reports nothing back (the warm start's demonstrations):
    drawn by weight, without caps or pass rates; nothing trains there, so no trained
    mixture needs correcting."""
    plain = SourceConfig()
    unset = {k: getattr(plain, k)
             for k in ("max_oversample", "max_in_flight", "max_in_flight_per_task")}
    sources = tuple(s.model_copy(update=unset) for s in cfg.sources)
    return cfg.model_copy(update={"mix": "weighted", "sources": sources,
                                  "pass_rate": PassRateConfig()})


FIT_ROWS = 1000  # training prompts per source that check_fits tokenizes (a bound on its cost)


class TaskMix:
    """Training tasks drawn from the sources as ``tasks.mix`` says, held-out tasks round-robin.

    Held-out tasks come only from held-out rows: a source without any is left out of the
    held-out set, with a warning in :meth:`warnings` (the data layer prints nothing).
    """

    def __init__(self, cfg: TasksConfig, tokenizer: PromptTokenizer) -> None:
        if not cfg.sources:
            raise ValueError("tasks.sources is empty: configure at least one source")
        check_source_paths(cfg)
        names = [s.source_name for s in cfg.sources]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(
                f"tasks.sources: more than one source is named {dups}; give each a distinct `name`"
            )
        self._cfg = cfg
        self._sources = {
            n: build_source(s, tokenizer, cfg.seed) for n, s in zip(names, cfg.sources, strict=True)
        }
        self._names = names
        self._set_sources(cfg.sources)
        self._num_drawn = 0
        self._next_index = dict.fromkeys(names, 0)
        self._counts = {n: _Counts() for n in names}
        # (groups drawn, samples trained) per source, and draws in all, when the weights last
        # changed: the quota and the trained mixture count from there (reweight)
        self._since: dict[str, tuple[int, int]] = {n: (0, 0) for n in names}
        self._num_drawn_since = 0
        self._group_size = 0  # samples per group, from the feedback
        self._task_live: dict[str, int] = {}  # task uid -> groups generating (capped sources)
        self._rates = PassRates(cfg.pass_rate, cfg.seed) if cfg.pass_rate.enabled else None
        self._held_out = [n for n in names if self._sources[n].num_tasks("eval") != 0]
        self._warnings = [] if cfg.num_eval == 0 else self._held_out_warnings()

    def _held_out_warnings(self) -> list[str]:
        warnings = [
            f"tasks source {n!r} ({s.path}) has no held-out rows: all its "
            f"{self._sources[n].num_tasks('train')} usable rows fall in the training split (a "
            f"hash of the prompt holds out 1 in {EVAL_BUCKETS}), so the held-out reward will "
            "not include it"
            for n, s in zip(self._names, self._cfg.sources, strict=True)
            if n not in self._held_out
        ]
        if not self._held_out:
            warnings.append("no task source has held-out tasks: the held-out reward is not "
                            "measured")
        return warnings

    def _set_sources(self, sources: tuple[SourceConfig, ...]) -> None:
        total = sum(s.weight for s in sources)
        self._target = {n: s.weight / total for n, s in zip(self._names, sources, strict=True)}
        self._src_cfg = dict(zip(self._names, sources, strict=True))

    def reweight(self, sources: tuple[SourceConfig, ...]) -> None:
        """New weights and caps of the same sources (a reconfiguration, between steps; the
        datasets and their order stay). New weights hold for the samples trained from now on:
        the quota and ``mix_share`` count from here, groups already in flight included."""
        names = [s.source_name for s in sources]
        if names != self._names:
            raise ValueError(f"reweight: sources {names} are not this mix's {self._names}")
        old = [self._src_cfg[n].weight for n in self._names]
        self._set_sources(sources)
        if old != [s.weight for s in sources]:
            self._since = {n: (c.drawn, c.trained) for n, c in self._counts.items()}
            self._num_drawn_since = self._num_drawn

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def source(self, name: str) -> TaskSource:
        if name not in self._sources:
            raise ValueError(f"unknown task source {name!r}; this mix has {self._names}")
        return self._sources[name]

    def check_fits(self, setting: str, max_tokens: int) -> None:
        """A ValueError naming the source when none of its first ``FIT_ROWS`` training
        prompts fits an engine context of ``max_tokens`` (``setting``): prompt + one new
        token. Such a source would only ever fail its samples."""
        for i, name in enumerate(self._names):
            src = self._sources[name]
            num = src.num_tasks("train")
            count = FIT_ROWS if num is None else min(num, FIT_ROWS)
            shortest = min((len(src.task(k, "train").prompt_ids) for k in range(count)),
                           default=0)
            if count and shortest >= max_tokens:
                raise ValueError(
                    f"tasks.sources.{i} ({name!r}): none of its first {count} training prompts "
                    f"fits the context: the shortest is {shortest} tokens and {setting} = "
                    f"{max_tokens} holds a prompt of at most {max_tokens - 1} (plus one new "
                    f"token); raise {setting} or shorten the prompts")

    # ---- drawing -----------------------------------------------------------------------
    def next_task(self) -> Task | None:
        """The next training task; None when every source is at an in-flight cap (a mix
        without caps never returns None)."""
        for name in self._choices():
            task = self._take(name)
            if task is None:
                continue
            c = self._counts[name]
            c.drawn += 1
            c.generating += 1
            c.pending += 1
            self._num_drawn += 1
            if self._src_cfg[name].reads_dataset:  # counted uncapped too: a cap may come
                self._task_live[task.uid] = self._task_live.get(task.uid, 0) + 1
            return task
        return None

    def _choices(self) -> Iterator[str]:
        """Sources to try, best first, among those not at their caps."""
        open_ = [n for n in self._names
                 if (cap := self._src_cfg[n].max_in_flight) is None
                 or self._counts[n].generating < cap]
        if self._cfg.mix == "weighted":
            rng = random.Random(f"{self._cfg.seed}/mix/{self._num_drawn}")
            while open_:
                name = rng.choices(open_, weights=[self._src_cfg[n].weight for n in open_])[0]
                yield name
                open_.remove(name)
            return
        bound = self._num_drawn - self._num_drawn_since + 1
        open_ = [n for n in open_ if self._counts[n].drawn - self._since[n][0]
                 < self._src_cfg[n].max_oversample * self._target[n] * bound]
        expected = {n: self._expected(n) for n in open_}
        everything = sum(self._expected(n) for n in self._names)
        deficit = {n: self._target[n] * everything - expected[n] for n in open_}
        yield from sorted(open_, key=lambda n: -deficit[n])  # stable: ties keep config order

    def _expected(self, name: str) -> float:
        """Trained samples the source has, and expects from its groups not yet resolved."""
        c, g = self._counts[name], max(self._group_size, 1)
        per_group = (c.trained + g) / (c.resolved + 1)
        waiting = max(0, c.pending - c.generating)  # an older state's groups are not counted
        return c.trained - self._since[name][1] + waiting * g + c.generating * per_group

    def _take(self, name: str) -> Task | None:
        """The source's next task in order that is not at its cap and that the pass rates
        take (None: every row is at its cap)."""
        src, cap = self._sources[name], self._src_cfg[name].max_in_flight_per_task
        size = src.num_tasks("train")
        if cap is not None and size is not None:
            at_cap = sum(1 for uid, n in self._task_live.items()
                         if n >= cap and self._is_of(uid, name))
            if at_cap >= size:
                return None
        floor = self._rates.cfg.floor if self._rates is not None else 1.0
        limit = _MAX_OFFERS if size is None else size * (int(1 / floor) + 2)
        for _ in range(limit):
            index = self._next_index[name]
            self._next_index[name] = index + 1
            task = src.task(index, "train")
            if cap is not None and self._task_live.get(task.uid, 0) >= cap:
                continue
            key = self._key(name, task)
            if key is None or self._rates is None or self._rates.accept(name, key):
                return task
        raise AssertionError(f"task source {name!r}: no task taken in {limit} offers")

    def _is_of(self, uid: str, name: str) -> bool:
        return uid.startswith(f"{name}/")

    def _key(self, name: str, task: Task) -> str | None:
        """What a pass rate is kept for: the task itself in a finite set, a difficulty bucket
        of a generated source, None (drawn in order) for a generator without buckets."""
        src = self._sources[name]
        if src.num_tasks("train") is not None:
            return task.uid
        return src.difficulty(task) if isinstance(src, Bucketed) else None

    # ---- feedback from the rollout -------------------------------------------------------
    def ended(self, group: Group, rewards: list[float] | None) -> None:
        """``group``'s generation is over; ``rewards``: those of its baseline (None: it was
        cancelled, which says nothing of its task)."""
        name, uid = group.task.source, group.task.uid
        c = self._counts[name]
        c.generating = max(0, c.generating - 1)  # an older state did not count it
        if uid in self._task_live:
            self._task_live[uid] -= 1
            if self._task_live[uid] <= 0:
                del self._task_live[uid]
        self._group_size = len(group.samples)
        if rewards is not None and self._rates is not None:
            key = self._key(name, group.task)
            if key is not None:
                self._rates.observe(name, key, rewards, len(group.samples))

    def resolved(self, group: Group, num_trained: int) -> None:
        """``group`` will not change: ``num_trained`` of its samples were trained (0: it was
        filtered, dropped or aborted)."""
        c = self._counts[group.task.source]
        c.pending = max(0, c.pending - 1)
        c.resolved += 1
        c.trained += num_trained

    def metrics(self) -> dict[str, float]:
        """The trained mixture since the run began (since the weights last changed):
        ``mix_share/<source>`` and ``mixture_error_pp`` (the largest |share - target| over the
        sources, in percentage points); ``pass_rate_tracked/<source>`` with pass-rate
        sampling."""
        out: dict[str, float] = {}
        trained = {n: c.trained - self._since[n][1] for n, c in self._counts.items()}
        total = sum(trained.values())
        if total:
            shares = {n: trained[n] / total for n in self._names}
            out.update({f"mix_share/{n}": v for n, v in shares.items()})
            out["mixture_error_pp"] = 100 * max(abs(shares[n] - self._target[n])
                                                for n in self._names)
        if self._rates is not None:
            for n in self._names:
                if (rate := self._rates.rate(n)) is not None:
                    out[f"pass_rate_tracked/{n}"] = rate
        return out

    # ---- held-out tasks, problems ------------------------------------------------------
    def eval_tasks(self) -> list[Task]:
        """Up to ``num_eval`` held-out tasks, round-robin over the sources that have any; a
        small dataset yields each held-out row once; empty when no source has held-out rows."""
        tasks = []
        for i in range(self._cfg.num_eval if self._held_out else 0):
            src = self._sources[self._held_out[i % len(self._held_out)]]
            index, size = i // len(self._held_out), src.num_tasks("eval")
            if size is None or index < size:
                tasks.append(src.task(index, "eval"))
        return tasks

    def rejected(self) -> list[tuple[str, str, str]]:
        """(task uid, source, reason) of every dataset row a source could not use; the reason
        names the file and line."""
        return [r for src in self._sources.values() for r in getattr(src, "rejected", [])]

    def warnings(self) -> list[str]:
        """Problems with the tasks that do not stop a run (a source without held-out rows),
        for the runtime to print and record."""
        return list(self._warnings)

    # ---- durable state -----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The cursor (tasks drawn, the next row of every source), the counters and the pass
        rates, as JSON (a copy)."""
        state: dict[str, Any] = {
            "num_drawn": self._num_drawn, "next_index": dict(self._next_index),
            "counts": {n: asdict(c) for n, c in self._counts.items()},
            "group_size": self._group_size, "task_live": dict(self._task_live),
            "since": {n: list(v) for n, v in self._since.items()},
            "num_drawn_since": self._num_drawn_since,
        }
        if self._rates is not None:
            state["pass_rates"] = self._rates.state()
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state`; keys an older state lacks start at zero."""
        next_index = state.get("next_index")
        if not isinstance(next_index, dict) or set(next_index) != set(self._names):
            raise ValueError(
                f"task mix state names sources {sorted(next_index or {})}, "
                f"this mix has {sorted(self._names)}"
            )
        self._num_drawn = int(state["num_drawn"])
        self._next_index = {n: int(next_index[n]) for n in self._names}
        counts = state.get("counts", {})
        self._counts = {n: _Counts(**counts.get(n, {})) for n in self._names}
        self._group_size = int(state.get("group_size", 0))
        self._task_live = {uid: int(v) for uid, v in state.get("task_live", {}).items()}
        since = state.get("since", {})
        self._since = {n: (int(since[n][0]), int(since[n][1])) if n in since else (0, 0)
                       for n in self._names}
        self._num_drawn_since = int(state.get("num_drawn_since", 0))
        if self._rates is not None:
            self._rates.restore(state.get("pass_rates", {}))
