"""verifiers environments as episode sources: a ``vf.Environment`` (the ``verifiers``
package, the ``verifiers`` extra; the environment standard of prime-rl's hub) runs its own
rollout against the run's OpenAI-compatible proxy and grades it with its own rubric.

A source with ``harness: verifiers`` names the environment in ``environment``: an import
path ``module:name`` of a ``vf.Environment`` or of a function returning one (called with
``environment_kwargs``, as a hub module's ``load_environment``), or the name of an installed
environment module (``vf.load_environment(name, **environment_kwargs)``). It is loaded and
checked when the run is built (:func:`load_environment`), and once more in each process that
runs episodes or grades them. Its episodes run on the proxy harness
(``agent/proxy_harness.py``) as an SDK agent would: :class:`VerifiersAgent` calls the
environment's ``rollout`` with a client on the episode's proxy session, so every model call is
a turn of the training sample, token for token as the proxy serves it, and returns the
rollout's state as the episode's record (:func:`state_record`).

Grading is verifiers' own group scoring, as its ``run_group`` does: the source's reward is
:class:`VerifiersRubric`, a group reward, which calls the rubric's ``score_group`` on the
states of a group's finished episodes once the group's last sample has finished, in a reward
worker (``reward.num_workers``, under ``reward.timeout_s``; the environment is loaded there before
the first call's timeout starts). So a rubric's group reward functions (which compare a
group's rollouts) work, and per-rollout functions score each state as ``score_rollout``
would. A group's samples that failed are not in its states.

What it simplifies: the rows come from the source's dataset (its ``prompt`` and ``answer``,
and its ``info`` and ``task`` objects when they are), not from the environment's own
``dataset``, which a hub environment downloads (docs/agents.md says how to supply it as a
local file); the run's sampling settings are used, not the environment's ``sampling_args``;
the state a rubric reads is what of it is JSON (:func:`state_record`: a client, a lock or a
step's raw response object are not kept).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollstream.config.tasks import EPISODE_ROW, lookup
from rollstream.named import import_named
from rollstream.reward.registry import SETUP_ATTR, group_reward

if TYPE_CHECKING:
    from rollstream.agent.proxy import SessionHandle
    from rollstream.config.schema import TasksConfig
    from rollstream.engine import SamplingParams
    from rollstream.trajectory import Task

# a hub environment's loader downloads its dataset, which fails without network
_OFFLINE = (" (a loader that downloads its dataset cannot here: give it local rows, "
            "docs/agents.md)")
_MISSING_PACKAGE = ("harness verifiers needs the `verifiers` package (the environments' "
                    "standard): pip install 'rollstream[verifiers]'")


def _vf() -> Any:
    try:
        import verifiers
    except ImportError as e:
        raise ValueError(f"{_MISSING_PACKAGE} ({e})") from None
    return verifiers


def load_environment(spec: str, kwargs: dict[str, Any]) -> Any:
    """The ``vf.Environment`` that ``spec`` names (module docstring), built with ``kwargs``;
    a ValueError or TypeError saying what is wrong otherwise."""
    vf = _vf()
    if ":" in spec:
        obj = import_named(spec, "environment")
        if not isinstance(obj, vf.Environment):
            if not callable(obj):
                raise TypeError(f"environment {spec!r} is {obj!r}: not a vf.Environment nor "
                                "a function returning one")
            obj = _called(spec, obj, kwargs)
        elif kwargs:
            raise TypeError(f"environment {spec!r} is a vf.Environment already: it takes no "
                            f"environment_kwargs (got {sorted(kwargs)})")
    else:
        try:
            obj = vf.load_environment(spec, **kwargs)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"environment {spec!r} is not an installed verifiers environment "
                             f"module with a load_environment function ({e})") from None
        except TypeError as e:
            raise TypeError(f"environment {spec!r}: load_environment(**environment_kwargs "
                            f"{sorted(kwargs)}) failed: {e}") from None
        except Exception as e:  # noqa: BLE001 - fault boundary: the module's loader, named
            raise ValueError(f"environment {spec!r}: load_environment raised "
                             f"{type(e).__name__}: {e}{_OFFLINE}") from None
    if not isinstance(obj, vf.Environment):
        raise TypeError(f"environment {spec!r} gave {obj!r}, which is not a vf.Environment")
    return obj


def _called(spec: str, fn: Any, kwargs: dict[str, Any]) -> Any:
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise TypeError(f"environment {spec!r} cannot be called with environment_kwargs "
                        f"{sorted(kwargs)}: {e}") from None
    except ValueError:  # no signature to read (a builtin): the call says
        pass
    try:
        return fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - fault boundary: the user's loader, named
        raise ValueError(f"environment {spec!r}: building it raised {type(e).__name__}: {e}"
                         f"{_OFFLINE}") from None


class RolloutFailed(RuntimeError):
    """The rollout ended on an error; ``record``: its state (:func:`state_record`). The proxy
    harness fails the sample unless a budget ended the episode (the proxy refused the call
    past it), which the rubric then grades from ``record``."""

    def __init__(self, message: str, *, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


@functools.cache
def _loaded(spec: str, kwargs_json: str) -> Any:
    """This process's environment of ``spec`` (built once per process: a dataset is read)."""
    return load_environment(spec, json.loads(kwargs_json))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Named:
    """A source's environment, by what names it in the config (plain data: it is sent to
    worker processes whole, and each loads the environment itself)."""

    environment: str  # SourceConfig.environment
    kwargs_json: str  # SourceConfig.environment_kwargs, as JSON

    def load(self) -> Any:
        """This process's environment (loaded at the first call: a check when the run is
        built, or the first episode or grade of a worker process)."""
        _vf()  # the package is there (a cached environment does not say so)
        return _loaded(self.environment, self.kwargs_json)


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifiersAgent(_Named):
    """One source's episodes as an SDK agent of the proxy harness (module docstring)."""

    prompt_column: str  # SourceConfig.columns.prompt: the rollout's opening messages

    async def __call__(self, session: SessionHandle, task: Task,
                       sampling: SamplingParams) -> dict[str, Any]:
        """Run the environment's rollout of ``task`` through ``session``, unscored; its state
        (:func:`state_record`), which the source's reward grades with its group's.
        :class:`RolloutFailed` when the rollout ended on an error (as when the proxy refused
        a call past a budget)."""
        import openai

        vf = _vf()
        env = self.load()
        sampling_args = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                         "max_tokens": sampling.max_new_tokens}
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                      max_retries=0) as client:
            # verifiers 0.1.14 takes its own client around the SDK's; earlier ones the SDK's
            wrap = getattr(vf, "OpenAIChatCompletionsClient", None)
            state = await env.rollout(rollout_input(task, self.prompt_column),
                                      client if wrap is None else wrap(client), "rollstream",
                                      sampling_args)
        record = state_record(state)
        if state.get("error") is not None:
            raise RolloutFailed(f"the verifiers rollout ended on an error: {state['error']}",
                                record=record)
        return record


