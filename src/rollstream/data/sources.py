"""Synthetic, verifiable task sources and the weighted mix that draws training tasks from them.

A ``TaskSource`` makes tasks, names the reward that grades them (sources do not grade: rewards
live in ``rollstream.reward``) and writes noisy demonstrations for the warm start. Every task
is a pure function of (tasks seed, source name, split, index), so a run can be resumed from
a cursor and two processes agree on task ``uid``\\ s (``tick/train/123``). Train and
eval are disjoint by construction: a prompt belongs to the eval split exactly when a CRC32 of
its text falls in one bucket of ``EVAL_BUCKETS``; each split redraws until the prompt lands on
its own side.

Dataset sources (kinds ``jsonl``, ``parquet``, ``hf_dataset``) live in
``rollstream.data.dataset``, reasoning-gym's generators in ``rollstream.data.reasoning_gym``
and the agent source in ``rollstream.agent.tally``; all build on this module, and ``rollstream.data.kinds`` builds every kind. :func:`check_source_paths`
checks that the datasets a tasks config names exist and can be opened, reading nothing and
needing no tokenizer, so a launcher can fail on a bad path before it touches the run
directory (``TaskMix`` runs it too). How sources are mixed is ``rollstream.data.mix``.

Families (the shapes follow LEARNABILITY.md: fixed-width items, the stop rule depends only on
the previous item, the information the next token needs is close to it):

* ``tick``    ``T517#07=`` -> ``517/07 518/06 ... 523/01``: count up, count the items left down.
* ``digits``  ``D4317=`` -> ``4317 4314 4311 4308 4305 4302``: the last two digits count down
  by 3, the first two are copied; the answer ends at the first item whose tail is below 3.
  Shorter items and a smaller Pareto scale than ``tick``: a shorter median and a relatively
  heavier tail (reference tokens p50/p99 at the default config: tick 34/223, digits 14/159).
* ``math``    ``12+7*3=`` -> ``33``: + - * with the usual precedence, graded by
  ``math_answer`` (a final value only, equal by math-verify).
* ``tally``   an agent episode (``rollstream.agent.tally``): sum labelled numbers with a
  calculator tool, one call per item; its tasks name the ``agent`` harness.

The number of items is ``min(max_items, int(scale * Pareto(alpha)))``, a long tail capped by
``SourceConfig.max_items``; it is a generated task's difficulty bucket (:class:`Bucketed`, for
pass-rate-aware sampling: ``n07``). Each source's ``reward`` is ``SourceConfig.reward`` when set, else
its kind's: ``math_answer`` for math, ``exact_match`` (the exact answer, properly ended) for
the others.

Simplifications: no natural-language tasks; math has no parentheses or division.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from rollstream.config.schema import SourceConfig, TasksConfig
from rollstream.trajectory import Task

Split = Literal["train", "eval"]
_SPLITS = ("train", "eval")
EVAL_BUCKETS = 8  # 1 in 8 prompts is held out for evaluation
_TICK_SCALE = 3.0
_DIGITS_SCALE = 2.0
_DIGITS_STEP = 3
_MATH_MAX_OPS = 4
_MATH_MAX_OPERAND = 20


class PromptTokenizer(Protocol):
    """The part of a Hugging Face tokenizer the sources use."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class TaskSource(Protocol):
    """A family of verifiable tasks."""

    name: str
    reward: str  # the registered reward (or import path) that grades this source's tasks

    def task(self, index: int, split: Split) -> Task:
        """The ``index``-th task of ``split``; deterministic; train and eval prompts differ."""
        ...

    def num_tasks(self, split: Split) -> int | None:
        """How many distinct tasks ``split`` holds (None: a generator without end)."""
        ...

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> str | list[dict]:
        """An answer for supervised warm start (no eos), wrong with a rate set by ``noise``;
        an agent source's: the conversation's turns after its opening (chat messages)."""
        ...


@runtime_checkable
class Bucketed(Protocol):
    """A generated source that can say how hard a task is: its tasks never recur, so
    pass rates are tracked per difficulty bucket (``rollstream.data.pass_rates``)."""

    def difficulty(self, task: Task) -> str:
        """The task's bucket (``n07``: seven items); a pure function of the task."""
        ...


def split_of(prompt_text: str) -> Split:
    """Which split a prompt belongs to (a pure function of the text)."""
    return "eval" if zlib.crc32(prompt_text.encode()) % EVAL_BUCKETS == 0 else "train"


def pareto_items(rng: random.Random, alpha: float, scale: float, cap: int) -> int:
    """A long-tailed item count in ``[1, cap]``."""
    return max(1, min(cap, int(scale * rng.paretovariate(alpha))))


