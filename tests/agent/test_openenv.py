"""OpenEnv environments (``tasks.sources.N.openenv``) against the real ``openenv-core`` package:
an environment written from OpenEnv's server template (``tests/agent/openenv_pkg``) served by
uvicorn on 127.0.0.1, launched and stopped by the run or attached by URL, driven through
OpenEnv's own client. The kit model cannot guess a number on purpose, so the adapter's
mapping is proved with scripted model turns, and a ``rollstream train`` run proves the
plumbing end to end (the environment ends every episode and grades it)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from pathlib import Path

import openenv  # noqa: F401 - the `openenv` extra (make test installs it)
import pytest
import yaml

from rollstream.agent.environment import ModelTurn
from rollstream.agent.episodes import episode_sources
from rollstream.agent.harness import AgentHarness
from rollstream.agent.loop import Budgets
from rollstream.config import load_config
from rollstream.config.schema import TasksConfig
from rollstream.data.ledger import read_ledger
from rollstream.run_files import RunFiles
from rollstream.runtime.build import check_inputs
from rollstream.trajectory import SampleStatus, Task
from tests import warm
from tests.agent.runs import two_step_run

ROOT = Path(__file__).resolve().parents[2]
GUESS_APP = "tests.agent.openenv_pkg.server.app:app"
HOSTILE_APP = "tests.agent.openenv_pkg.server.hostile:app"
SINGLE_APP = "tests.agent.openenv_pkg.server.app:single"
ROWS = [{"id": i, "prompt": f"guess {i % 10}", "target": 40 + i} for i in range(16)]


def _servers(app: str) -> list[int]:
    """Pids of live processes serving ``app`` (what a run must not leave behind)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if app.encode() in argv and b"uvicorn" in argv:
                pids.append(int(entry))
    return pids


def _sources(tmp_path: Path, *openenvs: dict) -> TasksConfig:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return TasksConfig(sources=tuple(
        {"name": f"s{i}", "kind": "jsonl", "path": str(tmp_path / "rows.jsonl"),
         "harness": "agent", "openenv": o} for i, o in enumerate(openenvs)))


def _task(row: dict) -> Task:
    return Task(uid=f"s0/{row['id']}", source="s0", prompt_ids=(1,), prompt_text=row["prompt"],
                reference="", extra={"row": row})


def _turn(text: str, i: int) -> ModelTurn:
    return ModelTurn(text=text, ended=True, turn_index=i)


def _harness(sources: dict) -> AgentHarness:
    """A harness of ``sources``, here only to be closed as a run closes it."""
    budgets = Budgets(max_turns=3, max_turn_tokens=4, max_total_tokens=64)
    return AgentHarness(renderer=None, budgets=budgets,  # type: ignore[arg-type]
                        sources=sources, tool_timeout_s=5.0)


async def test_episodes_run_in_a_server_the_run_launches_on_loopback_and_always_stops(
        tmp_path: Path):
    launched = {"app": GUESS_APP, "observation_field": "hint", "reset_columns": ["target"]}
    sources = episode_sources(_sources(tmp_path, launched))
    assert sources["s0"].gives_reward and not _servers(GUESS_APP)  # nothing starts at build
    harness = _harness(sources)
    try:
        env = sources["s0"].environment(_task(ROWS[2]), tools=None)
        assert await env.reset() == [{"role": "user", "content": "guess 2"}]  # the row's prompt
        url = await sources["s0"].make_environment.server.url()
        assert url.startswith("http://127.0.0.1:") and len(_servers(GUESS_APP)) == 1
        wrong = await env.step(_turn("I say 10", 0))  # the model's text is the action
        assert (wrong.messages, wrong.done) == ([{"role": "user", "content": "higher"}], False)
        right = await env.step(_turn("it is 42", 1))  # the target came from the row's column
        assert (right.done, right.reward, right.messages) == (True, 1.0, [])
        # two episodes at once, each its own session; the second runs out of guesses
        a, b = (sources["s0"].environment(_task(r), tools=None) for r in ROWS[:2])
        await a.reset(), await b.reset()
        assert (await a.step(_turn("99", 0))).messages[0]["content"] == "lower"
        assert (await b.step(_turn("41", 0))).reward == 1.0
        last = await a.step(_turn("no idea", 1))
        assert (last.done, last.reward) == (True, 0.0)
        # a running server attached by URL: used, and left running when its source closes
        attached = episode_sources(_sources(tmp_path, {"url": url, "observation_field": "hint"}))
        env = attached["s0"].environment(_task(ROWS[0]), tools=None)
        await env.reset()
        assert (await env.step(_turn("7", 0))).done  # reset without `target`: the default 7
        await _harness(attached).close()
        assert len(_servers(GUESS_APP)) == 1
    finally:
        await harness.close()
    assert not _servers(GUESS_APP)


