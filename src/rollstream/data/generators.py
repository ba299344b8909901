"""reasoning-gym's task generators, named by a JSON spec: checked without generating, made
once per process, their entries made again by index.

A ``kind: reasoning_gym`` source (:mod:`rollstream.data.reasoning_gym`) generates its entries
with :func:`generator`; the ``reasoning_gym`` reward (:mod:`rollstream.reward.reasoning_gym`)
grades a response with the same generator's ``score_answer(answer, entry)``, in a reward
worker process. The task carries only the spec and the entry's index (``task.extra``, JSON as
checkpoints need); the worker makes the entry again from them, since an entry's metadata is
not always JSON (tuples, sets) and some scorers read it. reasoning-gym makes entry ``i`` from
``Random(seed + i)``, so the entry is the same in every process; the reward checks that the
question it made is the task's and fails the sample if not.

This module imports only the standard library (reward workers import it); the
``reasoning-gym`` package is imported at the first use.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pydantic stays out of reward workers
    from rollstream.config.tasks import SourceConfig

SPEC_KEY = "reasoning_gym"  # task.extra key: {dataset, size, seed, options, index, question}
_RESERVED = ("seed", "size")  # options a generator's config has that the spec sets itself
_SHOWN_NAMES = 12


def _factory() -> Any:
    try:
        from reasoning_gym import factory
    except ImportError:
        raise ValueError("kind reasoning_gym needs the reasoning-gym package: pip install "
                         "'rollstream[reasoning_gym]'") from None
    return factory


def known_generators() -> list[str]:
    """The generator names the installed reasoning-gym registers, sorted."""
    return sorted(_factory().DATASETS)


def generator_problem(dataset: str, options: Mapping[str, Any], *, size: int,
                      seed: int) -> tuple[str, str] | None:
    """``(field, why)`` when reasoning-gym has no generator ``dataset`` (field ``dataset``) or
    it refuses ``options`` (field ``options``); None when it takes them. Generates nothing."""
    registry = _factory().DATASETS
    if dataset not in registry:
        names = sorted(registry)
        close = difflib.get_close_matches(dataset, names, n=3)
        hint = f"did you mean {close}? " if close else ""
        return "dataset", (f"reasoning-gym has no generator {dataset!r}; {hint}known: "
                           f"{', '.join(names[:_SHOWN_NAMES])}, ... ({len(names)} in all, "
                           "reasoning_gym.factory.DATASETS)")
    config_cls = registry[dataset][1]
    taken = [k for k in _RESERVED if k in options]
    if taken:
        return "options", (f"{taken} are set by reasoning_gym.seed and reasoning_gym.size, "
                           "not by options")
    if dataclasses.is_dataclass(config_cls):
        fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in _RESERVED]
        unknown = sorted(set(options) - set(fields))
        if unknown:
            return "options", (f"generator {dataset!r} has no option {unknown}; its options: "
                               f"{fields}")
    try:
        config = config_cls(**options, seed=seed, size=size)
        if callable(getattr(config, "validate", None)):
            config.validate()
    # fault boundary: the generator's own check (any exception, AssertionError in most) is why
    except Exception as e:  # noqa: BLE001
        return "options", (f"generator {dataset!r} refuses options {dict(options)} "
                           f"({type(e).__name__}: {e})")
    return None


def generator_spec(cfg: SourceConfig, tasks_seed: int) -> dict[str, Any]:
    """The generator's dataset, size, seed (``tasks.seed`` when unset) and options."""
    rg = cfg.reasoning_gym
    assert rg is not None, "SourceConfig: kind reasoning_gym requires reasoning_gym"
    return {"dataset": rg.dataset, "size": rg.size,
            "seed": tasks_seed if rg.seed is None else rg.seed, "options": dict(rg.options)}


def source_problem(cfg: SourceConfig, tasks_seed: int) -> tuple[str, str] | None:
    """``(field under reasoning_gym, why)`` when a ``kind: reasoning_gym`` source's generator
    is unknown or refuses its options; generates nothing."""
    spec = generator_spec(cfg, tasks_seed)
    return generator_problem(spec["dataset"], spec["options"], size=spec["size"],
                             seed=spec["seed"])


def spec_json(dataset: str, *, size: int, seed: int, options: Mapping[str, Any]) -> str:
    """The canonical key of a generator (what :func:`generator` caches by)."""
    return json.dumps({"dataset": dataset, "size": size, "seed": seed,
                       "options": dict(options)}, sort_keys=True)


@functools.lru_cache(maxsize=16)
def generator(key: str) -> Any:
    """The reasoning-gym dataset of a :func:`spec_json` key, made once per process."""
    spec = json.loads(key)
    return _factory().create_dataset(spec["dataset"], size=spec["size"], seed=spec["seed"],
                                     **spec["options"])


def entry_of(spec: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the generator, its entry) of a task's ``task.extra[SPEC_KEY]``; a ValueError when the
    entry made here is not the task's (its question differs)."""
    gen = generator(spec_json(spec["dataset"], size=spec["size"], seed=spec["seed"],
                              options=spec["options"]))
    entry = gen[spec["index"]]
    if entry["question"] != spec["question"]:
        raise ValueError(f"reasoning-gym generator {spec['dataset']!r} made entry "
                         f"{spec['index']} differently in this process (its question differs "
                         "from the task's): this generator is not deterministic by seed and "
                         "index, so its tasks cannot be graded by its scorer")
    return gen, entry
