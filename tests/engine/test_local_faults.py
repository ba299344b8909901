"""The local engine as a fault boundary: when its step loop raises, every request comes back
(running ones with exactly the tokens they had), nothing escapes to callers, and the engine
is RECOVERING until restarted, or DEAD from then on when it has no restarts left. Faults are
injected on the engine thread by wrapping the runner."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
import torch

from rollstream.engine import (
    EngineHealth,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
)
from rollstream.engine.local import LocalEngine
from rollstream.engine.local.commands import Submit
from rollstream.engine.local.weights import Weights
from tests.engine.test_local import _local, _prompts, _req, _state_dict

BOOM = "boom: the device fell off the bus"


class _Decode:
    """The runner's decode, watched on the engine thread: records the weight version of every
    call that runs, holds call ``hold_at`` until ``go`` is set, raises on call ``fail_at``."""

    def __init__(self, engine: LocalEngine, *, fail_at: int | None = None,
                 hold_at: int | None = None) -> None:
        self.engine, self.real = engine, engine._runner.decode
        self.fail_at, self.hold_at = fail_at, hold_at
        self.versions: list[int] = []  # the version that sampled each decode step's tokens
        self.held, self.go = threading.Event(), threading.Event()
        engine._runner.decode = self

    def __call__(self, new=()) -> list[int]:
        call = len(self.versions) + 1
        if call == self.fail_at:
            raise RuntimeError(BOOM)
        if call == self.hold_at:
            self.held.set()
            assert self.go.wait(60)
        self.versions.append(self.engine._version)
        return self.real(new)


async def _submit_together(engine: LocalEngine, requests: list[GenerateRequest]):
    """Submit ``requests`` so that the engine thread takes them in at once (it is held on the
    first until all are queued): the same batches, hence the same numbers, in every run."""
    gate = threading.Event()
    apply = engine._apply

    def held(cmd) -> None:
        if isinstance(cmd, Submit):
            gate.wait(60)
        apply(cmd)

    engine._apply = held
    # an idle engine thread waits in ``self._apply(self._inbox.get())`` with the old method
    # already looked up: one command through it, and the next ones go through ``held``
    await engine.interrupt([])
    try:
        return [engine.submit(r) for r in requests]
    finally:
        gate.set()


async def _outputs(futures: list[concurrent.futures.Future]) -> list[GenerateOutput]:
    return await asyncio.wait_for(
        asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), timeout=120
    )


async def _hold_then(decode: _Decode, engine: LocalEngine, command) -> asyncio.Task:
    """Once ``decode`` holds its call, queue ``command`` (a coroutine) and let decoding go on:
    the command lands right after that decode step."""
    assert await asyncio.to_thread(decode.held.wait, 60)
    task = asyncio.ensure_future(command)
    while engine._inbox.empty():
        await asyncio.sleep(0.001)
    decode.go.set()
    return task


def _seeded(n: int, seed: int, max_new_tokens: int = 60) -> list[GenerateRequest]:
    return [
        _req(f"r{i}", p, temperature=1.0, seed=100 + i, max_new_tokens=max_new_tokens)
        for i, p in enumerate(_prompts(n, seed=seed))
    ]


async def _assert_dead_for_good(engine: LocalEngine, cause: str, tiny_model_dir) -> None:
    stats = engine.stats()
    assert stats.health is EngineHealth.DEAD and cause in stats.health_reason
    assert engine.engine_id in stats.health_reason
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    late = await engine.generate(_req("late", [1, 2, 3], max_new_tokens=4))
    assert late.finish_reason is FinishReason.ABORT and not late.token_ids
    assert late.error == stats.health_reason
    bad = await engine.generate(_req("bad", [], max_new_tokens=4))
    assert bad.finish_reason is FinishReason.ERROR  # the request's own fault stays an error
    await engine.interrupt()  # nothing to stop: returns at once
    with pytest.raises(RuntimeError, match=cause):
        await engine.load_weights(1, _state_dict(tiny_model_dir))
    await engine.close()
    await engine.close()
    assert not engine._thread.is_alive()


async def test_dying_engine_returns_each_request_with_exactly_its_tokens(tiny_model_dir):
    """Decode step 6 raises while 4 requests run and 2 wait: each running request returns
    the 1 + 5 tokens a healthy engine gives it first (same logprobs), the waiting ones return
    empty, all as ABORT naming the engine and the cause; nothing raises."""
    requests = _seeded(4, seed=21)
    healthy = _local(tiny_model_dir)
    try:
        full = await _outputs(await _submit_together(healthy, requests))
    finally:
        await healthy.close()
    assert all(len(o.token_ids) == 60 for o in full)

    dying = _local(tiny_model_dir, max_restarts=0)
    decode = _Decode(dying, fail_at=6)
    waiting = [_req(f"w{i}", [1, 2, 3], max_new_tokens=5) for i in range(2)]
    outs = await _outputs(await _submit_together(dying, requests + waiting))
    assert decode.versions == [0] * 5
    for out, ref in zip(outs[:4], full, strict=True):
        assert out.finish_reason is FinishReason.ABORT
        assert BOOM in out.error and "local-0" in out.error
        assert out.token_ids == ref.token_ids[:6]
        assert out.logprobs == pytest.approx(ref.logprobs[:6], abs=1e-6)
        assert out.versions == [0] * 6
    for out in outs[4:]:
        assert out.finish_reason is FinishReason.ABORT and not out.token_ids
        assert BOOM in out.error
    await _assert_dead_for_good(dying, BOOM, tiny_model_dir)


async def test_partials_keep_the_version_of_each_token_across_a_load(tiny_model_dir):
    """A load lands after decode step 4 and the engine dies at step 8: each partial's
    versions are the prefill's and those of the 7 steps that ran, token by token."""
    engine = _local(tiny_model_dir, max_restarts=0)
    decode = _Decode(engine, hold_at=4, fail_at=8)
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.1 * torch.randn(v.shape, generator=g)
           for k, v in _state_dict(tiny_model_dir).items()}
    futures = await _submit_together(engine, _seeded(3, seed=22))
    load = await _hold_then(decode, engine, engine.load_weights(1, new))
    await load
    outs = await _outputs(futures)
    assert decode.versions == [0, 0, 0, 0, 1, 1, 1]
    for out in outs:
        assert out.finish_reason is FinishReason.ABORT and BOOM in out.error
        assert out.versions == [0, 0, 0, 0, 0, 1, 1, 1]  # prefill, then one per decode step
        assert len(out.token_ids) == len(out.logprobs) == 8
    assert engine.stats().version == 1
    await _assert_dead_for_good(engine, BOOM, tiny_model_dir)


