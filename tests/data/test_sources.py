"""Task sources and the mix: determinism, disjoint splits, the rewards they name, demonstrations,
long tail."""

from __future__ import annotations

import random
import re
import statistics
from itertools import pairwise

import pytest

from rollstream.config.schema import SourceConfig, TasksConfig
from rollstream.data.mix import TaskMix
from rollstream.data.kinds import build_source
from rollstream.data.sources import source_rewards, split_of
from rollstream.models.tokenizer import build_char_tokenizer
from rollstream.reward import decode_response, get_reward
from rollstream.trajectory import Task

TOK = build_char_tokenizer()
KINDS = ("tick", "digits", "math")


def _src(kind: str, seed: int = 0, **kw):
    return build_source(SourceConfig(kind=kind, **kw), TOK, seed)


def _task(kind: str, prompt: str, reference: str) -> Task:
    ids = tuple(TOK.encode(prompt, add_special_tokens=False))
    return Task(
        uid=f"{kind}/train/0", source=kind, prompt_ids=ids, prompt_text=prompt, reference=reference
    )


@pytest.mark.parametrize("kind", KINDS)
def test_tasks_are_deterministic_and_seeded(kind: str) -> None:
    a = [_src(kind).task(i, "train") for i in range(50)]
    assert a == [_src(kind).task(i, "train") for i in range(50)]
    assert [t.uid for t in a[:2]] == [f"{kind}/train/0", f"{kind}/train/1"]
    other = [_src(kind, seed=1).task(i, "train") for i in range(50)]
    assert [t.prompt_text for t in a] != [t.prompt_text for t in other]


@pytest.mark.parametrize("kind", KINDS)
def test_train_and_eval_prompts_are_disjoint(kind: str) -> None:
    src = _src(kind)
    train = {src.task(i, "train").prompt_text for i in range(1500)}
    held = {src.task(i, "eval").prompt_text for i in range(300)}
    assert train.isdisjoint(held)
    assert {split_of(p) for p in train} == {"train"} and {split_of(p) for p in held} == {"eval"}
    assert len(held) > 100  # the eval split is not a handful of repeats


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_ids_are_the_plain_encoding(kind: str) -> None:
    for i in range(20):
        t = _src(kind).task(i, "eval")
        assert list(t.prompt_ids) == TOK.encode(t.prompt_text, add_special_tokens=False)
        assert TOK.eos_token_id not in t.prompt_ids and TOK.pad_token_id not in t.prompt_ids


def test_tick_is_the_learnability_task() -> None:
    src = _src("tick")
    t = _task("tick", "T517#07=", "517/07 518/06 519/05 520/04 521/03 522/02 523/01")
    assert src.demonstration(t, random.Random(0), 0.0) == t.reference
    for i in range(200):
        t = src.task(i, "train")
        start, n = map(int, re.fullmatch(r"T(\d{3})#(\d{2})=", t.prompt_text).groups())
        assert 1 <= n <= 32
        assert t.reference == " ".join(f"{start + k:03d}/{n - k:02d}" for k in range(n))


def test_digits_counts_a_fixed_width_tail_down_by_three() -> None:
    src = _src("digits")
    for i in range(200):
        t = src.task(i, "train")
        head, tail = re.fullmatch(r"D(\d{2})(\d{2})=", t.prompt_text).groups()
        items = t.reference.split(" ")
        assert items[0] == head + tail and all(len(x) == 4 and x[:2] == head for x in items)
        tails = [int(x[2:]) for x in items]
        assert all(a - b == 3 for a, b in pairwise(tails))
        assert tails[-1] < 3 and all(x >= 3 for x in tails[:-1])
        assert src.demonstration(t, random.Random(i), 0.0) == t.reference


def test_math_reference_is_the_value() -> None:
    src = _src("math")
    for i in range(100):
        t = src.task(i, "train")
        expr = t.prompt_text[:-1]
        assert re.fullmatch(r"\d+([+*-]\d+)+", expr)
        assert int(t.reference) == eval(expr)  # noqa: S307 - test oracle on our own digits


@pytest.mark.parametrize("kind", ("tick", "digits"))
def test_the_source_reward_wants_the_exact_properly_ended_answer(kind: str) -> None:
    src = _src(kind)
    assert src.reward == "exact_match"
    reward = get_reward(src.reward)
    t = next(t for t in (src.task(i, "train") for i in range(100)) if t.reference.count(" ") >= 2)
    ref = t.reference
    eos = TOK.eos_token_id

    def graded(text: str, *, stopped: bool = True) -> float:
        ids = [*TOK.encode(text, add_special_tokens=False), *([eos] if stopped else [])]
        return reward.score(t, decode_response(TOK, ids, finish_reason="stop" if stopped else
                                               "length"))

    assert graded(ref) == 1.0
    near = ref[:-1] + str((int(ref[-1]) + 1) % 10)
    assert graded(ref, stopped=False) == 0.0  # capped before its eos
    for wrong in (near, ref.rsplit(" ", 1)[0], ref + " 1", "", ref + ref):
        assert graded(wrong) == 0.0, wrong


