"""Test doubles at the process edges of the rollout layer: an engine whose requests finish
after random numbers of tokens with random per-token delays, and a trainer that only counts.
They honour the engine contract (token boundaries, interrupts, per-token versions, health).

Faults on demand: ``die_after_tokens`` (the engine dies after generating that many tokens: its
in-flight requests return ABORT with their partial tokens and the cause, later ones ABORT
with no token, health DEAD), ``error_prompts`` (every request fails with ERROR, as a prompt
that does not fit), ``hang`` (requests never finish until interrupted)."""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Self

from rollstream.engine.protocol import (
    EngineHealth,
    EngineStats,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
)
from rollstream.staleness import StalenessPolicy
from rollstream.trajectory import StepResult


class RandomEngine:
    def __init__(self, seed: int, engine_id: str = "rand-0", max_delay_s: float = 0.002, *,
                 die_after_tokens: int | None = None, error_prompts: bool = False,
                 hang: bool = False, max_len: int = 24) -> None:
        self.die_after_tokens, self.error_prompts, self.hang = die_after_tokens, error_prompts, hang
        self.max_len = max_len
        self.dead: str | None = None
        self.engine_id = engine_id
        self.version = 0
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self.generated = 0
        self.tokens_by_sample: dict[str, int] = {}  # sample uid -> tokens generated for it
        self.loads: list[tuple[int, int]] = []

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        rid = request.request_id
        if self.dead is not None:
            return GenerateOutput(request_id=rid, token_ids=[], logprobs=[], versions=[],
                                  finish_reason=FinishReason.ABORT, error=self.dead)
        if self.error_prompts:
            await asyncio.sleep(0)
            return GenerateOutput(request_id=rid, token_ids=[], logprobs=[], versions=[],
                                  finish_reason=FinishReason.ERROR,
                                  error=f"prompt of {len(request.prompt_ids)} tokens does not fit")
        self._running.add(rid)
        # a sample's total length is a function of its uid (the request id before '@'), so a
        # resumed request continues the same sample; tokens still owed = total - done
        sample_uid = rid.split("@")[0]
        total = 1 + zlib.crc32(sample_uid.encode()) % self.max_len
        done = len(request.prompt_ids) - 4
        target = max(1, min(total - done, request.params.max_new_tokens))
        ids, lps, vs = [], [], []
        try:
            while len(ids) < target or self.hang:
                await asyncio.sleep(self.rng.random() * self.max_delay_s)
                if rid in self._aborted or self.dead is not None:
                    return GenerateOutput(request_id=rid, token_ids=ids, logprobs=lps,
                                          versions=vs, finish_reason=FinishReason.ABORT,
                                          error=self.dead)
                if self.hang:
                    continue
                ids.append(self.rng.randrange(1, 50))
                lps.append(-1.0)
                vs.append(self.version)
                self.generated += 1
                self.tokens_by_sample[sample_uid] = self.tokens_by_sample.get(sample_uid, 0) + 1
                if self.die_after_tokens is not None and self.generated >= self.die_after_tokens:
                    self.dead = f"engine {self.engine_id} died (injected fault)"
            return GenerateOutput(request_id=request.request_id, token_ids=ids, logprobs=lps,
                                  versions=vs, finish_reason=FinishReason.LENGTH)
        finally:
            self._running.discard(rid)
            self._aborted.discard(rid)

    async def interrupt(self, request_ids: Sequence[str] | None = None) -> None:
        """Like the real engines: returns once the interrupted requests have stopped."""
        ids = set(self._running if request_ids is None else request_ids)
        self._aborted.update(ids)
        while ids & self._running:
            await asyncio.sleep(0.0005)

    async def load_weights(self, version: int, tensors: Mapping) -> None:
        if self.dead is not None:
            raise RuntimeError(self.dead)
        self.loads.append((version, len(self._running)))  # (version, requests running then)
        await asyncio.sleep(0)
        self.version = version

    def stats(self) -> EngineStats:
        return EngineStats(engine_id=self.engine_id, version=self.version,
                           num_running=len(self._running), num_waiting=0, capacity=1 << 30,
                           generated_tokens=self.generated, busy_s=0.0,
                           health=EngineHealth.DEAD if self.dead else EngineHealth.UP,
                           health_reason=self.dead)


