"""YAML + dotted ``key=value`` overrides -> a validated :class:`RunConfig`.

Errors name the field path, the offending value and what is allowed; unknown keys get a
"did you mean" when a known key is close.
"""

from __future__ import annotations

import difflib
import reprlib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from rollstream.config.schema import RunConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message says where and why."""


_REPR = reprlib.Repr()  # values in messages: bounded (a YAML alias can nest exponentially)
_REPR.maxstring = _REPR.maxother = 120
_REPR.maxlevel = 3


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
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


def validation_problems(err: ValidationError, model: type[BaseModel]) -> list[str]:
    """One line per problem: the field path, the value and what is allowed; an unknown key
    with the known ones (and a close match); a check across fields with its own message."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            msg = f"unknown key {loc!r}" + _did_you_mean(e["loc"], model)
        elif e["type"] == "missing":
            msg = f"{loc}: missing (required)"
        elif isinstance(e.get("input"), dict) and e["msg"].startswith("Value error, "):
            reason = e["msg"].removeprefix("Value error, ")  # a check across fields
            msg = reason if loc == "<root>" else f"{loc}: {reason}"
        else:
            value = e.get("input")
            shown = _REPR.repr(value) if not isinstance(value, dict) else "{...}"
            msg = f"{loc} = {shown}: {e['msg'].removeprefix('Value error, ')}"
            allowed = _allowed(e)
            if allowed:
                msg += f" (allowed: {allowed})"
        lines.append(msg)
    return lines


def _allowed(e: dict[str, Any]) -> str:
    ctx = e.get("ctx") or {}
    for k, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if k in ctx:
            return f"{sym} {ctx[k]}"
    return ""


def _did_you_mean(loc: tuple, root: type[BaseModel]) -> str:
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return ""
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        model = inner[0] if inner and isinstance(inner[0], type) else ann
    if not hasattr(model, "model_fields"):
        return ""
    known = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    where = ".".join(str(x) for x in loc[:-1]) or "the top level"
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (known keys under {where}: {', '.join(known)})"
