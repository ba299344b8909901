"""Which engine a request goes to: least load, prefix affinity, engines out of routing left
out.

The router keeps the dispatcher's per-engine request counts (its own, not the engines':
an engine's queue is not visible through the protocol) in a :class:`LoadIndex`, so the
least-loaded engine is found without a scan of every engine (``rollout/loads.py``), each
engine's routing state (``engine/states.py``: drained by preemption, :meth:`Dispatcher.drain`;
quarantined and probing by its :class:`Breaker`, which :meth:`observe` feeds with every
request's outcome), and, with prefix affinity, each group's home engine and the engines each
sample's requests ran on. A request retried after an engine fault names the engines to
``avoid``: it goes elsewhere while another engine may take it.

Prefix affinity weighs real cache: a sample continuing (an episode's next turn, a resumed
partial sample) goes to the engine that holds most of its next prompt now, as the engines
that can say report it (``HoldsPrefixes.cached_tokens``: the tokens that request would not
prefill there), among the ones its requests ran on and its group's home. When that engine
has no room (its sequences, the KV rows, taken: by the router's requests or any other
client's) the request *spills* to the next holder with room, else to the least loaded engine,
rather than waiting behind it, and is counted in :attr:`Router.num_spills`. A group's first
sample goes to the engine that holds most of its prompt (an instruction earlier groups
shared), if any holds a whole block of it and has room, else to the least loaded; the
group's later samples follow it.

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
        # with prefix affinity: sample uid -> the engines its requests ran on, oldest first
        # (until :meth:`end`: the sample's run is over)
        self.ran: dict[str, list[str]] = {}
        self.num_spills = 0  # requests sent away from the engine holding most of their prefix

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
        for engines in self.ran.values():
            if e.engine_id in engines:
                engines.remove(e.engine_id)

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
        return None if least is None else self.route(least, sample, avoid)

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
        ``least`` (the least-loaded routable engine): ``home`` is routable and :meth:`has_room`,
        with at most ``AFFINITY_SLACK`` requests more than ``least``."""
        return self.admits(home) and self.has_room(home) and \
            self.load[home] <= self.load[least] + AFFINITY_SLACK

    def has_room(self, e: Engine) -> bool:
        """Whether ``e`` has a free sequence (a KV row): it holds fewer requests than its
        capacity, counting the router's own in flight and what the engine reports running and
        waiting (requests of other clients too: the agent proxy's, another run's)."""
        st = e.stats()
        return max(self.load[e], st.num_running + st.num_waiting) < st.capacity

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

    def route(self, least: Engine, sample: Sample, avoid: Collection[str] = ()) -> Engine:
        """``least`` (the least-loaded routable engine); with prefix affinity the engine that
        holds the sample's prefix instead (:meth:`homes`, the first not in ``avoid`` that
        :meth:`keeps` it). Otherwise the sample goes to ``least``, and its group is re-pinned
        there."""
        if not self.prefix_affinity:
            return least

        def spare() -> Engine | None:  # the least loaded with a free sequence, to spill to
            return self.load.least(lambda e: e.engine_id not in avoid and self.admits(e)
                                   and self.has_room(e))

        return self._choose(sample, least, lambda home: home.engine_id not in avoid
                            and self.keeps(home, least), spare)

    def place(self, sample: Sample, least: Engine, free: Collection[Engine]) -> Engine:
        """With a dispatch queue: of the engines with a free slot (``free``; ``least``, the
        queue's choice among them), the one that holds the sample's prefix (as
        :meth:`route`) while it is among them and :meth:`has_room`; otherwise ``least``, and
        the group is re-pinned there."""
        if not self.prefix_affinity:
            return least

        def spare() -> Engine | None:
            return min((e for e in free if self.has_room(e)), key=self.load.__getitem__,
                       default=None)

        return self._choose(sample, least, lambda home: home in free and self.has_room(home),
                            spare)

    def _choose(self, sample: Sample, least: Engine, room: Callable[[Engine], bool],
                spare: Callable[[], Engine | None]) -> Engine:
        """The first of ``sample``'s :meth:`homes` with ``room``; else ``least``, the group
        re-pinned there. A continuing sample that leaves its first home spills (counted), to
        ``least`` or, when only the engine's own count fills ``least`` (other clients'
        requests), to the ``spare`` engine with a free sequence (the router's own counts
        full everywhere: no engine has one, so none is looked for)."""
        homes = self.homes(sample)
        chosen = next((home for home in homes if room(home)), None)
        if chosen is not None and not sample.segments:  # a first sample went to a holder
            self.home.setdefault(sample.group_id, chosen.engine_id)
        if chosen is None:
            chosen = least
            if sample.segments and self.load[least] < least.stats().capacity and \
                    not self.has_room(least):
                chosen = spare() or least
            self.home[sample.group_id] = chosen.engine_id
        if sample.segments and homes and chosen is not homes[0]:
            self.num_spills += 1
            log.debug("sample %s spilled from %s (no room, or out of routing) to %s", sample.uid,
                      homes[0].engine_id, chosen.engine_id)
        ran = self.ran.setdefault(sample.uid, [])
        if chosen.engine_id in ran:
            ran.remove(chosen.engine_id)
        ran.append(chosen.engine_id)
        return chosen

    def homes(self, sample: Sample) -> list[Engine]:
        """The engines that hold ``sample``'s prefix, best first. A sample with tokens (an
        episode's next turn, a resumed sample): the engines that can say (:meth:`held`) and
        hold some of its next prompt, most first (ties: the latest it ran on), after its last
        engine when that one cannot say (it is assumed to hold it). A fresh sample: its
        group's home (its first sample's prefill may not have run yet: nothing to count); a
        group's first sample: the engines that hold some of its prompt (:meth:`holders`)."""
        group_home = self.by_id.get(self.home.get(sample.group_id, ""))
        if not sample.segments:
            return self.holders(sample.task.prompt_ids) if group_home is None else [group_home]
        held = self.held(sample)
        homes = [self.by_id[i] for i, n in sorted(held.items(), key=lambda kv: -kv[1]) if n > 0]
        last = self.by_id.get(sample.engine_id or "")
        if last is not None and last.engine_id not in held:
            homes.insert(0, last)
        return homes

    def holders(self, prompt: Sequence[int]) -> list[Engine]:
        """The engines that can say and hold some of ``prompt``, most first (ties: the less
        loaded first)."""
        counts = []
        for i, e in enumerate(self.engines):
            count = getattr(e, "cached_tokens", None)
            if count is not None and (n := count(prompt)) > 0:
                counts.append((-n, self.load[e], i))
        return [self.engines[i] for *_, i in sorted(counts)]

    def held(self, sample: Sample) -> dict[str, int]:
        """What each engine that may hold ``sample``'s next prompt (one its requests ran on,
        the latest first, then its group's home) holds of it now, by engine id, for the
        engines that can say (``HoldsPrefixes``): the tokens that request would not
        prefill there."""
        candidates = [*reversed(self.ran.get(sample.uid, ())), sample.engine_id or "",
                      self.home.get(sample.group_id, "")]
        prompt: list[int] | None = None
        out: dict[str, int] = {}
        for engine_id in candidates:
            count = getattr(self.by_id.get(engine_id), "cached_tokens", None)
            if count is not None and engine_id not in out:
                prompt = sample.served_ids() if prompt is None else prompt
                out[engine_id] = count(prompt)
        return out

    def end(self, sample: Sample) -> None:
        """``sample``'s run is over: forget the engines it ran on."""
        self.ran.pop(sample.uid, None)

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
