"""The agent proxy's OpenAI wire format: the request body of ``POST /v1/chat/completions``,
read within a size limit and validated into typed models before anything else looks at it,
and the reply (a chat completion, or its server-sent event chunks).

:class:`ChatRequest` is the one list of the OpenAI chat-completions fields rollstream knows:
each field's docstring says whether it is used, ignored (accepted, with no effect on what is
sampled), or refused unless it has its neutral value (it would change what is sampled in a
way the proxy does not implement). A field not listed is refused. Every refusal is a
:class:`Refused` naming the field by its path in the body (``messages.2.tool_calls.0``), the
``param`` of the OpenAI error object; nothing a client sends reaches the rest of the proxy
unvalidated, so bad input is a 4xx and never a 500.

The body is parsed by pydantic's own JSON parser (``model_validate_json``), which bounds
nesting depth and number size, so a hostile body costs at most its size, which
:func:`read_body` caps before parsing.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import from_json

from rollstream.agent.tools import ParsedTurn
from rollstream.trajectory import ToolCall

DEFAULT_MAX_TOKENS = 256
MAX_CHOICES = 64  # ChatRequest.n
TOOL_PATH = "/rollstream/v1/tool_calls"  # SessionHandle.call_tool
SEED_RANGE = (-(1 << 63), 1 << 63)  # a signed 64-bit seed, as OpenAI's API takes
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic union tags
_UNSUPPORTED = {  # fields accepted only with a value that changes nothing: why another is not
    "stop": "stop sequences are not supported (a reply ends at the chat template's "
            "end-of-turn token)",
    "frequency_penalty": "only 0 is supported", "presence_penalty": "only 0 is supported",
    "top_logprobs": "only 0 is supported", "logit_bias": "only an empty logit_bias is supported",
    "logprobs": "returned logprobs are not supported"}


@dataclass(slots=True, kw_only=True, frozen=True)
class SessionHandle:
    """What an agent is given for one episode: the proxy's URL and the episode's key (it
    crosses to harness worker processes)."""

    base_url: str
    api_key: str  # rs-<session_id>.<secret>
    session_id: str

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Run the episode source's tool ``name`` (rollstream's, e.g. a sandboxed one) in the
        run and get what the model reads: its output, or ``error: ...``. The episode records
        the call, so a resumed episode is answered from the record instead of running it
        again (``agent/proxy_episode.py``). A call the session refuses raises ``ValueError``
        with the reason."""
        import httpx

        async with httpx.AsyncClient(timeout=None) as client:
            reply = await client.post(f"{self.base_url.removesuffix('/v1')}{TOOL_PATH}",
                                      json={"name": name, "arguments": arguments},
                                      headers={"Authorization": f"Bearer {self.api_key}"})
        body = reply.json()
        if reply.status_code != 200:
            raise ValueError(body["error"]["message"])
        return body["content"]


class Refused(ValueError):
    """A call the proxy refuses because of what it sent: HTTP ``status`` with ``param``, the
    field (or the limit) that is the reason."""

    def __init__(self, param: str, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)


class TextPart(_Body):
    type: Literal["text"]
    """Accepted when ``text`` (images, audio and files are refused)."""
    text: str
    """Used: joined with the message's other parts."""


class FunctionCall(_Body):
    name: str = Field(min_length=1)
    """Used: the tool called."""
    arguments: str | dict[str, Any] = "{}"
    """Used: the arguments as a JSON string (OpenAI's form) or an object."""


class ToolCallIn(_Body):
    """A tool call of an assistant message the harness sends back."""

    function: FunctionCall
    """Used: rendered as the model writes a call (its ``name`` and ``arguments``)."""
    id: str | None = None
    """Ignored: the proxy stitches by messages, and renders a call as the model wrote it."""
    type: Literal["function"] = "function"
    """Accepted when ``function``."""


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    """Used: passed to the chat template."""
    content: str | list[TextPart] | None = None
    """Used: text, or text parts (joined); null is empty text."""
    tool_calls: list[ToolCallIn] | None = None
    """Used (assistant messages): rendered as the model writes tool calls."""
    tool_call_id: str | None = None
    """Used (tool messages): recorded with the tool result."""
    name: str | None = None
    """Ignored."""
    refusal: None = None
    """Accepted when null (the SDK echoes it back)."""
    function_call: None = None
    """Accepted when null (the legacy form of ``tool_calls``)."""
    audio: None = None
    """Accepted when null."""
    annotations: list[Any] | None = None
    """Ignored."""
    reasoning_content: str | None = None
    """Accepted when null or empty (vLLM's field, which verifiers sends back): replies carry
    no separate reasoning, so what the model wrote is all in ``content``."""

    @field_validator("reasoning_content")
    @classmethod
    def _no_reasoning(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("the proxy's replies carry no reasoning_content: send what the "
                             "model wrote back in content")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, v: list[ToolCallIn] | None, info) -> Any:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return v

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionSpec(_Body):
    name: str = Field(min_length=1)
    """Used: shown to the model by the chat template."""
    description: str | None = None
    """Used: shown to the model by the chat template."""
    parameters: dict[str, Any] | None = None
    """Used: the JSON schema shown to the model by the chat template."""
    strict: bool | None = None
    """Ignored (the model is not constrained to the schema)."""


