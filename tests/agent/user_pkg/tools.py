"""A user's tools: one plain, one that asks for the run's sandbox pool, and a wrong one."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, kw_only=True)
class Length:
    """How many characters a text has."""

    name: str = "length"
    description: str = "Count the characters of a text."
    parameters: dict = field(default_factory=lambda: {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})

    async def __call__(self, text: str) -> str:
        return str(len(text))


@dataclass(slots=True, kw_only=True)
class Shell:
    """Runs a Python program in the run's sandbox pool (it asks for ``sandbox``)."""

    sandbox: object
    name: str = "shell"
    description: str = "Run a Python program; read what it prints and why it stopped."
    parameters: dict = field(default_factory=lambda: {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]})

    async def __call__(self, code: str) -> str:
        result = await self.sandbox.run(code)
        return f"{result.stdout}|{result.exit_code}|{result.error}"


def not_a_tool() -> str:
    return "tools have a name, a description, parameters and an async __call__"
