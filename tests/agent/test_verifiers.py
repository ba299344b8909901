"""verifiers environments as episode sources, against the real ``verifiers`` package: a
``vf.Environment`` named in config (``tests/agent/user_pkg/vf_envs.py``, over local rows)
rolls out its own multi-turn episodes through the run's proxy, one session per episode, in
the run's process or in a harness worker process, so each sample is token for token what the
kit model was served; its rubric grades each group's rollouts together (verifiers'
``score_group``, in a reward worker), group reward functions included; and whatever cannot
run is refused when the run is built, naming the field."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import yaml

import rollstream
from rollstream.agent.chat import check_alignment
from rollstream.agent.episodes import episode_sources
from rollstream.agent.loop import Budgets
from rollstream.agent.proxy_harness import OPENAI
from rollstream.agent.proxy_wire import Refused, parse_request
from rollstream.agent.verifiers_env import with_rubrics
from rollstream.config import ConfigError, load_config
from rollstream.data.ledger import Ledger, read_ledger
from rollstream.data.mix import TaskMix
from rollstream.data.sources import source_rewards
from rollstream.reward.registry import build_resolver
from rollstream.run_files import RunFiles
from rollstream.runtime.build import check_inputs
from rollstream.trajectory import Group, Sample, SampleStatus, SegmentKind
from tests import warm
from tests.agent.runs import two_step_run
from tests.agent.test_proxy_harness import RENDERER, TOKENIZER, _dispatcher
from tests.agent.user_pkg.vf_envs import group_scores, score

ROOT = Path(__file__).resolve().parents[2]
ENVS = "tests.agent.user_pkg.vf_envs"
ROWS = [{"id": i, "prompt": [{"role": "user", "content": f"go {i}"}], "answer": "x"}
        for i in range(8)]


def _source(tmp_path: Path, **fields) -> str:
    path = tmp_path / "vf.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    entry = {"name": "vf", "kind": "jsonl", "path": str(path), **fields}
    return f"tasks.sources=[{json.dumps(entry)}]"


def _cfg(tmp_path: Path, *more: str, **fields):
    return load_config(None, ["tasks.num_eval=0", f"run_root={tmp_path}", *more,
                              _source(tmp_path, harness="verifiers", **fields)])


def _check_episode(s: Sample, turns: int) -> None:
    """The environment's conversation, token for token, graded by its rubric: the reward is
    ``score`` of the text the trained tokens decode to."""
    assert s.reward == score(_replies(s, turns))


def _replies(s: Sample, turns: int) -> list[str]:
    """The environment's conversation, token for token: the model's replies, as the trained
    tokens decode."""
    assert s.status is SampleStatus.GRADED and s.finish_reason == "done", s.failure
    kinds = [seg.kind for seg in s.segments]
    assert kinds == [SegmentKind.POLICY, SegmentKind.ENV] * (turns - 1) + [SegmentKind.POLICY]
    assert all(set(seg.versions) == {0} and all(seg.loss_mask)
               for seg in s.segments if seg.kind is SegmentKind.POLICY)
    messages = [{"role": "user", "content": s.task.extra["row"]["prompt"][0]["content"]}]
    replies = []
    for i, seg in enumerate(s.segments):
        if seg.kind is SegmentKind.POLICY:
            ids = seg.token_ids[:-1] if s.turns[i].finish_reason == "stop" else seg.token_ids
            replies.append(TOKENIZER.decode(ids))
            messages.append({"role": "assistant", "content": replies[-1]})
        else:
            messages.append({"role": "user", "content": f"more {len(replies)}"})
    check_alignment(RENDERER, messages, list(s.task.prompt_ids) + s.response_ids)
    assert s.episode_record is None  # the rubric read it; the samples keep their tokens
    return replies


def _rubric(cfg):
    """The run's rewards as it resolves them: the source's rubric (``VerifiersRubric``)."""
    return build_resolver(cfg.reward, source_rewards(cfg.tasks), with_rubrics(cfg.tasks, None))


async def _run_groups(engine, tmp_path: Path, cfg, workers: int = 0) -> list[Group]:
    mix = TaskMix(cfg.tasks, TOKENIZER)
    groups = [Group.new(mix.next_task(), 3) for _ in range(2)]
    assert {g.task.harness for g in groups} == {OPENAI}
    sources = list(episode_sources(cfg.tasks).values())
    disp, (graders, harness) = _dispatcher(
        engine, sources, Ledger(tmp_path / "l.jsonl"),
        Budgets(max_turns=8, max_turn_tokens=12, max_total_tokens=400), workers=workers,
        resolve=_rubric(cfg))
    try:
        await asyncio.wait_for(asyncio.gather(*(disp.run_group(g) for g in groups)), 180)
    finally:
        await harness.close()
        graders.close()
    return groups


async def test_a_verifiers_environment_rolls_out_through_the_proxy_graded_by_its_rubric(
        engine, tmp_path: Path):
    cfg = _cfg(tmp_path, environment=f"{ENVS}:load_environment",
               environment_kwargs={"turns": 3})
    check_inputs(cfg)
    groups = await _run_groups(engine, tmp_path, cfg)
    samples = [s for g in groups for s in g.samples]
    for s in samples:
        _check_episode(s, turns=3)
    assert len({s.reward for s in samples}) > 1  # the rubric read each reply


async def test_its_episodes_run_in_a_harness_worker_process(engine, tmp_path: Path):
    """The environment object by import path, in a worker process: it gets the source's
    agent whole (pickled), loads the environment itself and returns the rollout's state."""
    cfg = _cfg(tmp_path, "agent.harness_workers=1", environment=f"{ENVS}:ENV")
    groups = await _run_groups(engine, tmp_path, cfg, workers=1)
    for s in (s for g in groups for s in g.samples):
        _check_episode(s, turns=2)


