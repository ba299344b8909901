"""Built-in rewards, the registry (signatures checked once, sendable to workers) and the
resolver a run builds."""

from __future__ import annotations

import pytest

from rollstream.config.schema import RewardConfig
from rollstream.models.tokenizer import EOS, IM_END, build_char_tokenizer
from rollstream.reward import (
    Response,
    Reward,
    build_resolver,
    decode_response,
    get_reward,
    known_rewards,
    register_reward,
)
from rollstream.reward.builtins import exact_match, math_answer, math_reward
from rollstream.trajectory import Task
from tests.reward import worker_rewards


def task(reference: str, source: str = "test") -> Task:
    return Task(uid="t", source=source, prompt_ids=(1,), prompt_text="q", reference=reference)


@pytest.mark.parametrize(
    ("text", "finish_reason", "expected"),
    [
        ("42", "stop", 1.0),
        ("  42 \n", "stop", 1.0),
        ("42", "length", 0.0),  # capped: never finished its answer
        ("042", "stop", 0.0),
        ("4 2", "stop", 0.0),
        ("42 43", "stop", 0.0),
        ("", "stop", 0.0),
    ],
)
def test_exact_match(text: str, finish_reason: str, expected: float) -> None:
    assert exact_match(task(" 42"), text, finish_reason=finish_reason) == expected


@pytest.mark.parametrize(
    ("reference", "text", "expected"),
    [
        ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
        ("1/2", "The answer is $\\frac{1}{2}$.", 1.0),
        ("12", "so 3 * 4 = 12", 1.0),
        ("12", "13", 0.0),
        ("12", "no idea", 0.0),
        ("-7", "$-7$", 1.0),
    ],
)
def test_math(reference: str, text: str, expected: float) -> None:
    assert math_reward(task(reference), text, finish_reason="stop") == expected
    assert math_reward(task(reference), text, finish_reason="length") == 0.0


def test_math_answer_wants_a_properly_ended_final_value() -> None:
    t = task("33")
    assert math_answer(t, "33", finish_reason="stop") == 1.0
    assert math_answer(t, "33.0", finish_reason="stop") == 1.0  # equivalence, not string match
    assert math_answer(t, "33", finish_reason="length") == 0.0
    for wrong in ("34", "12+7*3", "-33", "3 3", "", "33=33", "x" * 40):
        assert math_answer(t, wrong, finish_reason="stop") == 0.0, wrong
    neg = task("-6")
    assert math_answer(neg, "-6", finish_reason="stop") == 1.0
    assert math_answer(neg, "6", finish_reason="stop") == 0.0


def test_the_real_tokenizer_decodes_a_tick_answer_to_exactly_the_reference() -> None:
    tok = build_char_tokenizer()
    reference = "517/07 518/06 519/05 520/04 521/03 522/02 523/01"
    ids = [*tok.encode(reference, add_special_tokens=False), tok.eos_token_id]
    response = decode_response(tok, ids, finish_reason="stop")
    assert response.text == reference and EOS not in response.text
    assert response.token_ids == tuple(ids)
    assert get_reward("exact_match").score(task(reference), response) == 1.0
    # special tokens the model may emit are invisible to rewards, as in TRL
    im_end = tok.convert_tokens_to_ids(IM_END)
    with_im_end = [*ids[:-1], im_end, ids[-1]]
    assert decode_response(tok, with_im_end, finish_reason="stop").text == reference


def test_response_checks_its_finish_reason() -> None:
    with pytest.raises(ValueError, match="'stop' or 'length'"):
        Response(text="x", token_ids=(1,), finish_reason="abort")


