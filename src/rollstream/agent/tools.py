"""Tool calls in multi-turn episodes: parse them from a turn's text, run them, report back.

A turn goes through three typed steps:

* a :class:`ToolCallParser` turns the model's text into a :class:`ParsedTurn`: the prose
  (``content``), the well-formed :class:`ToolCall` s and one error string per malformed block.
  :class:`HermesToolParser` reads the Hermes / Qwen2.5 format, one JSON object per block::

      <tool_call>
      {"name": "calculator", "arguments": {"expression": "2+3"}}
      </tool_call>

  :func:`render_tool_call` writes that canonical block. Another format is another parser
  object (the parser is an extension point, not a regex in config);
* :class:`ToolManager.run` runs a turn's calls concurrently (``asyncio.TaskGroup``, at most
  ``max_concurrency`` at once), each under its own ``timeout_s``, and returns one
  :class:`ToolResult` per call, in call order;
* the caller turns the results into tool messages for the next turn.

Fault boundary: a tool failure ends that call, never the episode or the run. An unknown tool,
arguments the tool's signature does not accept, an exception raised by the tool, a result that
is not a ``str`` and a call still running at ``timeout_s`` each give ``ok=False`` with the
reason in ``error`` and ``"error: <reason>"`` in ``content`` (what the model reads); ``run``
does not raise for them. Cancellation of ``run`` from outside propagates (the running calls are
cancelled with it).

Not covered, as in the grader pool: the timeout cancels the tool's coroutine, so a tool that
blocks the event loop (``time.sleep``, CPU-bound work, sync I/O) or swallows cancellation
cannot be bounded. A tool doing blocking work runs it with ``asyncio.to_thread`` (or in a
subprocess / sandbox, which it can kill). A tool's output is cut at ``max_output_chars`` here,
before anything tokenizes it (``cut_output``); what the episode may add in tokens is its token
budget's to bound.

Built-in tools: :class:`Calculator`. Python execution lives next to the sandbox.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import json
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollstream.trajectory import ToolCall, ToolResult  # the data model defines them


@dataclass(slots=True, kw_only=True, frozen=True)
class ParsedTurn:
    """A turn's text split into prose and tool calls."""

    content: str  # the text without tool-call blocks (an unclosed one included), stripped
    calls: list[ToolCall]
    errors: list[str]  # one per malformed or unclosed block, naming its index


class ToolCallParser(Protocol):
    """A model's tool-call format. A parser may also have ``call_start(text) -> int``: where
    the first tool call of ``text`` begins or may begin (the text is still being generated);
    the text before it is prose for sure, which the proxy streams as it is sampled (without
    it, a streamed reply's content arrives at its end)."""

    def parse(self, text: str) -> ParsedTurn: ...

    def render(self, call: ToolCall) -> str:
        """The text the model writes for ``call`` (``parse`` reads it back)."""
        ...


def marker_start(text: str, marker: str) -> int:
    """Where ``marker`` first occurs in ``text``, or where a tail of ``text`` that may grow
    into it begins; ``len(text)`` when neither (``ToolCallParser.call_start``)."""
    at = text.find(marker)
    if at != -1:
        return at
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)


