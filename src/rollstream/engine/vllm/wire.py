"""The wire format of vLLM's token-in/token-out endpoint ``POST /inference/v1/generate``.

Requests carry prompt token ids and explicit sampling parameters; responses stream one
server-sent event per engine step: ``{"choices": [{"token_ids": [...], "logprobs":
{"content": [{"token_id", "logprob"}, ...]}, "finish_reason", "weight_versions"}]}``. No text
crosses the wire (``detokenize: false``).

Semantics fixed here:

* Stopping: ``ignore_eos: true`` plus the request's ``stop_token_ids``, so only the caller's
  stop tokens end a sample (as in the local engine); the stop token is part of ``token_ids``.
* Logprobs: ``logprobs: 0`` returns the sampled token's logprob only. The server runs with
  ``--logprobs-mode processed_logprobs`` (``server.py``; the engine refuses one that does
  not): the logprob under the distribution the token was drawn from, ``logits / T``
  truncated by top-k then top-p and renormalised (greedy: ``log_softmax`` of the raw
  logits). That is the behaviour policy the trainer recomputes with the same truncation.
* Streaming: one event per :data:`STREAM_INTERVAL_TOKENS` (16) tokens, plus the first token
  and the final event (which carries every token not yet sent, also after an abort). One
  event per token costs the client and vLLM's API server a JSON message per token; on a
  busy CPU that overhead made token delivery lag generation by seconds.
* Versions: the final event of a stream (also after an abort) carries ``weight_versions``,
  spans ``[start, end)`` of output tokens labelled with the server's weight version at the
  engine step that produced them. We label versions with ``str(int)``.

A stream that breaks has no final event. Its versions then follow from the order of events
on the client (:class:`StreamState`): a request sent at version ``v`` (or while the server is
paused for a reload to ``v``) is sampled by ``v`` until a reload during the stream resumes the
server. Tokens received before that ``/resume`` was sent were sampled before it, so by ``v``
for certain; tokens received after it may have been sampled on either side of the reload
(vLLM's API server can deliver tokens seconds late), so a broken stream's partial output
ends at the last certain token. The rest is not lost: the caller resubmits ``prompt +
partial`` and the engine samples those tokens again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rollstream.engine.protocol import FinishReason, GenerateRequest

GENERATE_PATH = "/inference/v1/generate"
STREAM_INTERVAL_TOKENS = 16
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH,
           "abort": FinishReason.ABORT}


def request_body(request: GenerateRequest, wire_id: str, max_tokens: int) -> dict:
    p = request.params
    sampling: dict = {
        "max_tokens": max_tokens, "temperature": p.temperature, "top_p": p.top_p,
        "top_k": p.top_k, "logprobs": 0, "ignore_eos": True,
        "stop_token_ids": list(p.stop_token_ids), "detokenize": False, "n": 1,
        "stream_interval": STREAM_INTERVAL_TOKENS,
    }
    if p.seed is not None:
        sampling["seed"] = p.seed
    return {"request_id": wire_id, "token_ids": list(request.prompt_ids), "stream": True,
            "sampling_params": sampling}


@dataclass(slots=True, kw_only=True)
class StreamState:
    """What one stream has delivered so far, and which versions sampled it (module doc)."""

    base_version: int  # samples the stream's tokens until a reload during it resumes
    sent_paused: bool = False  # sent while the server was paused for a reload to base_version
    token_ids: list[int] = field(default_factory=list)  # [T]
    logprobs: list[float] = field(default_factory=list)  # [T]
    num_certain: int | None = None  # tokens received before the first /resume (None: all)
    spans: list[tuple[str, int, int]] | None = None  # from the final event
    finish: FinishReason | None = None
    error: str | None = None

    def resuming(self) -> None:
        """A weight reload resumes the server now (call just before ``/resume`` is sent)."""
        if self.sent_paused:  # it has sampled nothing yet; from now on it samples base_version
            self.sent_paused = False
        elif self.num_certain is None:
            self.num_certain = len(self.token_ids)

    def feed(self, line: str) -> None:
        """Consume one SSE line (``data: {...}``); ignores keep-alives and ``[DONE]``."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        event = json.loads(line[6:])
        if "error" in event:
            err = event["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            self.finish = FinishReason.ERROR
            return
        for choice in event.get("choices") or ():
            ids = choice.get("token_ids") or []
            content = (choice.get("logprobs") or {}).get("content") or []
            if len(content) != len(ids):
                raise ValueError(f"vLLM sent {len(ids)} tokens but {len(content)} logprobs")
            self.token_ids += ids
            self.logprobs += [float(c["logprob"]) for c in content]
            if choice.get("weight_versions"):
                self.spans = [(s["version"], int(s["start"]), int(s["end"]))
                              for s in choice["weight_versions"]]
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish = _FINISH.get(reason, FinishReason.ERROR)
                if self.finish is FinishReason.ERROR:
                    self.error = f"vLLM finished the request with reason {reason!r}"

    def result(self) -> tuple[list[int], list[float], list[int]]:
        """Token ids, logprobs and per-token versions to return: every token, with the
        server's spans, when the final event came; else the tokens whose version is certain."""
        versions = self._span_versions()
        if versions is not None:
            return list(self.token_ids), list(self.logprobs), versions
        n = len(self.token_ids) if self.num_certain is None else self.num_certain
        return self.token_ids[:n], self.logprobs[:n], [self.base_version] * n

    def _span_versions(self) -> list[int] | None:
        """The spans' versions when they label every token with a number, else None."""
        if self.spans is None:
            return None
        out: list[int | None] = [None] * len(self.token_ids)
        for label, start, end in self.spans:
            if not label.lstrip("-").isdigit() or not 0 <= start <= end <= len(out):
                return None
            out[start:end] = [int(label)] * (end - start)
        return None if None in out else out  # type: ignore[return-value]
