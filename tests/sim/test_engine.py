"""The simulated engine honours the engine contract; its cost model and workload."""

from __future__ import annotations

import asyncio
import math
import random
import statistics

import pytest

from rollstream.engine.protocol import FinishReason, GenerateRequest, SamplingParams
from rollstream.sim.engine import SimEngine
from rollstream.sim.profile import DecodeCost, load_profile
from rollstream.sim.scenario import WorkloadConfig
from rollstream.sim.vloop import run_virtual
from rollstream.sim.workload import CORRECT, TOKEN, WRONG, Workload, capped_lognormal_mean

WORKLOAD = WorkloadConfig(mean_response_tokens=3000, max_response_tokens=12288)


def _request(rid: str, prompt: list[int], max_new: int, seed: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt,
                           params=SamplingParams(max_new_tokens=max_new, seed=seed,
                                                 stop_token_ids=(CORRECT, WRONG)))


def test_interrupt_returns_partial_tokens_with_versions_and_the_sample_resumes():
    workload = Workload(WORKLOAD, seed=0, token_block=8)
    profile = load_profile("gpu_h100_7b")
    prompt = list(workload.task(5).prompt_ids)
    seed = next(s for s in range(100) if workload.outcome(prompt, s, 0)[1] > 40)  # a long one
    _, total, (answer,) = workload.outcome(prompt, seed, 0)

    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine("e0", profile, workload)
        t0 = loop.time()
        task = asyncio.create_task(engine.generate(_request("a@0", prompt, 10_000, seed)))
        await asyncio.sleep(0.3)  # ~8 ms per step: a few blocks of 8 tokens
        await engine.load_weights(1, {})  # continue in place: later blocks carry version 1
        await asyncio.sleep(0.3)
        await engine.interrupt(["a@0"])
        part = await task
        assert part.finish_reason is FinishReason.ABORT and 0 < len(part.token_ids) < total
        assert len(part.versions) == len(part.token_ids) == len(part.logprobs)
        assert part.versions == sorted(part.versions) and set(part.versions) == {0, 1}
        assert set(part.token_ids) == {TOKEN}
        rest = await engine.generate(_request("a@1", prompt + part.token_ids,
                                              10_000 - len(part.token_ids), seed))
        assert rest.finish_reason is FinishReason.STOP
        assert len(part.token_ids) + len(rest.token_ids) == total  # the same sample's length
        assert rest.token_ids[-1] == answer in (CORRECT, WRONG)
        assert set(rest.versions) == {1}
        assert engine.stats().busy_s > 0 and loop.time() - t0 > 0.6
        return loop.time() - t0

    run_virtual(main())


def test_a_full_batch_decodes_slower_than_one_sequence_and_the_cap_ends_by_length():
    workload = Workload(WORKLOAD, seed=1, token_block=16)
    profile = load_profile("gpu_h100_7b")

    async def main():
        loop = asyncio.get_running_loop()
        engine = SimEngine("e0", profile, workload)
        prompts = [list(workload.task(i).prompt_ids) for i in range(64)]
        t0 = loop.time()
        outs = await asyncio.gather(*(engine.generate(_request(f"r{i}", p, 20, i))
                                      for i, p in enumerate(prompts)))
        batch_s = loop.time() - t0
        assert all(len(o.token_ids) <= 20 for o in outs)
        capped = [o for o in outs if o.finish_reason is FinishReason.LENGTH]
        assert capped and all(len(o.token_ids) == 20 and o.token_ids[-1] == TOKEN for o in capped)
        t1 = loop.time()
        await engine.generate(_request("solo", prompts[0], 20, 999))
        return batch_s, loop.time() - t1

    batch_s, solo_s = run_virtual(main())
    assert batch_s > solo_s  # bigger batches take longer per step, not 64x longer
    assert batch_s < 64 * solo_s


def test_kv_capacity_preempts_and_every_request_still_finishes():
    workload = Workload(WORKLOAD, seed=2, token_block=16)
    tight = load_profile("gpu_h100_7b").model_copy(update={"kv_capacity_tokens": 20_000})

    async def main():
        engine = SimEngine("e0", tight, workload)
        outs = await asyncio.gather(*(engine.generate(_request(f"r{i}", list(
            workload.task(i).prompt_ids), 10_000, i)) for i in range(16)))
        return engine, outs

    engine, outs = run_virtual(main())
    assert engine.num_preemptions > 0
    assert all(o.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for o in outs)


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_decode_closed_form_matches_the_sum_of_steps(combine):
    cost = DecodeCost(overhead_s=1e-3, weights_s=5e-3, per_context_token_s=2e-8,
                      per_seq_s=3e-5, combine=combine)
    rng = random.Random(0)
    for _ in range(200):
        b, c, n = rng.randint(1, 300), rng.randint(1, 10**6), rng.randint(0, 2000)
        brute = sum(cost.step_s(b, c + i * b) for i in range(n))
        assert cost.steps_s(b, c, n) == pytest.approx(brute, rel=1e-9, abs=1e-12)
        assert cost.steps_in(b, c, cost.steps_s(b, c, n), 10**6) == n