async def test_max_sessions_holds_episodes_at_reset_for_a_server_of_one_session(
        tmp_path: Path):
    single = {"app": SINGLE_APP, "observation_field": "hint", "reset_columns": ["target"]}
    sources = episode_sources(_sources(tmp_path, single, single | {"max_sessions": 1}))
    try:
        a, b = (sources["s0"].environment(_task(r), tools=None) for r in ROWS[:2])
        await a.reset()
        # the server closes the connection or sends CAPACITY_REACHED, whichever comes first
        with pytest.raises(RuntimeError, match=r"the reset.*session limit .*max_sessions"):
            await b.reset()  # no cap: the server's own refusal fails the second episode
        await a.close()
        a, b = (sources["s1"].environment(_task(r), tools=None) for r in ROWS[:2])
        await a.reset()
        waiting = asyncio.create_task(b.reset())
        await asyncio.sleep(0.5)
        assert not waiting.done()  # held until the first episode ends
        assert (await a.step(_turn("40", 0))).reward == 1.0
        await asyncio.wait_for(waiting, timeout=30)
        assert (await b.step(_turn("41", 0))).reward == 1.0
    finally:
        await _harness(sources).close()
    assert not _servers(SINGLE_APP)


HOSTILE = [  # an OpenEnv server: what its framework lets through
    ("big", r"1009 \(message too big\)"),  # 64 kB over max_message_bytes = 4096
    ("nohint", "observation_field: the observation's 'hint' is not a string or a number: None"),
    ("list", r"observation_field: .*'hint' is not a string or a number: \[1, 2\]"),
]


async def test_what_an_openenv_server_sends_is_limited_and_checked(tmp_path: Path):
    cfg = {"app": HOSTILE_APP, "observation_field": "hint", "max_message_bytes": 4096,
           "timeout_s": 10}
    sources = episode_sources(_sources(tmp_path, cfg))
    try:
        for i, (asked, error) in enumerate(HOSTILE):
            env = sources["s0"].environment(_task(ROWS[i]), tools=None)
            await env.reset()
            with pytest.raises(Exception, match=error):
                await env.step(_turn(asked, 0))
            await env.close()
        env = sources["s0"].environment(_task(ROWS[0]), tools=None)
        await env.reset()  # a plain step still works on the same server
        assert (await env.step(_turn("fine", 0))).messages == [{"role": "user",
                                                                "content": "plain"}]
    finally:
        await _harness(sources).close()
    assert not _servers(HOSTILE_APP)


RAW = [  # a server that only speaks the protocol's frames (at the process edge): what it says
    ({"observation": [1], "reward": 0, "done": False}, r"observation is not a JSON object"),
    ({"observation": {}, "reward": 0, "done": "yes"}, r"`done` is not a boolean: 'yes'"),
    ({"observation": {}, "reward": float("nan"), "done": True},
     r"`reward` is not a finite number or null: nan"),
    ({"observation": {}, "reward": "1", "done": True}, r"`reward` is not a finite number"),
    ([1, 2], r"step reply is malformed \(AttributeError"),
    ("error", r"server refused the step: 'Server error: x{250,}\.\.\. \(100\d\d\d chars\)$"),
]


