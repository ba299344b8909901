"""The Python API: datasets and rewards passed as objects, and the docs' example run.

docs/your-data.md and docs/datasets.md include ``examples/train_api.py`` from its file; the
README's shorter example is checked to run its reward and to call the API as it is. The test
runs the example file as a user would (a script, so its reward is sent to the reward workers from
``__main__``), small enough for CI, and reads what the run wrote."""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

import pytest

import rollstream
from rollstream.config import ConfigError, load_config
from rollstream.data.ledger import read_ledger
from tests import warm

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_api.py"
ROWS = [{"prompt": "T100#02=", "answer": "100/02 101/01", "items": 2},
        {"prompt": "T205#01=", "answer": "205/01", "items": 1}]


def test_the_docs_show_the_example_that_this_file_runs(tmp_path: Path) -> None:
    for page in ("your-data.md", "datasets.md"):
        assert '--8<-- "examples/train_api.py"' in (ROOT / "docs" / page).read_text()
    text = (ROOT / "README.md").read_text()
    body = text.split("## Train your own data with your own reward\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", body, flags=re.DOTALL)
    readme: dict = {"__name__": "readme"}  # defines the reward; the run stays behind __main__
    exec(compile(block, "README example", "exec"), readme)  # noqa: S102 - our own README
    task = rollstream.Task(uid="mine/1", source="mine", prompt_ids=(1,), prompt_text="T517#03=",
                           reference="517/03 518/02 519/01")
    assert readme["item_credit"](task, "517/03 518/02 x", items=3) == 2 / 3
    # its call binds to rollstream.run, and its config and rows build a valid run config
    (call,) = [n for n in ast.walk(ast.parse(block))
               if isinstance(n, ast.Call) and ast.unparse(n.func) == "rollstream.run"]
    args = [ast.literal_eval(a) for a in call.args]
    keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
    inspect.signature(rollstream.run).bind(*args, **keywords)
    assert keywords == {"datasets": "{'mine': rows}", "rewards": "{'mine': item_credit}"}
    cfg = rollstream.build_config(ROOT / args[0], [*args[1], f"run_root={tmp_path}"],
                                  datasets={"mine": ROWS})
    assert cfg.tasks.sources[0].reward_kwargs == ("items",)


@pytest.mark.slow
def test_the_example_trains_on_its_rows_with_its_reward(tmp_path: Path) -> None:
    small = [f"run_root={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}",
             "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
             "model.tiny.intermediate_size=192", "model.warm_start.steps=100",
             "model.warm_start.tokens_per_step=2048", "train.steps=2",
             "train.groups_per_step=4", "tasks.num_eval=8", "monitor.progress=false",
             "monitor.report=false"]
    done = warm.run([str(EXAMPLE), *small], cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"held-out reward \d\.\d{3} -> \d\.\d{3} in 2 steps", done.stdout)
    run = tmp_path / "api-demo"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_samples"] > 0
    (data,) = (run / "inputs").glob("count-*.jsonl")
    assert len(data.read_text().splitlines()) == 2000
    saved = load_config(run / "config.yaml")
    assert saved.tasks.sources[0].path == str(data) and saved.tasks.sources[0].reward is None
    rows = read_ledger(run / "ledger.jsonl")
    graded = [r for r in rows if r.reward is not None]
    assert graded and all(r.task_uid.startswith("count/") for r in graded)
    # item_credit's values are shares of 1..6 items; exact_match's would be only 0 and 1
    shares = {round(k / n, 6) for n in range(1, 7) for k in range(n + 1)}
    assert {round(r.reward, 6) for r in graded} <= shares
    assert {round(r.reward, 6) for r in graded} - {0.0, 1.0}


def test_the_exported_names_are_the_api_even_after_every_subpackage_is_imported() -> None:
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(rollstream.__path__):
        if mod.name != "__main__":
            importlib.import_module(f"rollstream.{mod.name}")  # rollstream.train is the trainer
    from rollstream import api

    assert rollstream.run is api.run and rollstream.build_config is api.build_config
    assert not set(rollstream.__all__) & {m.name for m in pkgutil.iter_modules(rollstream.__path__)}


