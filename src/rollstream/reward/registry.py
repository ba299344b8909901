"""Reward functions by name, checked once, and what they are called with.

A reward is a plain typed callable, sync or ``async``::

    def my_reward(task: Task, text: str) -> float: ...
    def my_reward(task: Task, text: str, *, finish_reason: str) -> float: ...
    async def my_reward(task: Task, text: str, *, token_ids: tuple[int, ...]) -> float: ...

``text`` is the response decoded with special tokens skipped (as TRL does: no
``<|endoftext|>``). A reward that needs more *asks* for it by declaring keyword parameters
named ``finish_reason`` (``"stop"``: a stop token ended the response; ``"length"``: it was
capped), ``token_ids`` (the response tokens exactly as sampled, stop token included) and/or
``episode`` (an agent episode's record: the JSON object its OpenAI-SDK agent returned, such
as a verifiers rollout's state; None when it returned none, and for single-turn samples).
A dataset source's ``reward_kwargs`` columns arrive as keyword arguments too (``task.extra``),
as TRL passes dataset columns::

    def score(task: Task, text: str, *, data_source: str, extra_info: dict) -> float: ...
    def score(task: Task, text: str, **columns) -> float: ...

A **group reward** grades the samples of one group together (a ranking, a pairwise
preference, a diversity bonus): mark it with ``@group_reward``; it is called once per group,
when every sample of the group has finished generating, with lists in place of ``text`` and
the response keywords, and returns one number per response, in order::

    @group_reward
    def shortest_correct(task: Task, texts: list[str], *, finish_reason: list[str]) -> list[float]: ...

A sync reward whose first call builds something slow that is not grading (an import, a grader
built from the task: reasoning-gym's generators) names that step with ``@reward_setup(fn)``:
the worker runs ``fn(task)`` before the call's ``reward.timeout_s`` starts counting (it is
bounded by the worker's start-up limit instead), so the first grade of each worker is not
timed out by its imports. ``fn`` runs before every call: it caches what it builds.

Register one with ``@register_reward("name")``; a config names it by that name or by an import
path ``module:function`` (imported when the run is built). :func:`get_reward` turns any of
these into a :class:`Reward`: its signature is inspected once, there, never per call, and a
sync reward is checked to be sendable to a worker process by reference (module + name), so a
lambda or a local function fails at load time with a clear error instead of in a worker.
:func:`build_resolver` resolves every reward a run needs once, when the run is built.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import pickle
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, Union

from rollstream.trajectory import RESPONSE_KWARGS, Task

if TYPE_CHECKING:  # pydantic stays out of reward worker processes
    from rollstream.config.schema import RewardConfig

SyncRewardFn = Callable[..., float]
AsyncRewardFn = Callable[..., Awaitable[float]]
RewardFn = Union[SyncRewardFn, AsyncRewardFn]

F = TypeVar("F", bound=Callable[..., object])

_GROUP_MARK = "__rollstream_group_reward__"
SETUP_ATTR = "__rollstream_reward_setup__"  # @reward_setup's step, read by pool.call_in_worker
_FINISH_REASONS = ("stop", "length")


@dataclass(slots=True, kw_only=True, frozen=True)
class Response:
    """What a reward grades: one finished response."""

    text: str  # decoded with special tokens skipped (as TRL does)
    token_ids: tuple[int, ...]  # the response tokens exactly as sampled
    finish_reason: str  # "stop" (a stop token ended it) or "length" (capped)
    episode: Mapping[str, Any] | None = None  # an agent episode's record (Sample.episode_record)

    def __post_init__(self) -> None:
        if self.finish_reason not in _FINISH_REASONS:
            raise ValueError(
                f"Response.finish_reason must be 'stop' or 'length', got {self.finish_reason!r}"
            )


class TextDecoder(Protocol):
    """The part of a Hugging Face tokenizer that renders a response for rewards."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def decode_response(
    tokenizer: TextDecoder, token_ids: Sequence[int], *, finish_reason: str
) -> Response:
    """The grading input for sampled ``token_ids``: text without special tokens, as TRL does."""
    ids = list(token_ids)
    return Response(
        text=tokenizer.decode(ids, skip_special_tokens=True),
        token_ids=tuple(ids),
        finish_reason=finish_reason,
    )