async def test_what_any_server_says_is_checked_before_it_is_used(tmp_path: Path):
    from websockets.asyncio.server import serve

    async def answer(ws) -> None:
        async for raw in ws:
            kind = json.loads(raw)["type"]
            if kind == "reset":
                data: object = {"observation": {}, "reward": None, "done": False}
            elif kind == "step":
                data = RAW[int(json.loads(raw)["data"]["message"])][0]
            else:
                return
            if data == "error":  # an error frame of 100 kB
                await ws.send(json.dumps({"type": "error", "data": {"message": "x" * 100_000}}))
                continue
            await ws.send(json.dumps({"type": "observation", "data": data}))

    async with serve(answer, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        sources = episode_sources(_sources(tmp_path, {"url": f"http://127.0.0.1:{port}"}))
        for i, (_, error) in enumerate(RAW):
            env = sources["s0"].environment(_task(ROWS[0]), tools=None)
            await env.reset()
            with pytest.raises(RuntimeError, match=error):
                await env.step(_turn(str(i), 0))
            await env.close()


async def test_a_server_that_cannot_start_fails_with_its_log(tmp_path: Path):
    cfg = {"app": "tests.agent.openenv_pkg.models:GuessAction", "start_timeout_s": 60}
    sources = episode_sources(_sources(tmp_path, cfg))
    env = sources["s0"].environment(_task(ROWS[0]), tools=None)
    with pytest.raises(RuntimeError, match=r"source s0: the OpenEnv server .* exited with "
                                           r"code \d+:\n.*"):
        await env.reset()
    assert sources["s0"].make_environment.server.proc is None


def _source(tmp_path: Path, **fields) -> list[str]:
    (tmp_path / "d.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    entry = {"kind": "jsonl", "path": str(tmp_path / "d.jsonl"), "harness": "agent", **fields}
    return [f"tasks.sources=[{json.dumps(entry)}]", f"run_root={tmp_path}"]


BAD_AT_LOAD = [
    ({"openenv": {}}, r"tasks\.sources\.0\.openenv: name exactly one of `app` .* and `url`"),
    ({"openenv": {"app": GUESS_APP, "url": "http://127.0.0.1:1"}}, r"exactly one of `app`"),
    ({"openenv": {"app": GUESS_APP}, "environment": "m:E"}, r"`environment` and `openenv`"),
    ({"openenv": {"app": GUESS_APP}, "reward": "exact_match"}, r"`reward` and `openenv`"),
    ({"openenv": {"url": "ftp://x"}}, r"sources\.0\.openenv\.url = 'ftp://x': String should"),
    ({"openenv": {"app": GUESS_APP, "reset_columns": ["a.b"]}}, r"are not column names"),
    ({"openenv": {"app": GUESS_APP, "max_message_bytes": 10}},
     r"openenv\.max_message_bytes = 10: .*>= 1024"),
    ({"openenv": {"app": GUESS_APP}, "harness": "openai", "agent": "m:f"},
     r"`openenv` is read by a dataset source with harness: agent"),
]


@pytest.mark.parametrize(("fields", "error"), BAD_AT_LOAD)
def test_openenv_settings_that_contradict_are_refused_at_load(tmp_path: Path,
                                                             fields: dict, error: str):
    with pytest.raises(Exception, match=error):
        load_config(None, _source(tmp_path, **fields))


def test_what_cannot_run_is_refused_when_the_run_is_built_naming_the_field(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    missing = load_config(None, _source(tmp_path, openenv={"app": "tests.nowhere.app:app"}))
    with pytest.raises(ValueError, match=r"tasks\.sources\.0\.openenv: app 'tests\.nowhere"
                                         r"\.app:app': module 'tests\.nowhere\.app' cannot be"):
        check_inputs(missing)
    found = importlib.util.find_spec  # the package not installed: named with its extra
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "openenv" else found(name, *a))
    cfg = load_config(None, _source(tmp_path, openenv={"app": GUESS_APP}))
    with pytest.raises(ValueError, match=r"tasks\.sources\.0\.openenv: needs the "
                                         r"`openenv-core` package .*rollstream\[openenv\]"):
        check_inputs(cfg)


@pytest.mark.slow
def test_rollstream_train_runs_episodes_in_an_openenv_environment(tmp_path: Path,
                                                                  model_dir: Path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    source = {"name": "guess", "kind": "jsonl", "path": str(tmp_path / "rows.jsonl"),
              "columns": {"answer": "target"}, "harness": "agent",
              "openenv": {"app": GUESS_APP, "observation_field": "hint",
                          "reset_columns": ["target"]}}
    cfg = two_step_run(tmp_path, model_dir, "oe", [source], groups_per_step=4)
    (tmp_path / "oe.yaml").write_text(yaml.safe_dump(cfg))
    done = warm.run(["-m", "rollstream.cli", "train", str(tmp_path / "oe.yaml")], cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = read_ledger(RunFiles(tmp_path / "runs" / "oe").ledger)
    assert rows and all(r.status is not SampleStatus.FAILED for r in rows), rows[:2]
    assert any(r.status is SampleStatus.TRAINED for r in rows)
    # the environment ended each episode (a right guess, or its second wrong one) and graded it
    assert all(r.finish_reason in ("done", "max_tokens") for r in rows)
    assert all(r.reward in (0.0, 1.0) and 1 <= r.num_turns <= 2 for r in rows
               if r.finish_reason == "done")
    assert not _servers(GUESS_APP)  # the run stopped the server it launched
