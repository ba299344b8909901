"""mkdocs hook: the Reference pages generated from the code, so they cannot drift from it.

``reference/config.md`` is the text ``rollstream config`` prints (every field's default,
docstring and allowed values, from the pydantic schema); ``reference/cli.md`` is each
command's ``--help``; ``reference/api.md`` names every export of ``import rollstream`` for
mkdocstrings, which renders each from its docstring and signature. All come from this
checkout's ``src/``, whatever rollstream the interpreter has installed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mkdocs.structure.files import File

_SRC = Path(__file__).resolve().parents[1] / "src"


def _config_page() -> str:
    from rollstream.config.describe import describe

    return ("# Config reference\n\n"
            "Every setting with its default, what it means and the values allowed: the text "
            "`rollstream config` prints (`rollstream config SECTION` prints one section). The "
            "whole tree is a valid config of the defaults. Override any of them on the command "
            "line as a dotted path: `rollstream train my.yaml train.steps=20`.\n\n"
            f"```yaml\n{describe(None)}\n```\n")


def _cli_page() -> str:
    from rollstream.cli import _parser

    os.environ["COLUMNS"] = "100"  # argparse wraps help text to the terminal's width
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = ["# CLI reference\n\n`rollstream --help` and each command's `--help`, as printed.\n",
             f"```text\n{parser.format_help()}```\n"]
    for name, command in sub.choices.items():
        parts.append(f"## `rollstream {name}`\n\n```text\n{command.format_help()}```\n")
    return "\n".join(parts)


def _api_page() -> str:
    from rollstream import _EXPORTS

    intro = ("# Python API reference\n\n`import rollstream` exports these names (imported on "
             "first use, so the import stays light). [Your dataset and reward](../your-data.md) "
             "shows them in a run; every setting a config takes is in the "
             "[config reference](config.md).\n")
    parts = [intro]
    for name, module in _EXPORTS.items():
        # RunConfig's fields are the config reference's; here only the class itself
        members = "\n    options:\n      members: false" if name == "RunConfig" else ""
        parts.append(f"::: {module}.{name}{members}\n")
    return "\n".join(parts)


def on_files(files, config):  # mkdocs' hook signature
    if str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))
    for uri, content in (("reference/config.md", _config_page()),
                         ("reference/cli.md", _cli_page()),
                         ("reference/api.md", _api_page())):
        files.append(File.generated(config, uri, content=content))
    return files
