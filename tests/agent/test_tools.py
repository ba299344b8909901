"""Tool-call parsing, the tool manager's fault boundary, and the calculator (CPU, no engine)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rollstream.agent.tools import (
    Calculator,
    HermesToolParser,
    ToolCall,
    ToolManager,
    render_tool_call,
    tool_schema,
)

PARSER = HermesToolParser()


def _block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# --- parser -------------------------------------------------------------------------------


def test_parse_one_call() -> None:
    turn = PARSER.parse(_block('{"name": "calculator", "arguments": {"expression": "1+2"}}'))
    assert turn.calls == [ToolCall(id="call_0", name="calculator", arguments={"expression": "1+2"})]
    assert turn.content == ""
    assert turn.errors == []


def test_parse_several_calls_with_surrounding_text() -> None:
    text = (
        "Let me compute both.\n"
        + _block('{"name": "a", "arguments": {"x": 1}}')
        + "\nand\n"
        + _block('{"name": "b", "arguments": {}}')
        + "\nDone."
    )
    turn = PARSER.parse(text)
    assert [(c.id, c.name, c.arguments) for c in turn.calls] == [
        ("call_0", "a", {"x": 1}),
        ("call_1", "b", {}),
    ]
    assert turn.content == "Let me compute both.\n\nand\n\nDone."
    assert turn.errors == []


def test_parse_arguments_as_json_string_or_missing() -> None:
    turn = PARSER.parse(
        _block('{"name": "f", "arguments": "{\\"q\\": \\"hi\\"}"}') + _block('{"name": "g"}')
    )
    assert [(c.name, c.arguments) for c in turn.calls] == [("f", {"q": "hi"}), ("g", {})]


def test_parse_no_calls() -> None:
    turn = PARSER.parse("  The answer is 4.  ")
    assert turn.content == "The answer is 4."
    assert turn.calls == []
    assert turn.errors == []


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"name": "f", "arguments": {', "invalid JSON"),
        ('["f", {}]', "expected a JSON object, got an array"),
        ('{"arguments": {}}', 'missing "name"'),
        ('{"name": 3, "arguments": {}}', '"name" must be a non-empty string, got a number'),
        ('{"name": "f", "arguments": [1]}', '"arguments" must be an object, got an array'),
        ('{"name": "f", "arguments": "[1]"}', '"arguments" must be an object, got an array'),
        ('{"name": "f", "arguments": "{oops"}', '"arguments" is a string but not valid JSON'),
    ],
)
def test_parse_malformed_block_is_an_error_and_others_still_parse(body: str, expected: str) -> None:
    turn = PARSER.parse("hi " + _block('{"name": "ok"}') + _block(body) + _block('{"name": "k"}'))
    assert [(c.id, c.name) for c in turn.calls] == [("call_0", "ok"), ("call_2", "k")]
    assert len(turn.errors) == 1
    assert turn.errors[0].startswith("tool call 1: ")
    assert expected in turn.errors[0]
    assert turn.content == "hi"


def test_parse_unclosed_block_at_end_is_an_error() -> None:
    text = "Thinking. " + _block('{"name": "a"}') + ' then <tool_call>\n{"name": "calc", "argu'
    turn = PARSER.parse(text)
    assert [c.name for c in turn.calls] == ["a"]
    assert len(turn.errors) == 1
    assert turn.errors[0].startswith("tool call 1: <tool_call> is never closed")
    assert turn.content == "Thinking.  then"


def test_parser_tags_are_configurable() -> None:
    parser = HermesToolParser(open_tag="[CALL]", close_tag="[/CALL]")
    call = ToolCall(id="call_0", name="f", arguments={"x": [1, 2]})
    text = render_tool_call(call, open_tag="[CALL]", close_tag="[/CALL]")
    assert parser.parse(text).calls == [call]
    assert PARSER.parse(text).calls == []
    with pytest.raises(ValueError, match="non-empty"):
        HermesToolParser(open_tag="")


def test_render_round_trips_through_parse() -> None:
    calls = [
        ToolCall(id="call_0", name="calculator", arguments={"expression": "2**10"}),
        ToolCall(id="call_1", name="search", arguments={"q": "naïve </tool", "k": 3, "n": None}),
    ]
    text = "Two calls:\n" + "\n".join(render_tool_call(c) for c in calls)
    assert render_tool_call(calls[0]) == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2**10"}}\n</tool_call>'
    )
    turn = PARSER.parse(text)
    assert turn.calls == calls
    assert turn.content == "Two calls:"
    assert turn.errors == []


# --- manager ------------------------------------------------------------------------------


class FakeTool:
    def __init__(self, name: str) -> None:
        self.name = name
        self.description = f"test tool {name}"
        self.parameters: dict[str, Any] = {"type": "object", "properties": {}}


class FnTool(FakeTool):
    """A test tool around an async function."""

    def __init__(self, name: str, fn: Any) -> None:
        super().__init__(name)
        self._fn = fn

    async def __call__(self, **arguments: Any) -> str:
        return await self._fn(**arguments)


class Sleeper(FakeTool):
    def __init__(self) -> None:
        super().__init__("sleep")

    async def __call__(self, s: float, tag: str = "") -> str:
        await asyncio.sleep(s)
        return f"slept {s} {tag}".strip()


class Hang(FakeTool):
    def __init__(self) -> None:
        super().__init__("hang")
        self.started = asyncio.Event()
        self.cancelled = False

    async def __call__(self) -> str:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "unreachable"


class Typed(FakeTool):
    def __init__(self) -> None:
        super().__init__("typed")

    async def __call__(self, x: int) -> str:
        return str(x + "1")  # type: ignore[operator]  # TypeError inside the tool


def _call(name: str, i: int = 0, **arguments: Any) -> ToolCall:
    return ToolCall(id=f"call_{i}", name=name, arguments=arguments)


async def test_calls_run_concurrently_and_results_keep_call_order() -> None:
    manager = ToolManager([Sleeper()], timeout_s=5.0)
    calls = [_call("sleep", 0, s=0.3, tag="a"), _call("sleep", 1, s=0.3), _call("sleep", 2, s=0.05)]
    t0 = time.perf_counter()
    results = await manager.run(calls)
    assert time.perf_counter() - t0 < 0.5  # run one after another: 0.65 s
    assert [r.content for r in results] == ["slept 0.3 a", "slept 0.3", "slept 0.05"]
    assert [r.call for r in results] == calls
    assert all(r.ok and r.error is None for r in results)
    assert results[0].duration_s >= 0.29


async def test_max_concurrency_bounds_overlap() -> None:
    manager = ToolManager([Sleeper()], timeout_s=5.0, max_concurrency=1)
    t0 = time.perf_counter()
    await manager.run([_call("sleep", 0, s=0.1), _call("sleep", 1, s=0.1)])
    assert time.perf_counter() - t0 >= 0.19


async def test_raising_tool_is_an_error_result_and_others_succeed() -> None:
    async def boom() -> str:
        raise ValueError("bad input 42")

    manager = ToolManager([FnTool("boom", boom), Calculator()], timeout_s=2.0)
    results = await manager.run([_call("boom", 0), _call("calculator", 1, expression="6*7")])
    assert not results[0].ok
    assert results[0].error == "raised ValueError: bad input 42"
    assert results[0].content == "error: raised ValueError: bad input 42"
    assert results[1].ok and results[1].content == "42"


async def test_hanging_tool_times_out() -> None:
    hang = Hang()
    manager = ToolManager([hang, Sleeper()], timeout_s=0.2)
    t0 = time.perf_counter()
    results = await manager.run([_call("hang", 0), _call("sleep", 1, s=0.0)])
    elapsed_s = time.perf_counter() - t0
    assert 0.19 <= elapsed_s < 1.0
    assert results[0].error == "timeout after 0.2 s"
    assert results[0].content == "error: timeout after 0.2 s"
    assert hang.cancelled
    assert results[1].ok


async def test_tool_raising_timeout_error_itself_is_not_a_timeout() -> None:
    async def own_timeout() -> str:
        raise TimeoutError("upstream took too long")

    manager = ToolManager([FnTool("t", own_timeout)], timeout_s=2.0)
    (result,) = await manager.run([_call("t")])
    assert result.error == "raised TimeoutError: upstream took too long"


async def test_tool_raising_cancelled_error_itself_does_not_end_the_run() -> None:
    async def cancelled_inside() -> str:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        future.cancel()
        return await future

    manager = ToolManager([FnTool("c", cancelled_inside), Sleeper()], timeout_s=2.0)
    results = await manager.run([_call("c", 0), _call("sleep", 1, s=0.0)])
    assert results[0].error is not None and results[0].error.startswith("raised CancelledError")
    assert results[1].ok


async def test_unknown_tool() -> None:
    manager = ToolManager([Calculator(), Sleeper()], timeout_s=1.0)
    (result,) = await manager.run([_call("search", q="x")])
    assert result.error == "unknown tool 'search' (known: calculator, sleep)"
    assert not result.ok


async def test_bad_arguments_differ_from_type_error_inside_the_tool() -> None:
    manager = ToolManager([Typed(), Sleeper()], timeout_s=1.0)
    results = await manager.run(
        [
            _call("typed", 0, x=1, y=1),  # unexpected keyword
            _call("sleep", 1),  # missing required argument
            _call("typed", 2, x=1),  # binds; the tool raises TypeError itself
        ]
    )
    assert results[0].error is not None and results[0].error.startswith("bad arguments: ")
    assert "'y'" in results[0].error
    assert results[1].error is not None and results[1].error.startswith("bad arguments: ")
    assert "'s'" in results[1].error
    assert results[2].error is not None and results[2].error.startswith("raised TypeError: ")


async def test_non_string_result_is_an_error() -> None:
    async def number() -> Any:
        return 3

    manager = ToolManager([FnTool("n", number)], timeout_s=1.0)
    (result,) = await manager.run([_call("n")])
    assert result.error == "returned int, expected str"


async def test_no_calls() -> None:
    assert await ToolManager([], timeout_s=1.0).run([]) == []


async def test_cancellation_from_outside_propagates() -> None:
    hang = Hang()
    manager = ToolManager([hang], timeout_s=30.0)
    task = asyncio.create_task(manager.run([_call("hang")]))
    await asyncio.wait_for(hang.started.wait(), 1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hang.cancelled


def test_construction_checks() -> None:
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolManager([Calculator(), Sleeper(), Calculator()], timeout_s=1.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout_s"):
            ToolManager([Calculator()], timeout_s=bad)
    with pytest.raises(ValueError, match="max_concurrency"):
        ToolManager([Calculator()], timeout_s=1.0, max_concurrency=0)

    class SyncTool(FakeTool):
        def __call__(self) -> str:
            return ""

    with pytest.raises(TypeError, match="async def"):
        ToolManager([SyncTool("sync")], timeout_s=1.0)  # type: ignore[list-item]


def test_schemas() -> None:
    manager = ToolManager([Calculator()], timeout_s=1.0)
    assert manager.schemas() == [tool_schema(Calculator())]
    schema = manager.schemas()[0]
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


# --- calculator ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2", "3"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("2 ** 3 ** 2", "512"),
        ("-2 ** 2", "-4"),
        ("+-3", "-3"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("8 / 2", "4.0"),
        ("1 / 3", repr(1 / 3)),
        ("0.1 + 0.2", repr(0.1 + 0.2)),
        ("2 ** -1", "0.5"),
        ("2 ** 0.5", repr(2**0.5)),
        ("2 ** 100", str(2**100)),
        (
            "12345678901234567890 * 98765432109876543210",
            str(12345678901234567890 * 98765432109876543210),
        ),
        ("1_000 + 1e3", "2000.0"),
        ("  3  ", "3"),
    ],
)
async def test_calculator_values(expression: str, expected: str) -> None:
    assert await Calculator()(expression=expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "got Name"),
        ("abs(-1)", "got Call"),
        ("(1).real", "got Attribute"),
        ("__import__('os')", "got Call"),
        ("'a' * 3", "got Constant"),
        ("True + 1", "got Constant"),
        ("1j", "got Constant"),
        ("1 < 2", "got Compare"),
        ("~1", "got UnaryOp"),
        ("[1, 2]", "got List"),
        ("1 +", "not an arithmetic expression"),
        ("", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("1 // 0", "division by zero"),
        ("5 % 0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "power too large"),
        ("(2 ** 64) ** 64", "power too large"),
        ("2 ** 5000", "power too large"),
        ("10.0 ** 400", "result too large"),
        ("1e308 * 10", "result too large"),
        ("1e999", "result too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("(-8.0) ** 2.5", "not a real number"),
        ("1" * 201, "at most 200"),
    ],
)
async def test_calculator_refuses(expression: str, message: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        await Calculator()(expression=expression)
    assert time.perf_counter() - t0 < 0.1


async def test_calculator_bounds_products_of_allowed_powers() -> None:
    expression = "*".join(["(2**2000)"] * 3)
    with pytest.raises(ValueError, match="result too large"):
        await Calculator()(expression=expression)


async def test_calculator_errors_reach_the_model_through_the_manager() -> None:
    manager = ToolManager([Calculator()], timeout_s=1.0)
    results = await manager.run(
        [_call("calculator", 0, expression="1/0"), _call("calculator", 1, expression=5)]
    )
    assert results[0].content == "error: raised ValueError: division by zero"
    assert results[1].content == "error: raised TypeError: expression must be a string, got int"
