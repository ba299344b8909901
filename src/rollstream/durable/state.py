"""Groups and samples as JSON, token for token (what a checkpoint saves of the rollout).

Every per-token field of every segment is kept (ids, behaviour logprobs, versions, loss
mask), an episode's turns (tool calls and their results: what a resumed episode replays) and
its environment's snapshot (what a resumed episode restores instead, when its environment
can snapshot; absent from older checkpoints), the contexts where its chat template rewrote
earlier turns (``contexts``, written only when there are some: older checkpoints have none),
a mixture-of-experts sample's recorded routing (``routing``, its bytes in base64; absent
when it has none),
with the sample's status and what it has
recorded so far, so that a restored sample continues exactly where the saved one stood:
``prompt + tokens so far`` is resubmitted with the versions of the saved tokens unchanged.
"""

from __future__ import annotations

import base64
from typing import Any

from rollstream.trajectory import (
    SINGLE_TURN,
    Context,
    EnvSnapshot,
    Group,
    Routing,
    Sample,
    SampleStatus,
    Segment,
    SegmentKind,
    Task,
    ToolCall,
    ToolResult,
    Turn,
)


def task_to_dict(task: Task) -> dict[str, Any]:
    return {"uid": task.uid, "source": task.source, "prompt_ids": list(task.prompt_ids),
            "prompt_text": task.prompt_text, "reference": task.reference,
            "harness": task.harness, "extra": dict(task.extra)}


def task_from_dict(d: dict[str, Any]) -> Task:
    return Task(uid=d["uid"], source=d["source"], prompt_ids=tuple(d["prompt_ids"]),
                prompt_text=d["prompt_text"], reference=d["reference"],
                harness=d.get("harness", SINGLE_TURN), extra=d.get("extra", {}))


def _call_to_dict(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "name": c.name, "arguments": c.arguments}


def _turn_to_dict(t: Turn) -> dict[str, Any]:
    return {"kind": t.kind.value, "num_tokens": t.num_tokens, "started_s": t.started_s,
            "duration_s": t.duration_s, "finish_reason": t.finish_reason,
            "num_interrupts": t.num_interrupts,
            "tool_calls": [_call_to_dict(c) for c in t.tool_calls],
            "tool_results": [{"call": _call_to_dict(r.call), "content": r.content, "ok": r.ok,
                              "error": r.error, "duration_s": r.duration_s}
                             for r in t.tool_results]}


def _turn_from_dict(d: dict[str, Any]) -> Turn:
    return Turn(kind=SegmentKind(d["kind"]), num_tokens=d["num_tokens"],
                started_s=d["started_s"], duration_s=d["duration_s"],
                finish_reason=d["finish_reason"], num_interrupts=d["num_interrupts"],
                tool_calls=[ToolCall(**c) for c in d["tool_calls"]],
                tool_results=[ToolResult(call=ToolCall(**r["call"]), content=r["content"],
                                         ok=r["ok"], error=r["error"],
                                         duration_s=r["duration_s"])
                              for r in d["tool_results"]])


def group_to_dict(group: Group) -> dict[str, Any]:
    return {"group_id": group.group_id, "task": task_to_dict(group.task),
            "samples": [_sample_to_dict(s) for s in group.samples]}


def group_from_dict(d: dict[str, Any]) -> Group:
    task = task_from_dict(d["task"])
    gid = d["group_id"]
    samples = [_sample_from_dict(s, task, gid) for s in d["samples"]]
    return Group(group_id=gid, task=task, samples=samples)


def _sample_to_dict(s: Sample) -> dict[str, Any]:
    if s.status is SampleStatus.RUNNING:
        raise AssertionError(f"sample {s.uid} is RUNNING: interrupt it before a snapshot")
    out: dict[str, Any] = {
        "idx": s.sample_idx, "status": s.status.value, "reward": s.reward,
        "finish_reason": s.finish_reason, "failure": s.failure, "engine_id": s.engine_id,
        "num_interrupts": s.num_interrupts, "num_restored_tokens": s.num_restored_tokens,
        "temperature": s.temperature,
        "segments": [{"kind": g.kind.value, "token_ids": list(g.token_ids),  # copies: the
                      "logprobs": list(g.logprobs), "versions": list(g.versions),  # sample
                      "loss_mask": list(g.loss_mask)} for g in s.segments],  # grows on
        "turns": [_turn_to_dict(t) for t in s.turns],
        "env_snapshot": None if (e := s.env_snapshot) is None else {  # frozen: no copy
            "num_segments": e.num_segments, "state": e.state, "messages": e.messages},
    }
    if s.routing is not None:  # frozen: no copy
        out["routing"] = _routing_to_dict(s.routing)
    if s.episode_record is not None:  # a JSON object (the harness checked it), kept as it is
        out["episode_record"] = s.episode_record
    if s.contexts:
        out["contexts"] = [{"num_segments": c.num_segments, "token_ids": list(c.token_ids),
                            **({} if c.routing is None
                               else {"routing": _routing_to_dict(c.routing)})}
                           for c in s.contexts]
    return out


def _routing_to_dict(r: Routing) -> dict[str, Any]:
    """Its bytes as base64."""
    return {"num_layers": r.num_layers, "top_k": r.top_k, "wide": r.wide,
            "experts": base64.b64encode(r.experts).decode("ascii")}


def _routing_from_dict(r: dict[str, Any] | None) -> Routing | None:
    return None if r is None else Routing(num_layers=r["num_layers"], top_k=r["top_k"],
                                          wide=r["wide"], experts=base64.b64decode(r["experts"]))


def _sample_from_dict(d: dict[str, Any], task: Task, group_id: str) -> Sample:
    segments = [Segment(kind=SegmentKind(g["kind"]), token_ids=list(g["token_ids"]),
                        logprobs=list(g["logprobs"]), versions=list(g["versions"]),
                        loss_mask=list(g["loss_mask"])) for g in d["segments"]]
    sample = Sample(task=task, group_id=group_id, sample_idx=d["idx"], segments=segments,
                    status=SampleStatus(d["status"]), reward=d["reward"],
                    finish_reason=d["finish_reason"], failure=d["failure"],
                    engine_id=d["engine_id"], num_interrupts=d["num_interrupts"],
                    num_restored_tokens=d["num_restored_tokens"],
                    temperature=d.get("temperature"),
                    turns=[_turn_from_dict(t) for t in d.get("turns", ())],
                    env_snapshot=None if (e := d.get("env_snapshot")) is None else EnvSnapshot(
                        num_segments=e["num_segments"], state=e["state"],
                        messages=e["messages"]),
                    contexts=[Context(num_segments=c["num_segments"],
                                      token_ids=tuple(c["token_ids"]),
                                      routing=_routing_from_dict(c.get("routing")))
                              for c in d.get("contexts", ())],
                    routing=_routing_from_dict(d.get("routing")),
                    episode_record=d.get("episode_record"))
    if sample.status is SampleStatus.INTERRUPTED:  # a partial sample: it continues from these
        sample.num_restored_tokens = sample.num_response_tokens
    return sample
