"""Predictive dispatch: the length predictor, the dispatch queue's order and placement, and a
dispatcher that holds requests beyond each engine's capacity on a real embedded engine."""

from __future__ import annotations

import asyncio
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollstream.engine.protocol import EngineHealth
from rollstream.rollout.predict import LengthPredictor
from rollstream.rollout.queue import DispatchQueue
from rollstream.trajectory import Group, Task


def _group(i: int, size: int = 8, source: str = "s") -> Group:
    task = Task(uid=f"{source}/{i}", source=source, prompt_ids=(1,), prompt_text="", reference="")
    return Group.new(task, size)


def test_the_prediction_error_falls_as_siblings_finish() -> None:
    """Lengths share a per-group scale (one prompt) with noise around it, as sampled responses
    to one prompt do; the source prior knows only the mix."""
    rng = random.Random(0)
    history: dict[str, deque[int]] = {}
    predictor = LengthPredictor(history, default=64.0)
    err_by_known: dict[int, list[float]] = {}
    for i in range(200):
        group = _group(i)
        scale = rng.lognormvariate(4.0, 0.8)
        lengths = [max(1, round(scale * rng.uniform(0.8, 1.2))) for _ in group.samples]
        for known, (s, n) in enumerate(zip(group.samples, lengths, strict=True)):
            guess = predictor.predict(s)  # after `known` siblings finished
            err_by_known.setdefault(known, []).append(abs(guess - n) / n)
            predictor.observe(s, n)
            history.setdefault("s", deque(maxlen=256)).append(n)
        predictor.forget(group.group_id)
    mean = {k: sum(v) / len(v) for k, v in err_by_known.items()}
    assert mean[1] < 0.7 * mean[0]  # one sibling already beats the source prior
    assert mean[4] < mean[1] and mean[7] < 0.4 * mean[0]
    errors = predictor.take_errors()  # the first prediction of each sample, when it finished
    assert len(errors) == 200 * 8 and predictor.take_errors() == []


def test_a_source_without_history_is_predicted_at_the_default_and_forget_drops_a_group() -> None:
    predictor = LengthPredictor({"a": deque([10, 30])}, default=50.0)
    g = _group(0, size=2, source="b")
    assert predictor.predict(g.samples[0]) == 50.0
    assert predictor.predict(_group(1, source="a").samples[0]) == 20.0
    predictor.forget(g.group_id)
    predictor.observe(g.samples[0], 7)  # its first prediction was forgotten: no error
    assert predictor.take_errors() == []
    with pytest.raises(ValueError):
        LengthPredictor({}, default=0.0)


@dataclass
class _Stats:
    capacity: int
    health: EngineHealth = EngineHealth.UP
    num_running: int = 0
    num_waiting: int = 0


@dataclass
class _Slots:
    """The two things the queue reads of an engine: its id and its capacity."""

    engine_id: str
    capacity: int

    def stats(self) -> _Stats:
        return _Stats(self.capacity)


@pytest.mark.parametrize(("order", "granted"), [("fifo", [1.0, 9.0, 3.0]),
                                                ("longest_first", [9.0, 3.0, 1.0])])
async def test_a_freed_slot_goes_to_the_next_request_in_order(order: str,
                                                              granted: list[float]) -> None:
    engine = _Slots("a", capacity=1)
    queue = DispatchQueue(order, lambda: [engine])  # type: ignore[arg-type, list-item]
    first = await queue.acquire(lambda: ((5.0,), 5.0))
    assert first is not None and first.engine is engine and first.work == 5.0
    got: list[float] = []

    async def want(work: float) -> None:
        grant = await queue.acquire(lambda: ((work,), work))
        got.append(work)
        await asyncio.sleep(0)
        queue.release(grant)  # type: ignore[arg-type]

    waiters = [asyncio.create_task(want(w)) for w in (1.0, 9.0, 3.0)]
    await asyncio.sleep(0)
    assert queue.num_waiting == 3
    queue.release(first)
    await asyncio.gather(*waiters)
    assert got == granted


async def test_the_order_is_decided_on_predictions_read_when_a_slot_frees() -> None:
    """A waiting request's prediction improves as its siblings finish: the queue reads it
    when it decides, not when the request arrived."""
    engine = _Slots("a", capacity=1)
    queue = DispatchQueue("longest_first", lambda: [engine])  # type: ignore[arg-type, list-item]
    held = await queue.acquire(lambda: ((1.0,), 1.0))
    predicted = {"x": 10.0, "y": 20.0}
    x = asyncio.create_task(queue.acquire(lambda: ((predicted["x"],), predicted["x"])))
    y = asyncio.create_task(queue.acquire(lambda: ((predicted["y"],), predicted["y"])))
    await asyncio.sleep(0)
    predicted["x"] = 50.0  # x's siblings turned out long
    queue.release(held)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert x.done() and not y.done() and x.result().work == 50.0
    queue.release(x.result())
    assert (await y).work == 20.0