@pytest.mark.parametrize("workers", [0, 1])
async def test_a_rubric_that_compares_a_groups_rollouts_grades_each_group(
        engine, tmp_path: Path, workers: int):
    """A rubric with a group reward function (``longest_in_group``, which verifiers' own
    ``score_rollout`` refuses): each group's states are scored together once its last episode
    ends, so every reward is the per-rollout score plus half the group score of the group's
    replies, as the trained tokens decode; in the run's process or a harness worker."""
    cfg = _cfg(tmp_path, f"agent.harness_workers={workers}",
               environment=f"{ENVS}:load_group_environment")
    groups = await _run_groups(engine, tmp_path, cfg, workers=workers)
    for g in groups:
        replies = [_replies(s, turns=2) for s in g.samples]
        want = [score(r) + 0.5 * top for r, top in zip(replies, group_scores(replies),
                                                           strict=True)]
        assert [s.reward for s in g.samples] == pytest.approx(want)


async def test_a_budget_ends_its_rollout_and_the_rubric_still_grades(engine, tmp_path: Path):
    """A call past ``agent.max_turns`` is refused by the proxy: the rollout ends on that
    error, the episode by ``max_turns``, graded by the rubric on what the model wrote."""
    cfg = _cfg(tmp_path, environment=f"{ENVS}:load_environment",
               environment_kwargs={"turns": 4})
    mix = TaskMix(cfg.tasks, TOKENIZER)
    group = Group.new(mix.next_task(), 2)
    disp, (graders, harness) = _dispatcher(
        engine, list(episode_sources(cfg.tasks).values()), Ledger(tmp_path / "l.jsonl"),
        Budgets(max_turns=2, max_turn_tokens=12, max_total_tokens=400), resolve=_rubric(cfg))

    try:
        await asyncio.wait_for(disp.run_group(group), 120)
    finally:
        await harness.close()
        graders.close()
    for s in group.samples:
        assert s.status is SampleStatus.GRADED and s.finish_reason == "max_turns", s.failure
        assert sum(seg.kind is SegmentKind.POLICY for seg in s.segments) == 2
        assert s.reward is not None and 0 <= s.reward <= 1


BAD_AT_BUILD = [
    ({"environment": f"{ENVS}.nowhere:load_environment"},
     r"tasks\.sources\.0\.environment: environment .*cannot import module"),
    ({"environment": f"{ENVS}:NOT_AN_ENVIRONMENT"},
     r"tasks\.sources\.0\.environment: environment .* is 42: not a vf\.Environment"),
    ({"environment": f"{ENVS}:not_an_environment"},
     (r"tasks\.sources\.0\.environment: environment .* gave \{'turns': 2\}, which is not a "
      r"vf\.Environment")),
    ({"environment": f"{ENVS}:load_environment", "environment_kwargs": {"colour": 1}},
     (r"tasks\.sources\.0\.environment: .*cannot be called with environment_kwargs "
      r"\['colour'\]")),
    ({"environment": f"{ENVS}:ENV", "environment_kwargs": {"turns": 1}},
     r"tasks\.sources\.0\.environment: .* is a vf\.Environment already"),
    ({"environment": f"{ENVS}:load_from_the_hub"},
     (r"tasks\.sources\.0\.environment: environment .* building it raised ConnectionError: "
      r"cannot reach huggingface\.co \(a loader that downloads its dataset cannot here")),
    ({"environment": "no_such_vf_environment"},
     (r"tasks\.sources\.0\.environment: environment 'no_such_vf_environment' is not an "
      r"installed verifiers environment module")),
]


@pytest.mark.parametrize(("fields", "error"), BAD_AT_BUILD)
def test_what_cannot_run_is_refused_when_the_run_is_built_naming_the_field(
        tmp_path: Path, fields: dict, error: str):
    with pytest.raises((ValueError, TypeError), match=error):
        check_inputs(_cfg(tmp_path, **fields))


