"""The run's sandbox pool, from ``agent.sandbox``: one :class:`SandboxPool` shared by the
built-in ``python`` tool, the ``code`` reward and user tools that ask for ``sandbox``.

It starts at the first program (a run whose sources never run one starts no sandbox) and
the run closes it. The ``code`` reward is a registered function, not an object the run
builds, so it finds the pool as the process's current one (:func:`current_sandbox`): the
run installs its own when it is built; outside a run (a test calling the reward) the
default settings apply.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.agent.sandbox import SandboxLimits, SandboxPool, SandboxResult

if TYPE_CHECKING:
    from rollstream.config.tasks import SandboxConfig

_LIMITS = ("wall_s", "cpu_s", "memory_mb", "max_procs", "file_size_mb", "disk_mb",
           "max_output_bytes")


class RunSandbox:
    """A :class:`SandboxPool` made from ``agent.sandbox`` at its first ``run``."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.limits = SandboxLimits(**{k: getattr(cfg, k) for k in _LIMITS})
        self._pool: SandboxPool | None = None
        self._starting = asyncio.Lock()

    @property
    def pool(self) -> SandboxPool | None:
        """The pool, once a program has run."""
        return self._pool

    async def run(self, code: str, *, stdin: str = "") -> SandboxResult:
        """Run ``code`` in a free sandbox (``SandboxPool.run``)."""
        async with self._starting:
            if self._pool is None:
                c = self.cfg
                self._pool = await asyncio.to_thread(
                    SandboxPool, c.size, limits=self.limits, backend=c.backend,
                    allow_net=c.allow_net, pass_env=c.pass_env,
                    artifacts=None if c.artifacts is None else Path(c.artifacts).expanduser())
        return await self._pool.run(code, stdin=stdin)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


_current: RunSandbox | None = None


def install_sandbox(cfg: SandboxConfig) -> RunSandbox:
    """Make a run's pool the process's current one (what the ``code`` reward uses)."""
    global _current
    _current = RunSandbox(cfg)
    return _current


def current_sandbox() -> RunSandbox:
    """The current run's pool; one of the default settings when no run installed one."""
    global _current
    if _current is None:
        from rollstream.config.tasks import SandboxConfig

        _current = RunSandbox(SandboxConfig())
    return _current