async def test_placement_balances_predicted_tokens_not_request_counts() -> None:
    a, b = _Slots("a", capacity=4), _Slots("b", capacity=4)
    queue = DispatchQueue("longest_first", lambda: [a, b])  # type: ignore[arg-type, list-item]
    placed = []
    for w in (100.0, 10.0, 10.0, 10.0, 50.0):
        grant = await queue.acquire(lambda w=w: ((w,), w))
        placed.append(grant.engine.engine_id)  # type: ignore[union-attr]
    # 100 -> a; then b holds the short ones until it passes a's 100; 50 goes to the lighter b
    assert placed == ["a", "b", "b", "b", "b"]


async def test_a_cancelled_waiter_gives_its_slot_on_and_no_engine_wakes_everyone() -> None:
    engine = _Slots("a", capacity=1)
    routable = [engine]
    queue = DispatchQueue("longest_first", lambda: list(routable))  # type: ignore[arg-type]
    held = await queue.acquire(lambda: ((1.0,), 1.0))
    gone = asyncio.create_task(queue.acquire(lambda: ((9.0,), 9.0)))
    kept = asyncio.create_task(queue.acquire(lambda: ((2.0,), 2.0)))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    queue.release(held)  # type: ignore[arg-type]
    assert (await kept).engine is engine  # the cancelled request's turn passed to the next
    late = asyncio.create_task(queue.acquire(lambda: ((3.0,), 3.0)))
    await asyncio.sleep(0)
    routable.clear()  # the engine died: waiters are woken to look at health again
    queue.wake()
    assert await late is None


def test_the_dispatcher_holds_requests_beyond_capacity_and_grades_every_sample(
        tmp_path: Path) -> None:
    from rollstream.clock import WallClock
    from rollstream.config.schema import LocalEngineConfig, RewardConfig
    from rollstream.data.ledger import Ledger
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import SamplingParams
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle
    from rollstream.trajectory import SampleStatus
    from tests.engine.helpers import make_tiny_model

    async def one(task: Task, text: str) -> float:
        return 1.0

    model = make_tiny_model(tmp_path / "m")
    cfg = LocalEngineConfig(max_slots=3, max_seq_len=96, threads=1, device="cpu")
    spans: list[dict] = []
    groups = [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=(3 + i, 5, 7),
                             prompt_text="", reference=""), 4) for i in range(4)]

    async def main() -> tuple[Dispatcher, int]:
        engines = [LocalEngine(model, cfg, engine_id=f"e{i}") for i in range(2)]
        graders = GraderPool(RewardConfig(), lambda _: get_reward(one))
        disp = Dispatcher(engines=engines, params=SamplingParams(max_new_tokens=24, seed=None),
                          graders=graders, decode=lambda ids: "", clock=WallClock(),
                          lifecycle=Lifecycle(Ledger(), WallClock()),
                          span=lambda **kw: spans.append(kw), dispatch="longest_first")
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, max(e.stats().num_running + e.stats().num_waiting
                                     for e in engines))
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.wait_for(asyncio.gather(*(disp.run_group(g) for g in groups)), 120)
        finally:
            watcher.cancel()
            for e in engines:
                await e.close()
            graders.close()
        return disp, peak

    disp, peak = asyncio.run(main())
    assert all(s.status is SampleStatus.GRADED for g in groups for s in g.samples)
    assert peak <= 3  # an engine never held more than its 3 slots: the rest waited here
    assert disp.queue is not None and disp.queue.num_waiting == 0
    assert len(spans) == 16 and {sp["engine_id"] for sp in spans} == {"e0", "e1"}
    gauges = disp.gauges()
    assert gauges["dispatch_waiting"] == 0.0 and gauges["len_pred_err"] >= 0.0