@dataclass(slots=True, kw_only=True, frozen=True)
class Reward:
    """A reward function with its signature read once: how to call it."""

    name: str
    fn: RewardFn = field(repr=False)
    is_async: bool
    wants: tuple[str, ...]  # the keyword parameters it asked for, of RESPONSE_KWARGS
    needs: tuple[str, ...] = ()  # keyword parameters without a default: columns must give them
    columns: tuple[str, ...] = ()  # keywords it receives from task.extra (dataset columns)
    group: bool = False  # a group reward (``@group_reward``): lists in, one number per response

    @classmethod
    def of(cls, fn: RewardFn, name: str) -> Reward:
        """Check ``fn``'s signature; a signature the pool cannot call is a TypeError."""
        if not callable(fn):
            raise TypeError(f"reward {name!r} must be callable, got {fn!r}")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as e:
            raise TypeError(f"reward {name!r}: cannot read the signature of {fn!r}: {e}") from None
        keyword_ok = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        wants = tuple(
            n for n in RESPONSE_KWARGS
            if n in sig.parameters and sig.parameters[n].kind in keyword_ok
        )
        positional = [p for p in sig.parameters.values() if p.kind in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)][:2]
        needs = tuple(
            p.name for p in sig.parameters.values()
            if p.kind in keyword_ok and p.default is inspect.Parameter.empty
            and p not in positional and p.name not in wants
        )
        group = bool(getattr(fn, _GROUP_MARK, False))
        try:
            sig.bind(None, None, **dict.fromkeys((*wants, *needs)))
        except TypeError as e:
            shape = "fn(task, texts)" if group else "fn(task, text)"
            raise TypeError(
                f"reward {name!r}{sig} cannot be called as {shape} (plus keyword "
                f"parameters finish_reason, token_ids and/or episode when it declares them, and "
                f"dataset columns): {e}"
            ) from None
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(type(fn), "__call__", None)
        )
        return cls(name=name, fn=fn, is_async=is_async, wants=wants, needs=needs, group=group)

    def with_columns(self, columns: Sequence[str]) -> Reward:
        """This reward, also called with the keyword arguments ``columns`` (from
        ``task.extra``); a signature that cannot take them, or that needs a keyword they do not
        give, is a TypeError naming them."""
        missing = [n for n in self.needs if n not in columns]
        if missing:
            raise TypeError(
                f"reward {self.name!r} needs keyword arguments {missing} that no dataset column "
                f"gives (passed: {list(columns)}): list the columns in the source's "
                "reward_kwargs, or give the parameters defaults"
            )
        if not columns:
            return self
        sig = inspect.signature(self.fn)
        try:
            sig.bind(None, None, **dict.fromkeys((*self.wants, *columns)))
        except TypeError as e:
            raise TypeError(
                f"reward {self.name!r}{sig} cannot take the dataset columns {list(columns)} as "
                f"keyword arguments ({e}): declare them (or **kwargs), or drop them from "
                "reward_kwargs"
            ) from None
        return replace(self, columns=tuple(columns))

    def kwargs(self, task: Task, response: Response) -> dict[str, object]:
        """The keyword arguments this reward asked for, and its dataset columns."""
        kw: dict[str, object] = {n: getattr(response, n) for n in self.wants}
        for n in self.columns:
            kw[n] = task.extra[n]
        return kw

    def call_args(self, task: Task, responses: Sequence[Response]) -> Call:
        """How to call this reward on ``responses`` (all of one group for a group reward,
        exactly one otherwise): ``fn(task, text_or_texts, **kwargs)``, expecting ``count``
        numbers back (None: one number)."""
        if not self.group:
            if len(responses) != 1:
                raise ValueError(f"reward {self.name!r} grades one response at a time, got "
                                 f"{len(responses)} (mark group rewards with @group_reward)")
            return Call(task, responses[0].text, self.kwargs(task, responses[0]), None)
        kw: dict[str, object] = {n: [getattr(r, n) for r in responses] for n in self.wants}
        for n in self.columns:
            kw[n] = task.extra[n]
        return Call(task, [r.text for r in responses], kw, len(responses))

    def score(self, task: Task, response: Response) -> float:
        """Call the reward here, in this process, without a timeout (for measurements outside
        a run, such as the warm start's accuracy; a run grades through ``GraderPool``); a group
        reward sees a group of one. A value that is not a finite number is a ValueError."""
        call = self.call_args(task, [response])
        value = self.fn(call.task, call.text, **call.kwargs)
        if self.is_async:
            with concurrent.futures.ThreadPoolExecutor(1) as ex:  # safe inside a running loop
                value = ex.submit(asyncio.run, value).result()  # type: ignore[arg-type]
        rewards, error = call.checked(value)
        if error is not None:
            raise ValueError(f"reward {self.name!r}: {error}")
        return rewards[0]  # type: ignore[index]