def test_workload_mean_under_the_cap_and_lengths_correlated_within_groups():
    cfg = WorkloadConfig(mean_response_tokens=38959, max_response_tokens=98304)
    w = Workload(cfg, seed=0, token_block=1)
    sigma = math.hypot(cfg.sigma_prompt, cfg.sigma_within)
    assert capped_lognormal_mean(w.mu, sigma, 98304) == pytest.approx(38959, rel=1e-6)
    groups = []
    for t in range(400):
        prompt = list(w.task(t).prompt_ids)
        groups.append([min(w.outcome(prompt, 1000 * t + i, 0)[1], 98304) for i in range(8)])
    flat = [x for g in groups for x in g]
    assert statistics.fmean(flat) == pytest.approx(38959, rel=0.08)
    # within-group spread is smaller than the spread across prompts
    within = statistics.fmean(statistics.pstdev([math.log(x) for x in g]) for g in groups)
    assert within < statistics.pstdev([math.log(x) for x in flat]) * 0.8
    passes = [w.spec(t).pass_rate for t in range(400)]
    assert statistics.fmean(passes) == pytest.approx(0.4, abs=0.05)


def test_an_interrupt_at_the_instant_a_request_finishes_returns_it_finished():
    workload = Workload(WORKLOAD, seed=0, token_block=8)
    profile = load_profile("gpu_h100_7b")
    prompt = list(workload.task(7).prompt_ids)

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        whole = await SimEngine("e0", profile, workload).generate(_request("a", prompt, 999, 1))
        took = loop.time() - t0
        engine = SimEngine("e1", profile, workload)

        def interrupt_now():  # 2 ms before the end: the last step (~7 ms) is more than half
            with pytest.raises(StopIteration):  # done, so it counts: the request is complete
                engine.interrupt(None).send(None)

        loop.call_at(loop.time() + took - 0.002, interrupt_now)
        return whole, await engine.generate(_request("b", prompt, 999, 1))

    whole, again = run_virtual(main())
    assert whole.finish_reason is FinishReason.STOP
    assert again.finish_reason is FinishReason.STOP and again.token_ids == whole.token_ids


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_steps_in_is_the_last_step_whose_midpoint_is_due(combine):
    cost = DecodeCost(overhead_s=1e-3, weights_s=5e-3, per_context_token_s=2e-8,
                      per_seq_s=3e-5, combine=combine)
    flat = DecodeCost(overhead_s=0, weights_s=0, per_context_token_s=0, per_seq_s=0)
    rng = random.Random(1)
    for _ in range(300):
        b, c, limit = rng.randint(1, 300), rng.randint(1, 10**6), rng.randint(0, 3000)
        seconds = rng.uniform(0, cost.steps_s(b, c, limit + 5))
        n = cost.steps_in(b, c, seconds, limit)
        mid = [(cost.steps_s(b, c, i - 1) + cost.steps_s(b, c, i)) / 2 for i in (n, n + 1)]
        assert 0 <= n <= limit and (n == 0 or mid[0] <= seconds)
        assert n == limit or mid[1] > seconds
    assert flat.steps_in(4, 100, 1.0, 7) == 7 and cost.steps_in(4, 100, 0.0, 7) == 0


def test_a_slowdown_from_the_trainer_stretches_the_decode_in_progress():
    """Profile.contention: while a trainer step computes, every pass costs ``factor`` times
    more; a request slowed 2x for its second half ends at 1.5x its plain time, same tokens."""
    workload = Workload(WORKLOAD, seed=0, token_block=8)
    profile = load_profile("cpu_this_machine")
    prompt = list(workload.task(3).prompt_ids)
    seed = next(s for s in range(100) if workload.outcome(prompt, s, 0)[1] > 40)

    async def run(slow_at: float | None) -> tuple[float, int]:
        loop = asyncio.get_running_loop()
        engine, t0 = SimEngine("e0", profile, workload), loop.time()
        if slow_at is not None:
            loop.call_later(slow_at, engine.set_slowdown, 2.0)
        out = await engine.generate(_request("a@0", prompt, 10_000, seed))
        return loop.time() - t0, len(out.token_ids)

    plain, n = run_virtual(run(None))
    slowed, m = run_virtual(run(plain / 2))
    assert m == n and slowed == pytest.approx(1.5 * plain, rel=0.02)


def test_length_drift_scales_a_sample_by_the_growth_per_version_and_resumes_keep_it():
    cfg = WorkloadConfig(mean_response_tokens=3000, max_response_tokens=12288,
                         length_drift_per_step=0.05)
    w = Workload(cfg, seed=0, token_block=1)
    for s in range(50):
        grown = w.length_tokens(3, random.Random(s), 10)
        assert grown == pytest.approx(w.length_tokens(3, random.Random(s), 0) * 1.05 ** 10,
                                      rel=1e-12)
    flat = Workload(WORKLOAD, seed=0, token_block=1)  # no drift: the version changes nothing
    assert flat.length_tokens(3, random.Random(1), 10) == flat.length_tokens(3, random.Random(1), 0)
    prompt = list(w.task(3).prompt_ids)
    done, total, tail = w.outcome(prompt, 7, 2)  # drawn at its first request, version 2
    assert done == 0 and w.outcome(prompt + [TOKEN] * 5, 7, 9) == (5, total, tail)