def test_a_group_not_heard_from_ranks_high_and_fresh_groups_go_first() -> None:
    """Until one of its samples finishes a group may be long: it ranks at the source's upper
    quantile, above a group known to be short; among equals the group with fewer samples
    started goes first (early slots sample every group once)."""
    history = {"s": deque(range(1, 101))}  # p90 about 90, mean about 50
    predictor = LengthPredictor(history, default=10.0)
    short, fresh, busy = _group(0), _group(1), _group(2)
    predictor.observe(short.samples[0], 5)
    assert predictor.rank(short.samples[1])[0] < predictor.prior("s") < 85 < predictor.rank(
        fresh.samples[0])[0]
    predictor.started(busy.samples[0])
    assert predictor.rank(fresh.samples[0]) > predictor.rank(busy.samples[1])
    predictor.forget(busy.group_id)
    assert predictor.rank(busy.samples[1]) == predictor.rank(fresh.samples[0])


def test_adaptive_concurrency_on_a_real_engine_grades_every_sample_within_its_limit(
        tmp_path: Path) -> None:
    """With adaptive limits no request is granted on an engine beyond its current limit (a
    cut limit drains: the requests already held finish), so an engine never holds more than
    the highest limit it had; the limit moves, and every sample is graded."""
    from rollstream.clock import WallClock
    from rollstream.config.schema import LocalEngineConfig, RewardConfig
    from rollstream.data.ledger import Ledger
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import SamplingParams
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.rollout.concurrency import ConcurrencyLimit
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle
    from rollstream.trajectory import SampleStatus
    from tests.engine.helpers import make_tiny_model

    async def one(task: Task, text: str) -> float:
        return 1.0

    model = make_tiny_model(tmp_path / "m")
    cfg = LocalEngineConfig(max_slots=16, max_seq_len=96, threads=1, device="cpu")
    groups = [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=(3 + i, 5, 7),
                             prompt_text="", reference=""), 8) for i in range(12)]

    async def main() -> tuple[Dispatcher, list[str], set[int]]:
        engines = [LocalEngine(model, cfg, engine_id=f"e{i}") for i in range(2)]
        graders = GraderPool(RewardConfig(), lambda _: get_reward(one))
        disp = Dispatcher(engines=engines, params=SamplingParams(max_new_tokens=24, seed=None),
                          graders=graders, decode=lambda ids: "", clock=WallClock(),
                          lifecycle=Lifecycle(Ledger(), WallClock()), dispatch="fifo",
                          concurrency=lambda cap: ConcurrencyLimit(capacity=cap,
                                                                   window_tokens=48, start=2))
        queue = disp.queue
        assert queue is not None
        over: list[str] = []
        seen: set[int] = set()
        top = {e.engine_id: 0 for e in engines}  # the highest limit each engine had
        grant = queue._grant

        def granted(free: list, work: float):  # type: ignore[no-untyped-def]
            g = grant(free, work)  # a grant is never made beyond the engine's current limit
            top[g.engine.engine_id] = max(top[g.engine.engine_id], queue.slots(g.engine))
            if queue.num_held(g.engine) > queue.slots(g.engine):
                over.append(f"{g.engine.engine_id}: {queue.num_held(g.engine)} held > "
                            f"limit {queue.slots(g.engine)}")
            return g

        queue._grant = granted  # type: ignore[method-assign]

        async def watch() -> None:  # what the engines hold: never beyond a limit they had
            while True:
                for e in engines:
                    top[e.engine_id] = max(top[e.engine_id], queue.slots(e))
                    seen.add(queue.slots(e))
                    now = e.stats().num_running + e.stats().num_waiting
                    if now > top[e.engine_id]:
                        over.append(f"{e.engine_id} holds {now} > limit {top[e.engine_id]}")
                await asyncio.sleep(0.001)

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.wait_for(asyncio.gather(*(disp.run_group(g) for g in groups)), 120)
        finally:
            watcher.cancel()
            for e in engines:
                await e.close()
            graders.close()
        return disp, over, seen

    disp, over, seen = asyncio.run(main())
    assert all(s.status is SampleStatus.GRADED for g in groups for s in g.samples)
    assert over == []
    assert disp.queue is not None and disp.queue.num_waiting == 0
    assert set(disp.queue.limits) == {"e0", "e1"}
    assert len(seen) > 1 and min(seen) >= 1 and max(seen) <= 16  # the limit moved
    assert sum(len(c.history) for c in disp.queue.limits.values()) >= 2  # windows were measured
    gauges = disp.gauges()
    assert 1.0 <= gauges["concurrency_mean"] <= 16.0


