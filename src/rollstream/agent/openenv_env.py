"""Episodes in an OpenEnv environment (``tasks.sources.N.openenv``; the ``openenv`` extra).

OpenEnv serves an environment from a FastAPI app (its template's ``server/app.py``:
``create_app(Env, Action, Observation)``); a client holds one session per WebSocket
(``reset``, ``step``), each with its own environment instance. Here:

* :class:`OpenEnvServer` is a source's server: launched at its first episode as
  ``python -m uvicorn <app>`` on 127.0.0.1 (a free port), in a process group of its own with
  ``PR_SET_PDEATHSIG`` (it dies with the run), stopped by :meth:`OpenEnvServer.close` (the
  run closes it with the harness) or at exit; or a server at ``url``, attached.
* :class:`OpenEnvEpisode` is one episode's environment: a session of OpenEnv's own client
  (``GenericEnvClient``, JSON actions and observations), reset with the row's
  ``reset_columns``, stepped with ``{action_field: model text}``; each step's observation
  (``observation_field``, or all of it as JSON) is appended as a user message. It grades
  the episode from the steps' rewards. The episode opens with the row's prompt: its tokens
  are fixed when the dataset is read, before any server runs, so what ``reset`` observes is
  not shown (seed the reset from the row so that the prompt and the environment agree).

What the server sends is not trusted: a message over ``max_message_bytes`` closes the
connection (the client's WebSocket limit), a reply slower than ``timeout_s`` fails the
episode, and every result is checked (a JSON object observation, a boolean ``done``, a finite
number or null ``reward``, a text or number at ``observation_field``) before it is used.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import IO, TYPE_CHECKING, Any


from rollstream.agent.environment import Message, ModelTurn, Observation
from rollstream.config.tasks import lookup
from rollstream.engine.vllm.server import (HOST, free_port, kill_group, set_pdeathsig,
                                           until_healthy)

if TYPE_CHECKING:
    from rollstream.config.openenv import OpenEnvConfig

_LIVE: set[OpenEnvServer] = set()
_MISSING = object()


class OpenEnvError(RuntimeError):
    """An OpenEnv server could not be started, or sent what an episode cannot use."""


def check_openenv(cfg: OpenEnvConfig) -> None:
    """What ``cfg`` names outside the config exists: the ``openenv`` package and the module
    of ``app`` (not imported here: the server imports it)."""
    if importlib.util.find_spec("openenv") is None:
        raise ValueError("needs the `openenv-core` package (pip install 'rollstream[openenv]')")
    if cfg.app is not None:
        module = cfg.app.split(":", 1)[0]
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError) as e:
            raise ValueError(f"app {cfg.app!r}: module {module!r} cannot be found ({e})") from None
        if found is None:
            raise ValueError(f"app {cfg.app!r}: no module {module!r} on the path")


class OpenEnvServer:
    """A source's OpenEnv server (module docstring): :meth:`url` starts it once."""

    def __init__(self, cfg: OpenEnvConfig, *, source: str) -> None:
        self.cfg, self.source = cfg, source
        self.proc: subprocess.Popen[bytes] | None = None
        self._url: str | None = cfg.url.rstrip("/") if cfg.url is not None else None
        self._log: IO[bytes] | None = None
        self._starting = asyncio.Lock()

    async def url(self) -> str:
        """The server's URL, launching it at the first call."""
        async with self._starting:
            if self._url is None:
                self._url = await self._launch()
        return self._url

    async def _launch(self) -> str:
        assert self.cfg.app is not None
        port = free_port()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        # what the run imports, the server imports (the app's module may be a local one)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   ENABLE_WEB_INTERFACE="false", PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "uvicorn", self.cfg.app, "--host", HOST, "--port",
                str(port), "--log-level", "warning", "--no-access-log"]
        # on the loop's thread, not a worker's: Linux ties PR_SET_PDEATHSIG to the thread that
        # spawned the child, and the loop's lives as long as the run
        self.proc = subprocess.Popen(  # noqa: ASYNC220
            argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, preexec_fn=set_pdeathsig)  # noqa: PLW1509
        _LIVE.add(self)
        url = f"http://{HOST}:{port}"
        try:
            await self._wait_healthy(url)
        except BaseException:
            await self.close()
            raise
        return url

    async def _wait_healthy(self, url: str) -> None:
        assert self.proc is not None
        outcome = await until_healthy(url, self.proc, self.cfg.start_timeout_s, poll_s=0.2)
        if outcome == "exited":
            raise OpenEnvError(f"source {self.source}: the OpenEnv server {self.cfg.app!r} "
                               f"exited with code {self.proc.returncode}:\n{self.log_tail()}")
        if outcome == "timeout":
            raise OpenEnvError(f"source {self.source}: the OpenEnv server {self.cfg.app!r} did "
                               f"not answer {url}/health within "
                               f"{self.cfg.start_timeout_s:g} s:\n{self.log_tail()}")

    def log_tail(self, num_bytes: int = 4000) -> str:
        if self._log is None:
            return "(no log)"
        self._log.seek(max(0, self._log.seek(0, os.SEEK_END) - num_bytes))
        return self._log.read().decode(errors="replace")

    async def close(self) -> None:
        """Stop a launched server and its children (idempotent; an attached one stays)."""
        await asyncio.to_thread(self.stop)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None:
            kill_group(proc, grace_s=5.0)
            if self.cfg.app is not None:
                self._url = None
        if self._log is not None:
            self._log.close()
            self._log = None


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class OpenEnvEpisodes:
    """A source's environment factory: an :class:`OpenEnvEpisode` per episode, all on one
    server (closed with the harness)."""

    gives_reward = True

    def __init__(self, cfg: OpenEnvConfig, *, source: str, prompt_column: str) -> None:
        self.cfg, self.prompt_column = cfg, prompt_column
        self.server = OpenEnvServer(cfg, source=source)
        self.sessions = None if cfg.max_sessions is None else asyncio.Semaphore(cfg.max_sessions)

    def __call__(self, *, row: dict[str, Any]) -> OpenEnvEpisode:
        return OpenEnvEpisode(row=row, factory=self)

    async def close(self) -> None:
        await self.server.close()


