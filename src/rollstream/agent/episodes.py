"""How a source's episodes run, from its config: the environment, SDK agent, tools and
tool-call parser it names, resolved and checked once, when the run is built.

Any source with a ``harness`` (a dataset's, or the ``tally`` kind's) is an
:class:`EpisodeSource` for the harness that runs it (``agent/harness.py``,
``agent/proxy_harness.py``). What it names is resolved here and a mistake is a ValueError or
TypeError naming ``tasks.sources.N.<field>``:

* ``environment``: a class or function called for each episode as
  ``environment(row=..., **environment_kwargs)``, plus ``tools=`` (the episode's tool runner:
  ``await tools.run(calls)``, ``tools.schemas()``) and ``parser=`` (the source's tool-call
  parser) when it declares them. The row is the dataset row (``task.extra["row"]``); a
  generated task's is ``{"prompt": task.prompt_text, "answer": task.reference}``. What it
  returns has ``reset()`` and ``step(turn)``, async or plain (a plain one runs in a thread:
  :class:`~rollstream.agent.environment.ThreadedEnvironment`). An environment whose class sets
  ``gives_reward = True`` grades its episodes (``Observation.reward``), so its source names
  no ``reward``; any other episode is graded by the source's reward on its last model turn.
* ``openenv`` (instead of ``environment``): an OpenEnv environment's server, launched at the
  source's first episode or attached by URL, one client session per episode
  (``agent/openenv_env.py``); it grades the episodes.
* ``agent``: an ``async def (session, task, sampling)`` (``agent/proxy_harness.py``), which
  must be picklable by reference (defined at a module's top level) because
  ``agent.harness_workers`` runs it in spawned processes.
* ``tools``: ``calculator``, ``python`` (the run's sandbox pool: ``agent.sandbox``), or an
  import path of a tool (``name``, ``description``, ``parameters``, an async ``__call__``) or of
  a class or function making one, given ``sandbox=`` (the run's pool) when it declares it.
* ``tool_parser``: ``hermes`` or an import path of a parser or of what makes one (no
  arguments).

A ``harness: verifiers`` source's ``environment`` is a ``vf.Environment`` (or what makes one,
given ``environment_kwargs``, or an installed environment module's name), loaded here to be
checked (``agent/verifiers_env.py``); its episodes run on the proxy harness, driven by a
:class:`~rollstream.agent.verifiers_env.VerifiersAgent` that returns the rollout's state,
which the source's reward (:class:`~rollstream.agent.verifiers_env.VerifiersRubric`) grades
with its group's.
"""

from __future__ import annotations

import inspect
import json
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollstream.agent.environment import Environment, ThreadedEnvironment, aclose
from rollstream.agent.tools import Calculator, HermesToolParser, Tool, ToolCallParser
from rollstream.agent.verifiers_env import VerifiersAgent
from rollstream.config.tasks import EPISODE_ROW
from rollstream.named import import_named
from rollstream.trajectory import Task

if TYPE_CHECKING:
    from rollstream.agent.sandbox_shared import RunSandbox
    from rollstream.config.schema import SourceConfig, TasksConfig

BUILTIN_TOOLS = ("calculator", "python")
_ENV_OPTIONAL = ("tools", "parser")  # what an environment receives when it declares them


@dataclass(slots=True, kw_only=True)
class EpisodeSource:
    """What a harness needs of one source: its tools, parser and environment or agent."""

    name: str
    harness: str  # "agent" or "openai" (Task.harness: what runs its episodes)
    parser: ToolCallParser
    tools: list[Tool] = field(default_factory=list)
    make_environment: Callable[..., Any] | None = None  # harness agent
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    agent: str | VerifiersAgent | None = None  # harness openai: its import path, or verifiers'
    gives_reward: bool = False  # its environment grades episodes (harness agent)

    def tool_list(self) -> list[Tool]:
        return list(self.tools)

    async def close(self) -> None:
        """Release what its environment factory holds for the run (an OpenEnv server)."""
        await aclose(self.make_environment)

    def environment(self, task: Task, tools: Any) -> Environment:
        """A fresh environment for ``task`` whose tool calls go through ``tools``."""
        assert self.make_environment is not None, f"source {self.name}: no environment"
        kwargs = dict(self.environment_kwargs)
        wanted = _declared(self.make_environment, _ENV_OPTIONAL)
        if "tools" in wanted:
            kwargs["tools"] = tools
        if "parser" in wanted:
            kwargs["parser"] = self.parser
        env = self.make_environment(row=task_row(task), **kwargs)
        if not (hasattr(env, "reset") and hasattr(env, "step")):
            raise TypeError(f"the environment of source {self.name!r} made {env!r}, which has "
                            "no reset() and step(turn)")
        return env if inspect.iscoroutinefunction(env.step) else ThreadedEnvironment(env)


