"""Processes of the tests that start warm: ``python -m rollstream ...`` (or a script, or
``-c CODE``) as a process of its own, forked from a server that imported torch, transformers
and rollstream already.

A ``rollstream train`` process spends 6-7 CPU-seconds importing :data:`PRELOAD` before its
first line of work (2026-12-08, the 2-vCPU AMD EPYC VM, quiet: ``python -c "import ..."`` of
that list took 6.1-7.1 CPU-s in three runs), and the suite starts a few dozen. What runs is
still a process of its own running the real command: its own pid, signals, exit code,
environment, working folder and output files; the reward and harness workers it spawns start as
they always do. What a warm start skips is the interpreter's own start-up: the server's imports
are done with the environment the server started with (the test session's), so a setting read
at import time (``OMP_NUM_THREADS``) is the session's; ``PYTHONPATH`` entries go on
``sys.path`` and a ``sitecustomize`` among them runs, as at a start-up
(tests/durable/slow_engine/).

:func:`run` is ``subprocess.run(..., capture_output=True, text=True)``; :func:`start` a
``subprocess.Popen`` with stdout and stderr in one stream (``stderr=STDOUT``)."""

from __future__ import annotations

import atexit
import functools
import importlib
import multiprocessing
import multiprocessing.context
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

# what every rollstream command imports (docs/tests.md: most of a command's start-up); the
# trainer pulls transformers' modeling code (torch._dynamo, sympy: ~2.5 CPU-s more)
PRELOAD = ["torch", "transformers", "rollstream.cli", "rollstream.runtime.train",
           "rollstream.api", "rollstream.train.trainer", "rollstream.engine.local"]


@functools.cache
def forks() -> multiprocessing.context.ForkServerContext:
    """Processes forked from a server that imported :data:`PRELOAD` (started at first use,
    ended with the test session's process)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class WarmProcess:
    """A started command, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, argv: Sequence[str], *, cwd: str | Path | None = None,
                 env: Mapping[str, str] | None = None, output: Path | None = None,
                 errors: Path | None = None) -> None:
        self.args = list(argv)
        if output is None:  # a folder of its own, removed with this object
            folder = tempfile.mkdtemp(prefix="warm-")
            weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)
            output = Path(folder) / "stdout"
        self._out = output
        self._err = errors  # None: into the same stream as stdout
        self._proc = forks().Process(target=_main, args=(
            self.args, str(Path(cwd or os.getcwd()).resolve()),
            dict(os.environ if env is None else env), str(self._out),
            None if errors is None else str(errors)))
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> str:
        return self._out.read_text(errors="replace") if self._out.exists() else ""

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """(stdout and stderr as one text, None) once the process has ended."""
        self.wait(timeout)
        return self.output(), None


def start(argv: Sequence[str], *, cwd: str | Path | None = None,
          env: Mapping[str, str] | None = None) -> WarmProcess:
    """``subprocess.Popen([sys.executable, *argv], stdout=PIPE, stderr=STDOUT, text=True)``
    started warm: its output is read whole by ``communicate`` once it ended."""
    return WarmProcess(argv, cwd=cwd, env=env)


def start_train(config: Path, output: IO[str] | int, *, resume: bool = False) -> WarmProcess:
    """``rollstream.bench.sampling.start_train`` (a benchmark's run) started warm: its output
    to ``output``'s file (an open file, or ``subprocess.DEVNULL``)."""
    path = Path(os.devnull if isinstance(output, int) else output.name)
    return WarmProcess(["-m", "rollstream", "train", str(config),
                        *(["--resume"] if resume else [])], output=path)


def run(argv: Sequence[str], *, cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``
    started warm (``check=False``); past ``timeout`` the process is killed and
    ``TimeoutExpired`` raised, as subprocess.run does."""
    with tempfile.TemporaryDirectory(prefix="warm-run-") as tmp:
        err = Path(tmp) / "stderr"
        proc = WarmProcess(argv, cwd=cwd, env=env, output=Path(tmp) / "stdout", errors=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess([sys.executable, *proc.args], proc.returncode or 0,
                                           proc.output(), err.read_text(errors="replace"))


def _main(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str | None) -> None:
    """In the forked process: ``python *argv`` as the interpreter would run it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out_fd = os.open(out, flags)
    os.dup2(out_fd, 1)
    os.dup2(os.open(err, flags) if err else out_fd, 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [os.path.abspath(p) for p in paths]
    if any(Path(p, "sitecustomize.py").is_file() for p in paths):
        importlib.import_module("sitecustomize")
    code: object = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            with warnings.catch_warnings():  # "found in sys.modules ...": it is preloaded
                warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        else:
            # absolute: a process it spawns finds its __main__ by this path
            sys.argv = [os.path.abspath(argv[0]), *argv[1:]]
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        atexit._run_exitfuncs()  # as an interpreter's exit would (a forked child skips them)
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)

