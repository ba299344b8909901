"""Test doubles at the process edges of the rollout layer: an engine whose requests finish
after random numbers of tokens with random per-token delays, and a trainer that only counts.
They honour the engine contract (token boundaries, interrupts, per-token versions)."""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Mapping, Sequence

from rollstream.engine.protocol import EngineStats, FinishReason, GenerateOutput, GenerateRequest


class RandomEngine:
    def __init__(self, seed: int, engine_id: str = "rand-0", max_delay_s: float = 0.002) -> None:
        self.engine_id = engine_id
        self.version = 0
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self._aborted: set[str] = set()
        self._running: set[str] = set()
        self.generated = 0

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self._running.add(request.request_id)
        # a sample's total length is a function of its uid (the request id before '@'), so a
        # resumed request continues the same sample; tokens still owed = total - done
        sample_uid = request.request_id.split("@")[0]
        total = 1 + zlib.crc32(sample_uid.encode()) % 24
        done = len(request.prompt_ids) - 4
        target = max(1, min(total - done, request.params.max_new_tokens))
        ids, lps, vs = [], [], []
        try:
            while len(ids) < target:
                await asyncio.sleep(self.rng.random() * self.max_delay_s)
                if request.request_id in self._aborted:
                    return GenerateOutput(request_id=request.request_id, token_ids=ids,
                                          logprobs=lps, versions=vs,
                                          finish_reason=FinishReason.ABORT)
                ids.append(self.rng.randrange(1, 50))
                lps.append(-1.0)
                vs.append(self.version)
                self.generated += 1
            return GenerateOutput(request_id=request.request_id, token_ids=ids, logprobs=lps,
                                  versions=vs, finish_reason=FinishReason.LENGTH)
        finally:
            self._running.discard(request.request_id)
            self._aborted.discard(request.request_id)

    async def interrupt(self, request_ids: Sequence[str] | None = None) -> None:
        self._aborted.update(self._running if request_ids is None else request_ids)

    async def load_weights(self, version: int, tensors: Mapping) -> None:
        await asyncio.sleep(0)
        self.version = version

    def stats(self) -> EngineStats:
        return EngineStats(engine_id=self.engine_id, version=self.version,
                           num_running=len(self._running), num_waiting=0, capacity=1 << 30,
                           generated_tokens=self.generated, busy_s=0.0)


class CountingTrainer:
    def __init__(self, seed: int, max_delay_s: float = 0.01) -> None:
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.batches: list[list] = []

    def step(self, groups, step: int) -> dict[str, float]:
        import time

        time.sleep(self.rng.random() * self.max_delay_s)
        self.batches.append([(g.group_id, [s.uid for s in g.samples]) for g in groups])
        return {"loss": 0.0}

    def state_dict(self) -> dict:
        return {}


class NullMetrics:
    def record(self, kind, step, values) -> None:
        pass

    def observe(self, name, value) -> None:
        pass