def test_sources_name_their_reward_and_a_config_can_change_it() -> None:
    assert _src("math").reward == "math_answer"
    assert _src("tick", reward="math").reward == "math"
    cfg = TasksConfig(sources=(SourceConfig(kind="tick"), SourceConfig(kind="math", name="m"),
                               SourceConfig(kind="digits", reward="my_mod:fn")))
    assert source_rewards(cfg) == {"tick": ("exact_match", ()), "m": ("math_answer", ()),
                                   "digits": ("my_mod:fn", ())}
    assert {n: (TaskMix(cfg, TOK).source(n).reward, ()) for n in ("tick", "m", "digits")} == \
        source_rewards(cfg)


def test_tick_demonstrations_slip_and_follow_the_slip() -> None:
    src = _src("tick")
    t = _task("tick", "T517#20=", "")
    rng = random.Random(0)
    demos = [src.demonstration(t, rng, 0.3) for _ in range(50)]
    steps = []
    for demo in demos:
        items = demo.split(" ")
        assert [int(x[4:]) for x in items] == list(range(20, 0, -1))  # the stop rule stays exact
        nums = [int(x[:3]) for x in items]
        assert nums[0] == 517
        steps += [b - a for a, b in pairwise(nums)]
    assert set(steps) == {0, 1, 2}
    assert 0.2 < sum(s != 1 for s in steps) / len(steps) < 0.4


def test_digits_demonstrations_slip_and_still_stop_below_three() -> None:
    src = _src("digits")
    t = _task("digits", "D4395=", "")
    rng = random.Random(0)
    steps = []
    for _ in range(50):
        tails = [int(x[2:]) for x in src.demonstration(t, rng, 0.3).split(" ")]
        assert tails[0] == 95 and tails[-1] < 3 and min(tails[:-1]) >= 3
        steps += [a - b for a, b in pairwise(tails)]
    assert set(steps) == {2, 3, 4}


def test_math_demonstrations_are_off_by_one_at_the_noise_rate() -> None:
    src = _src("math")
    t = _task("math", "12+7*3=", "33")
    demos = [src.demonstration(t, random.Random(i), 0.25) for i in range(400)]
    assert set(demos) == {"32", "33", "34"}
    assert 0.15 < sum(d != "33" for d in demos) / 400 < 0.35


@pytest.mark.parametrize("kind", ("tick", "digits"))
def test_answer_lengths_are_long_tailed(kind: str) -> None:
    src = _src(kind)
    lengths = sorted(
        len(TOK.encode(src.task(i, "train").reference, add_special_tokens=False))
        for i in range(2000)
    )
    p50, p99 = statistics.median(lengths), lengths[int(0.99 * (len(lengths) - 1))]
    assert p99 / p50 >= 5, (p50, p99)


def test_tick_and_digits_have_different_length_distributions() -> None:
    med = {
        k: statistics.median(len(_src(k).task(i, "train").reference) for i in range(1000))
        for k in ("tick", "digits")
    }
    assert med["tick"] >= 1.5 * med["digits"]


def test_bad_tick_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_items must be <= 99"):
        _src("tick", max_items=150)


def _mix(**kw) -> TaskMix:
    sources = (SourceConfig(kind="tick", weight=1.0), SourceConfig(kind="digits", weight=3.0))
    return TaskMix(TasksConfig(sources=sources, **kw), TOK)


def test_mix_draws_by_weight_deterministically() -> None:
    a = [_mix().next_task() for _ in range(1)]  # a fresh mix starts at the same place
    mix = _mix()
    uids = [mix.next_task().uid for _ in range(2000)]
    assert a[0].uid == uids[0]
    again = _mix()
    assert uids == [again.next_task().uid for _ in range(2000)]
    share = sum(u.startswith("digits/") for u in uids) / len(uids)
    assert 0.70 < share < 0.80
    tick = [u for u in uids if u.startswith("tick/")]
    assert tick == [f"tick/train/{i}" for i in range(len(tick))]


def test_mix_cursor_resumes_the_same_stream() -> None:
    mix = _mix()
    for _ in range(37):
        mix.next_task()
    state = mix.state()
    expected = [mix.next_task() for _ in range(20)]
    fresh = _mix()
    fresh.restore(state)
    assert [fresh.next_task() for _ in range(20)] == expected
    with pytest.raises(ValueError, match="sources"):
        TaskMix(TasksConfig(), TOK).restore(state)


def test_mix_eval_tasks_round_robin_from_the_eval_split() -> None:
    tasks = _mix(num_eval=10).eval_tasks()
    assert [t.uid for t in tasks[:4]] == [
        "tick/eval/0",
        "digits/eval/0",
        "tick/eval/1",
        "digits/eval/1",
    ]
    assert len(tasks) == 10 and all(split_of(t.prompt_text) == "eval" for t in tasks)
    assert tasks == _mix(num_eval=10).eval_tasks()


def test_mix_sources_by_name() -> None:
    mix = _mix()
    assert mix.names == ["tick", "digits"] and mix.source("digits").name == "digits"
    with pytest.raises(ValueError, match="unknown task source 'math'"):
        mix.source("math")
    named = TaskMix(
        TasksConfig(
            sources=(
                SourceConfig(kind="tick"),
                SourceConfig(kind="tick", name="tick_long", max_items=64),
            )
        ),
        TOK,
    )
    assert named.source("tick_long").task(0, "train").uid == "tick_long/train/0"
    with pytest.raises(ValueError, match="distinct `name`"):
        TaskMix(TasksConfig(sources=(SourceConfig(kind="tick"), SourceConfig(kind="tick"))), TOK)
