"""Import paths ``module:name``: how a config names a user's code (rewards, environments,
SDK agents, tools, tool-call parsers), and how an object given to the Python API is named
back. One place decides what an import path is and what a failed import says."""

from __future__ import annotations

import importlib
from typing import Any


def import_named(path: str, what: str) -> Any:
    """The object at ``path`` (``module:name``, the name may be dotted: ``Class.method``); a
    ValueError that starts with ``what`` and says what is wrong otherwise."""
    module_name, colon, attr = path.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(f"{what} {path!r} is not an import path 'module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r} ({e}); is it "
                         "on PYTHONPATH (e.g. `PYTHONPATH=. rollstream train ...`)?") from None
    except SyntaxError as e:
        raise ValueError(f"{what} {path!r}: module {module_name!r} has a syntax error: "
                         f"{e.filename} line {e.lineno}: {e.msg}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - fault boundary: a user module
        raise ValueError(f"{what} {path!r}: importing module {module_name!r} raised "
                         f"{type(e).__name__}: {e}{raised_in(e)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def path_of(obj: Any, what: str) -> str:
    """The import path that names ``obj`` (a class or function defined at the top level of a
    module, a script's own included), checked to lead back to it; a ValueError otherwise:
    what a config names must be importable by a process that reads only the config (a
    resumed run, a worker process)."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or "<" in name:
        raise ValueError(f"{what} {obj!r} cannot be named by an import path: define it at the "
                         "top level of a module (not a lambda, a local function or an instance)")
    path = f"{module}:{name}"
    try:
        found = import_named(path, what)
    except ValueError as e:
        raise ValueError(f"{what} {obj!r} is not importable as {path!r}: {e}") from None
    if found is not obj:
        raise ValueError(f"{what} {obj!r}: {path!r} names another object ({found!r})")
    return path


def raised_in(e: BaseException) -> str:
    """`` (file line N)``: where the innermost frame of ``e``'s traceback raised, or ''."""
    tb = e.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f" ({tb.tb_frame.f_code.co_filename} line {tb.tb_lineno})"
