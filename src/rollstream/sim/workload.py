"""The simulated workload: tasks with a difficulty and a pass rate, and each sample's outcome.

Generator (WORKLOADS.md, "Length distributions"): a prompt's difficulty ``d ~ LogNormal(mu,
sigma_prompt)``; a sample's response length ``L = d * LogNormal(0, sigma_within)``, capped by
the sampling limit (``sigma_within < sigma_prompt`` makes lengths within a group correlated);
the prompt's pass rate ``p ~ Beta`` with the configured mean and concentration, and each
sample is correct with probability ``p`` (a capped sample is wrong). ``mu`` is solved so that
the mean of the *capped* length equals ``mean_response_tokens``.

**Length drift over steps** (WORKLOADS.md: "lengths grow and drift during training", "mu
drifting upward over steps"): with ``length_drift_per_step = g`` the policy at weight version
``v`` writes responses ``(1 + g) ** v`` times as long as at version 0 (the log-normal's median
moves, its spread does not; the cap stays, so more samples reach it as lengths grow). A
sample's length is drawn once, at its first request, with the version of the engine serving
that request: an interrupted sample resumes to the same length whatever version continues it
(a simplification: a real policy would change course with new weights).

A sample's outcome is a function of its task and of the request's seed, which the real
dispatcher derives from the run seed and the sample uid (``dispatcher.sample_seed``, the same
on every attempt): a sample interrupted and resumed, on any engine, still ends at the same
length with the same answer.

Tokens: one simulated token stands for ``token_block`` real tokens (lengths are rounded up to
whole blocks), so the real components' per-token bookkeeping stays affordable at cluster
scale. A prompt is ``(TASK_TOKEN_OFFSET + task index, TOKEN, ...)``; response tokens are
``TOKEN`` except the stop token that ends a finished sample: ``CORRECT`` or ``WRONG``, which
:func:`sim_reward` reads. :meth:`Workload.outcome` names the tokens a finished request ends
with (its *tail*): the engine writes them at the end of the response (``sim/agentic.py`` has
longer tails: a tool call and the end-of-turn token).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from rollstream.sim.scenario import WorkloadConfig
from rollstream.trajectory import Task

TOKEN, CORRECT, WRONG = 1, 2, 3
TASK_TOKEN_OFFSET = 16
SOURCE = "sim"
_N = NormalDist()
_ENDS = ((WRONG,), (CORRECT,))  # a single-turn sample's tail, by whether it is correct


@dataclass(slots=True, frozen=True)
class TaskSpec:
    index: int
    difficulty_tokens: float  # the prompt's median response length, real tokens
    pass_rate: float


def capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X ~ LogNormal(mu, sigma)."""
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * _N.cdf(z - sigma) + cap * (1 - _N.cdf(z))


def solve_mu(mean: float, sigma: float, cap: float) -> float:
    """The ``mu`` whose capped log-normal has this mean (bisection; the mean rises with mu)."""
    if not 0 < mean < cap:
        raise ValueError(f"workload.mean_response_tokens must be in (0, max_response_tokens = "
                         f"{cap:g}), got {mean:g}")
    lo, hi = math.log(mean) - 10 * sigma - 10, math.log(cap) + 10 * sigma + 10
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped_lognormal_mean(mid, sigma, cap) < mean else (lo, mid)
    return (lo + hi) / 2


class Workload:
    """Tasks by index and sample outcomes (module docstring)."""

    def __init__(self, cfg: WorkloadConfig, *, seed: int, token_block: int) -> None:
        self.cfg, self.seed, self.block = cfg, seed, token_block
        sigma = math.hypot(cfg.sigma_prompt, cfg.sigma_within)
        cap = cfg.agent.max_turn_tokens if cfg.agent is not None else cfg.max_response_tokens
        self.mu = solve_mu(cfg.mean_response_tokens, sigma, cap)  # episodes: per model turn
        m, c = cfg.pass_rate_mean, cfg.pass_rate_concentration
        self._beta = (m * c, (1 - m) * c)
        self.prompt_blocks = max(1, math.ceil(cfg.prompt_tokens / token_block))
        self.max_blocks = math.ceil(cfg.max_response_tokens / token_block)
        self._tasks: dict[int, TaskSpec] = {}
        self._drawn: dict[tuple[int, int], tuple[int, bool]] = {}  # (task, seed) -> outcome
        self._growth = 1.0 + cfg.length_drift_per_step  # per weight version (module docstring)

    def spec(self, index: int) -> TaskSpec:
        spec = self._tasks.get(index)
        if spec is None:
            rng = random.Random(f"{self.seed}/task/{index}")
            d = math.exp(rng.gauss(self.mu, self.cfg.sigma_prompt))
            spec = TaskSpec(index=index, difficulty_tokens=d, pass_rate=rng.betavariate(*self._beta))
            self._tasks[index] = spec
        return spec

    def task(self, index: int) -> Task:
        prompt = (TASK_TOKEN_OFFSET + index,) + (TOKEN,) * (self.prompt_blocks - 1)
        return Task(uid=f"sim-{index}", source=SOURCE, prompt_ids=prompt, prompt_text="",
                    reference="")

    def outcome(self, prompt_ids: list[int], seed: int | None,
                version: int) -> tuple[int, int, tuple[int, ...]]:
        """(response blocks already in the prompt, the sample's full length in blocks before
        any cap, the tokens it ends with when it stops: its answer) for a request served at
        weight ``version`` (the length drift's, when this is the sample's first request)."""
        if seed is None:
            raise ValueError("simulated engines need a per-request seed (a run seed)")
        index = prompt_ids[0] - TASK_TOKEN_OFFSET
        drawn = self._drawn.get((index, seed))
        if drawn is None:  # seeding a Random is most of the cost: once per sample
            rng = random.Random(seed)
            length = self.length_tokens(index, rng, version)
            drawn = (max(1, math.ceil(length / self.block)),
                     rng.random() < self.spec(index).pass_rate)
            self._drawn[(index, seed)] = drawn
        return (len(prompt_ids) - self.prompt_blocks, drawn[0], _ENDS[drawn[1]])

    def length_tokens(self, index: int, rng: random.Random, version: int) -> float:
        """A response length (real tokens, before the cap) of task ``index`` drawn from
        ``rng`` by the policy at weight ``version``: the task's difficulty times the
        within-group spread, grown by the drift."""
        length = self.spec(index).difficulty_tokens * math.exp(rng.gauss(0.0,
                                                                         self.cfg.sigma_within))
        return length if self._growth == 1.0 else length * self._growth ** version


class TaskStream:
    """The rollout's task source: task 0, 1, 2, ... (a resumable cursor)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.next_index = 0

    def next_task(self) -> Task:
        task = self.workload.task(self.next_index)
        self.next_index += 1
        return task

    def state(self) -> dict[str, Any]:
        return {"next_index": self.next_index}

    def restore(self, state: dict[str, Any]) -> None:
        self.next_index = int(state["next_index"])


async def sim_reward(task: Task, text: str, *, token_ids: tuple[int, ...]) -> float:
    """1 when the simulated policy's stop token says its answer is correct, else 0."""
    return 1.0 if token_ids and token_ids[-1] == CORRECT else 0.0