def test_datasets_become_the_sources_when_the_config_lists_none(tmp_path: Path) -> None:
    cfg = rollstream.build_config({"run_root": str(tmp_path), "name": "r"},
                                  datasets={"qa": ROWS, "more": iter(ROWS[:1])})
    qa, more = cfg.tasks.sources
    assert (qa.name, qa.kind, more.name) == ("qa", "jsonl", "more")
    assert Path(qa.path).parent == tmp_path / "r" / "inputs"
    assert [json.loads(line) for line in Path(qa.path).read_text().splitlines()] == ROWS
    again = rollstream.build_config({"run_root": str(tmp_path), "name": "r"},
                                    datasets={"qa": list(ROWS)})
    assert again.tasks.sources[0].path == qa.path  # named by content: the same rows, one file
    other = rollstream.build_config({"run_root": str(tmp_path), "name": "r"},
                                    datasets={"qa": ROWS[:1]})
    assert other.tasks.sources[0].path != qa.path


def test_a_listed_source_takes_its_dataset_and_keeps_its_settings(tmp_path: Path) -> None:
    base = {"run_root": str(tmp_path), "tasks": {"sources": [
        {"kind": "tick"}, {"name": "qa", "weight": 3, "reward_kwargs": ["items"]}]}}
    cfg = rollstream.build_config(base, ["train.steps=7"], datasets={"qa": ROWS})
    tick, qa = cfg.tasks.sources
    assert tick.kind == "tick" and cfg.train.steps == 7
    assert (qa.kind, qa.weight, qa.reward_kwargs) == ("jsonl", 3.0, ("items",))
    assert Path(qa.path).is_file()
    assert "path" not in base["tasks"]["sources"][1]  # the caller's tree is left as it was


def test_a_run_config_keeps_what_its_author_set(tmp_path: Path) -> None:
    base = load_config(None, [f"run_root={tmp_path}", "train.steps=3"])
    cfg = rollstream.build_config(base, ["name=x"], datasets={"qa": ROWS})
    assert (cfg.train.steps, cfg.name) == (3, "x")
    assert [s.name for s in cfg.tasks.sources] == ["qa"]  # the default tick source was not set


@pytest.mark.parametrize(("sources", "datasets", "message"), [
    ("[{kind: tick}]", {"qa": ROWS}, "a dataset was given for source 'qa', which tasks.sources "
                                     "does not have"),
    ("[{name: qa, kind: jsonl, path: x.jsonl}]", {"qa": ROWS}, "tasks.sources.0 ('qa') reads "
                                                               "path 'x.jsonl' and a dataset"),
    ("[{name: qa, kind: parquet}]", {"qa": ROWS}, "tasks.sources.0.kind is 'parquet'"),
    ("[{name: qa}]", {"qa": [{"prompt": "a", "answer": {1, 2}}]},
     "datasets['qa'] row 0: Object of type set is not JSON serializable"),
    ("[{name: qa}]", {"qa": ["T1#01="]}, "datasets['qa'] row 0 is a str, expected a mapping"),
    ("[{name: qa}]", {"qa": "rows.jsonl"}, "datasets['qa'] must be rows"),
])
def test_a_dataset_that_does_not_fit_the_config_is_a_clear_error(
        tmp_path: Path, sources: str, datasets: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        rollstream.build_config(None, [f"run_root={tmp_path}", f"tasks.sources={sources}"],
                                datasets=datasets)


def _score(task: rollstream.Task, text: str) -> float:
    return 1.0


@pytest.mark.parametrize(("overrides", "rewards", "error", "message"), [
    (["tasks.sources=[{name: qa, reward: exact_match}]"], {"qa": _score}, ConfigError,
     "tasks.sources.0.reward is 'exact_match' and a reward was given for source 'qa'"),
    (["tasks.sources=[{name: qa}]"], {"nope": _score}, ValueError,
     "rewards given for ['nope'], which are not task sources of this run"),
    (["tasks.sources=[{name: qa}]", "reward.name=exact_match"], {"qa": _score}, ValueError,
     "reward.name is 'exact_match' (one reward for every source) and rewards were given"),
    (["tasks.sources=[{name: qa}]"], {"qa": lambda task, text: 1.0}, TypeError,
     "tasks source 'qa' (the reward given for it): reward '<lambda>' is a sync function"),
])
def test_a_reward_that_does_not_fit_fails_before_the_run_directory_exists(
        tmp_path: Path, overrides: list[str], rewards: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        rollstream.run(None, [f"run_root={tmp_path}", "name=r", *overrides],
                         datasets={"qa": ROWS}, rewards=rewards)
    assert not (tmp_path / "r" / "ledger.jsonl").exists()
    assert not (tmp_path / "r" / "config.yaml").exists()
