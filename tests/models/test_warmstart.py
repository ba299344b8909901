"""prepare_model: validation of a given folder, the cached warm start, measurement helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rollstream.models.warmstart as ws

from rollstream.config.schema import (
    ModelConfig,
    SourceConfig,
    TasksConfig,
    TinyModelConfig,
    WarmStartConfig,
)
from rollstream.data.mix import TaskMix
from rollstream.models.tiny import init_tiny_model, save_model_folder
from rollstream.models.tokenizer import EOS, build_char_tokenizer
from rollstream.reward import Response
from rollstream.trajectory import Task

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)
TASKS = TasksConfig(num_eval=4, sources=(SourceConfig(kind="tick", max_items=6),))


def _cfg(cache: Path, steps: int = 3, **tiny) -> ModelConfig:
    return ModelConfig(
        tiny=TINY.model_copy(update=tiny),
        warm_start=WarmStartConfig(steps=steps, tokens_per_step=256),
        cache_dir=str(cache),
    )


def test_prepare_model_builds_once_then_returns_the_cache(tmp_path: Path, monkeypatch) -> None:
    threads = torch.get_num_threads()
    folder = ws.prepare_model(_cfg(tmp_path), TASKS)
    assert folder.parent == tmp_path.resolve() and len(folder.name) == 16
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folder left
    report = json.loads((folder / "warmstart.json").read_text())
    assert report["steps"] == 3 and report["num_eval_tasks"] == 4
    assert 0.0 <= report["sampled_accuracy"] <= 1.0 and 0.0 <= report["greedy_accuracy"] <= 1.0
    assert report["wall_s"] > 0 and report["num_train_tokens"] >= 3 * 256
    assert AutoModelForCausalLM.from_pretrained(folder).config.hidden_size == 32
    assert AutoTokenizer.from_pretrained(str(folder)).eos_token == EOS
    assert torch.get_num_threads() == threads

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached warm start was rebuilt")

    monkeypatch.setattr(ws, "_build", no_rebuild)
    assert ws.prepare_model(_cfg(tmp_path), TASKS) == folder


def test_cache_key_covers_the_configs_that_shape_the_model(tmp_path: Path) -> None:
    base = ws.cache_key(_cfg(tmp_path), TASKS)
    assert base == ws.cache_key(_cfg(tmp_path / "elsewhere"), TASKS)  # the location is not content
    assert base != ws.cache_key(_cfg(tmp_path, steps=4), TASKS)
    assert base != ws.cache_key(_cfg(tmp_path, seed=1), TASKS)
    assert base != ws.cache_key(_cfg(tmp_path), TASKS.model_copy(update={"seed": 1}))
    two = TASKS.model_copy(update={"sources": (*TASKS.sources, SourceConfig(kind="digits"))})
    assert base != ws.cache_key(_cfg(tmp_path), two)
    # how the rollout draws (quota, caps, pass rates) is not how demonstrations are drawn
    rollout_only = TasksConfig(num_eval=4, mix="weighted", pass_rate={"enabled": True},
                               sources=(SourceConfig(kind="tick", max_items=6, max_in_flight=2),))
    assert base == ws.cache_key(_cfg(tmp_path), rollout_only)
    moe = ws.cache_key(_cfg(tmp_path, arch="qwen2_moe"), TASKS)
    assert moe != base
    assert moe != ws.cache_key(_cfg(tmp_path, arch="qwen2_moe", num_experts=8), TASKS)


def test_a_given_model_path_is_validated(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=r"'.*nope': does not exist"):
        ws.prepare_model(ModelConfig(path=str(missing)), TASKS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty': has no config.json"):
        ws.prepare_model(ModelConfig(path=str(tmp_path / "empty")), TASKS)
    good = tmp_path / "good"
    save_model_folder(init_tiny_model(TINY, build_char_tokenizer()), build_char_tokenizer(), good)
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for f in good.iterdir():
        if f.name != "tokenizer.json":
            (no_tok / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"no_tok': has no tokenizer.json"):
        ws.prepare_model(ModelConfig(path=str(no_tok)), TASKS)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        ws.prepare_model(ModelConfig(path=str(tmp_path / "file")), TASKS)
    cfg = ModelConfig(path=str(good), cache_dir=str(tmp_path / "cache"))
    assert ws.prepare_model(cfg, TASKS) == good.resolve()
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_collate_trains_on_target_tokens_only() -> None:
    f, t = False, True
    input_ids, labels = ws.collate([([5, 6, 7, 8, 1], [f, f, f, t, t]),
                                    ([9, 10, 1], [f, f, t]),
                                    ([5, 6, 7, 8], [f, t, f, t])],  # an episode: env between
                                   pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8, 1], [9, 10, 1, 0, 0], [5, 6, 7, 8, 0]]
    assert labels.tolist() == [[-100, -100, -100, 8, 1], [-100, -100, 1, -100, -100],
                               [-100, 6, -100, 8, -100]]


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
def test_warm_start_learns_the_demonstrations(arch: str) -> None:
    tokenizer = build_char_tokenizer()
    moe = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    model = init_tiny_model(
        TINY.model_copy(update={"arch": arch, **(moe if arch == "qwen2_moe" else {})}), tokenizer)
    first = ws.warm_start(
        model,
        TASKS,
        WarmStartConfig(steps=1, tokens_per_step=256),
        tokenizer,
        max_position=TINY.max_position,
    )
    later = ws.warm_start(
        model,
        TASKS,
        WarmStartConfig(steps=40, tokens_per_step=256),
        tokenizer,
        max_position=TINY.max_position,
    )
    assert first["final_loss"] > 3.5  # about ln(vocab) at initialisation
    assert later["final_loss"] < 0.6 * first["final_loss"]


def test_warm_start_rejects_demonstrations_longer_than_the_model(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer()
    short = TINY.model_copy(update={"max_position": 16})
    model = init_tiny_model(short, tokenizer)
    long_tasks = TasksConfig(sources=(SourceConfig(kind="tick", pareto_alpha=0.1),))
    with pytest.raises(ValueError, match="max_position is 16"):
        ws.warm_start(
            model,
            long_tasks,
            WarmStartConfig(steps=1, tokens_per_step=256),
            tokenizer,
            max_position=16,
        )


def test_evaluate_accuracy_grades_responses_as_a_run_does(tmp_path: Path) -> None:
    folder = ws.prepare_model(_cfg(tmp_path), TASKS)
    tok = build_char_tokenizer()
    mix = TaskMix(TASKS, tok)
    tasks = mix.eval_tasks()
    seen: list[Response] = []

    def record(task: Task, response: Response) -> float:
        seen.append(response)
        return 1.0 if task.uid == tasks[0].uid else 0.0

    assert ws.evaluate_accuracy(folder, tasks, 0.0, record, max_new_tokens=12) == 0.25
    for r in seen:  # cut after the first eos; text without special tokens; why it ended
        assert EOS not in r.text and 0 < len(r.token_ids) <= 12
        assert r.text == tok.decode(list(r.token_ids), skip_special_tokens=True)
        stopped = tok.eos_token_id in r.token_ids
        assert r.finish_reason == ("stop" if stopped else "length")
        assert not stopped or r.token_ids.index(tok.eos_token_id) == len(r.token_ids) - 1
        assert stopped or len(r.token_ids) == 12
    greedy = list(seen)
    seen.clear()
    ws.evaluate_accuracy(folder, tasks, 0.0, record, max_new_tokens=12)
    assert seen == greedy  # greedy is deterministic
    with pytest.raises(ValueError, match="at least one task"):
        ws.evaluate_accuracy(folder, [], 1.0, record)


def always_one(task: Task, text: str, *, finish_reason: str) -> float:
    return 1.0


def test_the_warm_start_measures_accuracy_with_the_sources_registered_rewards(
    tmp_path: Path,
) -> None:
    own = TasksConfig(num_eval=4, sources=(
        SourceConfig(kind="tick", max_items=6, reward=f"{__name__}:always_one"),))
    report = json.loads((ws.prepare_model(_cfg(tmp_path), own) / "warmstart.json").read_text())
    assert report["greedy_accuracy"] == 1.0 and report["sampled_accuracy"] == 1.0
    with pytest.raises(ValueError, match="unknown reward 'nope'"):  # before any training
        ws.prepare_model(_cfg(tmp_path), TasksConfig(sources=(SourceConfig(reward="nope"),)))


def not_a_number(task: Task, text: str, *, finish_reason: str) -> str:
    return "not a number"


def test_a_warm_start_on_bad_rows_scores_a_failing_reward_0(tmp_path: Path) -> None:
    """A dataset with malformed rows beside tick, its reward returning a string: the
    demonstrations skip the rows a run rejects, and a failed grade scores 0 (as in a run's
    evaluation) instead of stopping the warm start."""
    data = tmp_path / "data.jsonl"
    rows = [json.dumps({"id": f"r{i}", "prompt": f"T{100 + i}#01=", "answer": f"{100 + i}/01"})
            for i in range(40)]
    rows.insert(5, "{not json")
    rows.insert(9, json.dumps({"id": "noprompt", "answer": "1"}))
    data.write_text("\n".join(rows) + "\n")
    tasks = TasksConfig(num_eval=16, sources=(
        SourceConfig(kind="tick", max_items=6, reward=f"{__name__}:always_one"),
        SourceConfig(kind="jsonl", path=str(data), name="ds", reward=f"{__name__}:not_a_number")))
    folder = ws.prepare_model(_cfg(tmp_path / "cache", steps=2), tasks)
    report = json.loads((folder / "warmstart.json").read_text())
    assert report["greedy_accuracy_by_source"] == {"tick": 1.0, "ds": 0.0}, report
    assert report["sampled_accuracy_by_source"] == {"tick": 1.0, "ds": 0.0}, report


def test_a_rows_answer_ends_with_eos_or_with_the_turn_end_when_a_harness_runs_it(
        tmp_path: Path, monkeypatch) -> None:
    """The agent loop stops a model turn at the chat template's end-of-turn token, not at eos:
    an agent source's row answer is demonstrated ending there, a single-turn row's at eos;
    and the cache keys the two apart."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"higher than {n}", "answer": str(n + 1),
                                        "target": n + 3}) + "\n" for n in range(10, 90)))
    tokenizer = build_char_tokenizer()
    trained: list[list[tuple[list[int], list[bool]]]] = []
    monkeypatch.setattr(ws, "_train_step", lambda model, opt, batch, pad_id: trained.append(
        batch) or 0.0)
    plain = SourceConfig(kind="jsonl", path=str(rows))
    agent = SourceConfig(kind="jsonl", path=str(rows), harness="agent",
                         environment="tests.agent.user_pkg.envs:SyncCountdown")
    for source in (plain, agent):
        ws.warm_start(init_tiny_model(TINY, tokenizer), TasksConfig(sources=(source,)),
                      WarmStartConfig(steps=1, tokens_per_step=64), tokenizer,
                      max_position=TINY.max_position)
    ends = [{ids[-1] for ids, _ in batch} for batch in trained]
    assert ends == [{tokenizer.eos_token_id}, {tokenizer.convert_tokens_to_ids("<|im_end|>")}]
    assert all(targets[-1] for batch in trained for _, targets in batch)
    keys = {ws.cache_key(_cfg(tmp_path), TasksConfig(sources=(s,))) for s in (plain, agent)}
    assert len(keys) == 2