class ToolSpec(_Body):
    """One of the request's ``tools``."""

    type: Literal["function"]
    """Accepted when ``function``."""
    function: FunctionSpec
    """Used: the tool, as the chat template shows it."""


class StreamOptions(_Body):
    include_usage: bool | None = None
    """Used: a last chunk holds the usage."""
    include_obfuscation: bool | None = None
    """Ignored (nothing is padded)."""


class ChatRequest(_Body):
    """The body of one call."""

    messages: list[ChatMessage] = Field(min_length=1)
    """Used: the conversation, rendered with the model's chat template."""
    model: str = "rollstream"
    """Echoed in the reply; the proxy serves its one model whatever the name."""
    max_completion_tokens: int | None = Field(None, ge=1, lt=1 << 31)
    """Used: the reply's token budget (wins over ``max_tokens``)."""
    max_tokens: int | None = Field(None, ge=1, lt=1 << 31)
    """Used: the reply's token budget (default 256)."""
    temperature: float | None = Field(None, ge=0, le=2)
    """Used (default 1)."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Used (default 1)."""
    top_k: int | None = Field(None, ge=-1, lt=1 << 31)
    """Used (vLLM's extension; 0 or -1 = off)."""
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    """Used: the call's sampling seed."""
    stream: bool | None = None
    """Used: the reply as server-sent events, its text as it is sampled."""
    tools: list[ToolSpec] | None = None
    """Used: shown to the model by the chat template; calls in a reply are parsed out."""
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    """Used: that many choices, each sampled on its own and each its own sample of the
    session (at most 64; a training episode's session and a streamed call take only 1)."""
    tool_choice: Literal["auto"] | None = None
    """Accepted when ``auto`` (the model decides; forcing a call is not implemented)."""
    stop: str | list[str] | None = None
    """Accepted when null or empty (generation stops at the template's end-of-turn token)."""
    frequency_penalty: float | None = None
    """Accepted when 0."""
    presence_penalty: float | None = None
    """Accepted when 0."""
    logit_bias: dict[str, float] | None = None
    """Accepted when empty."""
    logprobs: bool | None = None
    """Accepted when false (the logprobs are recorded for training, not returned)."""
    top_logprobs: int | None = None
    """Accepted when 0."""
    response_format: dict[str, Any] | None = None
    """Accepted when ``{"type": "text"}``."""
    parallel_tool_calls: bool | None = None
    """Ignored."""
    stream_options: StreamOptions | None = None
    """Used: ``include_usage`` adds a last chunk with the usage (``include_obfuscation``
    is ignored)."""
    user: str | None = None
    """Ignored."""
    metadata: dict[str, Any] | None = None
    """Ignored."""
    store: bool | None = None
    """Ignored."""
    service_tier: str | None = None
    """Ignored."""
    prompt_cache_key: str | None = None
    """Ignored (the engines cache prefixes on their own)."""
    safety_identifier: str | None = None
    """Ignored."""
    prediction: dict[str, Any] | None = None
    """Ignored (a hint of the output; what is sampled does not follow it)."""
    reasoning_effort: str | None = None
    """Ignored (the model's chat template is rendered without it)."""
    verbosity: str | None = None
    """Ignored."""
    modalities: list[Literal["text"]] | None = None
    """Accepted when ``["text"]``."""
    audio: None = None
    """Accepted when null."""
    functions: None = None
    """Accepted when null (the legacy form of ``tools``)."""
    function_call: None = None
    """Accepted when null (the legacy form of ``tool_choice``)."""
    web_search_options: None = None
    """Accepted when null."""

    @field_validator("n")
    @classmethod
    def _streamed_once(cls, v: int | None, info) -> int | None:
        if v is not None and v > 1 and info.data.get("stream"):
            raise ValueError("a streamed call has one choice (n must be 1 with stream)")
        return v

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _neutral(cls, v: Any, info) -> Any:
        if v:  # a value that would change what is sampled (or returned)
            raise ValueError(_UNSUPPORTED[info.field_name])
        return v

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, v: dict | None) -> dict | None:
        if v is not None and v != {"type": "text"}:
            raise ValueError('only {"type": "text"} is supported')
        return v

    @property
    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    def tool_schemas(self) -> list[dict] | None:
        """The tools as the chat template takes them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ToolCallBody(_Body):
    """The body of ``SessionHandle.call_tool``: one call of the episode source's tools."""

    name: str = Field(min_length=1, max_length=256)
    arguments: dict[str, Any] = Field(default_factory=dict)