def test_registry_checks_signatures_once_at_registration() -> None:
    assert get_reward("exact_match").fn is exact_match
    assert get_reward("exact_match").wants == ("finish_reason",)
    assert get_reward("math_answer").fn is math_answer
    with pytest.raises(ValueError, match="unknown reward 'nope'; known rewards: .*exact_match"):
        get_reward("nope")

    def mine(task: Task, text: str) -> float:
        return 0.5

    register_reward("test_builtins.mine")(mine)  # registering checks only the signature
    assert "test_builtins.mine" in known_rewards()
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_builtins.mine")(exact_match)
    with pytest.raises(TypeError, match="cannot be called as fn\\(task, text\\)"):
        register_reward("test_builtins.one_arg")(lambda task: 1.0)

    @register_reward("test_builtins.extra")  # a required keyword: a dataset column must give it
    async def extra(task: Task, text: str, *, rubric: str) -> float:
        return 1.0

    assert get_reward("test_builtins.extra").needs == ("rubric",)
    with pytest.raises(TypeError, match=r"needs keyword arguments \['rubric'\] that no dataset "
                                        r"column gives"):
        get_reward("test_builtins.extra").with_columns(())
    assert get_reward("test_builtins.extra").with_columns(("rubric",)).columns == ("rubric",)
    with pytest.raises(TypeError, match=r"cannot take the dataset columns \['rubric', 'x'\]"):
        get_reward("test_builtins.extra").with_columns(("rubric", "x"))

    with pytest.raises(ValueError, match="without ':'"):
        register_reward("a:b")
    with pytest.raises(TypeError):
        get_reward(3)  # type: ignore[arg-type]


def test_keywords_are_read_from_the_signature() -> None:
    async def a(task: Task, text: str, *, token_ids: tuple[int, ...]) -> float:
        return 1.0

    def b(task: Task, text: str, finish_reason: str = "stop", **other: object) -> float:
        return 1.0

    ra = get_reward(a)
    assert ra.is_async and ra.wants == ("token_ids",)
    resp = Response(text="x", token_ids=(3, 4), finish_reason="length")
    assert ra.kwargs(task("x"), resp) == {"token_ids": (3, 4)}
    assert ra.score(task("x"), resp) == 1.0  # async, called in this process
    assert Reward.of(b, "b").wants == ("finish_reason",)
    assert get_reward(worker_rewards.wants_everything).kwargs(task("x"), resp) == {
        "finish_reason": "length", "token_ids": (3, 4)}
    assert get_reward(worker_rewards.pid).wants == ()


def test_a_sync_reward_that_cannot_reach_a_worker_fails_at_load_time() -> None:
    def local(task: Task, text: str) -> float:
        return 1.0

    for fn in (local, lambda task, text: 1.0):
        with pytest.raises(TypeError, match="cannot be sent to a reward worker process.*"
                                            "top level of an importable module"):
            get_reward(fn)

    async def local_async(task: Task, text: str) -> float:  # runs in the loop: fine
        return 1.0

    assert get_reward(local_async).is_async


def test_import_paths() -> None:
    reward = get_reward("tests.reward.worker_rewards:pid")
    assert reward.fn is worker_rewards.pid and not reward.is_async
    assert get_reward("rollstream.reward.builtins:exact_match").name == "exact_match"
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'.*PYTHONPATH"):
        get_reward("no_such_mod:fn")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        get_reward("tests.reward.worker_rewards:nope")


def test_build_resolver() -> None:
    auto = build_resolver(RewardConfig(), {"tick": ("exact_match", ()),
                                                "math": ("math_answer", ())})
    assert auto(task("1", "tick")).fn is exact_match
    assert auto(task("1", "math")).fn is math_answer
    with pytest.raises(KeyError, match="no reward for task source 'other'"):
        auto(task("1", "other"))
    one = build_resolver(RewardConfig(name="math"), {"tick": ("exact_match", ())})
    assert one(task("1", "tick")).fn is math_reward and one(task("1", "x")).fn is math_reward
    with pytest.raises(ValueError, match="reward.name: unknown reward 'nope'; known rewards"):
        build_resolver(RewardConfig(name="nope"), {})
    with pytest.raises(ValueError, match="tasks source 'ds' .*unknown reward 'nope'"):
        build_resolver(RewardConfig(), {"tick": ("exact_match", ()), "ds": ("nope", ())})
