"""The wire format of vLLM's token-in/token-out endpoint ``POST /inference/v1/generate``.

Requests carry prompt token ids and explicit sampling parameters; responses stream one
server-sent event per engine step: ``{"choices": [{"token_ids": [...], "logprobs":
{"content": [{"token_id", "logprob"}, ...]}, "finish_reason", "weight_versions"}]}``. No text
crosses the wire (``detokenize: false``).

Semantics fixed here:

* Stopping: ``ignore_eos: true`` plus the request's ``stop_token_ids``, so only the caller's
  stop tokens end a sample (as in the local engine); the stop token is part of ``token_ids``.
* Logprobs: ``logprobs: 0`` returns the sampled token's logprob only. vLLM's default
  ``logprobs_mode`` is ``raw_logprobs``: log-softmax of the model's raw logits, before
  temperature, top-k and top-p. That is the behaviour policy at temperature 1, i.e. exactly
  what the trainer recomputes (the protocol's "logits at T=1"), whatever the sampling params.
* Streaming: one event per :data:`STREAM_INTERVAL_TOKENS` (16) tokens, plus the first token
  and the final event (which carries every token not yet sent, also after an abort). One
  event per token costs the client and vLLM's API server a JSON message per token; on a
  busy CPU that overhead made token delivery lag generation by seconds.
* Versions: the final event of a stream (also after an abort) carries ``weight_versions``,
  spans ``[start, end)`` of output tokens labelled with the server's weight version at the
  engine step that produced them. We label versions with ``str(int)``.
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
    """What one stream has delivered so far."""

    token_ids: list[int] = field(default_factory=list)  # [T]
    logprobs: list[float] = field(default_factory=list)  # [T]
    receipt_versions: list[int] = field(default_factory=list)  # [T] client-side fallback
    spans: list[tuple[str, int, int]] | None = None  # from the final event
    finish: FinishReason | None = None
    error: str | None = None

    def feed(self, line: str, receipt_version: int) -> None:
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
            self.receipt_versions += [receipt_version] * len(ids)
            if choice.get("weight_versions"):
                self.spans = [(s["version"], int(s["start"]), int(s["end"]))
                              for s in choice["weight_versions"]]
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish = _FINISH.get(reason, FinishReason.ERROR)
                if self.finish is FinishReason.ERROR:
                    self.error = f"vLLM finished the request with reason {reason!r}"

    def versions(self) -> list[int]:
        """Per-token versions: the server's spans when it sent them (exact), else the
        client-side receipt versions (only after a broken stream; see engine.py)."""
        if self.spans is None:
            return list(self.receipt_versions)
        out = list(self.receipt_versions)
        for label, start, end in self.spans:
            if label.lstrip("-").isdigit():
                out[start:end] = [int(label)] * (end - start)
        return out
