"""The engine breaker as pure logic: its state machine over every sequence of events, and the
router's rules built on it (who may take a request, the probe's single slot, the retry that
avoids the engines that failed it, the operator's view)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from rollstream.config import ConfigError, load_config
from rollstream.config.breaker import BreakerConfig
from rollstream.engine.protocol import EngineStats, FinishReason, GenerateOutput
from rollstream.engine.states import EngineHealth, Routing
from rollstream.rollout.breaker import Breaker
from rollstream.rollout.queue import DispatchQueue
from rollstream.rollout.routing import Router
from rollstream.trajectory import Group, Task

Q = 10.0  # quarantine_s in these tests
EVENTS = ("fail", "ok", "wait", "tick")  # fail / succeed, Q passes, a tenth of Q passes


def _expected(n: int, events: tuple[str, ...]) -> list[tuple[Routing, int, bool]]:
    """The specification, written as a transition table: after each event, (routing, streak,
    what the call returned). ROUTED counts failures in a row and quarantines at ``n`` (never
    when 0); QUARANTINED ignores outcomes until its time is up (then PROBING); PROBING goes
    back to ROUTED on a success and to QUARANTINED, for a fresh Q, on a failure."""
    state, streak, until, now, out = Routing.ROUTED, 0, 0.0, 0.0, []
    for ev in events:
        ret = False
        if ev in ("wait", "tick"):
            now += Q if ev == "wait" else Q / 10
            if state is Routing.QUARANTINED and now >= until:
                state = Routing.PROBING
        elif state is Routing.QUARANTINED:
            pass  # a request sent before the quarantine: counts for nothing
        elif ev == "ok":
            ret = state is Routing.PROBING
            state, streak = Routing.ROUTED, 0
        elif n > 0:  # fail
            streak += 1
            if state is Routing.PROBING or streak >= n:
                state, until, ret = Routing.QUARANTINED, now + Q, True
        out.append((state, streak, ret))
    return out


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_the_breaker_follows_its_transition_table_over_every_sequence_of_events(n: int) -> None:
    """Every sequence of 7 events (4^7 = 16384 per n): the breaker's state, failure count
    and answers match the table after each event."""
    for events in itertools.product(EVENTS, repeat=7):
        b, now = Breaker(failures=n, quarantine_s=Q), 0.0
        for ev, (state, streak, ret) in zip(events, _expected(n, events), strict=True):
            if ev in ("wait", "tick"):
                now += Q if ev == "wait" else Q / 10
                got = False
            elif ev == "ok":
                got = b.succeeded(now)
            else:
                got = b.failed(now, "HTTP 500")
            assert (b.routing(now), b.streak, got) == (state, streak, ret), (events, ev)
            assert (b.reason is None) == (state is Routing.ROUTED), (events, b.reason)


def test_a_quarantine_names_its_cause_and_lasts_its_time_exactly() -> None:
    b = Breaker(failures=2, quarantine_s=Q)
    assert not b.failed(1.0, "a") and b.failed(2.0, "vllm engine v answered HTTP 500")
    assert b.routing(2.0 + Q - 1e-9) is Routing.QUARANTINED
    assert b.routing(2.0 + Q) is Routing.PROBING
    assert "2 requests in a row" in b.reason and "HTTP 500" in b.reason and b.num_quarantines == 1
    with pytest.raises(ValueError, match="failures >= 0 and quarantine_s > 0"):
        Breaker(failures=1, quarantine_s=0)


class _Engine:
    """An engine as the router sees it: an id, a health and a capacity."""

    def __init__(self, engine_id: str, health: EngineHealth = EngineHealth.UP) -> None:
        self.engine_id, self.health = engine_id, health

    def stats(self) -> EngineStats:
        return EngineStats(engine_id=self.engine_id, version=0, num_running=0, num_waiting=0,
                           capacity=4, generated_tokens=0, busy_s=0.0, health=self.health)


def _out(*, tokens: int = 0, finish: FinishReason = FinishReason.ABORT,
         error: str | None = "vllm engine a answered HTTP 500") -> GenerateOutput:
    return GenerateOutput(request_id="r", token_ids=[7] * tokens, logprobs=[-0.1] * tokens,
                          versions=[0] * tokens, finish_reason=finish, error=error)


def _sample():
    task = Task(uid="t/0", source="t", prompt_ids=(1, 2), prompt_text="", reference="")
    return Group.new(task, 1, k=0).samples[0]


def test_the_router_quarantines_probes_one_request_at_a_time_and_routes_back() -> None:
    clock = [0.0]
    a, b = _Engine("a"), _Engine("b")
    router = Router([a, b], breaker=BreakerConfig(failures=2, quarantine_s=Q),
                    now=lambda: clock[0])
    s = _sample()
    for out in (_out(finish=FinishReason.ERROR), _out(error=None)):  # the request's own
        router.observe(a, out)  # fault and an interrupt count for nothing
    router.observe(a, _out())
    router.observe(a, _out())
    assert router.routing(a) is Routing.QUARANTINED and not router.admits(a)
    assert router.pick(s) is b and router.routable() == [b] and router.may_come_back()
    clock[0] = Q
    assert router.routing(a) is Routing.PROBING and router.cap(a) == 1 and router.admits(a)
    router.load.add(a, 1)  # the probe is in flight: nothing more goes there
    assert not router.admits(a) and router.routable() == [b]
    router.load.add(a, -1)
    router.observe(a, _out(tokens=1))  # a token: routed again
    assert router.routing(a) is Routing.ROUTED and router.cap(a) is None
    row = {r["engine_id"]: r for r in router.table()}["a"]
    assert (row["routing"], row["routing_reason"]) == ("routed", None)


def test_failures_of_an_engine_that_is_not_up_are_its_healths_business() -> None:
    a = _Engine("a", EngineHealth.RECOVERING)
    router = Router([a], breaker=BreakerConfig(failures=1))
    router.observe(a, _out())
    assert router.routing(a) is Routing.ROUTED
    a.health = EngineHealth.UP
    router.observe(a, _out(tokens=2, error="stream broke"))  # it brought tokens: no failure
    assert router.routing(a) is Routing.ROUTED


def test_drained_wins_and_the_table_shows_each_state_with_its_cause() -> None:
    a, b, c = _Engine("a"), _Engine("b"), _Engine("c")
    router = Router([a, b, c], breaker=BreakerConfig(failures=1, quarantine_s=Q), now=lambda: 0)
    router.observe(a, _out())
    router.observe(b, _out())
    router.drained.add("b")
    rows = {r["engine_id"]: r for r in router.table()}
    assert rows["a"]["routing"] == "quarantined" and "HTTP 500" in rows["a"]["routing_reason"]
    assert (rows["b"]["routing"], rows["b"]["routing_reason"]) == ("drained", None)
    assert (rows["c"]["routing"], rows["c"]["health"]) == ("routed", "up")


def test_a_retry_avoids_the_engines_that_failed_it_while_another_may_take_it() -> None:
    a, b = _Engine("a"), _Engine("b")
    router = Router([a, b])
    s = _sample()
    assert router.pick(s) is a  # ties of least load: engine order
    assert router.pick(s, avoid={"a"}) is b
    b.health = EngineHealth.RECOVERING
    assert router.pick(s, avoid={"a"}) is a  # no other: the one that failed it, once more


async def test_the_dispatch_queue_gives_a_retry_a_slot_elsewhere_and_a_probe_one_slot() -> None:
    a, b = _Engine("a"), _Engine("b")  # 4 slots each; a is probing: the router caps it at 1
    queue = DispatchQueue("fifo", lambda: [a, b], cap=lambda e: 1 if e is a else None)

    def ask() -> tuple[tuple[float, ...], float]:
        return (1.0,), 1.0

    assert (await queue.acquire(ask, avoid={"a"})).engine is b  # a is free, but failed it
    probe = await queue.acquire(ask)
    assert probe.engine is a and queue.slots(a) == 1
    on_b = [await queue.acquire(ask) for _ in range(3)]  # a holds its one: b fills up
    assert {g.engine for g in on_b} == {b}
    retry = asyncio.ensure_future(queue.acquire(ask, avoid={"b"}))
    await asyncio.sleep(0)
    queue.release(on_b[0])  # a slot on b, which failed it, while a may free one: it waits
    await asyncio.sleep(0)
    assert not retry.done()
    queue.release(probe)
    assert (await asyncio.wait_for(retry, 1.0)).engine is a


def test_breaker_settings_are_checked_at_load_with_their_path() -> None:
    cfg = load_config(None, ["rollout.breaker.failures=5", "rollout.breaker.quarantine_s=2"])
    assert (cfg.rollout.breaker.failures, cfg.rollout.breaker.quarantine_s) == (5, 2.0)
    with pytest.raises(ConfigError, match="rollout.breaker.quarantine_s"):
        load_config(None, ["rollout.breaker.failures=0", "rollout.breaker.quarantine_s=2"])
    with pytest.raises(ConfigError, match="rollout.breaker.failures"):
        load_config(None, ["rollout.breaker.failures=-1"])
