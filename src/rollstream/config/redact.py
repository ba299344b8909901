"""Secrets never leave the process in a config: the one rule for what is a secret in a config
tree, applied wherever a config is written or served (``config.yaml`` in the run folder,
which the dashboard's config view and the report show, and a checkpoint's saved config).

A secret is the value of a setting or environment variable whose name is like ``*_KEY``,
``*_TOKEN``, ``*_SECRET``, ``*PASSWORD`` (any case; ``api_key``, ``hf_token`` as setting
names too), in whatever form a config holds it: a mapping's value (``{"WANDB_API_KEY":
...}``), a ``NAME=value`` string (an environment list), a command-line flag and the word
after it or after its ``=`` (``["--api-key", "sk-..."]``, ``--hf-token=...``), and the password
of a URL (``redis://user:pass@host``). Each is replaced by :data:`REDACTED`; the names stay,
so a reader sees which secrets were set.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollstream.config.schema import RunConfig

REDACTED = "<redacted>"
_SECRET = re.compile(r"(?:^|_)(?:API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD)$|PASSWORD",
                     re.IGNORECASE)
_ASSIGNMENT = re.compile(r"^(-{0,2})([A-Za-z_][A-Za-z0-9_.-]*)=(.+)$", re.DOTALL)
_URL_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/:@\s]*):([^/@\s]+)@")


def is_secret_name(name: str) -> bool:
    """Whether a setting or environment variable of this name holds a secret
    (``--api-key`` and ``api-key`` read as ``api_key``)."""
    return bool(_SECRET.search(name.lstrip("-").replace("-", "_")))


def redact(tree: Any) -> Any:
    """``tree`` (JSON-like: dicts, lists, scalars) with every secret replaced (module
    docstring); the input is not changed."""
    if isinstance(tree, dict):
        return {k: (REDACTED if isinstance(k, str) and is_secret_name(k) and v not in (None, "")
                    else redact(v)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        out: list[Any] = []
        for i, item in enumerate(tree):
            before = tree[i - 1] if i else None
            flag = isinstance(before, str) and before.startswith("-") and "=" not in before
            if flag and is_secret_name(before) and isinstance(item, str) and (
                    not item.startswith("-")):  # the value of a secret flag
                out.append(REDACTED)
            else:
                out.append(redact(item))
        return out
    if isinstance(tree, str):
        return _redact_text(tree)
    return tree


def _redact_text(text: str) -> str:
    if (m := _ASSIGNMENT.match(text)) and is_secret_name(m.group(2)):
        return f"{m.group(1)}{m.group(2)}={REDACTED}"
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text, count=1)


def saved_config(cfg: RunConfig) -> dict[str, Any]:
    """``cfg`` as a run keeps it (``config.yaml``, a checkpoint's ``config``, what a resume
    compares with that): every field, as JSON values, secrets redacted."""
    return redact(cfg.model_dump(mode="json"))


def redacted_text(text: str) -> str:
    """A config file's text as it may be shown: unchanged when it holds no secret, else
    redacted (text that is not a YAML mapping is shown as it is; nothing there is a
    setting)."""
    import yaml

    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(tree, dict):
        return text
    clean = redact(tree)
    return text if clean == tree else yaml.safe_dump(clean, sort_keys=False)
