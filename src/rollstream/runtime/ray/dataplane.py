"""The data plane between the driver and its engine actors: token arrays packed, sent out of
band when large, and only the tokens an episode added since its last call.

    driver (RayEngine)                                    engine actor
    ----------------------------------------------------  -----------------------------------
    Episodes.plan(request) -> GenerateCall + prompt ids    Histories.prompt(call, ids)
      (base: the stamp of the history the actor keeps;       history[base] + ids, or None: it
       ids: only the tokens added since)                     does not hold it (evicted, a new
                                                             actor): the driver sends it whole
    prompt ids packed (int32): inline, or ray.put          Histories.keep(stamp, prompt + out)
    above runtime.ray.out_of_band_bytes (a reference)      reply tokens packed: inline, or
                                                           ray.put above the same threshold

**Control plane**: the call (request id, sampling params, stamps) and its reply (finish
reason, error), with a payload small enough to ride along. **Data plane**: a payload above the
threshold goes through Ray's object store (shared memory on one host, Ray's object transfer
across hosts) and the call carries its reference. Ray itself stores an argument or a return
above ~100 KiB in the object store; the threshold makes the split explicit, counted
(``wire.py``) and lower where that pays.

**Episodes** (``GenerateRequest.episode_id``: a sample's turns and the resubmissions after an
interrupt): each completed call's prompt + output is kept by the actor under the call's
*stamp* (unique in this process) and mirrored by the proxy. A call that extends the mirrored
history exactly (compared token by token on the driver) sends the new tokens and the stamp it
extends; anything else sends the whole prompt. Both sides drop an episode's history when a
call for it starts (a call in flight holds none), keep a new one only when a call completes,
and evict the oldest past ``runtime.ray.episode_cache_tokens``; the actor also drops the
stamps the proxy tells it (episodes that ended or moved to another engine) with its next
call. So the actor never builds a prompt from a history other than the one the driver
compared against, and a history it lacks costs one more call, never a wrong prompt. The
call also names its episode, so that the actor's engine keeps the turn's keys and values in
its prefix cache as the embedded engine does, and the episodes that ended or moved away, so
that it demotes theirs (``end_episode``).
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollstream.engine.protocol import FinishReason, GenerateOutput, GenerateRequest, SamplingParams
from rollstream.trajectory import Routing

_STAMPS = itertools.count(1)  # histories' stamps: unique among this process's proxies


# ---- packed token arrays ----------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Tokens:
    """Token ids (int32), their logprobs (float32 where that is exact, else float64) and their
    versions as (version, count) runs (int64): 8 bytes a token plus the runs, where the
    pickled lists cost ~15. A reply's also carries a mixture-of-experts model's routing
    (``GenerateOutput.routing``: bytes already, of the whole prompt + output), so that it
    travels with the tokens, out of band when they do."""

    ids: bytes
    logprobs: bytes
    runs: bytes
    routing: Routing | None = None

    @property
    def nbytes(self) -> int:
        routed = 0 if self.routing is None else len(self.routing.experts)
        return len(self.ids) + len(self.logprobs) + len(self.runs) + routed

    def unpack(self) -> tuple[list[int], list[float], list[int]]:
        ids = array("i", self.ids).tolist()
        lps = array("f" if len(self.logprobs) == 4 * len(ids) else "d", self.logprobs).tolist()
        runs = array("q", self.runs)
        versions = [v for v, n in zip(runs[::2], runs[1::2], strict=True) for _ in range(n)]
        return ids, lps, versions


def pack(token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
         routing: Routing | None = None) -> Tokens:
    single = array("f", logprobs)
    lps = single if single.tolist() == list(logprobs) else array("d", logprobs)
    runs: list[int] = []
    for v in versions:
        if runs and runs[-2] == v:
            runs[-1] += 1
        else:
            runs += [v, 1]
    return Tokens(ids=array("i", token_ids).tobytes(), logprobs=lps.tobytes(),
                  runs=array("q", runs).tobytes(), routing=routing)


def pack_ids(token_ids: Sequence[int]) -> bytes:
    return array("i", token_ids).tobytes()


def unpack_ids(blob: bytes) -> list[int]:
    return array("i", blob).tolist()


def payload_size(value: Any) -> int:
    """The bytes of a payload: packed ids or :class:`Tokens`."""
    return len(value) if isinstance(value, bytes) else value.nbytes


def offload(value: Any, threshold: int) -> Any:
    """``value`` (a payload) itself when at most ``threshold`` bytes, else its reference in
    Ray's object store (owned by this process)."""
    if payload_size(value) <= threshold:
        return value
    import ray

    return ray.put(value)


