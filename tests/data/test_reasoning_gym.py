"""reasoning-gym as a task source, against the real package: a generator named in config
becomes tasks rendered with the chat template, its own scorer grades them in a reward worker
process, a bad generator name or option fails when the run is built naming the field, an
entry the tokenizer cannot hold is a rejected row, the tasks are a pure function of the seed
(a resumed cursor names the same task), and a tiny run trains on it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import reasoning_gym

from rollstream.agent.chat import ChatRenderer
from rollstream.config.loader import ConfigError, load_config
from rollstream.data.ledger import read_ledger
from rollstream.data.mix import TaskMix
from rollstream.data.sources import source_rewards
from rollstream.durable.state import task_from_dict, task_to_dict
from rollstream.models.tokenizer import ALPHABET, build_char_tokenizer
from rollstream.reward import GraderPool, Response, build_resolver
from rollstream.runtime.build import check_inputs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOK = build_char_tokenizer()
# chain_sum with one-digit terms: "State the final answer to the following arithmetic
# problem: 4 - 1 =" (every character in the kit's alphabet)
CHAIN = "{dataset: chain_sum, size: 64, options: {max_terms: 3, max_digits: 1}}"


def _cfg(generator: str = CHAIN, *more: str):
    source = f"{{kind: reasoning_gym, name: cs, reasoning_gym: {generator}}}"
    return load_config(None, ["reward.num_workers=1", "tasks.num_eval=4", *more,
                              f"tasks.sources=[{source}]"])


def test_a_generator_named_in_config_becomes_chat_rendered_tasks() -> None:
    mix = TaskMix(_cfg().tasks, TOK)
    src = mix.source("cs")
    assert src.num_tasks("train") + src.num_tasks("eval") == 64 and not mix.rejected()
    assert mix.eval_tasks()  # the held-out split is the hash split of every source
    gen = reasoning_gym.create_dataset("chain_sum", size=64, seed=0, max_terms=3, max_digits=1)
    for _ in range(10):
        task = mix.next_task()
        index = int(task.uid.removeprefix("cs/"))
        entry = gen[index]
        text = ChatRenderer(TOK).text([{"role": "user", "content": entry["question"]}],
                                      add_generation_prompt=True)
        assert task.prompt_text == text and task.reference == entry["answer"]
        assert task.prompt_ids == tuple(TOK.encode(text, add_special_tokens=False))
        assert set(entry["question"]) <= set(ALPHABET)
    assert src.reward == "reasoning_gym"


async def test_its_scorer_grades_in_a_reward_worker() -> None:
    cfg = _cfg()
    drawn = TaskMix(cfg.tasks, TOK).next_task()
    task = task_from_dict(json.loads(json.dumps(task_to_dict(drawn))))  # as a checkpoint keeps it
    assert task == drawn
    pool = GraderPool(cfg.reward, build_resolver(cfg.reward, source_rewards(cfg.tasks)))
    try:
        async def grade(text: str, finish: str = "stop") -> float:
            result = await pool.grade(task, Response(text=text, token_ids=(1,),
                                                     finish_reason=finish))
            assert result.error is None, result.error
            return result.reward

        assert await grade(f" {task.reference}\n") == 1.0
        assert await grade(str(int(task.reference) + 1)) == 0.0
        assert 0 < await grade(f"{task.reference} is it") < 1  # reasoning-gym's partial credit
        assert await grade(task.reference, "length") == 0.0  # never finished its answer
        spec = {**task.extra["reasoning_gym"], "question": "not the entry's"}
        other = dataclasses.replace(task, extra={"reasoning_gym": spec})
        result = await pool.grade(other, Response(text=task.reference, token_ids=(1,),
                                                  finish_reason="stop"))
        assert result.reward is None or result.error is not None
        assert "made entry" in str(result.error) and "not deterministic" in str(result.error)
    finally:
        pool.close()


@pytest.mark.parametrize(("generator", "field", "said"), [
    ("{dataset: chain_summ}", "dataset", "did you mean ['chain_sum'"),
    ("{dataset: no_such_generator}", "dataset", "basic_arithmetic"),
    ("{dataset: chain_sum, options: {max_term: 3}}", "options", "'max_terms'"),
    ("{dataset: chain_sum, options: {min_terms: 5, max_terms: 2}}", "options",
     "max_terms must be >= min_terms"),
    ("{dataset: chain_sum, options: {seed: 3}}", "options", "reasoning_gym.seed"),
])
def test_a_bad_generator_or_option_fails_when_the_run_is_built(generator: str, field: str,
                                                               said: str) -> None:
    cfg = _cfg(generator)
    for build in (lambda: check_inputs(cfg), lambda: TaskMix(cfg.tasks, TOK)):
        with pytest.raises(ValueError) as e:
            build()
        assert f"reasoning_gym.{field}" in str(e.value) and "'cs'" in str(e.value)
        assert said in str(e.value)


def test_the_generator_section_belongs_to_its_kind() -> None:
    with pytest.raises(ConfigError, match=r"tasks\.sources\.0.*needs `reasoning_gym`"):
        load_config(None, ["tasks.sources=[{kind: reasoning_gym}]"])
    with pytest.raises(ConfigError, match=r"`reasoning_gym` is read only by kind"):
        load_config(None, ["tasks.sources=[{kind: tick, reasoning_gym: {dataset: chain_sum}}]"])


def test_an_entry_the_tokenizer_cannot_hold_is_rejected_and_the_rest_go_on() -> None:
    # complex_arithmetic writes some answers' questions with non-ASCII characters, which the
    # kit's tokenizer encodes to nothing
    cfg = _cfg("{dataset: complex_arithmetic, size: 40, seed: 3}")
    mix = TaskMix(cfg.tasks, TOK)
    rejected = mix.rejected()
    src = mix.source("cs")
    assert rejected and src.num_tasks("train") + src.num_tasks("eval") + len(rejected) == 40
    uid, source, reason = rejected[0]
    assert source == "cs" and uid.startswith("cs/")
    assert "'complex_arithmetic' entry" in reason and "tokenizer cannot encode" in reason
    gen = reasoning_gym.create_dataset("complex_arithmetic", size=40, seed=3)
    assert any(ord(c) > 127 for c in gen[int(uid.removeprefix("cs/"))]["question"])


def test_tasks_are_a_pure_function_of_the_seed_and_a_cursor_resumes() -> None:
    def uids_and_prompts(mix: TaskMix, n: int) -> list[tuple[str, str]]:
        return [(t.uid, t.prompt_text) for t in (mix.next_task() for _ in range(n))]

    first = TaskMix(_cfg().tasks, TOK)
    drawn = uids_and_prompts(first, 5)
    assert drawn == uids_and_prompts(TaskMix(_cfg().tasks, TOK), 5)
    other = "{dataset: chain_sum, size: 64, seed: 7, options: {max_terms: 3, max_digits: 1}}"
    assert [p for _, p in uids_and_prompts(TaskMix(_cfg(other).tasks, TOK), 5)] != [
        p for _, p in drawn]
    resumed = TaskMix(_cfg().tasks, TOK)
    resumed.restore(first.state())
    assert uids_and_prompts(resumed, 5) == uids_and_prompts(first, 5)


def test_the_example_generates_prompts_in_the_kit_alphabet_that_fit_its_context() -> None:
    cfg = load_config(EXAMPLES / "reasoning_gym.yaml")
    check_inputs(cfg)
    mix = TaskMix(cfg.tasks, TOK)
    src = mix.source("spell_backward")
    assert not mix.rejected() and src.num_tasks("train") > 4000
    tasks = [src.task(i, "train") for i in range(src.num_tasks("train"))]
    # the model writes only the alphabet; it reads one character more, the example's ">"
    # ("sun -> nus"), which the kit's byte tokenizer encodes as it encodes any ASCII
    assert set("".join(t.reference for t in tasks)) <= set(ALPHABET)
    questions = "".join(t.extra["reasoning_gym"]["question"] for t in tasks)
    assert set(questions) <= set(ALPHABET) | {">"}
    assert all(TOK.decode(list(t.prompt_ids)) == t.prompt_text for t in tasks)
    longest = max(len(t.prompt_ids) for t in tasks)
    assert longest + cfg.sampling.max_new_tokens <= cfg.engine.local.max_seq_len


def test_a_tiny_run_trains_on_generators_records_rejected_entries_and_resumes(
        tmp_path: Path) -> None:
    import rollstream
    from rollstream.durable.audit import audit_run

    ca = "{dataset: complex_arithmetic, size: 40, seed: 3}"  # 4 entries the kit cannot encode
    sources = (f"[{{kind: reasoning_gym, name: cs, reasoning_gym: {CHAIN}}}, "
               f"{{kind: reasoning_gym, name: ca, reasoning_gym: {ca}}}]")
    run = [
        "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.tiny.max_position=192", "model.warm_start.steps=0",
        f"model.cache_dir={tmp_path / 'cache'}", f"run_root={tmp_path}", "name=rg",
        f"tasks.sources={sources}", "tasks.num_eval=0", "engine.local.max_seq_len=192",
        "sampling.max_new_tokens=4", "rollout.group_size=4", "rollout.filter_zero_variance=false",
        "train.groups_per_step=2", "train.micro_batch_tokens=256", "reward.num_workers=1",
        "monitor.progress=false", "monitor.report=false"]
    summary = rollstream.run(None, [*run, "train.steps=2"])
    assert summary["steps"] == 2 and summary["trained_samples"] > 0
    rows = read_ledger(tmp_path / "rg" / "ledger.jsonl")
    graded = [r for r in rows if r.reward is not None]
    assert graded and {r.source for r in graded} == {"cs", "ca"}
    rejected = [r for r in rows if r.sample_uid.endswith("#row")]
    assert len(rejected) == 4 and all(r.source == "ca" and r.status == "failed" for r in rejected)
    assert all("tokenizer cannot encode" in r.reason for r in rejected)
    # the cursor goes on from the checkpoint: nothing lost, repeated or rejected twice
    assert rollstream.run(None, [*run, "train.steps=3", "resume=true"])["steps"] == 3
    audit = audit_run(tmp_path / "rg", group_size=4, eval_group_size=4, groups_per_step=2,
                      steps=3)
    assert audit["lost_samples"] == audit["duplicated_samples"] == 0, audit
    assert audit["steps_repeated"] == audit["steps_missing"] == 0, audit
    rows = read_ledger(tmp_path / "rg" / "ledger.jsonl")
    assert sum(r.sample_uid.endswith("#row") for r in rows) == 4
