"""A reward named by import path receives a dataset source's columns as keyword arguments,
through the real grader pool (a sync reward in its worker processes, an async one in the
loop); a reward whose signature cannot take them, or an import path that does not resolve,
fails when the run is built, naming the source and the field."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollstream.config import RunConfig, load_config
from rollstream.data.mix import TaskMix
from rollstream.data.sources import source_rewards
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.reward import GraderPool, Response, build_resolver
from rollstream.runtime.build import check_inputs

MODULE = '''
import os


def verl_score(task, text, *, data_source, extra_info):
    """verl's compute_score shape: the columns arrive by name (here: in a worker process)."""
    ok = text.strip() == task.reference and data_source == "gsm8k"
    return (1.0 if ok else 0.0) + extra_info["index"] / 100


async def any_columns(task, text, **columns):
    """TRL's shape: every passed column in **kwargs."""
    return float(len(columns)) + (0.5 if columns["style"] == "rule" else 0.0)


def no_columns(task, text):
    return 1.0


def worker_pid(task, text, *, data_source, extra_info):
    return float(os.getpid())
'''


@pytest.fixture
def dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "col_rewards.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned workers inherit sys.path
    rows = [{"prompt": f"T{100 + i}#01=", "data_source": "gsm8k",
             "reward_model": {"style": "rule", "ground_truth": f"{100 + i}/01"},
             "extra_info": {"index": i}} for i in range(16)]
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _cfg(path: Path, reward: str, kwargs: str) -> RunConfig:
    return load_config(None, ["reward.num_workers=1", "tasks.num_eval=0",
                              (f"tasks.sources=[{{kind: parquet, name: ds, path: '{path}', "
                               f"reward: '{reward}', reward_kwargs: {kwargs}}}]")])


async def test_columns_reach_a_reward_by_import_path_in_the_worker(dataset: Path) -> None:
    import os

    cfg = _cfg(dataset, "col_rewards:verl_score", "[data_source, extra_info]")
    check_inputs(cfg)
    task = TaskMix(cfg.tasks, build_char_tokenizer()).next_task()
    index = task.extra["extra_info"]["index"]
    pool = GraderPool(cfg.reward, build_resolver(cfg.reward, source_rewards(cfg.tasks)))
    pid_cfg = _cfg(dataset, "col_rewards:worker_pid", "[data_source, extra_info]")
    pid_pool = GraderPool(pid_cfg.reward,
                          build_resolver(pid_cfg.reward, source_rewards(pid_cfg.tasks)))
    try:
        right = Response(text=task.reference, token_ids=(1,), finish_reason="stop")
        wrong = Response(text="nope", token_ids=(1,), finish_reason="stop")
        assert (await pool.grade(task, right)).reward == pytest.approx(1 + index / 100)
        assert (await pool.grade(task, wrong)).reward == pytest.approx(index / 100)
        graded = await pid_pool.grade(task, right)
        assert graded.error is None and graded.reward != float(os.getpid())  # a worker did it
    finally:
        pool.close()
        pid_pool.close()


async def test_an_async_reward_takes_every_passed_column_as_kwargs(dataset: Path) -> None:
    cfg = _cfg(dataset, "col_rewards:any_columns", "[data_source, reward_model.style]")
    task = TaskMix(cfg.tasks, build_char_tokenizer()).next_task()
    assert task.extra == {"data_source": "gsm8k", "style": "rule"}
    pool = GraderPool(cfg.reward, build_resolver(cfg.reward, source_rewards(cfg.tasks)))
    try:
        result = await pool.grade(task, Response(text="x", token_ids=(1,), finish_reason="stop"))
        assert result.error is None and result.reward == 2.5
    finally:
        pool.close()


def test_a_reward_that_cannot_take_the_columns_fails_at_load(dataset: Path) -> None:
    cfg = _cfg(dataset, "col_rewards:no_columns", "[data_source]")
    with pytest.raises(TypeError, match=r"tasks source 'ds' \(its `reward`\): reward "
                                        r"'col_rewards:no_columns'.* cannot take the dataset "
                                        r"columns \['data_source'\].*reward_kwargs"):
        check_inputs(cfg)
    one = load_config(None, ["reward.name=col_rewards:verl_score",
                             f"tasks.sources=[{{kind: parquet, name: ds, path: '{dataset}'}}]"])
    with pytest.raises(TypeError, match=r"tasks source 'ds' \(reward.name\): reward "
                                        r"'col_rewards:verl_score' needs keyword arguments "
                                        r"\['data_source', 'extra_info'\] that no dataset "
                                        r"column gives \(passed: \[\]\).*reward_kwargs"):
        check_inputs(one)  # it needs data_source and extra_info; the source passes none


def test_a_bad_import_path_fails_at_load_naming_the_source(dataset: Path) -> None:
    for reward, expected in (("no_such_pkg.rewards:score", "cannot import module 'no_such_pkg"),
                             ("col_rewards:missing", "has no attribute 'missing'")):
        cfg = _cfg(dataset, reward, "[]")
        with pytest.raises(ValueError, match=rf"tasks source 'ds' \(its `reward`\): .*{expected}"):
            check_inputs(cfg)
