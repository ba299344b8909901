"""The agent tests' kit model and embedded engine, and ``rollstream proxy`` on that model run
as a separate process (so that its memory can be read from outside): the proxy tests here
reach it over real HTTP on 127.0.0.1."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.agent.conftest import engine, model_dir  # noqa: F401 - the agent tests' fixtures

NUM_KEYS = 4


@dataclass(slots=True, frozen=True)
class ProxyProcess:
    pid: int
    base_url: str
    keys: tuple[str, ...]
    stderr: Path  # what the server wrote there (a traceback would be a bug)


@pytest.fixture(scope="package")
def cli_proxy(model_dir: Path, tmp_path_factory) -> Iterator[ProxyProcess]:  # noqa: F811
    """``rollstream proxy MODEL_DIR --sessions 4`` with its default limits."""
    err = tmp_path_factory.mktemp("proxy") / "stderr.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "rollstream", "proxy", str(model_dir),
                                 "--sessions", str(NUM_KEYS)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        base_url = proc.stdout.readline().split()[1]
        keys = tuple(proc.stdout.readline().split()[1] for _ in range(NUM_KEYS))
        yield ProxyProcess(pid=proc.pid, base_url=base_url, keys=keys, stderr=err)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
