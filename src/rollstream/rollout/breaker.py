"""One engine's breaker: an engine that stays UP but fails every request is quarantined, and
probed back after a while (``rollout.breaker``).

    ROUTED --``failures`` in a row without a token--> QUARANTINED
       ^                                                  | quarantine_s passed
       |                                                  v
       +--------- a request brings a token ------------ PROBING --a failure--> QUARANTINED

Why routing needs it: an engine's health (``EngineHealth``) says whether it serves, not
whether what it serves is any good. A grey failure (a vLLM server answering HTTP 500 while its
``/health`` says 200, an engine actor that raises) answers at once, so it holds no request,
and least-load routing sends it a large share of the requests (docs/dispatch.md measures a
run that lost half its samples so). The dispatcher retries each such request on another
engine with its tokens; the breaker stops sending it more.

What counts, in the order requests end (``Router.observe``): a request of an UP engine that
ended with an engine fault and no token is a failure; one that brought a token, or finished,
is a success and clears the count. A request's own fault (``ERROR``), an interrupt, and the
requests of an engine that is not UP (its health handles those) count for nothing. While
QUARANTINED, the requests sent before it ends count for nothing either: the quarantine lasts
its ``quarantine_s``. A PROBING engine takes one request at a time (the router's rule).

Time comes from the caller (the dispatcher's clock), so the simulator runs it unchanged.
"""

from __future__ import annotations

from rollstream.engine.states import Routing


class Breaker:
    def __init__(self, *, failures: int, quarantine_s: float) -> None:
        """``failures``: failed requests in a row that quarantine (0: never);
        ``quarantine_s``: how long a quarantine lasts before the probe."""
        if failures < 0 or quarantine_s <= 0:
            raise ValueError(f"breaker needs failures >= 0 and quarantine_s > 0, got "
                             f"{failures} and {quarantine_s}")
        self.max_failures = failures
        self.quarantine_s = quarantine_s
        self.streak = 0  # failed requests in a row
        self.until: float | None = None  # quarantined until this time (None: routed)
        self.reason: str | None = None  # why it was quarantined
        self.num_quarantines = 0

    def routing(self, now: float) -> Routing:
        """ROUTED, QUARANTINED or PROBING at time ``now``."""
        if self.until is None:
            return Routing.ROUTED
        return Routing.QUARANTINED if now < self.until else Routing.PROBING

    def failed(self, now: float, why: str) -> bool:
        """A request failed without a token (the engine's fault, ``why``); True when this
        quarantined the engine."""
        state = self.routing(now)
        if self.max_failures == 0 or state is Routing.QUARANTINED:
            return False
        self.streak += 1
        if state is Routing.ROUTED and self.streak < self.max_failures:
            return False
        self.until = now + self.quarantine_s
        self.num_quarantines += 1
        self.reason = (f"{self.streak} requests in a row failed without a token "
                       f"(last: {why}); quarantined for {self.quarantine_s:g} s")
        return True

    def succeeded(self, now: float) -> bool:
        """A request brought a token or finished; True when this routed the engine again."""
        state = self.routing(now)
        if state is Routing.QUARANTINED:
            return False
        self.streak, self.until, self.reason = 0, None, None
        return state is Routing.PROBING