class OpenEnvEpisode:
    """One episode's OpenEnv session (module docstring)."""

    gives_reward = True

    def __init__(self, *, row: dict[str, Any], factory: OpenEnvEpisodes) -> None:
        self.row, self.cfg, self.factory = row, factory.cfg, factory
        self.client: Any = None
        self.holds_session = False  # one of the factory's max_sessions
        self.rewards: list[float] = []

    async def reset(self) -> list[Message]:
        from openenv.core.generic_client import GenericEnvClient

        missing = [c for c in self.cfg.reset_columns if c not in self.row]
        if missing:
            raise OpenEnvError(f"openenv.reset_columns: the row has no column {missing}")
        kwargs = {c: self.row[c] for c in self.cfg.reset_columns}
        await self.close()  # a replayed episode starts a fresh session
        self.rewards = []
        if self.factory.sessions is not None:
            await self.factory.sessions.acquire()  # released by close()
            self.holds_session = True
        self.client = GenericEnvClient(
            base_url=await self.factory.server.url(), connect_timeout_s=self.cfg.timeout_s,
            message_timeout_s=self.cfg.timeout_s,
            max_message_size_mb=self.cfg.max_message_bytes / (1 << 20))
        self._checked(await _reply("reset", self.client.reset(**kwargs)), "reset")
        return _opening(self.row, self.factory.prompt_column)

    async def step(self, turn: ModelTurn) -> Observation:
        if self.client is None:
            raise OpenEnvError("step before reset")
        result = await _reply("step", self.client.step({self.cfg.action_field: turn.text}))
        observation, reward, done = self._checked(result, "step")
        self.rewards.append(0.0 if reward is None else reward)
        if done:
            await self.close()
            total = sum(self.rewards) if self.cfg.reward == "sum" else self.rewards[-1]
            return Observation(messages=[], done=True, reward=total)
        return Observation(messages=[{"role": "user", "content": self._text(observation)}],
                           done=False)

    async def close(self) -> None:
        """End the session (the server frees its environment)."""
        client, self.client = self.client, None
        try:
            if client is not None:
                with contextlib.suppress(Exception):  # a session the server already dropped
                    await _awaited(client.close())
        finally:
            if self.holds_session:
                assert self.factory.sessions is not None
                self.holds_session = False
                self.factory.sessions.release()

    def _checked(self, result: Any, what: str) -> tuple[dict[str, Any], float | None, bool]:
        observation, reward, done = (getattr(result, k, None)
                                     for k in ("observation", "reward", "done"))
        if not isinstance(observation, dict):
            raise OpenEnvError(f"the OpenEnv server's {what} observation is not a JSON object: "
                               f"{_shown(observation)}")
        if not isinstance(done, bool):
            raise OpenEnvError(f"the OpenEnv server's {what} `done` is not a boolean: "
                               f"{_shown(done)}")
        if reward is not None and (isinstance(reward, bool) or not isinstance(
                reward, (int, float)) or not math.isfinite(reward)):
            raise OpenEnvError(f"the OpenEnv server's {what} `reward` is not a finite number "
                               f"or null: {_shown(reward)}")
        return observation, None if reward is None else float(reward), done

    def _text(self, observation: dict[str, Any]) -> str:
        key = self.cfg.observation_field
        if key is None:
            return json.dumps(observation, separators=(",", ":"), ensure_ascii=False)
        value = observation.get(key, _MISSING)
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise OpenEnvError(f"openenv.observation_field: the observation's {key!r} is not a "
                           f"string or a number: {_shown(None if value is _MISSING else value)}"
                           f" (fields: {sorted(observation)[:20]})")