@dataclass(slots=True, kw_only=True)
class _Synthetic:
    """Shared plumbing: seeded drawing, split rejection, tokenising, the reward's name."""

    name: str
    cfg: SourceConfig
    tokenizer: PromptTokenizer
    seed: int
    reward: str = field(init=False)

    def __post_init__(self) -> None:
        self.reward = reward_name(self.cfg)

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        """(prompt text, reference answer)."""
        raise NotImplementedError

    def task(self, index: int, split: Split) -> Task:
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if index < 0:
            raise ValueError(f"task index must be >= 0, got {index}")
        rng = random.Random(f"{self.seed}/{self.name}/{split}/{index}")
        while True:
            prompt, reference = self._draw(rng)
            if split_of(prompt) == split:
                break
        return Task(
            uid=f"{self.name}/{split}/{index}",
            source=self.name,
            prompt_ids=tuple(self.tokenizer.encode(prompt, add_special_tokens=False)),
            prompt_text=prompt,
            reference=reference,
        )

    def num_tasks(self, split: Split) -> None:
        return None

    def _parse(self, pattern: re.Pattern[str], task: Task) -> re.Match[str]:
        m = pattern.fullmatch(task.prompt_text)
        if m is None:
            raise ValueError(f"task {task.uid} is not a {self.name!r} prompt: {task.prompt_text!r}")
        return m


_TICK_PROMPT = re.compile(r"T(\d{3})#(\d{2})=")


@dataclass(slots=True, kw_only=True)
class TickSource(_Synthetic):
    """Count up from a 3-digit number while counting the items left down to 01."""

    def __post_init__(self) -> None:
        _Synthetic.__post_init__(self)
        if self.cfg.max_items > 99:
            raise ValueError(
                f"tick: max_items must be <= 99 (2-digit counter), got {self.cfg.max_items}"
            )

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        n = pareto_items(rng, self.cfg.pareto_alpha, _TICK_SCALE, self.cfg.max_items)
        # room for a demonstration that slips +1 on every step
        start = rng.randint(100, 999 - 2 * self.cfg.max_items)
        return f"T{start:03d}#{n:02d}=", _tick_items(start, n, rng=None, noise=0.0)

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> str:
        m = self._parse(_TICK_PROMPT, task)
        return _tick_items(int(m[1]), int(m[2]), rng=rng, noise=noise)

    def difficulty(self, task: Task) -> str:
        return f"n{int(self._parse(_TICK_PROMPT, task)[2]):02d}"


def _tick_items(start: int, n: int, *, rng: random.Random | None, noise: float) -> str:
    items, x = [], start
    for left in range(n, 0, -1):
        items.append(f"{x:03d}/{left:02d}")
        step = 1
        if rng is not None and rng.random() < noise:
            step += rng.choice((-1, 1))  # later items count on from the slipped value
        x += step
    return " ".join(items)


@dataclass(slots=True, kw_only=True)
class DigitsSource(_Synthetic):
    """Count the tail of a fixed-width number down by 3; the head is copied unchanged."""

    tail_width: int = field(init=False)
    _prompt_re: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        _Synthetic.__post_init__(self)
        self.tail_width = max(2, len(str(_DIGITS_STEP * self.cfg.max_items - 1)))
        self._prompt_re = re.compile(rf"D(\d{{2}})(\d{{{self.tail_width}}})=")

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        n = pareto_items(rng, self.cfg.pareto_alpha, _DIGITS_SCALE, self.cfg.max_items)
        head = rng.randint(10, 99)
        tail = _DIGITS_STEP * (n - 1) + rng.randrange(_DIGITS_STEP)
        prompt = f"D{head:02d}{tail:0{self.tail_width}d}="
        return prompt, self._items(head, tail, rng=None, noise=0.0)

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> str:
        m = self._parse(self._prompt_re, task)
        return self._items(int(m[1]), int(m[2]), rng=rng, noise=noise)

    def difficulty(self, task: Task) -> str:
        tail = int(self._parse(self._prompt_re, task)[2])
        return f"n{tail // _DIGITS_STEP + 1:02d}"

    def _items(self, head: int, tail: int, *, rng: random.Random | None, noise: float) -> str:
        items = [f"{head:02d}{tail:0{self.tail_width}d}"]
        while tail >= _DIGITS_STEP:  # the stop rule looks only at the previous item
            step = _DIGITS_STEP
            if rng is not None and rng.random() < noise:
                step += rng.choice((-1, 1))
            tail -= step if tail - step >= 0 else _DIGITS_STEP
            items.append(f"{head:02d}{tail:0{self.tail_width}d}")
        return " ".join(items)


_MATH_PROMPT = re.compile(r"(\d+(?:[+*-]\d+)+)=")


@dataclass(slots=True, kw_only=True)
class MathSource(_Synthetic):
    """Small integer arithmetic, graded by ``math_answer`` (a properly ended final value)."""

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        num_ops = pareto_items(
            rng, self.cfg.pareto_alpha, 1.0, min(self.cfg.max_items, _MATH_MAX_OPS)
        )
        operands = [rng.randint(1, _MATH_MAX_OPERAND) for _ in range(num_ops + 1)]
        ops = [rng.choice("+-*") for _ in range(num_ops)]
        expr = str(operands[0]) + "".join(f"{o}{v}" for o, v in zip(ops, operands[1:], strict=True))
        return f"{expr}=", str(_evaluate(operands, ops))

    def difficulty(self, task: Task) -> str:
        expr = self._parse(_MATH_PROMPT, task)[1]
        return f"n{sum(expr.count(op) for op in '+-*'):02d}"  # operators: no negative operand

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> str:
        self._parse(_MATH_PROMPT, task)
        if rng.random() < noise:
            return str(int(task.reference) + rng.choice((-1, 1)))
        return task.reference


