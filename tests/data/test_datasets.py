"""Datasets as users have them: JSONL with chat messages, Parquet in verl's layout, a
``datasets`` folder saved to disk (TRL's layout), the column mapping with dotted paths, bad
mappings failing at load, malformed rows recorded with file and row, and the reward's
keyword columns surviving a checkpoint. Fixtures are written here, from Python objects."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rollstream.agent.chat import ChatRenderer
from rollstream.config.loader import ConfigError, load_config
from rollstream.config.schema import SourceConfig, TasksConfig
from rollstream.data.kinds import build_source
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.data.mix import TaskMix
from rollstream.data.sources import check_source_paths, split_of
from rollstream.durable.state import task_from_dict, task_to_dict
from rollstream.models.folder_check import save_char_tokenizer
from rollstream.models.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tok")
    save_char_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))  # as a run loads a model folder's tokenizer


_SYSTEM = {"role": "system", "content": "answer with a number."}
_RENDERER = ChatRenderer(build_char_tokenizer())


def _train_prompts(n: int, *, system: bool = False) -> list[str]:
    """``n`` distinct questions whose prompt (as text, or rendered as a user message after
    ``_SYSTEM`` when ``system``) hashes into the training split."""
    out = []
    for x in range(100, 1000):
        q = f"what is {x}+1?"
        msgs = [_SYSTEM, {"role": "user", "content": q}] if system else None
        text = _RENDERER.text(msgs, add_generation_prompt=True) if msgs else q
        if split_of(text) == "train" and split_of(
                _RENDERER.text([{"role": "user", "content": q}], add_generation_prompt=True)
        ) == "train":  # train as text, as a user message, and after the system message
            out.append(q)
        if len(out) == n:
            return out
    raise AssertionError("not enough prompts")


def _verl_row(q: str, i: int, **over) -> dict:
    row = {"data_source": "openai/gsm8k",
           "prompt": [_SYSTEM, {"role": "user", "content": q}],
           "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": str(int(q[8:11]) + 1)},
           "extra_info": {"split": "train", "index": i}}
    row.update(over)
    return row


def _source(tok, **cfg):
    return build_source(SourceConfig(name="ds", **cfg), tok, 0)


def test_jsonl_with_chat_messages_is_rendered_with_the_models_template(tmp_path, tok) -> None:
    qs = _train_prompts(2)
    path = tmp_path / "trl.jsonl"  # TRL's conversational layout: prompt messages + solution
    path.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": q}],
                                          "solution": f"s{i}"}) for i, q in enumerate(qs)))
    src = _source(tok, kind="jsonl", path=str(path))
    task = src.task(0, "train")
    messages = [{"role": "user", "content": qs[0]}]
    assert task.prompt_text == ChatRenderer(tok).text(messages, add_generation_prompt=True)
    assert task.prompt_text.endswith("<|im_start|>assistant\n")
    assert list(task.prompt_ids) == ChatRenderer(tok).prompt(messages)
    assert task.reference == "s0" and task.uid == "ds/line1" and task.extra == {}


def test_verl_parquet_rows_load_without_conversion(tmp_path, tok, monkeypatch) -> None:
    qs = _train_prompts(3, system=True)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([_verl_row(q, i) for i, q in enumerate(qs)]), path)
    src = _source(tok, kind="parquet", path=str(path), reward_kwargs=("data_source", "extra_info"))
    task = src.task(1, "train")
    assert task.uid == "ds/row1" and task.reference == str(int(qs[1][8:11]) + 1)
    assert task.prompt_text.startswith("<|im_start|>system\nanswer with a number.<|im_end|>\n")
    assert task.extra == {"data_source": "openai/gsm8k",
                          "extra_info": {"split": "train", "index": 1}}
    assert src.rejected == [] and src.num_tasks("train") == 3
    monkeypatch.setenv("HOME", str(tmp_path))  # verl's examples write ~/data/...
    assert _source(tok, kind="parquet", path="~/train.parquet").num_tasks("train") == 3
    named = _source(tok, kind="parquet", path=str(path),
                    columns={"id": "extra_info.index"}, reward_kwargs=("reward_model.style",))
    assert named.task(2, "train").uid == "ds/2" and named.task(2, "train").extra == {"style": "rule"}


def test_a_datasets_folder_saved_to_disk_loads_with_a_column_mapping(tmp_path, tok) -> None:
    datasets = pytest.importorskip("datasets")
    qs = _train_prompts(3)
    rows = [{"question": q, "meta": {"gt": i * 7}, "level": i} for i, q in enumerate(qs)]
    ds = datasets.Dataset.from_list(rows).shuffle(seed=1)  # save_to_disk writes the shuffle
    ds.save_to_disk(str(tmp_path / "saved"))
    cfg = load_config(None, [
        "tasks.sources=[{kind: hf_dataset, name: ds, path: " + str(tmp_path / "saved") + ", "
        "columns: {prompt: question, answer: meta.gt}, reward_kwargs: [level]}]"])
    mix = TaskMix(cfg.tasks, tok)
    tasks = [mix.source("ds").task(i, "train") for i in range(3)]
    assert [t.prompt_text for t in tasks] == list(ds["question"])  # text prompts as they are
    assert [t.reference for t in tasks] == [str(r["meta"]["gt"]) for r in ds]  # a number: text
    assert [t.extra for t in tasks] == [{"level": r["level"]} for r in ds]
    assert [t.uid for t in tasks] == ["ds/row0", "ds/row1", "ds/row2"]
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    cfg = TasksConfig(sources=(SourceConfig(kind="hf_dataset", path=str(tmp_path / "dict")),))
    with pytest.raises(ValueError, match=r"^tasks.sources.0.path: .*holds a DatasetDict "
                                         r"\(splits \['train'\]\).*dict/train"):
        check_source_paths(cfg)


def test_malformed_rows_are_recorded_with_file_and_row(tmp_path, tok) -> None:
    qs = _train_prompts(6, system=True)
    rows = [_verl_row(qs[0], 0),
            _verl_row(qs[1], 1, prompt=[{"role": "user"}]),  # no content
            _verl_row(qs[2], 2, reward_model={"style": "rule", "ground_truth": None}),
            _verl_row(qs[3], 3, extra_info=None),  # the reward's column is null: kept
            _verl_row(qs[4], 4, prompt=[{"role": "user", "content": qs[4]},
                                        {"role": "assistant", "content": "x"}]),
            _verl_row(qs[5], 5, data_source=None)]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    mix = TaskMix(TasksConfig(sources=(SourceConfig(
        kind="parquet", name="ds", path=str(path), reward_kwargs=("extra_info.split",)),)), tok)
    rejected = mix.rejected()
    assert [uid for uid, _, _ in rejected] == ["ds/row1", "ds/row2", "ds/row3"]
    reasons = [r for _, _, r in rejected]
    for n, reason in zip((1, 2, 3), reasons, strict=True):
        assert reason.startswith(f"{path} row {n}: ")
    assert "'prompt' must be a non-empty string or chat messages" in reasons[0]
    assert "no answer column" in reasons[1] and "columns.answer" in reasons[1]
    assert "no column 'extra_info.split' (reward_kwargs)" in reasons[2]
    assert mix.source("ds").num_tasks("train") + mix.source("ds").num_tasks("eval") == 3
    ledger = Ledger(tmp_path / "ledger.jsonl")
    for uid, source, reason in rejected:
        ledger.record_rejected(uid, source, reason)
    ledger.close()
    lines = read_ledger(tmp_path / "ledger.jsonl")
    assert [(r.task_uid, r.status) for r in lines] == [
        ("ds/row1", "failed"), ("ds/row2", "failed"), ("ds/row3", "failed")]
    assert all(f"{path} row" in r.reason for r in lines)


def test_a_mapping_no_row_matches_fails_at_load_naming_the_field(tmp_path, tok) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([_verl_row(q, i) for i, q in
                                         enumerate(_train_prompts(2, system=True))]), path)
    with pytest.raises(ValueError, match=r"no usable training rows .*no column 'question' "
                                         r"\(columns.prompt\); the row has columns \['ability'"):
        _source(tok, kind="parquet", path=str(path), columns={"prompt": "question"})
    with pytest.raises(ConfigError, match=r"tasks.sources.0.columns.answer = 'a..b'"):
        load_config(None, [("tasks.sources=[{kind: parquet, path: d.parquet, "
                           "columns: {answer: a..b}}]")])
    with pytest.raises(ConfigError, match=r"unknown key 'tasks.sources.0.columns.prompts'"):
        load_config(None, [("tasks.sources=[{kind: parquet, path: d.parquet, "
                           "columns: {prompts: q}}]")])
    with pytest.raises(ConfigError, match=r"tasks.sources.0: reward_kwargs .* keyword \['x'\]"):
        load_config(None, [("tasks.sources=[{kind: jsonl, path: d.jsonl, "
                           "reward_kwargs: [a.x, b.x]}]")])
    for taken in ("token_ids", "meta.episode"):  # a keyword the reward gets from the response
        with pytest.raises(ConfigError, match=r"tasks.sources.0: reward_kwargs: keyword "
                                              r"\['(token_ids|episode)'\] is the response's"):
            load_config(None, [f"tasks.sources=[{{kind: jsonl, path: d.jsonl, "
                               f"reward_kwargs: [{taken}]}}]"])
    with pytest.raises(ConfigError, match=r"tasks.sources.0: `columns` is read only by a"):
        load_config(None, ["tasks.sources=[{kind: tick, columns: {prompt: q}}]"])
    with pytest.raises(ConfigError, match=r"tasks.sources.0: `reward_kwargs` is read only"):
        load_config(None, ["tasks.sources=[{kind: math, reward_kwargs: [x]}]"])


def test_files_that_are_not_the_format_fail_naming_the_source(tmp_path, tok) -> None:
    path = tmp_path / "d.parquet"
    path.write_text('{"prompt": "x", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"tasks source 'ds': .*d.parquet is not a readable "
                                         r"Parquet file"):
        _source(tok, kind="parquet", path=str(path))
    with pytest.raises(ValueError, match=r"has no state.json: not a folder written by "
                                         r"Dataset.save_to_disk"):
        _source(tok, kind="hf_dataset", path=str(tmp_path))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}))
    bare = _bare_tokenizer(tmp_path, tok)
    with pytest.raises(ValueError, match="holds chat messages but the model's tokenizer has no "
                                         "chat template"):
        _source(bare, kind="jsonl", path=str(chat))


def _bare_tokenizer(tmp_path: Path, tok):
    folder = tmp_path / "bare"
    tok.save_pretrained(str(folder))
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    bare = AutoTokenizer.from_pretrained(str(folder))
    assert getattr(bare, "chat_template", None) is None
    return bare


def test_a_tasks_reward_columns_survive_a_checkpoint() -> None:
    from rollstream.trajectory import Task

    task = Task(uid="ds/1", source="ds", prompt_ids=(1, 2), prompt_text="q", reference="a",
                extra={"extra_info": {"index": 1, "tags": ["a"]}, "data_source": "x"})
    back = task_from_dict(json.loads(json.dumps(task_to_dict(task))))
    assert back == task and back.extra == task.extra
    old = task_to_dict(task)
    del old["extra"]  # a checkpoint written before tasks carried columns
    assert task_from_dict(old).extra == {}


def test_a_reward_column_that_is_not_a_json_value_rejects_its_row(tmp_path, tok) -> None:
    import datetime

    qs = _train_prompts(2)
    when = datetime.datetime(2025, 1, 2)
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": q, "answer": "1", "meta": {"at": when}}
                                         for q in qs]), path)
    with pytest.raises(ValueError, match=r"no usable training rows \(0 held out, 2 rejected\); "
                                         r"the first rejected: .*t.parquet row 0: reward_kwargs "
                                         r"column 'meta' is not a JSON value"):
        _source(tok, kind="parquet", path=str(path), reward_kwargs=("meta",))
    assert _source(tok, kind="parquet", path=str(path)).num_tasks("train") == 2
