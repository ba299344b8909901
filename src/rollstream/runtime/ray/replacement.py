"""The replacement of an engine actor that died, placed while the run goes on.

When an engine actor dies (its process was killed, its engine's loop died, or its node left
the cluster), its proxy (``engines.py``) asks Ray for a new actor at once, in the same place
as the old one (its scale unit's bundle, ``units.py``), and does not wait for it: the old one
is killed first (a live actor whose engine died still holds the bundle's CPUs). Only once the
new actor answered its first call does the proxy report that it needs a restart, so the
rollout's supervisor, under weight sync's lock, only hands it the current weights
(:meth:`RayEngine.restart`): a replacement that cannot be placed never holds that lock.

Where it can be placed depends on what the cluster has left. A bundle whose node left is
placed again by Ray on another node with room for it (Ray's placement groups reschedule the
bundles of a dead node), and the replacement starts there; until such a node exists (or one
joins the cluster), the replacement waits, the engine stays RECOVERING, and the run goes on
with the engines it has: after :data:`REPORT_AFTER_S` the engine's ``health_reason`` (what
``rollstream engines RUN`` and the dashboard show) and the log say so. A replacement still
waiting when the run ends is killed with the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from rollstream.engine.protocol import EngineStats

log = logging.getLogger(__name__)
REPORT_AFTER_S = 3.0  # a replacement not placed by then is reported (an actor starts in ~1 s)


class Replacement:
    """At most one new actor on its way for one engine: begun, placed, taken."""

    def __init__(self, *, engine_id: str, spawn: Callable[[int], Any]) -> None:
        self.engine_id, self._spawn = engine_id, spawn
        self.actor: Any = None  # the new actor (None: none on its way)
        self._answer: Any = None  # its first stats call, in flight until it is placed
        self._since = 0.0  # time.monotonic() it was asked for
        self._reported = False

    def placed(self, old: Any, version: int) -> bool:
        """Whether a replacement of ``old`` answered (or failed: :meth:`take`'s caller finds
        out); asks for one first if none is on its way."""
        import ray

        if self.actor is None:
            ray.kill(old, no_restart=True)  # frees the bundle's CPUs if it still lives
            self.actor, self._since, self._reported = self._spawn(version), time.monotonic(), False
            self._answer = self.actor.stats.remote()
            log.warning("ray engine %s: a replacement actor is asked for", self.engine_id)
        if ray.wait([self._answer], timeout=0)[0]:
            return True
        if not self._reported and self.waited_s() >= REPORT_AFTER_S:
            self._reported = True
            log.warning("ray engine %s: %s", self.engine_id, self.waiting())
        return False

    def waited_s(self) -> float:
        return time.monotonic() - self._since if self.actor is not None else 0.0

    def waiting(self) -> str | None:
        """Why the engine is still down, once its replacement waited REPORT_AFTER_S."""
        if self.actor is None or self.waited_s() < REPORT_AFTER_S:
            return None
        return (f"its replacement has waited {self.waited_s():.0f} s for room on the cluster "
                "(its scale unit's node may have left and no node has the unit's resources "
                "free); the run goes on with the other engines and this one serves again "
                "once Ray places it")

    def take(self) -> Any:
        """The placed actor, no longer this object's to kill."""
        actor, self.actor, self._answer = self.actor, None, None
        return actor

    def drop(self) -> None:
        """Kill a replacement still on its way (the engine closes)."""
        import ray

        if self.actor is not None:
            ray.kill(self.take(), no_restart=True)


class Totals:
    """Counters of replaced actors, so an engine's totals stay monotonic across restarts."""

    def __init__(self) -> None:
        self.tokens, self.busy_s, self.work = 0, 0.0, {}

    def add(self, st: EngineStats, delivered: int) -> None:
        self.tokens += max(st.generated_tokens, delivered)
        self.busy_s += st.busy_s
        self.work = {k: self.work.get(k, 0.0) + v for k, v in st.work.items()}
