"""A user's own environment, OpenAI-SDK agent and tools (``tests/agent/user_pkg``), named by
import path in YAML and trained by ``rollstream train``, or passed as objects to
``rollstream.run``; one batch mixes the environment's episodes, the agent's and single-turn
rows. The kit model cannot write tool calls: the environment runs its tool itself and its
episodes end by its guess budget, the agent calls the tool through its session, so the
plumbing is proved whatever the model writes. Every name or signature that cannot work is
refused at load, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import rollstream
from rollstream.config import ConfigError, load_config
from rollstream.data.ledger import read_ledger
from rollstream.data.ledger_row import LedgerRow
from rollstream.run_files import RunFiles
from rollstream.runtime.build import check_inputs
from rollstream.trajectory import SampleStatus
from tests import warm
from tests.agent.runs import two_step_run
from tests.agent.user_pkg import agents, envs, tools

ROOT = Path(__file__).resolve().parents[2]
PKG = "tests.agent.user_pkg"
GUESS = [{"id": i, "prompt": f"guess {i % 10}", "target": 40 + i, "answer": "x"}
         for i in range(24)]
PLAIN = [{"id": i, "prompt": f"T{100 + i}#01=", "answer": f"{100 + i}/01"} for i in range(24)]


def _sources(folder: Path, named: bool) -> list[dict]:
    """Three sources: the environment's, the SDK agent's and single-turn rows (JSONL files in
    ``folder``); ``named``: the environment, agent and tools by import path."""
    paths = {}
    for name, rows in (("guess", GUESS), ("sdk", GUESS), ("plain", PLAIN)):
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    guess = {"name": "guess", "kind": "jsonl", "path": str(paths["guess"]),
             "environment_kwargs": {"max_guesses": 2}}
    sdk = {"name": "sdk", "kind": "jsonl", "path": str(paths["sdk"])}
    if named:
        guess |= {"harness": "agent", "environment": f"{PKG}.envs:GuessNumber",
                  "tools": [f"{PKG}.tools:Length"]}
        sdk |= {"harness": "openai", "agent": f"{PKG}.agents:guess",
                "tools": [f"{PKG}.tools:Length"]}
    return [guess, sdk, {"name": "plain", "kind": "jsonl", "path": str(paths["plain"])}]


def _config(tmp_path: Path, model_dir: Path, named: bool) -> dict:
    return two_step_run(tmp_path, model_dir, "mine", _sources(tmp_path, named),
                        groups_per_step=6, mix="weighted")


def _check_mixed_run(run: Path) -> None:
    """Each source trained: the environment's episodes ended by its guess budget and graded
    by it, the agent's through the proxy (its tool calls recorded), single-turn rows as one
    request."""
    rows = read_ledger(RunFiles(run).ledger)
    by_source: dict[str, list[LedgerRow]] = {}
    for r in rows:
        by_source.setdefault(r.task_uid.split("/")[0], []).append(r)
    assert set(by_source) == {"guess", "sdk", "plain"}, sorted(by_source)
    for name, got in by_source.items():
        assert all(r.status is not SampleStatus.FAILED for r in got), (name, got[:2])
        assert any(r.status is SampleStatus.TRAINED for r in got), name
    assert {r.finish_reason for r in by_source["guess"]} <= {"done", "max_tokens"}
    # its model turns: two guesses (max_guesses), or one right one
    assert all(r.reward in (0.0, 1.0) and r.num_turns in (1, 2) for r in by_source["guess"])
    assert all(r.num_turns in (1, 2) for r in by_source["sdk"])
    assert all(r.num_turns == 0 for r in by_source["plain"])  # one request, no turns


@pytest.mark.slow
def test_yaml_names_a_user_environment_agent_and_tool_and_rollstream_train_trains_them(
        tmp_path: Path, model_dir: Path):
    cfg = _config(tmp_path, model_dir, named=True)
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(cfg))
    done = warm.run(["-m", "rollstream.cli", "train", str(tmp_path / "mine.yaml")], cwd=ROOT,
                    timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    run = tmp_path / "runs" / "mine"
    assert json.loads(RunFiles(run).summary.read_text())["steps"] == 2
    _check_mixed_run(run)


@pytest.mark.slow
def test_rollstream_run_takes_the_environment_agent_and_tools_as_objects(
        tmp_path: Path, model_dir: Path):
    cfg = _config(tmp_path, model_dir, named=False)
    summary = rollstream.run(cfg, environments={"guess": envs.GuessNumber},
                             agents={"sdk": agents.guess},
                             tools={"guess": [tools.Length], "sdk": [tools.Length]})
    assert summary["steps"] == 2
    run = tmp_path / "runs" / "mine"
    _check_mixed_run(run)
    saved = yaml.safe_load((run / "config.yaml").read_text())["tasks"]["sources"]
    assert (saved[0]["harness"], saved[0]["environment"]) == ("agent",
                                                              f"{PKG}.envs:GuessNumber")
    assert (saved[1]["harness"], saved[1]["agent"]) == ("openai", f"{PKG}.agents:guess")
    assert saved[0]["tools"] == saved[1]["tools"] == [f"{PKG}.tools:Length"]


def _source(tmp_path: Path, **fields) -> list[str]:
    (tmp_path / "d.jsonl").write_text(json.dumps(GUESS[0]) + "\n")
    entry = {"kind": "jsonl", "path": str(tmp_path / "d.jsonl"), **fields}
    return [f"tasks.sources=[{json.dumps(entry)}]"]


BAD_AT_BUILD = [
    ({"harness": "agent", "environment": f"{PKG}.nowhere:Env"},
     r"tasks\.sources\.0\.environment: environment .*cannot import module"),
    ({"harness": "agent", "environment": f"{PKG}.envs:Missing"},
     r"tasks\.sources\.0\.environment: .*has no attribute 'Missing'"),
    ({"harness": "agent", "environment": f"{PKG}.envs:NoStep"},
     r"tasks\.sources\.0\.environment: .*has no reset\(\) and step"),
    ({"harness": "agent", "environment": f"{PKG}.envs:NoRow"},
     r"tasks\.sources\.0\.environment: .*cannot be called as \(row=\.\.\."),
    ({"harness": "agent", "environment": f"{PKG}.envs:GuessNumber",
      "environment_kwargs": {"colour": 1}},
     r"tasks\.sources\.0\.environment: .*environment_kwargs \['colour'\]"),
    ({"harness": "agent", "environment": f"{PKG}.envs:GuessNumber", "reward": "exact_match"},
     r"tasks\.sources\.0\.reward: the environment .* grades its episodes"),
    ({"harness": "openai", "agent": f"{PKG}.agents:not_async"},
     r"tasks\.sources\.0\.agent: agent .* must be an `async def`"),
    ({"harness": "openai", "agent": f"{PKG}.agents:two_args"},
     r"tasks\.sources\.0\.agent: .*cannot be called as \(session, task, sampling\)"),
    ({"harness": "openai", "agent": f"{PKG}.agents:guess", "tools": ["calculator", "search"]},
     r"tasks\.sources\.0\.tools\.1: tool 'search' is neither a built-in"),
    ({"harness": "openai", "agent": f"{PKG}.agents:guess",
      "tools": [f"{PKG}.tools:not_a_tool"]},
     r"tasks\.sources\.0\.tools\.0: tool .* made 'tools have.*which is not a tool"),
    ({"harness": "openai", "agent": f"{PKG}.agents:guess", "tools": ["calculator", "calculator"]},
     r"tasks\.sources\.0\.tools: two tools share a name"),
    ({"harness": "openai", "agent": f"{PKG}.agents:guess", "tool_parser": f"{PKG}.tools:Length"},
     r"tasks\.sources\.0\.tool_parser: .*has no parse\(text\) and render"),
]


@pytest.mark.parametrize(("fields", "error"), BAD_AT_BUILD)
def test_what_cannot_run_is_refused_when_the_run_is_built_naming_the_field(
        tmp_path: Path, fields: dict, error: str):
    cfg = load_config(None, [*_source(tmp_path, **fields), f"run_root={tmp_path}"])
    with pytest.raises((ValueError, TypeError), match=error):
        check_inputs(cfg)
    assert not (tmp_path / "default").exists()


BAD_AT_LOAD = [
    ({"harness": "agent"}, r"harness agent needs `environment`"),
    ({"harness": "openai"}, r"harness openai needs `agent`"),
    ({"harness": "agent", "environment": "envs.GuessNumber"},
     r"environment 'envs\.GuessNumber': harness agent takes an import path module:name"),
    ({"harness": "agent", "environment": "envs:Guess Number"},
     r"tasks\.sources\.0\.environment = 'envs:Guess Number': String should match pattern"),
    ({"harness": "openai", "agent": "a:b", "environment": "a:c"},
     r"`environment` is read by harness agent"),
    ({"tools": ["calculator"]}, r"`tools` is read only by a source whose tasks are episodes"),
    ({"harness": "agent", "environment": "a:b", "tool_parser": "json"},
     r"tasks\.sources\.0\.tool_parser = 'json': String should match pattern"),
    ({"harness": "agent", "environment": "a:b", "reward_kwargs": ["row"]},
     r"keyword 'row' is the whole row"),
]


@pytest.mark.parametrize(("fields", "error"), BAD_AT_LOAD)
def test_settings_that_contradict_are_refused_at_load(tmp_path: Path, fields: dict,
                                                      error: str):
    with pytest.raises(ConfigError, match=error):
        load_config(None, _source(tmp_path, **fields))


def test_objects_that_cannot_be_named_are_refused_naming_the_argument(tmp_path: Path):
    class Local(envs.GuessNumber):
        pass

    base = {"tasks": {"sources": [{"name": "g", "kind": "jsonl", "path": "x"}]}}
    with pytest.raises(ConfigError, match=r"environments\['g'\]: .*top level of a module"):
        rollstream.build_config(base, environments={"g": Local})
    with pytest.raises(ConfigError, match=r"agents\['nope'\] is for a source that"):
        rollstream.build_config(base, agents={"nope": agents.guess})
    with pytest.raises(ConfigError, match=r"tools\['g'\]: is a str, not a list"):
        rollstream.build_config(base, tools={"g": "calculator"})
    named = {"tasks": {"sources": [{"name": "g", "kind": "jsonl", "path": "x",
                                    "harness": "agent", "environment": "a:b"}]}}
    with pytest.raises(ConfigError, match=r"tasks\.sources\.0\.environment is 'a:b' and"):
        rollstream.build_config(named, environments={"g": envs.GuessNumber})