def is_ref(value: Any) -> bool:
    from ray import ObjectRef

    return isinstance(value, ObjectRef)


# ---- the messages -----------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class GenerateCall:
    """A generate call's control message; its prompt tokens travel beside it (an argument of
    their own, which Ray resolves when it is a reference)."""

    request_id: str
    params: SamplingParams
    base: int  # the stamp of the history the tokens extend; 0: they are the whole prompt
    stamp: int  # keep prompt + output under this stamp; 0: keep nothing
    forget: tuple[int, ...] = ()  # stamps the actor may drop
    episode_id: str | None = None  # the request's: its engine keeps the turn's cache for it
    ended: tuple[str, ...] = ()  # episodes this actor's engine serves no more (end_episode)


@dataclass(slots=True, frozen=True)
class GenerateReply:
    """None instead of this: the actor does not hold ``base`` (send the prompt whole)."""

    finish_reason: FinishReason
    error: str | None
    tokens: Any  # Tokens, or its ObjectRef


@dataclass(slots=True, frozen=True)
class PeekReply:
    """The tokens each running request sampled since the last peek: ``entries`` are (request
    id, tokens it had before, new tokens), their tokens concatenated in ``tokens``."""

    entries: tuple[tuple[str, int, int], ...]
    tokens: Any  # Tokens, or its ObjectRef


def output(request_id: str, reply: GenerateReply, tokens: Tokens) -> GenerateOutput:
    ids, lps, versions = tokens.unpack()
    return GenerateOutput(request_id=request_id, token_ids=ids, logprobs=lps,
                          versions=versions, finish_reason=reply.finish_reason,
                          error=reply.error, routing=tokens.routing)


# ---- the actor's side -------------------------------------------------------------------
class Histories:
    """The engine actor's episode histories by stamp, at most ``max_tokens`` tokens (oldest
    evicted first), 4 bytes a token."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens, self.num_tokens = max_tokens, 0
        self._kept: OrderedDict[int, array] = OrderedDict()

    def prompt(self, call: GenerateCall, ids: list[int]) -> list[int] | None:
        """The call's whole prompt: ``ids`` after its base history (None: not held)."""
        for stamp in call.forget:
            self._drop(stamp)
        if not call.base:
            return ids
        base = self._drop(call.base)
        return None if base is None else base.tolist() + ids

    def keep(self, stamp: int, token_ids: list[int]) -> None:
        if not stamp or len(token_ids) > self.max_tokens:
            return
        self._kept[stamp] = array("i", token_ids)
        self.num_tokens += len(token_ids)
        while self.num_tokens > self.max_tokens:
            self.num_tokens -= len(self._kept.popitem(last=False)[1])

    def _drop(self, stamp: int) -> array | None:
        held = self._kept.pop(stamp, None)
        if held is not None:
            self.num_tokens -= len(held)
        return held


