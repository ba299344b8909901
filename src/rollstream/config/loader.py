"""YAML + dotted ``key=value`` overrides -> a validated :class:`RunConfig`.

Errors name the field path, the offending value and what is allowed; unknown keys get a
"did you mean" when a known key is close.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from rollstream.config.problems import REPR as _REPR
from rollstream.config.problems import validation_problems
from rollstream.config.schema import RunConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message says where and why."""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The run config of the YAML file at ``path`` (``None``: the defaults) with each dotted
    ``key=value`` override applied, as ``rollstream train`` loads it. A bad key or value is a
    :class:`ConfigError` naming the field, the value and what is allowed."""
    data = {} if path is None else read_yaml_mapping(path, "config")
    for item in overrides:
        apply_override(data, item)
    return validate(data)


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (empty file: ``{}``); ConfigError otherwise,
    naming ``what`` (config, scenario, profile) and the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file not found: {p}")
    try:
        loaded = yaml.safe_load(p.read_bytes())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    except (OSError, ValueError, RecursionError) as e:  # not UTF-8, a 5,000-digit int, depth
        raise ConfigError(f"{p}: cannot be read as YAML ({_why(e)})") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(loaded).__name__}")
    return loaded or {}


M = TypeVar("M", bound=BaseModel)


def validate_model(model: type[M], data: dict[str, Any], what: str) -> M:
    """``model`` from ``data``; a ConfigError listing every problem by field path otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, model, what)) from None


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place (value parsed as YAML)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {_REPR.repr(item)} must look like key.path=value")
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw
    except (ValueError, RecursionError) as e:  # a 5,000-digit int, nesting past the stack
        raise ConfigError(f"override {key}: its value cannot be read ({_why(e)})") from None
    parts = key.split(".")
    if "" in parts:
        raise ConfigError(f"override {_REPR.repr(item)}: the key {key!r} has an empty part "
                          "(keys look like train.lr or tasks.sources.0.weight)")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = node[_index(part, node, parts[: i + 1])]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[:i])} is "
                              f"{_REPR.repr(node)}, not a mapping to set {part!r} in")
        nxt = node.get(part)
        if nxt is None:
            nxt = _default_container(parts[: i + 1])
            node[part] = nxt
        node = nxt
    if not isinstance(node, (dict, list)):
        raise ConfigError(f"override {key}: {'.'.join(parts[:-1])} is {_REPR.repr(node)}, not "
                          f"a mapping to set {parts[-1]!r} in")
    last = parts[-1]
    if isinstance(node, list):
        node[_index(last, node, parts)] = value
    else:
        node[last] = value


def _why(e: BaseException) -> str:
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _index(part: str, node: list, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override path {'.'.join(path)}: {part!r} is not an index below {len(node)}")
    return int(part)


def _default_container(path: list[str]) -> Any:
    """Materialise defaults for a path an override reaches into (e.g. tasks.sources.0.kind)."""
    node: Any = RunConfig()
    for part in path:
        if isinstance(node, (list, tuple)):
            node = node[int(part)] if part.isdigit() and int(part) < len(node) else None
        else:
            node = getattr(node, part, None)
        if node is None:
            return {}
    if isinstance(node, BaseModel):
        return {}
    if isinstance(node, (list, tuple)):
        return [x.model_dump() if isinstance(x, BaseModel) else x for x in node]
    return {}


def validate(data: dict[str, Any]) -> RunConfig:
    return validate_model(RunConfig, data, "config")


def format_validation_error(err: ValidationError, model: type[BaseModel], what: str) -> str:
    """Each problem on a line (:func:`validation_problems`), under a heading naming ``what``."""
    lines = validation_problems(err, model)
    n = len(lines)
    return "\n".join([f"invalid {what} ({n} problem{'s' if n > 1 else ''}):",
                      *("  - " + line for line in lines)])
