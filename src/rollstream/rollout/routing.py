"""Which engine a request goes to: least load, prefix affinity, drained engines left out.

The router keeps the dispatcher's per-engine request counts (its own, not the engines':
an engine's queue is not visible through the protocol) in a :class:`LoadIndex`, so the
least-loaded engine is found without a scan of every engine (``rollout/loads.py``), the
engines taken out of routing by preemption (:meth:`Dispatcher.drain`), and, with prefix
affinity, each group's home engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollstream.engine.protocol import Engine, EngineHealth
from rollstream.rollout.loads import LoadIndex
from rollstream.trajectory import Sample

AFFINITY_SLACK = 4  # prefix affinity: requests an engine may hold above the least loaded


class Router:
    def __init__(self, engines: Sequence[Engine], *, prefix_affinity: bool = False) -> None:
        self.engines = list(engines)
        self.prefix_affinity = prefix_affinity
        self.load: LoadIndex[Engine] = LoadIndex(self.engines)  # requests in flight
        self.by_id = {e.engine_id: e for e in self.engines}
        self.drained: set[str] = set()  # engine ids taken out of routing (preemption)
        self.home: dict[str, str] = {}  # group id -> the engine that holds its prompt's prefix

    def admits(self, e: Engine) -> bool:
        """Whether ``e`` may take a request now: UP and not drained."""
        return e.engine_id not in self.drained and e.stats().health is EngineHealth.UP

    def routable(self) -> list[Engine]:
        """Engines that may take a request now."""
        return [e for e in self.engines if self.admits(e)]

    def pick(self, sample: Sample) -> Engine | None:
        """The engine for ``sample``'s next request (:meth:`route` from the least loaded
        routable engine), or None while no engine may take one."""
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
        UP but drained."""
        return any(e.stats().health is EngineHealth.RECOVERING or (
            e.engine_id in self.drained and e.stats().health is EngineHealth.UP)
            for e in self.engines)

    def route(self, least: Engine, sample: Sample) -> Engine:
        """``least`` (the least-loaded routable engine); with prefix affinity the engine that
        holds the sample's prefix instead (the one its episode's last turn ran on, else the
        one its group's first sample went to) while it :meth:`keeps` it. Otherwise the sample
        goes to ``least``, and its group is re-pinned there."""
        if not self.prefix_affinity:
            return least
        episode = sample.engine_id if sample.segments else None
        home = self.by_id.get(episode or self.home.get(sample.group_id, ""))
        if home is not None and self.keeps(home, least):
            return home
        self.home[sample.group_id] = least.engine_id
        return least

    def engine(self, engine_id: str) -> Engine:
        engine = self.by_id.get(engine_id)
        if engine is None:
            raise ValueError(f"no engine {engine_id!r}; engines: "
                             f"{[e.engine_id for e in self.engines]}")
        return engine

    def table(self) -> list[dict[str, object]]:
        """Each engine as the operator sees it: id, health (and why), the weight version it
        serves, whether it is drained, and the requests in flight on it."""
        rows = []
        for e in self.engines:
            st = e.stats()
            rows.append({"engine_id": e.engine_id, "health": st.health.value,
                         "health_reason": st.health_reason, "version": st.version,
                         "drained": e.engine_id in self.drained,
                         "in_flight": self.load[e]})
        return rows