@dataclass(slots=True, frozen=True)
class Call:
    """One reward call: ``fn(task, text, **kwargs)``; ``count``: how many numbers a group
    reward must return (None: a single number)."""

    task: Task
    text: str | list[str]
    kwargs: dict[str, object]
    count: int | None

    def checked(self, value: object) -> tuple[list[float] | None, str | None]:
        """The call's rewards, one per response, or (None, why the value is not that)."""
        if self.count is None:
            reward, error = checked_value(value)
            return (None, error) if error is not None else ([reward], None)  # type: ignore[list-item]
        if inspect.iscoroutine(value):
            value.close()
        items = value.tolist() if hasattr(value, "tolist") else value  # numpy, torch
        if not isinstance(items, (list, tuple)):
            return None, (f"group reward returned {_shown(value)}, expected a list of "
                          f"{self.count} numbers")
        if len(items) != self.count:
            return None, (f"group reward returned {len(items)} values for {self.count} "
                          "responses")
        rewards = []
        for i, item in enumerate(items):
            reward, error = checked_value(item)
            if error is not None:
                return None, f"group reward, response {i}: {error}"
            rewards.append(reward)
        return rewards, None  # type: ignore[return-value]


def _shown(value: object) -> str:
    shown = repr(value)
    return shown[:200] + "..." if len(shown) > 200 else shown


def checked_value(value: object) -> tuple[float | None, str | None]:
    """``(float(value), None)`` for a finite real number, else ``(None, reason)``."""
    if inspect.iscoroutine(value):  # a sync callable that returned a coroutine
        value.close()
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok and math.isfinite(value):  # type: ignore[arg-type]
        return float(value), None  # type: ignore[arg-type]
    return None, f"reward returned {_shown(value)}, expected a finite number"


_REGISTRY: dict[str, Reward] = {}


def register_reward(name: str) -> Callable[[F], F]:
    """Decorator registering a reward function under ``name`` (names are unique); its
    signature is checked here, at import time."""
    if not name or not isinstance(name, str) or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':', got {name!r}")

    def decorate(fn: F) -> F:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"reward {name!r} is already registered ({_REGISTRY[name].fn!r})")
        _REGISTRY[name] = Reward.of(fn, name)
        return fn

    return decorate


def reward_setup(setup: Callable[[Task], object]) -> Callable[[F], F]:
    """Decorator: ``setup(task)`` runs in the reward's worker before each call's timeout starts
    (module docstring). Its failure is not the sample's: the call meets it again, timed."""

    def decorate(fn: F) -> F:
        try:
            setattr(fn, SETUP_ATTR, setup)
        except AttributeError:
            raise TypeError(f"@reward_setup cannot mark {fn!r} (it takes no attributes); wrap "
                            "it in a function") from None
        return fn

    return decorate