def _evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """+ - * with the usual precedence, without eval()."""
    terms, signs, cur = [], [1], operands[0]
    for op, v in zip(ops, operands[1:], strict=True):
        if op == "*":
            cur *= v
        else:
            terms.append(cur)
            signs.append(1 if op == "+" else -1)
            cur = v
    terms.append(cur)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


@dataclass(slots=True, kw_only=True)
class FiniteSource:
    """A source of tasks all made at start, split by the hash of their prompts (datasets,
    reasoning-gym's generators): training cycles through the train tasks in order, held-out
    tasks come only from the eval ones. Rows that could not be tasks are in ``rejected`` as
    (task uid, source, reason), for the ledger."""

    name: str
    cfg: SourceConfig
    tokenizer: PromptTokenizer
    seed: int
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
    reward: str = field(init=False)
    _rows: dict[str, list[Task]] = field(default_factory=lambda: {"train": [], "eval": []})

    def task(self, index: int, split: Split) -> Task:
        if split not in self._rows:
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rows = self._rows[split]
        if not rows:  # only eval can be empty; held-out tasks never come from train rows
            raise ValueError(f"tasks source {self.name!r} has no held-out rows")
        return rows[index % len(rows)]

    def num_tasks(self, split: Split) -> int:
        return len(self._rows[split])

    def demonstration(self, task: Task, rng: random.Random, noise: float) -> str:
        return task.reference


SYNTHETIC_KINDS: dict[str, type[_Synthetic]] = {
    "tick": TickSource,
    "digits": DigitsSource,
    "math": MathSource,
}


# the other kinds: exact_match; reasoning_gym: the generator's own scorer
_KIND_REWARDS = {"math": "math_answer", "reasoning_gym": "reasoning_gym"}


def reward_name(cfg: SourceConfig) -> str:
    """The reward that grades a source's tasks: its ``reward``, else its kind's."""
    return cfg.reward or _KIND_REWARDS.get(cfg.kind, "exact_match")


def source_rewards(cfg: TasksConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Source name -> (reward name, the keyword arguments its tasks pass it from dataset
    columns), from the config alone (no tokenizer, no dataset read), for
    ``rollstream.reward.build_resolver``: a run resolves its rewards before any other work.
    (A verifiers environment's source is graded by its rubric, which the run passes as the
    source's reward object: ``agent.verifiers_env.with_rubrics``.)"""
    return {s.source_name: (reward_name(s), tuple(s.reward_kwarg_columns))
            for s in cfg.sources}


def path_problem(path: str) -> str | None:
    """Why the dataset file ``path`` cannot be read, or None. Opens it; reads nothing."""
    p = Path(path)
    if not p.exists():
        return f"dataset file {path!r} does not exist (looked for {p.absolute()})"
    if p.is_dir():
        return f"dataset file {path!r} is a folder, not a file"
    if not p.is_file():
        return f"dataset file {path!r} is not a regular file"
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        return f"dataset file {path!r} cannot be read: {e.strerror}"
    return None


def dataset_problem(cfg: SourceConfig) -> str | None:
    """Why a dataset source's ``path`` cannot be read, or None: a ``jsonl`` or ``parquet``
    file that can be opened, an ``hf_dataset`` folder written by ``Dataset.save_to_disk``."""
    path = dataset_path(cfg)
    if cfg.kind == "hf_dataset":
        from rollstream.data.tables import saved_dataset_problem

        return saved_dataset_problem(path)
    return path_problem(str(path))


def dataset_path(cfg: SourceConfig) -> Path:
    """A dataset source's ``path``, ``~`` expanded (verl's examples write ``~/data/...``)."""
    assert cfg.path is not None, "SourceConfig: a dataset kind requires path"
    return Path(cfg.path).expanduser()


def check_source_paths(cfg: TasksConfig) -> None:
    """Raise ValueError naming ``tasks.sources.N.path`` for a dataset that is missing or
    unreadable, or ``tasks.sources.N.reasoning_gym.dataset`` / ``.options`` for a generator
    reasoning-gym does not have or that refuses its options. Cheap and tokenizer-free (opens
    files, generates nothing): call it before touching the run directory."""
    for i, src in enumerate(cfg.sources):
        problem = dataset_problem(src) if src.reads_dataset else None
        if problem is not None:
            raise ValueError(f"tasks.sources.{i}.path: {problem}")
        if src.kind == "reasoning_gym":
            from rollstream.data.generators import source_problem

            found = source_problem(src, cfg.seed)
            if found is not None:
                raise ValueError(f"tasks.sources.{i}.reasoning_gym.{found[0]} "
                                 f"({src.source_name!r}): {found[1]}")
