"""Which engine a request goes to: least load, prefix affinity, drained engines left out.

The router keeps the dispatcher's per-engine request counts (its own, not the engines':
an engine's queue is not visible through the protocol), the engines taken out of routing by
preemption (:meth:`Dispatcher.drain`), and, with prefix affinity, each group's home engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollstream.engine.protocol import Engine, EngineHealth
from rollstream.trajectory import Sample

AFFINITY_SLACK = 4  # prefix affinity: requests an engine may hold above the least loaded


class Router:
    def __init__(self, engines: Sequence[Engine], *, prefix_affinity: bool = False) -> None:
        self.engines = list(engines)
        self.prefix_affinity = prefix_affinity
        self.load = {id(e): 0 for e in self.engines}  # requests in flight per engine
        self.drained: set[str] = set()  # engine ids taken out of routing (preemption)
        self.home: dict[str, str] = {}  # group id -> the engine that holds its prompt's prefix

    def routable(self) -> list[Engine]:
        """Engines that may take a request now: UP and not drained."""
        return [e for e in self.engines
                if e.engine_id not in self.drained and e.stats().health is EngineHealth.UP]

    def may_come_back(self) -> bool:
        """Whether an engine that takes no request now may later: one RECOVERING, or one
        UP but drained."""
        return any(e.stats().health is EngineHealth.RECOVERING or (
            e.engine_id in self.drained and e.stats().health is EngineHealth.UP)
            for e in self.engines)

    def route(self, up: list[Engine], sample: Sample) -> Engine:
        """The least-loaded engine; with prefix affinity the engine that holds the sample's
        prefix instead (the one its episode's last turn ran on, else the one its group's first
        sample went to) while it has room: a free sequence and at most ``AFFINITY_SLACK``
        requests more than the least loaded. Otherwise the sample goes to the least loaded,
        and its group is re-pinned there."""
        least = min(up, key=lambda e: self.load[id(e)])
        if not self.prefix_affinity:
            return least
        episode = sample.engine_id if sample.segments else None
        home = next((e for e in up if e.engine_id == (episode or self.home.get(
            sample.group_id))), None)
        if home is not None and self.load[id(home)] < home.stats().capacity and (
                self.load[id(home)] <= self.load[id(least)] + AFFINITY_SLACK):
            return home
        self.home[sample.group_id] = least.engine_id
        return least

    def engine(self, engine_id: str) -> Engine:
        engine = next((e for e in self.engines if e.engine_id == engine_id), None)
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
                         "in_flight": self.load[id(e)]})
        return rows