class CountingTrainer:
    """Records its batches; keeps what the staleness policy's token mask keeps."""

    def __init__(self, seed: int, policy: StalenessPolicy, max_delay_s: float = 0.01) -> None:
        self.rng = random.Random(seed)
        self.policy = policy
        self.max_delay_s = max_delay_s
        self.batches: list[list] = []

    def step(self, groups, step: int) -> StepResult:
        import time

        time.sleep(self.rng.random() * self.max_delay_s)
        self.batches.append([(g.group_id, [s.uid for s in g.samples]) for g in groups])
        kept = {}
        for g in groups:
            for s in g.samples:
                if s.reward is not None:
                    by_age = self.policy.kept_tokens(s, step)
                    kept[s.uid] = by_age if by_age.num_tokens else replace(
                        by_age, reason="masked by token age")
        return StepResult(metrics={"loss": 0.0}, kept=kept)

    def state_dict(self) -> dict:
        return {}


class NullMetrics:
    def record(self, kind, step, values) -> None:
        pass

    def observe(self, name, value) -> None:
        pass


async def run_then_close(cfg, loop, graders, ledger, **hooks):
    """Runs a controller built for ``loop`` (with ``hooks``: ``after_step``, ``before_stop``)
    to its end, then closes the graders and the ledger (also when the run raises): what every
    rollout test that builds a loop does."""
    from rollstream.runtime.build import build_controller

    try:
        return await build_controller(cfg, loop, **hooks).run()
    finally:
        graders.close()
        ledger.close()


def task_groups(start: int, n: int, *, prompt_len: int = 4, group_size: int = 2) -> list:
    """``n`` groups of tasks ``t/start`` ... with a prompt of ``prompt_len`` tokens."""
    from rollstream.trajectory import Group, Task

    return [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=tuple(range(1, prompt_len + 1)),
                           prompt_text="", reference=""), group_size)
            for i in range(start, start + n)]


class TwoEngineSync:
    """Two :class:`RandomEngine` doubles (``a``, ``b``) behind a real dispatcher, lifecycle,
    graders (reward 1, graded in the loop) and :class:`~rollstream.sync.weights.WeightSync`
    under ``policy``, its loop running: the weight-sync ordering tests' scene. ``async with``
    starts and stops it."""

    def __init__(self, policy: str, *, max_len: int, on_applied=None) -> None:
        from rollstream.clock import WallClock
        from rollstream.config import RewardConfig
        from rollstream.data.ledger import Ledger
        from rollstream.engine.protocol import SamplingParams
        from rollstream.reward.pool import GraderPool
        from rollstream.reward.registry import get_reward
        from rollstream.rollout.dispatcher import Dispatcher
        from rollstream.rollout.lifecycle import Lifecycle
        from rollstream.sync.weights import WeightSync

        self.engines = [RandomEngine(1, "a", max_delay_s=0.004, max_len=max_len),
                        RandomEngine(2, "b", max_delay_s=0.004, max_len=max_len)]
        reward = get_reward(_reward_one)
        self.graders = GraderPool(RewardConfig(), lambda task: reward)
        self.dispatcher = Dispatcher(
            engines=self.engines, params=SamplingParams(max_new_tokens=max_len),
            graders=self.graders, decode=lambda ids: "", clock=WallClock(),
            lifecycle=Lifecycle(Ledger(), WallClock()))
        self.sync = WeightSync(self.engines, self.dispatcher, policy,  # type: ignore[arg-type]
                               on_applied or (lambda v, s: None))
        self._loop: asyncio.Task | None = None

    async def __aenter__(self) -> Self:
        self._loop = asyncio.create_task(self.sync.run())
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._loop is not None
        self._loop.cancel()
        self.graders.close()

    async def until_running(self, num_requests: int, num_tokens: int = 0) -> None:
        """Wait until ``num_requests`` run on the engines and ``num_tokens`` were generated."""
        while (sum(len(e._running) for e in self.engines) < num_requests
               or sum(e.generated for e in self.engines) < num_tokens):
            await asyncio.sleep(0.002)


async def _reward_one(task, text: str) -> float:  # async: graded in the loop, no worker
    return 1.0
