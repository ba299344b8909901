"""Validation errors as the lines a user reads: the field path, the value and what is
allowed; an unknown key with the known ones and a close match. Below the schema, which
uses it to word a reconfiguration's problems, and the loader, which words a file's."""

from __future__ import annotations

import difflib
import reprlib
from typing import Any

from pydantic import BaseModel, ValidationError

REPR = reprlib.Repr()  # values in messages: bounded (a YAML alias can nest exponentially)
REPR.maxstring = REPR.maxother = 120
REPR.maxlevel = 3


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
            shown = REPR.repr(value) if not isinstance(value, dict) else "{...}"
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