def task_row(task: Task) -> dict[str, Any]:
    """The row an episode's environment is built from (module docstring)."""
    row = task.extra.get(EPISODE_ROW)
    if isinstance(row, Mapping):
        return dict(row)
    return {"prompt": task.prompt_text, "answer": task.reference}


def episode_sources(tasks: TasksConfig,
                    sandbox: RunSandbox | None = None) -> dict[str, EpisodeSource]:
    """Source name -> its :class:`EpisodeSource`, for every source whose tasks are episodes;
    everything named resolved and checked. ``sandbox``: the run's pool, given to the tools
    that ask for one (None: a pool of the default settings, never started by a check)."""
    if sandbox is None:
        from rollstream.agent.sandbox_shared import RunSandbox
        from rollstream.config.tasks import SandboxConfig

        sandbox = RunSandbox(SandboxConfig())
    out = {}
    for i, src in enumerate(tasks.sources):
        if src.episodic:
            out[src.source_name] = _episode_source(src, f"tasks.sources.{i}", sandbox)
    return out


def _episode_source(src: SourceConfig, where: str, sandbox: RunSandbox) -> EpisodeSource:
    harness = src.task_harness or "agent"
    parser = _field(where, "tool_parser", build_parser, src.episode_setting("tool_parser"))
    tools = [_field(f"{where}.tools", str(k), build_tool, spec, sandbox)
             for k, spec in enumerate(src.episode_setting("tools"))]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}.tools: two tools share a name ({names})")
    out = EpisodeSource(name=src.source_name, harness=harness, parser=parser, tools=tools)
    if src.harness == "verifiers":
        out.agent = VerifiersAgent(environment=str(src.environment),
                                   kwargs_json=json.dumps(src.environment_kwargs, sort_keys=True),
                                   prompt_column=src.columns.prompt)
        _field(where, "environment", out.agent.load)
        return out
    if harness == "openai":
        path = src.episode_setting("agent")
        _field(where, "agent", check_agent, path)
        out.agent = path
        return out
    if src.openenv is not None:
        return _openenv_source(src, where, out)
    path = src.episode_setting("environment")
    out.make_environment = _field(where, "environment", environment_factory, path,
                                  dict(src.environment_kwargs))
    out.environment_kwargs = dict(src.environment_kwargs)
    out.gives_reward = getattr(out.make_environment, "gives_reward", False) is True
    if out.gives_reward and src.reward is not None:
        raise ValueError(f"{where}.reward: the environment {path!r} grades its episodes "
                         f"(gives_reward), and the source names reward {src.reward!r}: "
                         "drop one of them")
    return out


def _openenv_source(src: SourceConfig, where: str, out: EpisodeSource) -> EpisodeSource:
    """A source whose episodes run in an OpenEnv environment (``agent/openenv_env.py``): its
    server is launched (or attached) at the first episode and closed with the harness."""
    from rollstream.agent.openenv_env import OpenEnvEpisodes, check_openenv

    assert src.openenv is not None
    _field(where, "openenv", check_openenv, src.openenv)
    out.make_environment = OpenEnvEpisodes(src.openenv, source=src.source_name,
                                           prompt_column=src.columns.prompt)
    out.gives_reward = True
    return out


def _field(where: str, key: str, resolve: Callable[..., Any], *args: Any) -> Any:
    """``resolve(*args)``, its error prefixed with the config field."""
    try:
        return resolve(*args)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}.{key}: {e}") from None