async def test_a_weight_load_that_raises_kills_the_engine_and_fails_the_load(
    tiny_model_dir, monkeypatch
):
    def corrupt(self, pairs) -> None:
        raise RuntimeError("weights corrupt")

    engine = _local(tiny_model_dir, max_restarts=0)
    decode = _Decode(engine, hold_at=3)
    futures = await _submit_together(engine, _seeded(2, seed=23))
    monkeypatch.setattr(Weights, "copy_in", corrupt)
    load = await _hold_then(decode, engine, engine.load_weights(1, _state_dict(tiny_model_dir)))
    with pytest.raises(RuntimeError, match="weights corrupt") as err:
        await load
    assert "local-0 died" in str(err.value)
    for out in await _outputs(futures):
        assert out.finish_reason is FinishReason.ABORT and "weights corrupt" in out.error
        assert out.versions == [0] * 4 and len(out.token_ids) == 4  # prefill + 3 decode steps
    await _assert_dead_for_good(engine, "weights corrupt", tiny_model_dir)


async def test_rows_not_prefilled_or_unreadable_return_without_tokens(tiny_model_dir):
    """An admission that raises (the prompts' prefill, fused into the decode pass): the rows
    already decoding keep their tokens, the rows being admitted have none. Then a runner that
    cannot even be read: ABORT without tokens."""
    engine = _local(tiny_model_dir, max_restarts=0)
    decode = _Decode(engine, hold_at=2)
    first = await _submit_together(engine, _seeded(2, seed=24))
    assert await asyncio.to_thread(decode.held.wait, 60)
    second = [engine.submit(r) for r in _seeded(4, seed=25)[2:]]

    def broken_admit(seqs):
        raise RuntimeError(BOOM)

    engine._runner._admit = broken_admit
    decode.go.set()
    outs = await _outputs(first + second)
    assert [len(o.token_ids) for o in outs] == [3, 3, 0, 0]
    assert all(o.finish_reason is FinishReason.ABORT and BOOM in o.error for o in outs)
    await _assert_dead_for_good(engine, BOOM, tiny_model_dir)

    engine = _local(tiny_model_dir, max_restarts=0)
    _Decode(engine, fail_at=3)

    def unreadable(rows, prompt_lens):
        raise RuntimeError("device unreadable")

    engine._runner.read = unreadable
    outs = await _outputs(await _submit_together(engine, _seeded(2, seed=26)))
    assert all(o.finish_reason is FinishReason.ABORT and not o.token_ids for o in outs)
    assert all(BOOM in o.error for o in outs)
    await _assert_dead_for_good(engine, BOOM, tiny_model_dir)