@dataclass(slots=True, kw_only=True, frozen=True)
class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5).

    ``arguments`` may be an object or a JSON string holding one (some models emit the OpenAI
    wire form); a missing ``arguments`` means ``{}``. A block opened but not closed at the end
    of the text (a turn cut by its token budget) is an error and is left out of ``content``.
    """

    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"

    def __post_init__(self) -> None:
        if not self.open_tag or not self.close_tag:
            raise ValueError("HermesToolParser: open_tag and close_tag must be non-empty")

    def parse(self, text: str) -> ParsedTurn:
        prose: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos = index = 0
        while (start := text.find(self.open_tag, pos)) != -1:
            prose.append(text[pos:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            if end == -1:
                errors.append(
                    f"tool call {index}: {self.open_tag} is never closed by {self.close_tag}"
                    " (was the turn cut by its token budget?)"
                )
                pos = len(text)
                break
            decoded = _decode_call(text[body_start:end], index)
            if isinstance(decoded, ToolCall):
                calls.append(decoded)
            else:
                errors.append(decoded)
            index += 1
            pos = end + len(self.close_tag)
        prose.append(text[pos:])
        return ParsedTurn(content="".join(prose).strip(), calls=calls, errors=errors)

    def render(self, call: ToolCall) -> str:
        return render_tool_call(call, open_tag=self.open_tag, close_tag=self.close_tag)

    def call_start(self, text: str) -> int:
        return marker_start(text, self.open_tag)


@dataclass(slots=True, kw_only=True, frozen=True)
class CommandToolParser:
    """One call per command: ``#name argument`` up to the end of its line, for tools of one
    string argument (``commands`` maps each name to that argument's key). A compact format
    for small vocabularies (the tiny-model kit's tokenizer has no ``<``, ``{`` or ``"``)::

        c #calc 57+7          ->  calc(expression="57+7"), content "c"

    A ``#`` followed by a name it does not know is an error naming the known ones.
    """

    commands: dict[str, str]  # tool name -> the key of its one argument
    prefix: str = "#"

    def __post_init__(self) -> None:
        if not self.commands:
            raise ValueError("CommandToolParser: commands must name at least one tool")
        if not self.prefix or any(c.isspace() for c in self.prefix):
            raise ValueError(f"CommandToolParser: bad prefix {self.prefix!r}")

    def parse(self, text: str) -> ParsedTurn:
        prose: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        index = 0
        for line in text.split("\n"):
            at = line.find(self.prefix)
            if at == -1:
                prose.append(line)
                continue
            prose.append(line[:at])
            name, _, argument = line[at + len(self.prefix):].partition(" ")
            if name not in self.commands:
                errors.append(f"tool call {index}: unknown command {name!r} (known: "
                              f"{', '.join(self.commands)})")
            else:
                calls.append(ToolCall(id=f"call_{index}", name=name,
                                      arguments={self.commands[name]: argument.strip()}))
            index += 1
        return ParsedTurn(content="\n".join(prose).strip(), calls=calls, errors=errors)

    def render(self, call: ToolCall) -> str:
        key = self.commands.get(call.name)
        if key is None or set(call.arguments) != {key}:
            raise ValueError(f"CommandToolParser cannot write {call.name}({call.arguments}): "
                             f"one argument of {sorted(self.commands.items())} expected")
        return f"{self.prefix}{call.name} {call.arguments[key]}"

    def call_start(self, text: str) -> int:
        return marker_start(text, self.prefix)


def _decode_call(body: str, index: int) -> ToolCall | str:
    """The block's call, or the error that names what is wrong with it."""
    where = f"tool call {index}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"{where}: invalid JSON ({exc})"
    except RecursionError:  # a model can write nesting deeper than the parser recurses
        return f"{where}: JSON nested too deep"
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object, got {_json_type(obj)}"
    if "name" not in obj:
        return f'{where}: missing "name"'
    name = obj["name"]
    if not isinstance(name, str) or not name:
        return f'{where}: "name" must be a non-empty string, got {_json_type(name)}'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return f'{where}: "arguments" is a string but not valid JSON ({exc})'
    if not isinstance(arguments, dict):
        return f'{where}: "arguments" must be an object, got {_json_type(arguments)}'
    return ToolCall(id=f"call_{index}", name=name, arguments=arguments)


def _json_type(value: Any) -> str:  # value came from json.loads
    return _JSON_TYPES[type(value)]


_JSON_TYPES: dict[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def render_tool_call(
    call: ToolCall, *, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"
) -> str:
    """The canonical block for ``call``; :class:`HermesToolParser` parses it back."""
    payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{open_tag}\n{payload}\n{close_tag}"


class Tool(Protocol):
    """A tool the model can call. ``__call__`` takes the call's arguments as keywords; what it
    accepts is checked against its signature before each call."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object (OpenAI function style)

    async def __call__(self, **arguments: Any) -> str: ...


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The OpenAI function-calling entry for ``tool`` (what chat templates list as tools)."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        },
    }


class ToolRunner(Protocol):
    """What an environment runs its tool calls with (a :class:`ToolManager`, or in an
    episode the harness's runner, which answers a resumed episode's recorded calls)."""

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]: ...

    def schemas(self) -> list[dict[str, Any]]: ...


class ToolManager:
    """Runs a turn's tool calls (module docstring)."""

    def __init__(
        self, tools: Sequence[Tool], *, timeout_s: float, max_concurrency: int | None = None,
        max_output_chars: int | None = None,
    ) -> None:
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"ToolManager: timeout_s must be a finite number > 0, got {timeout_s}")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"ToolManager: max_concurrency must be >= 1, got {max_concurrency}")
        if max_output_chars is not None and max_output_chars < 1:
            raise ValueError(f"ToolManager: max_output_chars must be >= 1, got {max_output_chars}")
        self.max_output_chars = max_output_chars  # None: not cut
        self._tools: dict[str, Tool] = {}
        self._signatures: dict[str, inspect.Signature] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ValueError(f"ToolManager: two tools are named {tool.name!r}")
            if not (callable(tool) and inspect.iscoroutinefunction(tool.__call__)):
                raise TypeError(f"tool {tool.name!r}: __call__ must be an async def")
            self._tools[tool.name] = tool
            self._signatures[tool.name] = inspect.signature(tool)
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    def schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(tool) for tool in self._tools.values()]

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in call order; raises only if cancelled."""
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._run_one(call)) for call in calls]
        return [task.result() for task in tasks]

    async def _run_one(self, call: ToolCall) -> ToolResult:
        async with self._slots or contextlib.nullcontext():
            clock = asyncio.get_running_loop().time  # the agent loop's clock (virtual in sim)
            t0 = clock()
            output, error = await self._invoke(call)
            if error is not None:  # an exception's text may be as long as any output
                error = cut_output(error, self.max_output_chars)
            return ToolResult(
                call=call,
                content=output if error is None else f"error: {error}",
                ok=error is None,
                error=error,
                duration_s=clock() - t0,
            )

    async def _invoke(self, call: ToolCall) -> tuple[str, str | None]:
        """``(output, None)`` or ``("", error)``: the fault boundary for one call."""
        tool = self._tools.get(call.name)
        if tool is None:
            return "", f"unknown tool {call.name!r} (known: {', '.join(self._tools)})"
        try:  # before calling, so a TypeError raised inside the tool is not "bad arguments"
            self._signatures[call.name].bind(**call.arguments)
        except TypeError as exc:
            return "", f"bad arguments: {exc}"
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                output = await tool(**call.arguments)
        except TimeoutError as exc:
            if deadline.expired():
                return "", f"timeout after {self.timeout_s} s"
            return "", _raised(exc)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():  # cancelled from outside: not ours to end
                raise
            return "", _raised(exc)  # the tool's own (e.g. it awaited a cancelled future)
        except Exception as exc:  # noqa: BLE001 - fault boundary: the model reads why
            return "", _raised(exc)
        if not isinstance(output, str):
            return "", f"returned {type(output).__name__}, expected str"
        return cut_output(output, self.max_output_chars), None


def cut_output(output: str, max_chars: int | None) -> str:
    """``output`` up to ``max_chars`` characters, then a note of how much was cut."""
    if max_chars is None or len(output) <= max_chars:
        return output
    return f"{output[:max_chars]}\n[output cut: {len(output) - max_chars} more characters]"


def _raised(exc: BaseException) -> str:
    return f"raised {type(exc).__name__}: {exc}" if str(exc) else f"raised {type(exc).__name__}"


# --- calculator ---------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_INT_BITS = 4096  # ~1233 decimal digits: any integer result, intermediate ones included

_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


@dataclass(slots=True, kw_only=True)
class Calculator:
    """Arithmetic on numbers with ``+ - * / // % **``, unary ``+``/``-`` and parentheses.

    Evaluated by walking the ``ast`` (no ``eval``): names, calls, attributes and anything else
    are refused. Python semantics throughout: integers are exact, ``/`` is true division so
    ``8/2`` gives ``4.0`` (floats are returned as their ``repr``, integral or not). Bounds keep
    every call fast: at most ``MAX_EXPRESSION_CHARS`` characters, integers of at most
    ``MAX_INT_BITS`` bits (an integer power is refused before it is computed when it could
    exceed that, so ``9**9**9`` fails at once), finite real floats only. Errors raise
    ``ValueError``; the manager reports them to the model.
    """

    name: str = "calculator"
    description: str = (
        "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses."
    )
    parameters: dict[str, Any] = field(
        default_factory=lambda: {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "for example (2 + 3) * 4 ** 2"}
            },
            "required": ["expression"],
        }
    )

    async def __call__(self, expression: str) -> str:
        if not isinstance(expression, str):
            raise TypeError(f"expression must be a string, got {type(expression).__name__}")
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise ValueError(
                f"expression is {len(expression)} characters, at most {MAX_EXPRESSION_CHARS}"
            )
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as exc:
            raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
        value = _evaluate(tree.body)
        return repr(value) if isinstance(value, float) else str(value)


def _evaluate(node: ast.expr) -> float:  # an int or a float
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _checked(_UNARY_OPS[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY_OPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large") from None
    raise ValueError(
        f"only numbers, + - * / // % ** and parentheses are allowed, got {type(node).__name__}"
        f" ({ast.unparse(node)[:40]})"
    )


def _check_power(base: float, exponent: float) -> None:
    if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
        raise ValueError("a negative number to a fractional power is not a real number")
    # bit_length(base) * exponent bounds the result's bits from above (within a factor of 2).
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and abs(base) > 1
        and abs(base).bit_length() * exponent > MAX_INT_BITS
    ):
        raise ValueError(f"power too large: the result would exceed {MAX_INT_BITS} bits")


def _checked(value: float) -> float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result too large (not a finite number)")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"result too large: more than {MAX_INT_BITS} bits")
    return value
