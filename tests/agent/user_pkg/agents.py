"""A user's OpenAI-SDK agent: it plays the guessing game of ``envs.GuessNumber`` itself, with
the ``openai`` client against the session it is given, and measures each guess with the
source's ``length`` tool through the session (rollstream runs and records the call)."""

from __future__ import annotations

import openai


async def guess(session, task, sampling) -> None:
    row = task.extra["row"]
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                  max_retries=0) as client:
        for turn in range(2):
            reply = await client.chat.completions.create(
                model="kit", messages=messages, temperature=sampling.temperature,
                max_tokens=sampling.max_new_tokens)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            if str(row["target"]) in text or turn == 1:
                return
            size = await session.call_tool("length", {"text": text})
            if not size.isdigit():  # the source's tool must be there: fail the episode
                raise RuntimeError(f"the length tool answered {size!r}")
            messages.append({"role": "user", "content": f"no {size}"})


def not_async(session, task, sampling) -> None:
    """Not an agent: agents are ``async def``."""


async def two_args(session, task) -> None:
    """Not an agent: agents take (session, task, sampling)."""