@group_reward
@dataclass(frozen=True, slots=True, kw_only=True)
class VerifiersRubric(_Named):
    """A verifiers source's reward (module docstring): the rubric's ``score_group`` on the
    states of a group's finished episodes (``episode``: their records), one reward each."""

    def __call__(self, task: Task, texts: list[str], *,
                 episode: list[Mapping[str, Any] | None]) -> list[float]:
        vf = _vf()
        env = self.load()
        missing = [i for i, record in enumerate(episode)
                   if not isinstance(record, Mapping) or not isinstance(record.get("input"),
                                                                        dict)]
        if missing:
            raise ValueError(f"responses {missing} of the group have no verifiers rollout "
                             "state to grade (their agent returned none)")
        states = [vf.State(json.loads(json.dumps(record))) for record in episode]  # own copies
        asyncio.run(env.rubric.score_group(states))
        return [s.get("reward") for s in states]

    def setup(self, task: Task) -> None:
        """Before a worker's call is timed: load the environment (``@reward_setup``)."""
        self.load()


setattr(VerifiersRubric, SETUP_ATTR, VerifiersRubric.setup)


def with_rubrics(tasks: TasksConfig, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The reward objects of a run by source (``build_resolver``'s ``given``): ``given`` (the
    caller's; none names a verifiers source, the config refuses it) and each verifiers
    source's rubric."""
    return {**(given or {}), **{
        s.source_name: VerifiersRubric(environment=str(s.environment),
                                       kwargs_json=json.dumps(s.environment_kwargs,
                                                              sort_keys=True))
        for s in tasks.sources if s.harness == "verifiers"}}

_STEP_DROPPED = ("response", "tokens")  # a step's raw reply object, and the sample's own ids


def state_record(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a rubric can read of a rollout's ``state``, as a JSON object: each of its entries
    that is JSON data (pydantic objects as their dicts, an error as its text), the trajectory's
    steps without their raw reply objects and token ids; the rest (the client, a lock, any
    other object) is left out."""
    record: dict[str, Any] = {}
    for key, value in dict.items(state):  # as stored: the input fields stay under "input"
        if key == "trajectory" and isinstance(value, list):
            value = [{k: v for k, v in step.items() if k not in _STEP_DROPPED}
                     if isinstance(step, Mapping) else step for step in value]
        try:
            record[key] = json.loads(json.dumps(value, default=_plain, allow_nan=False))
        except (TypeError, ValueError):  # not data (or a NaN, which JSON has not)
            continue
    return record


def _plain(obj: Any) -> Any:
    if isinstance(obj, BaseException):
        return f"{type(obj).__name__}: {obj}"
    dump = getattr(obj, "model_dump", None)  # pydantic messages and tool calls
    if callable(dump):
        return dump(mode="json")
    raise TypeError(f"{type(obj).__name__} is not data")


def rollout_input(task: Task, prompt_column: str) -> dict[str, Any]:
    """The ``RolloutInput`` of a dataset task: the prompt as chat messages (a string is one
    user message, as the run rendered it), the reference answer, the row's ``example_id``,
    and its ``info`` and ``task`` when they are objects."""
    row = task.extra[EPISODE_ROW]  # a dataset source's task: its whole row
    prompt = lookup(row, prompt_column)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    out = {"prompt": prompt, "answer": "" if task.reference is None else task.reference,
           "example_id": row.get("example_id", 0)}
    # verifiers reads both as objects (a task payload, the rubric's info); a row's plain
    # ``task`` label is not one
    out.update({k: row[k] for k in ("info", "task") if isinstance(row.get(k), dict)})
    return out
