"""The documented config tree, as ``rollstream config [SECTION]`` prints it.

Every field is printed as YAML with its default, under its docstring (the schema keeps them:
``use_attribute_docstrings``) and what values are allowed, so a user finds a setting without
reading the source. The output for the whole tree is itself a valid config equal to the
defaults; a list of sections (``tasks.sources``) shows one item with its own defaults, and an
optional section that is null by default (``tasks.sources.reasoning_gym``) its fields,
commented out.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rollstream.config.schema import RunConfig

_REQUIRED = object()  # a field without a default, in an example item
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "length >="),
           ("pattern", "matching"))


def describe(section: str | None = None) -> str:
    """The tree under ``section`` (a dotted path such as ``rollout`` or ``tasks.sources``, or
    one field such as ``rollout.mode``; None: everything). ValueError for an unknown path,
    naming the known keys where it went wrong."""
    model: type[BaseModel] = RunConfig
    default: Any = RunConfig()
    if not section:
        return "\n".join(_model_lines(model, default, ""))
    parts = section.split(".")
    for i, part in enumerate(parts):
        info = model.model_fields.get(part)
        if info is None:
            where = ".".join(parts[:i]) or "the top level"
            raise ValueError(f"config has no {'.'.join(parts[:i + 1])!r}; keys under {where}: "
                             f"{', '.join(model.model_fields)}")
        if i == len(parts) - 1:
            return "\n".join(_field_lines(part, info, getattr(default, part), ""))
        inner = _section_type(info.annotation)
        if inner is None:
            raise ValueError(f"config field {'.'.join(parts[:i + 1])!r} has no keys under it")
        value = getattr(default, part)
        model = inner
        default = (value[0] if isinstance(value, tuple) and value else
                   value if isinstance(value, BaseModel) else inner.model_construct())
    raise AssertionError("unreachable")


def _model_lines(model: type[BaseModel], default: BaseModel, indent: str) -> list[str]:
    lines: list[str] = []
    for name, info in model.model_fields.items():  # a required field shows as (required)
        lines += _field_lines(name, info, getattr(default, name, _REQUIRED), indent)
    return lines


def _field_lines(name: str, info: FieldInfo, value: Any, indent: str) -> list[str]:
    lines = [f"{indent}# {line}".rstrip() for line in (info.description or "").splitlines()]
    inner = _section_type(info.annotation)
    if inner is not None and isinstance(value, BaseModel):
        return [*lines, f"{indent}{name}:", *_model_lines(inner, value, indent + "  ")]
    if inner is not None and value is None:  # an optional section, unset: its fields, commented
        body = _model_lines(inner, inner.model_construct(), indent + "  ")
        return [*lines, f"{indent}{name}: null  # or:",
                *(f"{indent}#{line[len(indent):]}" for line in body)]
    if inner is not None:  # a list of sections: one item with the defaults of its own fields
        body = _model_lines(inner, value[0] if value else inner.model_construct(), indent + "    ")
        first = next(i for i, line in enumerate(body) if not line.lstrip().startswith("#"))
        body[first] = f"{indent}  - {body[first].lstrip()}"
        if not value:  # empty by default: the item is an example, commented out
            return [*lines, f"{indent}{name}: []  # an item:",
                    *(f"{indent}#{line[len(indent):]}" for line in body)]
        return [*lines, f"{indent}{name}:", *body]
    allowed = _allowed(info)
    if value is _REQUIRED:
        return [*lines, f"{indent}{name}: (required)" + (f"  # {allowed}" if allowed else "")]
    shown = yaml.safe_dump(_plain(value), default_flow_style=True, width=1 << 16)
    shown = shown.removesuffix("\n").removesuffix("\n...").strip()
    return [*lines, f"{indent}{name}: {shown}" + (f"  # {allowed}" if allowed else "")]


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The model of a section field (an optional one too), or of the items of a
    tuple-of-sections field."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(models) == 1 and isinstance(models[0], type) and issubclass(models[0], BaseModel):
            return models[0]
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            return args[0]
    return None


def _allowed(info: FieldInfo) -> str:
    choices = _literals(info.annotation)
    parts = [f"one of: {', '.join(choices)}"] if choices else []
    for meta in info.metadata:
        for attr, sym in _BOUNDS:
            bound = getattr(meta, attr, None)
            if bound is not None:
                parts.append(f"{sym} {bound}")
    return "; ".join(parts)


def _literals(annotation: Any) -> list[str]:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    if typing.get_origin(annotation) is tuple:  # tuple[Literal[...], ...]
        args = typing.get_args(annotation)
        return _literals(args[0]) if args else []
    return []


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