class PeekCursor:
    """The actor's record of how many tokens of each running request it has peeked, so that
    each peek sends only the new ones."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def deltas(self, outs: Sequence[GenerateOutput]) -> tuple[tuple[tuple[str, int, int], ...],
                                                               Tokens]:
        sent, self._sent = self._sent, {}
        entries, ids, lps, versions = [], [], [], []
        for o in outs:
            start = sent.get(o.request_id, 0)
            start = start if start <= len(o.token_ids) else 0
            self._sent[o.request_id] = len(o.token_ids)
            if len(o.token_ids) > start:
                entries.append((o.request_id, start, len(o.token_ids) - start))
                ids += o.token_ids[start:]
                lps += o.logprobs[start:]
                versions += o.versions[start:]
        return tuple(entries), pack(ids, lps, versions)


# ---- the driver's side ------------------------------------------------------------------
class Episodes:
    """The proxy's mirror of the histories its actor keeps, by episode id, at most
    ``max_tokens`` tokens (oldest evicted first; 0: none, every prompt goes whole).
    ``holders`` (shared by the run's proxies): which proxy's actor holds an episode, so that
    the one it left forgets it."""

    def __init__(self, max_tokens: int, holders: dict[str, Episodes] | None = None) -> None:
        self.max_tokens, self.num_tokens = max_tokens, 0
        self._holders = holders if holders is not None else {}
        self._kept: OrderedDict[str, tuple[int, array]] = OrderedDict()
        self._forget: list[int] = []  # stamps to tell the actor with the next call
        self._ended: list[str] = []  # episodes whose cached turns its engine may demote

    def sharing(self) -> Episodes:
        """An empty mirror of the same size for another proxy of the run, sharing ``holders``."""
        return Episodes(self.max_tokens, self._holders)

    def plan(self, request: GenerateRequest, *, whole: bool = False) -> tuple[GenerateCall,
                                                                              list[int]]:
        """The call for ``request`` and the prompt tokens it sends (all of them when
        ``whole``, or when the actor holds no history the prompt extends)."""
        eid, prompt = request.episode_id, request.prompt_ids
        base, stamp, ids = 0, 0, prompt
        if eid is not None and self.max_tokens:
            stamp = next(_STAMPS)
            other = self._holders.get(eid)
            if other is not None and other is not self:
                other._release(eid)  # it moved here: the engine it left may forget it
            self._holders[eid] = self
            held = self._drop(eid)
            if held is not None:
                old, hist = held
                n = len(hist)
                if not whole and len(prompt) >= n and hist == array("i", prompt[:n]):
                    base, ids = old, prompt[n:]
                else:
                    self._forget.append(old)
        forget, self._forget = tuple(self._forget), []
        ended, self._ended = tuple(self._ended), []
        return GenerateCall(request.request_id, request.params, base, stamp, forget,
                            eid, ended), ids

    def done(self, request: GenerateRequest, call: GenerateCall,
             out: GenerateOutput | None) -> None:
        """``call`` completed with ``out`` (None: no reply came, e.g. cancelled: what the
        actor may have kept under its stamp is dropped there with the next call)."""
        eid = request.episode_id
        if not call.stamp or eid is None:
            return
        if out is None or out.finish_reason is FinishReason.ERROR or \
                self._holders.get(eid) is not self:
            self._forget.append(call.stamp)
            return
        hist = array("i", request.prompt_ids)
        hist.extend(out.token_ids)
        if len(hist) > self.max_tokens:
            self._forget.append(call.stamp)
            return
        self._drop(eid)
        self._kept[eid] = (call.stamp, hist)
        self.num_tokens += len(hist)
        while self.num_tokens > self.max_tokens:
            self._forget.append(self._evict())

    def end(self, episode_id: str) -> None:
        """The episode sends no more requests: the actor that holds it (this proxy's or
        another's) may forget it, and the engines that served it demote its cached turns."""
        holder = self._holders.pop(episode_id, None)
        self._release(episode_id)
        if holder is not None and holder is not self:
            holder._release(episode_id)

    def _release(self, episode_id: str) -> None:
        """Drop the episode's mirror; its actor drops its history, and its engine demotes the
        episode's cached turns, with the next call."""
        self._ended.append(episode_id)
        held = self._drop(episode_id)
        if held is not None:
            self._forget.append(held[0])

    def reset(self) -> None:
        """A new actor holds nothing."""
        for eid in self._kept:
            if self._holders.get(eid) is self:
                del self._holders[eid]
        self._kept.clear()
        self._forget.clear()
        self._ended.clear()
        self.num_tokens = 0

    def _evict(self) -> int:
        eid, (stamp, hist) = self._kept.popitem(last=False)
        self.num_tokens -= len(hist)
        if self._holders.get(eid) is self:
            del self._holders[eid]
        return stamp

    def _drop(self, eid: str) -> tuple[int, array] | None:
        held = self._kept.pop(eid, None)
        if held is not None:
            self.num_tokens -= len(held[1])
        return held