async def test_a_died_engine_recovers_only_through_restart(tiny_model_dir):
    """With a restart left it is RECOVERING (requests return ABORT with the cause) until
    ``restart`` gives it a fresh thread and cache at the given version, RECOVERING while that
    runs; with none left, DEAD."""
    engine = _local(tiny_model_dir, max_restarts=1)
    _Decode(engine, fail_at=3)
    out = await engine.generate(_req("r", [1, 2, 3], max_new_tokens=20))
    assert out.finish_reason is FinishReason.ABORT and BOOM in out.error
    assert engine.stats().health is EngineHealth.RECOVERING and engine.needs_restart()
    build, building, go = engine._build, threading.Event(), threading.Event()

    def slow_build() -> None:
        building.set()
        assert go.wait(60)
        build()

    engine._build = slow_build
    restart = asyncio.create_task(engine.restart(5, None))
    assert await asyncio.to_thread(building.wait, 60)
    # its last restart, still building: RECOVERING (read as DEAD, a dispatcher with no other
    # engine gave up on the run while its only engine was being restarted)
    assert engine.stats().health is EngineHealth.RECOVERING and not engine.needs_restart()
    go.set()
    await restart
    stats = engine.stats()
    assert stats.health is EngineHealth.UP and stats.version == 5 and engine.num_restarts == 1
    again = await engine.generate(_req("again", [1, 2, 3], max_new_tokens=20))
    assert again.finish_reason is FinishReason.LENGTH and again.versions == [5] * 20
    _Decode(engine, fail_at=2)
    await engine.generate(_req("r2", [1, 2, 3], max_new_tokens=20))
    assert engine.stats().health is EngineHealth.DEAD and not engine.needs_restart()
    with pytest.raises(RuntimeError, match="cannot restart"):
        await engine.restart(6, None)
    await engine.close()


async def test_peek_returns_each_running_request_so_far(tiny_model_dir):
    """What a driver in another process keeps so that a request whose process dies still
    returns its tokens: a prefix of the request's output, with the same logprobs and
    versions; nothing once the requests are done or the engine is dead."""
    engine = _local(tiny_model_dir, max_restarts=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=100, seed=5)
    tasks = [asyncio.create_task(engine.generate(GenerateRequest(
        request_id=f"r{i}", prompt_ids=[3 + i, 5, 7], params=params))) for i in range(2)]
    while engine.stats().generated_tokens < 10:
        await asyncio.sleep(0.001)
    peeked = {o.request_id: o for o in await engine.peek()}
    outs = {o.request_id: o for o in await asyncio.gather(*tasks)}
    assert peeked and set(peeked) <= set(outs)
    for rid, p in peeked.items():
        k = len(p.token_ids)
        assert 0 < k < 100 and p.finish_reason is FinishReason.ABORT
        assert (p.token_ids, p.logprobs, p.versions) == \
            (outs[rid].token_ids[:k], outs[rid].logprobs[:k], outs[rid].versions[:k])
    assert await engine.peek() == []
    await engine.close()
    assert await engine.peek() == []
