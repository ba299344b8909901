"""Which engine a request goes to: least load, prefix affinity, engines out of routing left
out.

The router keeps the dispatcher's per-engine request counts (its own, not the engines':
an engine's queue is not visible through the protocol) in a :class:`LoadIndex`, so the
least-loaded engine is found without a scan of every engine (``rollout/loads.py``), each
engine's routing state (``engine/states.py``: drained by preemption, :meth:`Dispatcher.drain`;
quarantined and probing by its :class:`Breaker`, which :meth:`observe` feeds with every
request's outcome), and, with prefix affinity, each group's home engine. A request retried
after an engine fault names the engines to ``avoid``: it goes elsewhere while another engine
may take it.

The router's engine list is the run's roster, shared with weight sync, the supervisor and the
meters: :meth:`join` and :meth:`leave` (called by ``runtime/fleet.py``, the one owner of a live
run's membership) change it and the router's per-engine state together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence

from rollstream.config.breaker import BreakerConfig
from rollstream.engine.protocol import Engine, FinishReason, GenerateOutput
from rollstream.engine.states import EngineHealth, Routing
from rollstream.rollout.breaker import Breaker
from rollstream.rollout.loads import LoadIndex
from rollstream.trajectory import Sample

log = logging.getLogger(__name__)
AFFINITY_SLACK = 4  # prefix affinity: requests an engine may hold above the least loaded


class Router:
    def __init__(self, engines: Sequence[Engine], *, prefix_affinity: bool = False,
                 breaker: BreakerConfig | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        """``engines``: the run's roster, kept (not copied) when it is a list, so every
        holder sees :meth:`join` and :meth:`leave`; ``breaker``: ``rollout.breaker`` (None:
        its defaults); ``now``: the clock quarantines are timed with."""
        self.breaker = breaker = breaker or BreakerConfig()
        self.engines = engines if isinstance(engines, list) else list(engines)
        self.prefix_affinity = prefix_affinity
        self.load: LoadIndex[Engine] = LoadIndex(self.engines)  # requests in flight
        self.by_id = {e.engine_id: e for e in self.engines}
        self.drained: set[str] = set()  # engine ids taken out of routing (preemption)
        self.breakers = {e.engine_id: Breaker(failures=breaker.failures,
                                              quarantine_s=breaker.quarantine_s)
                         for e in self.engines}
        self.now = now
        self.home: dict[str, str] = {}  # group id -> the engine that holds its prompt's prefix

    def join(self, e: Engine) -> None:
        """``e`` (a new engine id, serving the current version) takes requests from now on."""
        assert e.engine_id not in self.by_id, f"engine id {e.engine_id} is taken"
        self.engines.append(e)
        self.by_id[e.engine_id] = e
        self.breakers[e.engine_id] = Breaker(failures=self.breaker.failures,
                                             quarantine_s=self.breaker.quarantine_s)
        self.load.join(e)

    def leave(self, e: Engine) -> None:
        """``e`` (drained, no request in flight) is out of the run: forgotten everywhere."""
        assert self.load[e] == 0, f"engine {e.engine_id} still has requests in flight"
        self.engines.remove(e)
        del self.by_id[e.engine_id], self.breakers[e.engine_id]
        self.drained.discard(e.engine_id)
        self.load.leave(e)
        for group_id in [g for g, home in self.home.items() if home == e.engine_id]:
            del self.home[group_id]

    def routing(self, e: Engine) -> Routing:
        """``e``'s routing state (``engine/states.py``): drained wins over the breaker's."""
        if e.engine_id in self.drained:
            return Routing.DRAINED
        return self.breakers[e.engine_id].routing(self.now())

    def admits(self, e: Engine) -> bool:
        """Whether ``e`` may take a request now: UP, and ROUTED (or PROBING with no request
        in flight)."""
        if e.stats().health is not EngineHealth.UP:
            return False
        state = self.routing(e)
        return state is Routing.ROUTED or (state is Routing.PROBING and self.load[e] == 0)

    def cap(self, e: Engine) -> int | None:
        """The most requests ``e`` may hold now whatever its slots (a probing engine: one);
        None: no cap of the router's."""
        return 1 if self.routing(e) is Routing.PROBING else None

    def routable(self) -> list[Engine]:
        """Engines that may take a request now."""
        return [e for e in self.engines if self.admits(e)]

    def pick(self, sample: Sample, avoid: Collection[str] = ()) -> Engine | None:
        """The engine for ``sample``'s next request (:meth:`route` from the least loaded
        routable engine not in ``avoid``, engine ids: the ones that failed it; one of those
        only when no other is routable), or None while no engine may take one."""
        least = self.load.least(
            (lambda e: e.engine_id not in avoid and self.admits(e)) if avoid else self.admits)
        if least is None and avoid:
            least = self.load.least(self.admits)
        return None if least is None else self.route(least, sample)

    def pick_near(self, home: Engine | None) -> Engine | None:
        """The engine for the next request of a conversation whose prefix ``home`` holds (None
        for its first): ``home`` while :meth:`keeps` it, else the least-loaded routable
        engine; None while no engine may take one. The agent proxy's sessions go this way."""
        least = self.load.least(self.admits)
        if least is None:
            return None
        return home if home is not None and self.keeps(home, least) else least

    def keeps(self, home: Engine, least: Engine) -> bool:
        """Whether a request whose prefix ``home`` holds stays there instead of going to
        ``least`` (the least-loaded routable engine): ``home`` is routable and has room, a free
        sequence and at most ``AFFINITY_SLACK`` requests more than ``least``."""
        return self.admits(home) and self.load[home] < home.stats().capacity and \
            self.load[home] <= self.load[least] + AFFINITY_SLACK

    def may_come_back(self) -> bool:
        """Whether an engine that takes no request now may later: one RECOVERING, or one
        UP but out of routing (drained, quarantined, probing)."""
        return any(e.stats().health is EngineHealth.RECOVERING or (
            e.stats().health is EngineHealth.UP and self.routing(e) is not Routing.ROUTED)
            for e in self.engines)

    def observe(self, e: Engine, out: GenerateOutput) -> None:
        """A request on ``e`` ended with ``out``: its breaker counts an engine fault without a
        token (while ``e`` is UP) as a failure, a token or a finish as a success."""
        breaker, now = self.breakers[e.engine_id], self.now()
        if out.token_ids or out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            if breaker.succeeded(now):
                log.warning("engine %s answered its probe: routed again", e.engine_id)
        elif out.engine_fault and e.stats().health is EngineHealth.UP:
            if breaker.failed(now, out.error or ""):
                log.warning("engine %s quarantined: %s", e.engine_id, breaker.reason)

    def route(self, least: Engine, sample: Sample) -> Engine:
        """``least`` (the least-loaded routable engine); with prefix affinity the engine that
        holds the sample's prefix instead (the one its episode's last turn ran on, else the
        one its group's first sample went to) while it :meth:`keeps` it. Otherwise the sample
        goes to ``least``, and its group is re-pinned there."""
        if not self.prefix_affinity:
            return least
        home = self._home(sample)
        if home is not None and self.keeps(home, least):
            return home
        self.home[sample.group_id] = least.engine_id
        return least

    def place(self, sample: Sample, least: Engine, free: Collection[Engine]) -> Engine:
        """With a dispatch queue: of the engines with a free slot (``free``; ``least``, the
        queue's choice among them), the one that holds the sample's prefix (as
        :meth:`route`) while it is among them; otherwise ``least``, and the group is
        re-pinned there."""
        if not self.prefix_affinity:
            return least
        home = self._home(sample)
        if home is not None and home in free:
            return home
        self.home[sample.group_id] = least.engine_id
        return least

    def _home(self, sample: Sample) -> Engine | None:
        """The engine that holds ``sample``'s prefix: the one its episode's (or partial
        sample's) last request ran on, else the one its group was pinned to."""
        episode = sample.engine_id if sample.segments else None
        return self.by_id.get(episode or self.home.get(sample.group_id, ""))

    def engine(self, engine_id: str) -> Engine:
        engine = self.by_id.get(engine_id)
        if engine is None:
            raise ValueError(f"no engine {engine_id!r}; engines: "
                             f"{[e.engine_id for e in self.engines]}")
        return engine

    def table(self) -> list[dict[str, object]]:
        """Each engine as the operator sees it: id, health (and why), the weight version it
        serves, its routing state (and, quarantined or probing, why), the requests in
        flight on it and the tokens it generated (its stats' ``generated_tokens``)."""
        rows = []
        for e in self.engines:
            st, routing = e.stats(), self.routing(e)
            why = None if routing is Routing.DRAINED else self.breakers[e.engine_id].reason
            rows.append({"engine_id": e.engine_id, "health": st.health.value,
                         "health_reason": st.health_reason, "version": st.version,
                         "routing": routing.value, "routing_reason": why,
                         "in_flight": self.load[e],
                         "generated_tokens": st.generated_tokens})
        return rows
