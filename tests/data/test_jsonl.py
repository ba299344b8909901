"""JSONL datasets with bad input: duplicate ids, rejected rows, no held-out rows, encodings,
missing files. Every failure names the file (or config field) and where in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollstream.config.loader import ConfigError, load_config
from rollstream.config.schema import SourceConfig, TasksConfig
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.data.mix import TaskMix
from rollstream.data.kinds import build_source
from rollstream.data.sources import check_source_paths, split_of
from rollstream.models.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer()


def _prompts(split: str, n: int) -> list[str]:
    """``n`` distinct tick-like prompts that hash into ``split``."""
    found = (f"T{x:03d}#01=" for x in range(100, 1000))
    return [p for p in found if split_of(p) == split][:n]


def _row(prompt: str, **kw) -> str:
    return json.dumps({"prompt": prompt, "answer": "1", **kw}, ensure_ascii=False)


def _write(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _source(path: Path):
    return build_source(SourceConfig(kind="jsonl", path=str(path), name="ds"), TOK, 0)


def _mix(*sources: SourceConfig, num_eval: int = 16) -> TaskMix:
    return TaskMix(TasksConfig(sources=sources, num_eval=num_eval), TOK)


def test_a_duplicate_id_names_the_file_both_lines_and_the_id(tmp_path: Path) -> None:
    p = _prompts("train", 5)
    path = _write(tmp_path, [_row(p[0], id="a"), _row(p[1], id="r3"), "", _row(p[2], id="b"),
                             _row(p[3], id="r3"), _row(p[4], id="c")])
    with pytest.raises(ValueError, match="duplicate row id 'r3' on lines 2 and 5") as e:
        _source(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ({"id": 7}, {"id": "7"},
         r"lines 1 and 2 both name task 'ds/7' \(line 1: id 7; line 2: id '7'\)"),
        ({}, {"id": "line1"}, "lines 1 and 2 both name task 'ds/line1' .*named by its line number"),
    ],
)
def test_two_ids_that_make_one_task_uid_are_an_error(tmp_path: Path, first, second,
                                                     expected: str) -> None:
    p = _prompts("train", 2)
    path = _write(tmp_path, [_row(p[0], **first), _row(p[1], **second)])
    with pytest.raises(ValueError, match=expected):
        _source(path)


def test_usable_rows_are_named_by_id_else_by_line(tmp_path: Path) -> None:
    p = _prompts("train", 3)
    path = _write(tmp_path, [_row(p[0], id="a"), _row(p[1]), _row(p[2], id=12)])
    src = _source(path)
    assert [src.task(i, "train").uid for i in range(3)] == ["ds/a", "ds/line2", "ds/12"]
    assert src.num_tasks("train") == 3 and src.rejected == []


def test_rejected_rows_with_one_id_are_each_reported_and_recorded(tmp_path: Path) -> None:
    p = _prompts("train", 2)
    path = _write(tmp_path, [
        _row(p[0], id="a"),
        json.dumps({"id": "x", "answer": "1"}),
        _row(p[1], id="b"),
        json.dumps({"id": "x", "prompt": "", "answer": "1"}),
        json.dumps({"id": ["x"], "prompt": p[1], "answer": "1"}),
        "{not json",
    ])
    mix = _mix(SourceConfig(kind="jsonl", path=str(path), name="ds"))
    rejected = mix.rejected()
    assert [uid for uid, _, _ in rejected] == ["ds/line2", "ds/line4", "ds/line5", "ds/line6"]
    reasons = [reason for _, _, reason in rejected]
    for lineno, reason in zip((2, 4, 5, 6), reasons, strict=True):
        assert reason.startswith(f"{path} line {lineno}")
    assert "(id 'x')" in reasons[0] and "(id 'x')" in reasons[1] and "'prompt'" in reasons[1]
    assert "'id' must be a non-empty string or an integer" in reasons[2]
    assert "not JSON" in reasons[3]
    ledger = Ledger(tmp_path / "ledger.jsonl")
    for uid, source, reason in rejected:
        ledger.record_rejected(uid, source, reason)
    ledger.close()
    lines = read_ledger(tmp_path / "ledger.jsonl")
    assert [r.task_uid for r in lines] == ["ds/line2", "ds/line4", "ds/line5", "ds/line6"]
    assert all(r.status == "failed" and str(path) in r.reason for r in lines)


def test_lines_split_on_newlines_only(tmp_path: Path) -> None:
    p = _prompts("train", 2)
    # U+2028 and U+0085 are line breaks to str.splitlines, not to JSONL
    path = _write(tmp_path, [_row(p[0][:-1] + "\u2028="), _row(p[1][:-1] + "\x85="), "{bad"])
    src = _source(path)
    assert src.num_tasks("train") + src.num_tasks("eval") == 2
    assert [uid for uid, _, _ in src.rejected] == ["ds/line3"]


def test_a_source_without_held_out_rows_warns_and_never_lends_train_rows(tmp_path: Path) -> None:
    path = _write(tmp_path, [_row(q) for q in _prompts("train", 6)])
    src = _source(path)
    assert src.num_tasks("eval") == 0
    with pytest.raises(ValueError, match="has no held-out rows"):
        src.task(0, "eval")
    ds = SourceConfig(kind="jsonl", path=str(path), name="ds")
    mix = _mix(SourceConfig(kind="tick"), ds, num_eval=8)
    tasks = mix.eval_tasks()
    assert len(tasks) == 8 and {t.source for t in tasks} == {"tick"}
    assert all(split_of(t.prompt_text) == "eval" for t in tasks)
    [warning] = mix.warnings()
    assert "'ds'" in warning and str(path) in warning
    assert "held-out reward will not include it" in warning
    alone = _mix(ds)
    assert alone.eval_tasks() == []
    assert any("held-out reward is not measured" in w for w in alone.warnings())
    assert _mix(ds, num_eval=0).warnings() == []  # no held-out set asked for, nothing missing
    assert alone.next_task().uid == "ds/line1"  # training still runs


def test_held_out_tasks_are_exactly_the_held_out_rows(tmp_path: Path) -> None:
    train, held = _prompts("train", 5), _prompts("eval", 3)
    path = _write(tmp_path, [_row(q) for q in train[:3] + held + train[3:]])
    mix = _mix(SourceConfig(kind="jsonl", path=str(path), name="ds"),
               SourceConfig(kind="tick"), num_eval=10)
    tasks = mix.eval_tasks()
    from_ds = [t.prompt_text for t in tasks if t.source == "ds"]
    assert from_ds == held  # each held-out row once, in file order, no train row
    assert len(tasks) == 3 + 5 and mix.warnings() == []
    only_held = _write(tmp_path, [_row(q) for q in held] + ["[]"], name="held.jsonl")
    with pytest.raises(ValueError, match=r"no usable training rows \(3 held out, 1 rejected\)"):
        _source(only_held)


def test_a_non_utf8_file_names_the_file_and_byte_offset(tmp_path: Path) -> None:
    good = _row(_prompts("train", 1)[0]).encode()
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good + b"\n" + '{"prompt": "caf'.encode() + b"\xe9" + b'=", "answer": "1"}\n')
    offset = len(good) + 1 + len('{"prompt": "caf')
    with pytest.raises(ValueError) as e:
        _source(path)
    assert not isinstance(e.value, UnicodeDecodeError)
    msg = str(e.value)
    assert str(path) in msg and "not UTF-8" in msg
    assert f"byte 0xe9 at byte offset {offset} (line 2)" in msg
    bom = tmp_path / "bom.jsonl"  # a byte-order mark is allowed and counted in the offset
    bom.write_bytes(b"\xef\xbb\xbf" + good + b"\n\xff\n")
    with pytest.raises(ValueError, match=f"byte 0xff at byte offset {3 + len(good) + 1} "):
        _source(bom)
    bom.write_bytes(b"\xef\xbb\xbf" + good + b"\n")
    assert _source(bom).task(0, "train").prompt_text == json.loads(good)["prompt"]


def test_check_source_paths_names_the_field(tmp_path: Path) -> None:
    good = _write(tmp_path, [_row(_prompts("train", 1)[0])])

    def cfg(path: str) -> TasksConfig:
        return TasksConfig(sources=(SourceConfig(kind="tick"),
                                    SourceConfig(kind="jsonl", path=path, name="ds")))

    check_source_paths(cfg(str(good)))
    with pytest.raises(ValueError, match=r"^tasks.sources.1.path: dataset file .* does not exist"):
        check_source_paths(cfg(str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match=r"^tasks.sources.1.path: .* is a folder, not a file"):
        check_source_paths(cfg(str(tmp_path)))
    with pytest.raises(ValueError, match=r"^tasks.sources.1.path: .* does not exist"):
        TaskMix(cfg(str(tmp_path / "missing.jsonl")), TOK)  # the mix checks before it reads


def test_check_source_paths_reports_an_unreadable_file(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, [_row(_prompts("train", 1)[0])])
    path.chmod(0)
    real_open = Path.open

    def denied(self: Path, *args, **kwargs):  # root ignores chmod: the OS's answer, faked
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    cfg = TasksConfig(sources=(SourceConfig(kind="jsonl", path=str(path)),))
    with pytest.raises(ValueError, match=r"^tasks.sources.0.path: .* cannot be read"):
        check_source_paths(cfg)


def test_path_and_kind_must_agree_at_load() -> None:
    with pytest.raises(ConfigError, match=r"tasks.sources.0: kind jsonl needs `path`"):
        load_config(None, ["tasks.sources=[{kind: jsonl}]"])
    with pytest.raises(ConfigError, match=r"tasks.sources.1: `path` is read only by a jsonl"):
        load_config(None, ["tasks.sources=[{kind: tick}, {kind: digits, path: d.jsonl}]"])
