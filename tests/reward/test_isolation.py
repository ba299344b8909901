"""A reward stuck in C code holding the GIL must not freeze the run: it times out on schedule
while a real engine keeps generating and the event loop keeps running.

Before rewards ran in worker processes, such a reward ran on a thread of this process: the
regex below held the GIL for seconds, the loop, the engine and the timeout all waited."""

from __future__ import annotations

import asyncio
import time
from itertools import pairwise
from pathlib import Path

from rollstream.config.schema import LocalEngineConfig, RewardConfig
from rollstream.engine import GenerateRequest, SamplingParams
from rollstream.engine.local import LocalEngine
from rollstream.reward import GraderPool, Response, get_reward
from rollstream.trajectory import Task
from tests.engine.helpers import MAX_SEQ_LEN, make_tiny_model
from tests.reward import worker_rewards

TIMEOUT_S = 1.0
# ~2**27 backtracking steps: several seconds of C code here (n=24 took 1 s on this CPU)
STALL = "a" * 27 + "b"


def _said(text: str) -> Response:
    return Response(text=text, token_ids=(1,), finish_reason="stop")


async def test_a_reward_spinning_in_c_times_out_on_schedule_while_generation_goes_on(
    tmp_path: Path,
) -> None:
    engine = LocalEngine(
        make_tiny_model(tmp_path / "model"),
        LocalEngineConfig(max_slots=4, max_seq_len=MAX_SEQ_LEN, threads=1, device="cpu"),
    )
    backtrack = get_reward(worker_rewards.backtrack)
    pool = GraderPool(RewardConfig(timeout_s=TIMEOUT_S, num_workers=1), lambda t: backtrack)
    task = Task(uid="t", source="s", prompt_ids=(1,), prompt_text="q", reference="")
    stop = asyncio.Event()
    ticks: list[tuple[float, int]] = []  # (time, engine tokens so far), every 10 ms

    async def generate(lane: int) -> None:
        for i in range(10**6):
            if stop.is_set():
                return
            await engine.generate(GenerateRequest(
                request_id=f"{lane}-{i}", prompt_ids=[3, 4, 5],
                params=SamplingParams(max_new_tokens=32, temperature=1.0)))

    async def tick() -> None:
        while not stop.is_set():
            ticks.append((time.perf_counter(), engine.stats().generated_tokens))
            await asyncio.sleep(0.01)

    try:
        quick = await pool.grade(task, _said("ab"))  # the worker is up and has the module
        assert quick.reward == 0.0, quick
        background = [asyncio.create_task(generate(k)) for k in range(2)]
        background.append(asyncio.create_task(tick()))
        await asyncio.sleep(0.3)  # generation under way
        t0 = time.perf_counter()
        stuck = await pool.grade(task, _said(STALL))
        t1 = time.perf_counter()
        after = await pool.grade(task, _said("ab"))  # a fresh worker replaced the killed one
        stop.set()
        await asyncio.gather(*background)
    finally:
        pool.close()
        await engine.close()

    assert stuck.error == f"timeout after {TIMEOUT_S:g}s"
    assert TIMEOUT_S <= stuck.elapsed_s < TIMEOUT_S + 0.7, stuck
    assert after.reward == 0.0 and after.error is None
    during = [(t, n) for t, n in ticks if t0 <= t <= t1]
    times = [t0, *(t for t, _ in during), t1]
    assert max(b - a for a, b in pairwise(times)) < 0.5  # the loop kept ticking
    assert during[-1][1] - during[0][1] >= 20  # the engine generated during the stall
