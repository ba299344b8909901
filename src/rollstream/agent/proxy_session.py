"""A proxy session's calls stitched into samples by dialogue-prefix matching.

A session holds its samples and its *heads*: after a call, one per choice of its reply, the
sample that choice ended and the messages the call sent plus that reply. The next call
continues the first head whose messages it extends (the new messages rendered after the
tokens already served, ``ChatRenderer.extend``; where the chat template rewrites the earlier
turns, the whole conversation rendered anew, a ``trajectory.Context`` that splits the sample
into turn-samples as the agent loop does); a call that extends none (it rewrote its
history), or follows a call that failed (no heads), starts a new sample, recorded with the
reason. A call with ``n`` choices forks its sample: choice 0 goes on in it, choice ``i`` in a
copy of it up to this call's prompt (``started_because``: ``choice i of call k``), so every
choice is its own sample and the next call goes on in the one whose reply it kept.

What one session may hold is bounded (:class:`~rollstream.config.tasks.ProxyConfig`): the
bytes of message text its samples hold, and the context a prompt must fit, checked by the
text's length before it is rendered when that alone cannot fit.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollstream.agent.chat import ChatRenderer, Message
from rollstream.agent.proxy_episode import Binding, EpisodeRefused
from rollstream.agent.proxy_wire import Refused
from rollstream.agent.tools import ToolCallParser
from rollstream.config.tasks import ProxyConfig
from rollstream.engine import Engine
from rollstream.trajectory import Context, Segment, ToolCall, served_ids


@dataclass(slots=True, kw_only=True)
class ProxySample:
    """One stitched trajectory of a session."""

    prompt_ids: list[int]
    messages: list[Message]  # the conversation as rendered (model turns as their raw text)
    segments: list[Segment] = field(default_factory=list)
    num_calls: int = 0
    started_because: str | None = None  # why a new sample began (None: the first one)
    contexts: list[Context] = field(default_factory=list)  # where the template rewrote turns

    @property
    def token_ids(self) -> list[int]:
        """What the model is served next (``trajectory.served_ids``)."""
        return served_ids(self.prompt_ids, self.segments, self.contexts)


@dataclass(slots=True, kw_only=True)
class Head:
    """A sample a next call may continue: the last call's messages and one choice of its
    reply, and whether that reply ended with its stop token."""

    sample: ProxySample
    seen: list[Message]
    ended_turn: bool


@dataclass(slots=True, kw_only=True)
class Session:
    id: str  # the public half of its key: what request ids, episode ids and logs show
    secret: bytes
    episode_id: str
    samples: list[ProxySample] = field(default_factory=list)
    heads: list[Head] = field(default_factory=list)  # none: no call yet, or the last failed
    engine: Engine | None = None
    num_calls: int = 0
    num_tool_calls: int = 0
    history_bytes: int = 0  # message text its samples hold (ProxyConfig.max_session_...)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    binding: Binding | None = None  # a training sample's session
    closed: bool = False  # ended: a call that was waiting for the lock is refused


@dataclass(slots=True, kw_only=True)
class Stitcher:
    """Places each call of a session in its sample (module docstring). ``context_tokens``:
    what one sequence may hold on the engines (None: no check here)."""

    tokenizer: Any
    parser: ToolCallParser
    limits: ProxyConfig
    context_tokens: int | None
    # a token covers at most this many characters, so text of n characters is at least
    # n / this many tokens: a prompt can be refused before it is rendered or tokenized
    max_token_chars: int = 1

    def __post_init__(self) -> None:
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) or 1

    async def place(self, session: Session, messages: list[Message],
                    renderer: ChatRenderer) -> ProxySample:
        """The sample this call continues or starts, holding the call's prompt: checked
        against the caps and the context before anything of it is appended."""
        bound = session.binding
        head = None
        if not session.samples:
            at: int | str = "the first call"
        elif not session.heads:  # the last call failed: its tokens end where its prompt did
            at = "the previous call failed"
        else:
            tried = [(h, extends(h.seen, messages)) for h in session.heads]
            head, at = next(((h, a) for h, a in tried if isinstance(a, int)), tried[0])
        if isinstance(at, int):
            sample = head.sample
            new = [templated(m, self.parser) for m in messages[at:]]
            if bound is not None:
                bound.room()
            held = held_tokens(sample, bound)
            self.check_room(session, held=held, text=new)
            delta, context = await answer_tokens(renderer, sample, new, head.ended_turn,
                                                 bound)
            self.check_context(held + len(delta) if context is None else len(context.token_ids))
            if bound is None:
                sample.segments.append(Segment.env(delta))
                sample.contexts += [] if context is None else [context]
            else:
                bound.answer(messages[at:], delta, self.tokenizer.decode, session.num_calls,
                             context)
            sample.messages.extend(new)
            session.history_bytes += sum(len(m["content"].encode()) for m in new)
            return sample
        messages = [templated(m, self.parser) for m in messages]
        self.check_room(session, held=0, text=messages)
        prompt = await render(renderer.prompt, messages)
        self.check_context(len(prompt))
        if bound is not None and (session.samples or prompt != bound.prompt_ids):
            raise EpisodeRefused(
                f"a training episode is one trajectory: {at}" if session.samples else
                "the first messages render to another prompt than the task's")
        sample = ProxySample(prompt_ids=prompt, messages=messages,
                             started_because=None if not session.samples else at,
                             segments=[] if bound is None else bound.segments,
                             contexts=[] if bound is None else bound.contexts)
        session.samples.append(sample)
        session.history_bytes += sum(len(m["content"].encode()) for m in messages)
        return sample

    def fork(self, session: Session, sample: ProxySample, choice: int,
             call: int) -> ProxySample:
        """A copy of ``sample`` (holding call ``call``'s prompt) for the call's ``choice``."""
        self.check_room(session, held=0, text=sample.messages)
        fork = ProxySample(prompt_ids=list(sample.prompt_ids), messages=list(sample.messages),
                           segments=copy.deepcopy(sample.segments), num_calls=sample.num_calls,
                           contexts=list(sample.contexts),
                           started_because=f"choice {choice} of call {call}")
        session.samples.append(fork)
        session.history_bytes += sum(len(m["content"].encode()) for m in sample.messages)
        return fork

    def check_room(self, session: Session, *, held: int, text: list[Message]) -> None:
        """Refuse a call whose new messages ``text`` would pass the session's history cap, or
        cannot fit the context after ``held`` tokens (by their length alone: no rendering)."""
        added = sum(len(m["content"].encode()) for m in text)
        cap = self.limits.max_session_history_bytes
        if session.history_bytes + added > cap:
            raise Refused("max_session_history_bytes", (
                f"the session's messages would hold {session.history_bytes + added} bytes, over "
                f"the proxy's limit of {cap} (agent.proxy.max_session_history_bytes)"))
        chars = sum(len(m["content"]) for m in text)
        if self.context_tokens is not None and held + chars // self.max_token_chars >= (
                self.context_tokens):
            raise Refused("messages", (
                f"messages: the prompt is longer than the context: at least "
                f"{held + chars // self.max_token_chars} tokens, and a sequence holds "
                f"{self.context_tokens} (prompt + at least one new token)"))

    def check_context(self, num_tokens: int) -> None:
        if self.context_tokens is not None and num_tokens >= self.context_tokens:
            raise Refused("messages", (
                f"messages: the prompt of {num_tokens} tokens does not fit the context of "
                f"{self.context_tokens} tokens (prompt + at least one new token)"))


async def render(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` (a ChatRenderer method) in a thread; a template that cannot render what the
    harness sent is the call's fault (400), never the proxy's."""
    from jinja2 import TemplateError as JinjaError

    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except (ValueError, TypeError, JinjaError) as e:
        raise Refused("messages", f"messages: the chat template cannot render them: "
                                  f"{type(e).__name__}: {e}") from None


async def answer_tokens(renderer: ChatRenderer, sample: ProxySample, new: list[Message],
                        ended_turn: bool, bound: Binding | None,
                        ) -> tuple[list[int], Context | None]:
    """The tokens of a call's new messages after the sample's last model turn: the ids to
    append, or, where the template rewrites the earlier turns, none and the next context
    (the conversation rendered anew), served from the next model turn on."""
    if await render(renderer.rewrites, sample.messages, new):
        ids = await render(renderer.prompt, [*sample.messages, *new])
        at = len(sample.segments) if bound is None else bound.position
        return [], Context(num_segments=at + 1, token_ids=tuple(ids))
    delta = await render(renderer.extend, sample.messages, new, model_ended_turn=ended_turn)
    return delta, None


def templated(message: Message, parser: ToolCallParser) -> Message:
    """A message as the chat template renders it: tool calls as the model writes them."""
    text = message["content"]
    try:
        calls = [parser.render(ToolCall(id="", name=name, arguments=args))
                 for name, args in message.get("tool_calls", ())]
    except (ValueError, TypeError) as e:  # a call this model's format cannot write
        raise Refused("messages", f"messages: a tool call cannot be rendered: {e}") from None
    if calls:
        text = "\n".join([text, *calls]) if text else "\n".join(calls)
    return {"role": message["role"], "content": text}


def extends(seen: list[Message], messages: list[Message]) -> int | str:
    """Where the new messages start, when ``messages`` continue ``seen``; else why not."""
    if len(messages) <= len(seen):
        return f"history rewritten: {len(messages)} messages sent after {len(seen)} seen"
    for i, (a, b) in enumerate(zip(seen, messages, strict=False)):
        if a != b:
            return f"history rewritten at message {i} ({a['role']} -> {b['role']})"
    return len(seen)


def held_tokens(sample: ProxySample, bound: Binding | None) -> int:
    """The tokens a call's new messages come after: a replaying episode's, up to where the
    replay stands."""
    if bound is None:
        return len(sample.token_ids)
    return len(sample.prompt_ids) + bound.used_tokens()
