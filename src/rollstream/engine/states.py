"""An engine's states, defined once: its health (what the engine says of itself) and its
routing (what the router decides about it). The engines, the router, the dispatcher, weight
sync, the dashboard and ``rollstream engines`` all read these two enums.

Health (``EngineStats.health``, why in ``health_reason``), reported by the engine:

* ``UP``: it serves.
* ``RECOVERING``: it is being restarted (a vLLM server that died restarts itself; a local
  engine or an engine actor whose serving loop died is restarted by the rollout,
  ``Restartable``); requests wait until it is UP again.
* ``DEAD``: it will never serve again (a restart failed, no restart is left, or it was closed).

Routing, decided by the router (``rollout/routing.py``) for an engine that is UP:

* ``ROUTED``: it takes requests, least loaded first.
* ``DRAINED``: an operator took it out (preemption, ``Dispatcher.drain``) until undrained; its
  requests were handed back with their tokens. Drained wins over the breaker's states.
* ``QUARANTINED``: its breaker opened (``rollout/breaker.py``): ``rollout.breaker.failures``
  requests in a row failed without a token while it stayed UP (a grey failure: a server that
  answers HTTP 500 while its /health says 200, an engine actor that raises). It takes nothing
  until ``rollout.breaker.quarantine_s`` have passed.
* ``PROBING``: its quarantine is over: it takes one request at a time; the first that brings
  a token (or finishes) routes it again, one that fails without a token quarantines it again.

An engine takes a request only when it is UP and ROUTED (or PROBING with none in flight).
"""

from __future__ import annotations

import enum


class EngineHealth(str, enum.Enum):
    UP = "up"  # route requests here
    RECOVERING = "recovering"  # restarting itself; requests sent now wait
    DEAD = "dead"  # will never serve again; requests return ABORT with the cause


class Routing(str, enum.Enum):
    ROUTED = "routed"  # takes requests
    DRAINED = "drained"  # taken out by an operator until undrained
    QUARANTINED = "quarantined"  # its breaker opened: nothing until the quarantine ends
    PROBING = "probing"  # quarantine over: one request at a time decides
