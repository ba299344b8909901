"""The Python API: a training run from a script, with datasets and rewards passed as objects.

    import rollstream

    def score(task, text, *, bonus) -> float: ...   # a reward, as in docs/datasets.md

    if __name__ == "__main__":  # reward workers are spawned processes that import this file
        summary = rollstream.run("my.yaml", ["train.steps=20"],
                                   datasets={"qa": rows}, rewards={"qa": score})

``config`` is what ``rollstream train`` takes: a YAML file, or the same tree as a dict, or a
:class:`RunConfig`; ``overrides`` are its dotted ``key=value`` settings. ``datasets`` maps a
source name to its rows (a list of dicts, a Hugging Face ``datasets.Dataset``, a pandas
DataFrame: anything that yields mappings): a source of that name in ``tasks.sources`` without
a ``path`` takes them (its columns, reward_kwargs and weight apply), and when the config lists
no sources the datasets are its sources. The rows are written once, as JSONL named by their
content, under ``{run_root}/{name}/inputs/``, and the source reads that file like any JSONL
source: the run directory keeps the data it trained on, a resume finds it, and every row
check of a dataset source applies. ``rewards`` maps a source name to a reward callable (sync
or async, per sample or ``@group_reward``); such a source names no ``reward`` in the config.
A resumed run is given the same rewards again (a callable is not in the checkpoint).

``environments``, ``agents`` and ``tools`` map a source name to an environment class (or
function), an OpenAI-SDK agent function, and a list of tools (objects, the classes or
functions that make them, or built-in names): the source's tasks become episodes of
``harness: agent`` or ``openai`` (docs/agents.md). Each object is written into the config as
the import path that names it, checked to lead back to it, so it must be defined at the top
level of a module (a script's own included): the saved config names what ran, and worker
processes import it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.config.loader import ConfigError, apply_override, read_yaml_mapping, validate
from rollstream.config.schema import RunConfig

if TYPE_CHECKING:
    from rollstream.reward.registry import RewardFn

Rows = Iterable[Mapping[str, Any]]
_DEFAULT_KIND = "tick"  # a source entry without `kind` (SourceConfig's default)


def build_config(config: str | Path | Mapping[str, Any] | RunConfig | None = None,
                 overrides: Sequence[str] = (), *,
                 datasets: Mapping[str, Rows | Any] | None = None,
                 environments: Mapping[str, Any] | None = None,
                 agents: Mapping[str, Any] | None = None,
                 tools: Mapping[str, Sequence[Any]] | None = None) -> RunConfig:
    """The validated config of a run given ``datasets`` and episode objects (module
    docstring); writes the rows under the run directory. A dataset or object for no source,
    or for a source that already names one, is a ConfigError naming it."""
    data = _tree(config)
    for item in overrides:
        apply_override(data, item)
    objects = {"environment": environments or {}, "agent": agents or {}, "tools": tools or {}}
    if datasets:
        probe = validate(_with_objects(_with_paths(
            data, datasets, dict.fromkeys(datasets, "unwritten")), objects))
        inputs = probe.run_dir / "inputs"
        data = _with_paths(data, datasets,
                           {n: str(_write_rows(inputs, n, rows)) for n, rows in datasets.items()})
    return validate(_with_objects(data, objects))


def run(config: str | Path | Mapping[str, Any] | RunConfig | None = None,
          overrides: Sequence[str] = (), *, datasets: Mapping[str, Rows | Any] | None = None,
          rewards: Mapping[str, RewardFn] | None = None,
          environments: Mapping[str, Any] | None = None, agents: Mapping[str, Any] | None = None,
          tools: Mapping[str, Sequence[Any]] | None = None) -> dict[str, Any]:
    """Run one training job as ``rollstream train`` does and return its summary (also in
    ``{run_root}/{name}/summary.json``). Raises ConfigError for a bad config, ValueError or
    TypeError for an unusable reward, environment, agent or tool, and ``RunStopped`` when the
    run could not train."""
    from rollstream.logs import configure_unless_configured
    from rollstream.runtime.train import run_training

    configure_unless_configured()  # the messages `rollstream train` shows
    cfg = build_config(config, overrides, datasets=datasets, environments=environments,
                       agents=agents, tools=tools)
    for i, src in enumerate(cfg.tasks.sources):
        name = src.name or src.kind
        if rewards and name in rewards and src.harness == "verifiers":
            raise ConfigError(f"a reward was given for source {name!r} (tasks.sources.{i}), "
                              "whose verifiers environment's rubric grades its episodes: "
                              "drop it")
        if rewards and name in rewards and src.reward is not None:
            raise ConfigError(f"tasks.sources.{i}.reward is {src.reward!r} and a reward was "
                              f"given for source {name!r}: give one of them")
    return run_training(cfg, rewards=rewards)


def _tree(config: str | Path | Mapping[str, Any] | RunConfig | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, RunConfig):  # the settings its author set, not every default
        return config.model_dump(mode="json", exclude_unset=True)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, Path)):
        return read_yaml_mapping(config, "config")
    raise TypeError(f"config is a YAML path, a dict or a RunConfig, got {type(config).__name__}")


def _with_paths(data: dict[str, Any], datasets: Mapping[str, Any],
                paths: Mapping[str, str]) -> dict[str, Any]:
    """``data`` with the source of each dataset reading its file (a new tree)."""
    data = copy.deepcopy(data)
    tasks = data.setdefault("tasks", {})
    if not isinstance(tasks, dict):
        raise ConfigError(f"tasks must be a mapping, got {tasks!r}")
    if "sources" not in tasks:
        tasks["sources"] = [{"name": n} for n in datasets]
    sources = tasks["sources"]
    if not isinstance(sources, list) or not all(isinstance(s, dict) for s in sources):
        raise ConfigError(f"tasks.sources must be a list of mappings, got {sources!r}")
    names = [s.get("name") or s.get("kind", _DEFAULT_KIND) for s in sources]
    for source in datasets:
        where = [i for i, n in enumerate(names) if n == source]
        if not where:
            raise ConfigError(f"a dataset was given for source {source!r}, which tasks.sources "
                              f"does not have (sources: {names}); add "
                              f"{{name: {source}}} to tasks.sources")
        i = where[0]
        entry = sources[i]
        if entry.get("path") is not None:
            raise ConfigError(f"tasks.sources.{i} ({source!r}) reads path {entry['path']!r} and "
                              "a dataset was given for it: give one of them")
        kind = entry.setdefault("kind", "jsonl")
        if kind != "jsonl":
            raise ConfigError(f"tasks.sources.{i}.kind is {kind!r}, but its dataset was given "
                              "as rows, which the run reads as JSONL: drop kind (or set jsonl)")
        entry["path"] = paths[source]
    return data


_HARNESS_OF = {"environment": "agent", "agent": "openai"}


def _with_objects(data: dict[str, Any], objects: Mapping[str, Mapping[str, Any]]
                  ) -> dict[str, Any]:
    """``data`` with each given environment, agent and tool named by its import path in its
    source's entry (a new tree)."""
    from rollstream.named import path_of

    data = copy.deepcopy(data)
    sources = data.get("tasks", {}).get("sources", [])
    names = [s.get("name") or s.get("kind", _DEFAULT_KIND) if isinstance(s, dict) else None
             for s in sources]
    for key, given in objects.items():
        arg = "tools" if key == "tools" else f"{key}s"
        for source, obj in given.items():
            if source not in names:
                raise ConfigError(f"{arg}[{source!r}] is for a source that tasks.sources does "
                                  f"not have (sources: {names})")
            i = names.index(source)
            entry = sources[i]
            try:
                if key == "tools":
                    if isinstance(obj, (str, bytes)) or not isinstance(obj, Sequence):
                        raise ValueError(f"is a {type(obj).__name__}, not a list of tools")
                    named = [t if isinstance(t, str) else path_of(t, "tool") for t in obj]
                    entry["tools"] = [*entry.get("tools", []), *named]
                    continue
                path = path_of(obj, key)
            except ValueError as e:
                raise ConfigError(f"{arg}[{source!r}]: {e}") from None
            if entry.get(key) is not None:
                raise ConfigError(f"tasks.sources.{i}.{key} is {entry[key]!r} and {arg} gives "
                                  f"one for source {source!r}: give one of them")
            entry[key] = path
            entry.setdefault("harness", _HARNESS_OF[key])
    return data


def _write_rows(folder: Path, source: str, rows: Rows | Any) -> Path:
    """The rows as JSONL in ``folder``, named by source and content (written once)."""
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # a pandas DataFrame
        rows = rows.to_dict(orient="records")
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Iterable):
        raise ConfigError(f"datasets[{source!r}] must be rows (dicts), e.g. a list of dicts or "
                          f"a datasets.Dataset, got {type(rows).__name__}")
    lines = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ConfigError(f"datasets[{source!r}] row {i} is a {type(row).__name__}, "
                              "expected a mapping of column -> value")
        try:
            lines.append(json.dumps(dict(row), allow_nan=False, ensure_ascii=False))
        except (TypeError, ValueError, RecursionError) as e:
            raise ConfigError(f"datasets[{source!r}] row {i}: {e} (rows are kept as JSON: "
                              "use str, number, bool, None, lists and dicts)") from None
    text = "".join(line + "\n" for line in lines)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = folder / f"{source}-{digest}.jsonl"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(text)
        partial.replace(path)
    return path.resolve()
