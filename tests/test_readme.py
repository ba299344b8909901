"""The docs' Rewards example (docs/datasets.md) runs as written, and a new user's reward sees
what they expect.

The ``my_rewards.py`` block is written to a folder on ``sys.path`` (as a user's module would
be), imported, and graded through the real grader pool (its worker processes import it too)
on a tick answer decoded by the kit tokenizer loaded from disk, as a run loads it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rollstream.config import load_config
from rollstream.data.mix import TaskMix
from rollstream.data.sources import source_rewards
from rollstream.models.folder_check import save_char_tokenizer
from rollstream.reward import GraderPool, build_resolver, decode_response

DATASETS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "datasets.md"


def _python_blocks(section: str) -> list[str]:
    text = DATASETS_PAGE.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


async def test_the_readme_reward_example_runs_and_sees_an_exact_match(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module_block, script_block = _python_blocks("Rewards")
    assert module_block.startswith("# my_rewards.py\n")
    (tmp_path / "my_rewards.py").write_text(module_block)
    monkeypatch.syspath_prepend(str(tmp_path))
    my_rewards = importlib.import_module("my_rewards")
    compile(script_block, "docs script", "exec")  # the run script is valid Python

    save_char_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    one = "reward.num_workers=1"
    by_name = load_config(None, [one, "tasks.sources=[{kind: tick}]", "reward.name=partial_credit"])
    by_path = load_config(
        None, [one, "tasks.sources=[{kind: tick, reward: 'my_rewards:finished_exact'}]"])
    task = TaskMix(by_name.tasks, tok).next_task()
    answer = tok.encode(task.reference, add_special_tokens=False)
    eos = tok.eos_token_id
    correct = decode_response(tok, [*answer, eos], finish_reason="stop")
    assert correct.text == task.reference  # no "<|endoftext|>" for the reward to trip on
    wrong = decode_response(tok, [*answer[:-1], eos], finish_reason="stop")
    capped = decode_response(tok, answer, finish_reason="length")

    pools = [GraderPool(c.reward, build_resolver(c.reward, source_rewards(c.tasks)))
             for c in (by_name, by_path)]
    try:
        partial, finished = pools
        assert (await partial.grade(task, correct)).reward == 1.0  # the new user's exact match
        assert (await partial.grade(task, wrong)).reward == 0.25
        assert (await finished.grade(task, correct)).reward == 1.0
        assert (await finished.grade(task, capped)).reward == 0.0  # asked for finish_reason
    finally:
        for pool in pools:
            pool.close()
    assert my_rewards.partial_credit(task, correct.text + "\n") == 1.0