@pytest.mark.parametrize("dispatch", ["engine", "fifo", "longest_first"])
@pytest.mark.parametrize("affinity", [True, False])
def test_prefix_affinity_keeps_a_group_on_one_engine_while_it_has_room(
        tmp_path: Path, affinity: bool, dispatch: str) -> None:
    """With prefix affinity each group's samples go to the engine its first sample went to,
    whatever the dispatch, so the engines' prefix caches prefill each group's 40-token prompt
    once (the other 3 samples find its 2 whole blocks); without it, routing spreads every
    group over both engines, each of which prefills it."""
    from rollstream.clock import WallClock
    from rollstream.config.schema import LocalEngineConfig, RewardConfig
    from rollstream.data.ledger import Ledger
    from rollstream.engine.local import LocalEngine
    from rollstream.engine.protocol import SamplingParams
    from rollstream.reward.pool import GraderPool
    from rollstream.reward.registry import get_reward
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.rollout.lifecycle import Lifecycle
    from rollstream.trajectory import SampleStatus
    from tests.engine.helpers import make_tiny_model

    async def one(task: Task, text: str) -> float:
        return 1.0

    model = make_tiny_model(tmp_path / "m")
    spans: list[dict] = []
    groups = [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=(3 + i, *range(5, 44)),
                             prompt_text="", reference=""), 4) for i in range(4)]
    hits = []

    async def main() -> None:
        engines = [LocalEngine(model, LocalEngineConfig(max_slots=slots, max_seq_len=96,
                                                        threads=1, device="cpu"),
                               engine_id=f"e{i}") for i, slots in enumerate((16, 16))]
        graders = GraderPool(RewardConfig(), lambda _: get_reward(one))
        disp = Dispatcher(engines=engines, params=SamplingParams(max_new_tokens=16, seed=None),
                          graders=graders, decode=lambda ids: "", clock=WallClock(),
                          lifecycle=Lifecycle(Ledger(), WallClock()), dispatch=dispatch,
                          span=lambda **kw: spans.append(kw), prefix_affinity=affinity)
        try:
            await asyncio.wait_for(asyncio.gather(*(disp.run_group(g) for g in groups)), 120)
            hits.extend(e.stats().work["prefix_hit_tokens"] for e in engines)
        finally:
            for e in engines:
                await e.close()
            graders.close()

    asyncio.run(main())
    assert all(s.status is SampleStatus.GRADED for g in groups for s in g.samples)
    engines_of = {g.task.uid: {sp["engine_id"] for sp in spans if sp["sample_uid"].startswith(
        g.group_id)} for g in groups}
    if affinity:  # 4 groups of 4 at once: each stays home, within the slack of 4
        assert all(len(e) == 1 for e in engines_of.values()), engines_of
        assert set().union(*engines_of.values()) == {"e0", "e1"}  # homes spread the groups
        assert sum(hits) == 4 * 3 * 32  # each group's prompt prefilled once
    else:
        assert all(len(e) == 2 for e in engines_of.values()), engines_of
        assert sum(hits) < 4 * 3 * 32


def test_a_group_whose_home_is_full_is_re_pinned() -> None:
    from rollstream.rollout.routing import AFFINITY_SLACK, Router

    @dataclass
    class _Up:
        engine_id: str
        capacity: int

        def stats(self) -> _Stats:
            return _Stats(self.capacity)

    a, b = _Up("a", 64), _Up("b", 64)
    router = Router([a, b], prefix_affinity=True)  # routing only: no engine runs here

    def route(sample):
        return router.pick(sample).engine_id

    g = _group(0)
    assert route(g.samples[0]) == "a"  # first: least loaded, pinned
    router.load.add(a, AFFINITY_SLACK)
    assert route(g.samples[1]) == "a"  # within the slack: home
    router.load.add(a, 1)
    assert route(g.samples[2]) == "b"  # past it: re-pinned
    router.load.add(a, -AFFINITY_SLACK - 1)
    assert route(g.samples[3]) == "b"  # its new home
    router.drained.add("b")
    assert route(g.samples[4]) == "a"  # a drained home is not routed to


def test_the_upper_quantile_follows_the_window_of_recent_lengths() -> None:
    """The predictor keeps each source's recent lengths sorted as they come and go (not a
    sort per observation); its upper quantile is the sorted window's, at every step."""
    rng = random.Random(1)
    history = {"s": deque([rng.randint(1, 50) for _ in range(5)], maxlen=16)}
    predictor = LengthPredictor(history, default=10.0, window=16)
    for i in range(200):
        predictor.observe(_group(i).samples[0], rng.choice([1, 7, 7, rng.randint(1, 500)]))
        ordered = sorted(history["s"])
        assert predictor.rank(_group(1000 + i).samples[0])[0] == ordered[int(0.9 * len(ordered))]