def _opening(row: dict[str, Any], column: str) -> list[Message]:
    """The row's prompt as the dataset opened the episode (a string is one user message)."""
    value = lookup(row, column)
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return [dict(m) for m in value]
    raise OpenEnvError(f"the row's prompt {column!r} is neither a string nor messages")


async def _reply(what: str, call: Any) -> Any:
    """The client's result of a reset or step; a reply its parser cannot read (not a JSON
    object, or one whose parts are not objects) or an error the server sends is named as the
    server's, its text cut (it lands in the sample's failure reason)."""
    from websockets.exceptions import ConnectionClosed

    try:
        return await _awaited(call)
    except ConnectionClosed as e:  # a message over max_message_bytes, or the server hung up
        raise OpenEnvError(f"the OpenEnv server's connection closed at the {what} ({e}); a "
                           "server at its session limit closes it (openenv.max_sessions)"
                           ) from None
    except (AttributeError, TypeError, json.JSONDecodeError) as e:
        raise OpenEnvError(f"the OpenEnv server's {what} reply is malformed "
                           f"({type(e).__name__}: {_shown(str(e))})") from None
    except RuntimeError as e:  # its error frame: the server's own words, cut to a reason's size
        # a server at capacity either closes the connection (above) or says so in an error
        # frame (CAPACITY_REACHED), whichever comes first: both name the setting
        full = ("; a server at its session limit refuses new sessions (openenv.max_sessions)"
                if "capacity" in str(e).lower() else "")
        raise OpenEnvError(f"the OpenEnv server refused the {what}: {_shown(str(e))}{full}"
                           ) from None


async def _awaited(value: Any) -> Any:
    """OpenEnv's client methods are coroutines in some releases and awaitables in others."""
    return await value if inspect.isawaitable(value) else value


def _shown(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
