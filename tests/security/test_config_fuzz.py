"""The config loader under arbitrary input: every refusal is a ConfigError naming the field
(or the file, or the override), never another exception or a traceback; hypothesis,
derandomized, a few hundred examples per property."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from rollstream.config import ConfigError, RunConfig, load_config


def _paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted field path of the config tree (list items as index 0)."""
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        ann = field.annotation
        inner = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type)]
        for sub in (ann, *inner):
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                index = "0." if getattr(ann, "__args__", None) else ""
                out.extend(_paths(sub, f"{path}.{index}"))
    return out


KEYS = sorted(set(_paths(RunConfig)))
YAMLISH = ["[", "]", "{", "}", ":", "-", "&a", "*a", "!!python/object:os.system", "null", "~",
           ".inf", ".nan", "1e400", "0x1F", "2020-01-01", "'", '"', "#", "|", ">", ",", "\0",
           "9" * 5000, "[" * 2000, "!!binary aGk=", "!!set {a}", "yes", "..", "../x"]
SCALARS = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "auto", "local", "vllm", "ray", "sync", "async", "fsdp",
                     "tick", "math", "jsonl", "interrupt", "drain", "0", "1", "-1", ""]),
    st.text(max_size=20),
    st.lists(st.sampled_from(YAMLISH), max_size=6).map("".join),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3).map(lambda xs: f"[{', '.join(xs)}]"))
KEY = st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).map(lambda k: k + ".x"),
                st.text(alphabet="abcdefgh._0123456789", min_size=1, max_size=16))
KEY_VALUE = st.tuples(KEY, VALUES).map("=".join)
OVERRIDE = st.one_of(KEY_VALUE, KEY_VALUE, KEY_VALUE, KEY_VALUE, st.text(max_size=30))


def _names_a_field(message: str, overrides: list[str]) -> bool:
    """Whether ``message`` names what was given: an override's key or the field it sets
    (``a.b.c=1`` on an integer ``a.b``: ``a.b``; an unknown ``x.y``: ``'x'``), or the
    override itself when it is not ``key=value``."""
    for item in overrides:
        parts = item.partition("=")[0].strip().split(".")
        named = [".".join(parts[:j]) for j in range(2, len(parts) + 1)]
        if (any(p in message for p in named) or f"'{parts[0]}'" in message
                or f"override {'.'.join(parts)}" in message
                or f"{parts[0]} =" in message or repr(item)[1:-1][:40] in message):
            return True
    return False


@settings(max_examples=300, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OVERRIDE, min_size=1, max_size=4))
@example(["train=1", "train.lr=1"])
@example(["tasks.sources=5", "tasks.sources.0.kind=math"])
@example(["seed=" + "9" * 5000])
@example(["train.lr=" + "[" * 100_000 + "]" * 100_000])
@example(["name=.."])
def test_overrides_load_or_are_refused_naming_the_field(overrides: list[str]) -> None:
    try:
        load_config(None, overrides)
    except ConfigError as e:
        assert _names_a_field(str(e), overrides), (overrides, str(e))


BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefg", "bcdefgh"))


@settings(max_examples=200, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.sampled_from(YAMLISH), st.sampled_from(KEYS), st.text(max_size=8),
                          st.sampled_from([": ", "\n", "\n  ", "- "])), max_size=24).map("".join))
@example("a: " + "[" * 100_000 + "]" * 100_000)
@example("a: &a [x, x, x, x, x, x, x, x, x]\n" + BOMB + "monitor: {trackers: *h}\n")
@example("tasks: &a {sources: [*a]}\n")
@example("\xff\xfe")
def test_a_config_file_loads_or_is_refused_naming_the_file_or_field(tmp_path: Path,
                                                                    text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(text.encode("utf-8", errors="surrogateescape") if text != "\xff\xfe"
                     else b"\xff\xfe")
    try:
        load_config(path)
    except ConfigError as e:
        message = str(e)
        assert str(path) in message or message.startswith("invalid config ("), message
        assert len(message) < 20_000, len(message)