def test_without_the_package_the_error_says_how_to_install_it(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    cfg = _cfg(tmp_path, environment=f"{ENVS}:load_environment")
    monkeypatch.setitem(sys.modules, "verifiers", None)  # `import verifiers` raises
    with pytest.raises(ValueError, match=r"tasks\.sources\.0\.environment: harness verifiers "
                                         r"needs the `verifiers` package.*rollstream\[verifiers\]"):
        check_inputs(cfg)


BAD_AT_LOAD = [
    ({"harness": "verifiers"}, r"harness verifiers needs `environment`"),
    ({"harness": "verifiers", "environment": "m:f", "reward": "exact_match"},
     r"`reward` is not read with harness verifiers \(the environment's rubric grades"),
    ({"harness": "verifiers", "environment": "m:f", "reward_kwargs": ["answer"]},
     r"`reward_kwargs` is not read with harness verifiers"),
    ({"harness": "verifiers", "environment": "m:f", "tools": ["calculator"]},
     r"`tools` is not read with harness verifiers"),
    ({"harness": "verifiers", "environment": "m:f", "agent": "m:g"},
     r"`agent` is not read with harness verifiers"),
    ({"harness": "agent", "environment": "vf_module"},
     r"harness agent takes an import path module:name"),
]


@pytest.mark.parametrize(("fields", "error"), BAD_AT_LOAD)
def test_settings_that_contradict_are_refused_at_load(tmp_path: Path, fields: dict,
                                                      error: str):
    with pytest.raises(ConfigError, match=error):
        load_config(None, [_source(tmp_path, **fields)])


def test_a_reward_besides_the_rubric_is_refused(tmp_path: Path) -> None:
    """The rubric grades: a run-wide reward, or one given to ``rollstream.run`` for the
    source, contradicts it."""
    with pytest.raises(ConfigError, match=r"reward\.name = 'exact_match' grades every source, "
                                          r"and tasks\.sources\.0 is a verifiers"):
        _cfg(tmp_path, "reward.name=exact_match", environment=f"{ENVS}:ENV")
    cfg = _cfg(tmp_path, environment=f"{ENVS}:ENV")
    with pytest.raises(ConfigError, match=r"a reward was given for source 'vf' "
                                          r"\(tasks\.sources\.0\), whose verifiers"):
        rollstream.run(cfg, rewards={"vf": lambda response, task: 1.0})


def test_only_a_dataset_source_runs_a_verifiers_environment() -> None:
    tally = "tasks.sources=[{kind: tally, harness: verifiers, environment: 'm:f'}]"
    with pytest.raises(ConfigError, match=r"harness verifiers is read by dataset kinds"):
        load_config(None, [tally])


def test_the_proxy_takes_back_the_empty_reasoning_content_verifiers_sends() -> None:
    """verifiers sends each assistant message back with ``reasoning_content`` (null or empty:
    the proxy's replies carry none); one that holds text is not what the model wrote."""
    turns = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "x"},
             {"role": "user", "content": "more 1"}]
    for empty in (None, ""):
        turns[1]["reasoning_content"] = empty
        assert parse_request(json.dumps({"messages": turns}).encode()).messages[1].text == "x"
    turns[1]["reasoning_content"] = "hidden"
    with pytest.raises(Refused) as refused:
        parse_request(json.dumps({"messages": turns}).encode())
    assert refused.value.param == "messages.1.reasoning_content"


@pytest.mark.slow
def test_rollstream_train_trains_a_verifiers_environment_from_yaml(tmp_path: Path,
                                                                   model_dir: Path):
    """The config as a user writes it, run by ``rollstream train``, the environment named
    by its module as an installed hub environment is (``vf.load_environment``): its episodes
    train, two model turns each (the environment's ``max_turns``), graded by the rubric."""
    cfg = two_step_run(tmp_path, model_dir, "vf", [{
        "name": "vf", "kind": "jsonl", "path": str(tmp_path / "vf.jsonl"),
        "harness": "verifiers", "environment": ENVS}], max_slots=8)  # by module, as a hub one
    _source(tmp_path)  # writes vf.jsonl
    (tmp_path / "vf.yaml").write_text(yaml.safe_dump(cfg))
    done = warm.run(["-m", "rollstream.cli", "train", str(tmp_path / "vf.yaml")], cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = read_ledger(RunFiles(tmp_path / "runs" / "vf").ledger)
    assert all(r.status is not SampleStatus.FAILED for r in rows), rows[:2]
    trained = [r for r in rows if r.status is SampleStatus.TRAINED]
    assert len(trained) >= 2 * 2 * 2  # steps x groups x samples
    assert all(r.num_turns == 2 and r.finish_reason == "done" and 0 <= r.reward <= 1
               for r in trained)
