"""The docs site builds with ``mkdocs build --strict``: a broken link or anchor, a page left
out of the nav, a missing included example or a failing reference hook fails the suite; the
reference pages hold what the code says (config schema, CLI parser, docstrings). The
Getting-started pages' commands, configs and Python blocks are the code's (and run:
tests/test_docs_run.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "WARNING" not in log, log
    site = tmp_path / "site"
    # the generated reference pages hold what `rollstream config` and `--help` print
    assert "checkpoint_every" in (site / "reference" / "config" / "index.html").read_text()
    assert "rollstream export" in (site / "reference" / "cli" / "index.html").read_text()
    # the Python API page is rendered from the docstrings and signatures of every export
    api = (site / "reference" / "api" / "index.html").read_text()
    from rollstream import _EXPORTS

    for name, module in _EXPORTS.items():
        assert f'id="{module}.{name}"' in api, name
    assert "Run one training job as" in api  # run's docstring


# The pages a newcomer follows first; their commands and configs must be the code's.
GETTING_STARTED = ("README.md", "docs/quickstart.md", "docs/your-data.md", "docs/your-agent.md",
                   "docs/stop-resume.md", "docs/ray-cluster.md")
# placeholders of the pages' commands -> a value of the kind they stand for
PLACEHOLDERS = {"NAME": "modes", "<name>": "tick-demo", "MODEL_DIR": "model", "OUT": "out.json",
                "DIR": "out", "CONFIG": "examples/tick.yaml"}


def _blocks(text: str, lang: str) -> list[str]:
    """The bodies of the fenced blocks of ``lang`` ("" for a bare fence), in order."""
    blocks, fence, body = [], None, []
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if fence is None:
                fence, body = line[3:].strip(), []
                continue
            if fence == lang:
                blocks.append("".join(body))
            fence = None
        elif fence is not None:
            body.append(line)
    return blocks


def _commands(block: str) -> list[list[str]]:
    """The ``rollstream ...`` lines of a block as argv (comments, ``[optional ...]`` parts
    and a leading ``VAR=value`` dropped, continuations joined, placeholders filled)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if not re.match(r"([A-Z_]+=\S*\s+)*rollstream\s", line):
            continue
        line = re.sub(r"\s#.*$", "", re.sub(r"(?<=\s)\[[^\]]*\]", "", line))
        words = shlex.split(line)
        words = words[words.index("rollstream"):]
        out.append([PLACEHOLDERS.get(w, w.replace("<name>", "tick-demo")) for w in words[1:]])
    return out


def test_getting_started_commands_and_configs_are_the_codes() -> None:
    """Every ``rollstream`` command of the Getting-started pages parses with the CLI as it is,
    a ``train`` of an example config loads with its overrides (every key a field, every value
    allowed), every YAML config block validates, and every Python block compiles: fast,
    beside tests/test_docs_run.py, which runs them on the smallest shape."""
    from rollstream.cli import _parser
    from rollstream.config.loader import load_config, validate

    checked = 0
    for page in GETTING_STARTED:
        text = (ROOT / page).read_text()
        for block in _blocks(text, ""):
            for argv in _commands(block):
                args = _parser().parse_args(argv)  # SystemExit (exit 2) on a bad command
                checked += 1
                if args.command == "train" and (ROOT / args.config).is_file():
                    load_config(ROOT / args.config, args.overrides)
        for block in _blocks(text, "yaml"):
            if "tasks:" in block or "rollout:" in block:
                validate(yaml.safe_load(block))
                checked += 1
        for block in _blocks(text, "python"):
            if not block.startswith("--8<--"):
                compile(block, page, "exec")
                checked += 1
    assert checked >= 20, checked  # the pages were read, not skipped