def parse_tool_call(raw: bytes) -> ToolCall:
    """The body of a tool call as a :class:`ToolCall` (:class:`Refused` naming a bad field)."""
    try:
        body = ToolCallBody.model_validate_json(raw)
    except ValidationError as e:
        raise _refused(e) from None
    return ToolCall(id="", name=body.name, arguments=body.arguments)


def field_docs() -> dict[str, dict[str, str]]:
    """Every field the body may hold (at the top, in ``stream_options``, a message, a content
    part, a tool call, a tool), with what the proxy does with it."""
    return {model.__name__: {name: (f.description or "") for name, f in
                             model.model_fields.items()}
            for model in (ChatRequest, StreamOptions, ChatMessage, TextPart, ToolCallIn,
                          FunctionCall, ToolSpec, FunctionSpec)}


def parse_request(raw: bytes) -> ChatRequest:
    """The body as a :class:`ChatRequest`; :class:`Refused` naming a bad field (of a value
    that matches none of a field's forms, the form it came closest to: the longest path)."""
    try:
        return ChatRequest.model_validate_json(raw)
    except ValidationError as e:
        raise _refused(e) from None


def _refused(e: ValidationError) -> Refused:
    named = [(_path(err["loc"]), err["msg"])
             for err in e.errors(include_url=False, include_input=False)]
    path, message = max(named, key=lambda pm: len(pm[0]))
    param = ".".join(map(str, path)) or "body"
    return Refused(param, f"{param}: {message.removeprefix('Value error, ')}")


def _path(loc: tuple) -> tuple:
    """A pydantic error location without its union-member tags (``str``, ``list[...]``)."""
    return tuple(p for p in loc
                 if isinstance(p, int) or (_NAME.fullmatch(p) and p not in _TYPE_NAMES))


async def read_body(request: Any, limit_bytes: int) -> bytes:
    """The body of a Starlette ``request``, at most ``limit_bytes`` of it: a larger one is
    refused (413) by its ``Content-Length`` before any of it is read, or, sent in chunks, as
    soon as it passes the limit."""
    declared = request.headers.get("content-length")
    too_large = Refused("body", f"the request body is larger than the proxy's limit of "
                                f"{limit_bytes} bytes (agent.proxy.max_request_bytes)",
                        status=413)
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise too_large
    return bytes(body)


def plain(message: ChatMessage) -> dict[str, Any]:
    """A request message as comparable data: role, text content, tool calls as (name,
    arguments), the id of the call a tool message answers."""
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [(c.function.name, _arguments(c.function.arguments))
                             for c in message.tool_calls]
    return out


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:  # pydantic's parser: bounded nesting and number size, a ValueError past them
            return from_json(raw)
        except ValueError:
            return raw
    return raw


def reply_message(text: str, parsed: ParsedTurn, call_index: int) -> dict[str, Any]:
    """The assistant message of a reply: ``text`` as sampled, or, when the model wrote tool
    calls (``parsed``), its prose and the calls in OpenAI's form."""
    if not parsed.calls:  # the text exactly as sampled (as vLLM's server answers)
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": [
        {"id": f"call_{call_index}_{i}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for i, c in enumerate(parsed.calls)]}


def chunk(head: dict, delta: dict, finish: str | None = None) -> str:
    """One server-sent event of a streamed reply (``head``: its id, object, created, model)."""
    data = head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(data)}\n\n"


def closing(reply: dict, head: dict, content: str, *, usage: bool) -> Iterator[str]:
    """The end of a streamed ``reply``: ``content`` (what is left of its text), its tool
    calls, the finish chunk, the usage (when asked: ``stream_options.include_usage``) and
    ``[DONE]``."""
    choice = reply["choices"][0]
    if content:
        yield chunk(head, {"content": content})
    for i, call in enumerate(choice["message"].get("tool_calls", ())):
        yield chunk(head, {"tool_calls": [{"index": i, **call}]})
    yield chunk(head, {}, choice["finish_reason"])
    if usage:
        yield f"data: {json.dumps(head | {'choices': [], 'usage': reply['usage']})}\n\n"
    yield "data: [DONE]\n\n"


async def sse(reply: dict, *, usage: bool = False) -> AsyncIterator[str]:
    """A whole ``reply`` as stream chunks: role, content, tool calls, finish, [DONE]."""
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object":
                                                               "chat.completion.chunk"}
    yield chunk(head, {"role": "assistant", "content": ""})
    for line in closing(reply, head, reply["choices"][0]["message"]["content"] or "",
                        usage=usage):
        yield line
