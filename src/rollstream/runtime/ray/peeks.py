"""What the driver knows of a Ray engine actor's requests in flight: their tokens at the last
peek, and the listeners of those that stream (``GenerateRequest.on_tokens``).

Every ``PEEK_S`` while it polls, the driver copies the running requests' tokens sampled since
the last peek (``engines.py``): an actor that dies loses only what was sampled after it. The
same peeks stream: the engine samples in another process, so while a request with
``on_tokens`` is in flight the driver peeks every :data:`STREAM_PEEK_S`, and each peek that
brings a streamed request's tokens hands the new ones to its listener. When the call returns,
the tokens of its output not heard yet follow, so that what a listener hears adds up to the
output, in order and each token once, as on the local engine (whose listeners hear every
step).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from rollstream.engine.protocol import FinishReason, GenerateOutput, OnTokens
from rollstream.runtime.ray.dataplane import Tokens

log = logging.getLogger(__name__)
STREAM_PEEK_S = 0.02  # how often the driver peeks while a request streams


class Peeked:
    """Per request in flight: its tokens at the last peek (``partial``) and, when it streams,
    its listener and how many of its tokens that heard."""

    def __init__(self) -> None:
        self.partial: dict[str, GenerateOutput] = {}
        self._heard: dict[str, tuple[OnTokens, int]] = {}

    def merge(self, entries: tuple[tuple[str, int, int], ...], tokens: Tokens,
              inflight: Collection[str]) -> None:
        """Append each request's new tokens to what earlier peeks brought (from 0: replace;
        out of step with them, e.g. a reply of another proxy's peek: keep none); listeners
        hear what is new."""
        ids, lps, versions = tokens.unpack()
        at = 0
        for rid, start, n in entries:
            part, at = slice(at, at + n), at + n
            have = self.partial.get(rid)
            if rid not in inflight:
                continue
            if start == 0:
                self.partial[rid] = GenerateOutput(
                    request_id=rid, token_ids=ids[part], logprobs=lps[part],
                    versions=versions[part], finish_reason=FinishReason.ABORT)
            elif have is not None and len(have.token_ids) == start:
                have.token_ids.extend(ids[part])
                have.logprobs.extend(lps[part])
                have.versions.extend(versions[part])
            else:
                self.partial.pop(rid, None)
            if (now := self.partial.get(rid)) is not None:
                self._known(rid, now.token_ids)

    # ---- streams ---------------------------------------------------------------------------
    @property
    def streaming(self) -> bool:
        return bool(self._heard)

    def listen(self, request_id: str, on_tokens: OnTokens) -> None:
        self._heard[request_id] = (on_tokens, 0)

    def end(self, request_id: str, tokens: Sequence[int]) -> None:
        """The call returned ``tokens`` (its output): its listener hears the rest of them."""
        self._known(request_id, tokens)
        self._heard.pop(request_id, None)

    def _known(self, request_id: str, tokens: Sequence[int]) -> None:
        """``tokens``: all the request's tokens known here (a prefix of its output)."""
        entry = self._heard.get(request_id)
        if entry is None or len(tokens) <= entry[1]:
            return
        on_tokens, heard = entry
        self._heard[request_id] = (on_tokens, len(tokens))
        try:
            on_tokens(list(tokens[heard:]))
        except Exception:  # a listener's fault never fails the request
            log.exception("on_tokens of request %s raised", request_id)