def environment_factory(path: str, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """The callable at ``path``, checked to take ``row=`` and ``kwargs``."""
    factory = import_named(path, "environment")
    if not callable(factory):
        raise TypeError(f"environment {path!r} is {factory!r}, not a class or function")
    if inspect.isclass(factory) and not (hasattr(factory, "reset") and hasattr(factory, "step")):
        raise TypeError(f"environment {path!r}: class {factory.__name__} has no reset() and "
                        "step(turn)")
    extra = dict.fromkeys(_declared(factory, _ENV_OPTIONAL))
    try:
        inspect.signature(factory).bind(row={}, **kwargs, **extra)
    except TypeError as e:
        raise TypeError(f"environment {path!r}{inspect.signature(factory)} cannot be called as "
                        f"(row=..., **environment_kwargs {sorted(kwargs)}): {e}") from None
    return factory  # type: ignore[no-any-return]


def check_agent(path: str) -> Any:
    """The agent at ``path``, checked to be an ``async def (session, task, sampling)`` that
    worker processes can import (it pickles by reference)."""
    fn = import_named(path, "agent")
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"agent {path!r} must be an `async def` function of (session, task, "
                        f"sampling), got {fn!r}")
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError as e:
        raise TypeError(f"agent {path!r}{inspect.signature(fn)} cannot be called as "
                        f"(session, task, sampling): {e}") from None
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same
        raise TypeError(f"agent {path!r} cannot be sent to a harness worker process "
                        f"({type(e).__name__}: {e}): define it at the top level of a "
                        "module") from None
    return fn


def build_tool(spec: str, sandbox: RunSandbox) -> Tool:
    """The tool ``spec`` names (module docstring)."""
    if spec == "calculator":
        return Calculator()
    if spec == "python":
        from rollstream.agent.sandbox import PythonTool

        return PythonTool(pool=sandbox)  # type: ignore[arg-type]  (a pool's run())
    if ":" not in spec:
        raise ValueError(f"tool {spec!r} is neither a built-in ({', '.join(BUILTIN_TOOLS)}) "
                         "nor an import path 'module:name'")
    obj = import_named(spec, "tool")
    if _is_tool(obj):
        return obj  # type: ignore[no-any-return]
    if not callable(obj):
        raise TypeError(f"tool {spec!r} is {obj!r}: not a tool nor a class or function making "
                        "one")
    try:
        tool = obj(sandbox=sandbox) if "sandbox" in _declared(obj, ("sandbox",)) else obj()
    except TypeError as e:
        raise TypeError(f"tool {spec!r}: cannot make the tool with no arguments (or "
                        f"sandbox=): {e}") from None
    if not _is_tool(tool):
        raise TypeError(f"tool {spec!r} made {tool!r}, which is not a tool: it needs `name`, "
                        "`description`, `parameters` and an `async def __call__(**arguments)`")
    return tool  # type: ignore[no-any-return]


def build_parser(spec: str) -> ToolCallParser:
    """The tool-call parser ``spec`` names (module docstring)."""
    if spec == "hermes":
        return HermesToolParser()
    obj = import_named(spec, "tool_parser")
    if not _is_parser(obj) and callable(obj):
        obj = obj()
    if not _is_parser(obj):
        raise TypeError(f"tool_parser {spec!r} gives {obj!r}, which has no parse(text) and "
                        "render(call)")
    return obj  # type: ignore[no-any-return]


def _is_tool(obj: object) -> bool:
    return (not inspect.isclass(obj) and all(hasattr(obj, a) for a in
                                             ("name", "description", "parameters"))
            and inspect.iscoroutinefunction(getattr(type(obj), "__call__", None)))


def _is_parser(obj: object) -> bool:
    return not inspect.isclass(obj) and callable(getattr(obj, "parse", None)) and callable(
        getattr(obj, "render", None))


def _declared(fn: Callable[..., Any], names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``names`` that ``fn`` takes by keyword (all of them with ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return names
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(n for n in names if n in params and params[n].kind in keyword)