def group_reward(fn: F) -> F:
    """Decorator marking ``fn`` a group reward (module docstring): called once per group with
    every response of it, returning one number per response. Stack it under or over
    ``@register_reward``."""
    try:
        setattr(fn, _GROUP_MARK, True)
    except AttributeError:
        raise TypeError(f"@group_reward cannot mark {fn!r} (it takes no attributes); wrap it "
                        "in a function") from None
    for name, reward in list(_REGISTRY.items()):  # registered before it was marked
        if reward.fn is fn:
            _REGISTRY[name] = Reward.of(fn, name)
    return fn


def get_reward(spec: str | RewardFn) -> Reward:
    """The checked reward for a registered name, an import path ``module:function``, or a
    callable. Sync rewards must be sendable to worker processes (module-level functions or
    picklable objects); anything else is a TypeError saying so."""
    if isinstance(spec, str):
        reward = _REGISTRY.get(spec) or (_import(spec) if ":" in spec else None)
        if reward is None:
            known = ", ".join(sorted(_REGISTRY)) or "(none)"
            raise ValueError(
                f"unknown reward {spec!r}; known rewards: {known} (or an import path "
                "'module:function')"
            )
    elif callable(spec):
        reward = Reward.of(spec, getattr(spec, "__qualname__", repr(spec)))
    else:
        raise TypeError(f"a reward is a registered name or a callable, got {spec!r}")
    if not reward.is_async:
        try:
            pickle.dumps(reward.fn)
        except Exception as e:
            raise TypeError(
                f"reward {reward.name!r} is a sync function that cannot be sent to a reward "
                f"worker process ({type(e).__name__}: {e}). Sync rewards run in worker "
                "processes and reach them by reference: define the function at the top level "
                "of an importable module (not a lambda, closure or local function), or make it "
                "`async def` (async rewards run in the event loop)"
            ) from None
    return reward


def _import(path: str) -> Reward:
    from rollstream.named import import_named

    fn = import_named(path, "reward")
    registered = next((r for r in _REGISTRY.values() if r.fn is fn), None)
    return registered or Reward.of(fn, path)


def known_rewards() -> list[str]:
    return sorted(_REGISTRY)


def build_resolver(
    cfg: RewardConfig, source_rewards: Mapping[str, tuple[str, Sequence[str]]],
    given: Mapping[str, RewardFn] | None = None,
) -> Callable[[Task], Reward]:
    """The grader pool's ``resolve``. ``source_rewards``: source name -> (reward name, the
    keyword arguments its tasks pass from dataset columns).
    ``reward.name: auto`` grades each task with its source's reward, any other name grades
    every task with that reward (still given each source's columns). ``given``: source name -> a reward callable passed as an
    object (the Python API), in place of its source's named one. Every reward is resolved and
    checked here, once, signature against columns included; an unknown name fails here, naming
    the config field and the known rewards."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(source_rewards))
    if unknown:
        raise ValueError(f"rewards given for {unknown}, which are not task sources of this run "
                         f"(sources: {sorted(source_rewards)})")
    one = None
    if cfg.name != "auto":
        if given:
            raise ValueError(f"reward.name is {cfg.name!r} (one reward for every source) and "
                             f"rewards were given for sources {sorted(given)}; use one or the "
                             "other (reward.name: auto)")
        try:
            one = get_reward(cfg.name)
        except (ValueError, TypeError) as e:
            raise type(e)(f"reward.name: {e}") from None
    by_source: dict[str, Reward] = {}
    for source, (name, columns) in source_rewards.items():
        try:
            reward = get_reward(given[source]) if source in given else (one or get_reward(name))
            by_source[source] = reward.with_columns(columns)
        except (ValueError, TypeError) as e:
            what = ("reward.name" if one is not None else
                    "the reward given for it" if source in given else "its `reward`")
            raise type(e)(f"tasks source {source!r} ({what}): {e}") from None

    def resolve(task: Task) -> Reward:
        try:
            return by_source[task.source]
        except KeyError:
            if one is not None:  # a task of no configured source (a test's): no columns
                return one
            raise KeyError(
                f"no reward for task source {task.source!r}; sources: {sorted(by_source)}"
            ) from None

    return resolve
