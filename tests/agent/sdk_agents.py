"""OpenAI-SDK agents for the harness tests, at an import path (``tests.agent.sdk_agents:...``)
as the OpenAI harness needs: it runs them here or in its worker processes, which import this
module. What an agent does is read from its task's text (the prompt itself is always
``OPENING``): ``"<turns> [rewrite] [pid] [crash] [hang] [tools] [nonce] [record]
[bigrecord] [nanrecord]"``."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import openai

from rollstream.agent.proxy import SessionHandle
from rollstream.engine import SamplingParams
from rollstream.trajectory import Task

OPENING = [{"role": "user", "content": "go"}]


NONCE = uuid.uuid4().hex[:6]  # this process's: a resumed run's agent says another
SIDE_EFFECTS: list[str] = []  # what the agent's own code did, in this process


def user_message(i: int, task: Task) -> str:
    """What the scripted agent says after model turn ``i`` (its process id with ``pid``, a
    nonce of its process with ``nonce``)."""
    flags = task.prompt_text.split()
    return (f"more {i}" + (f" pid {os.getpid()}" if "pid" in flags else "")
            + (f" nonce {NONCE}" if "nonce" in flags else ""))


async def scripted(session: SessionHandle, task: Task, sampling: SamplingParams) -> Any:
    """Answers every model turn with a tool message and a user message, for ``turns`` turns;
    ``rewrite``: rewrites its history after the first; ``crash``: its process exits after
    the first reply (exit code 3); ``hang``: it blocks there (not an ``await``: nothing in
    its process can stop it); ``tools``: each tool message is what the run's ``calc`` tool
    answered (``session.call_tool``), and the agent notes a side effect of its own. It
    returns an episode record with ``record`` (its turns and last reply), one over the
    harness's size limit with ``bigrecord``, one that is not JSON with ``nanrecord``."""
    turns, *flags = task.prompt_text.split()
    messages = list(OPENING)
    async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                  max_retries=0) as client:
        for i in range(int(turns)):
            reply = await client.chat.completions.create(
                model="m", messages=messages, temperature=sampling.temperature,
                max_tokens=sampling.max_new_tokens)
            if "crash" in flags:
                os._exit(3)
            if "hang" in flags:
                time.sleep(3600)  # noqa: ASYNC251 - the point: a hang no await can end
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            result = f"r{i}"
            if "tools" in flags:
                SIDE_EFFECTS.append(f"{task.uid} after turn {i}")
                result = await session.call_tool("calc", {"expression": f"{i}+100"})
            messages += [{"role": "tool", "content": result},
                         {"role": "user", "content": user_message(i, task)}]
            if "rewrite" in flags:
                messages = [*OPENING, {"role": "user", "content": "start again"}]
    if "record" in flags:
        return {"turns": int(turns), "last": messages[-3].get("content")}
    if "bigrecord" in flags:
        return {"pad": "x" * (1 << 20)}
    if "nanrecord" in flags:
        return {"score": float("nan")}
    return None
