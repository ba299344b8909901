"""``agent.sandbox`` configures the run's sandbox pool: the built-in ``python`` tool, a user
tool that asks for the pool and the built-in ``code`` reward run there, under its limits,
without network, with its artifact folder and the variables it passes."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from rollstream.agent.episodes import episode_sources
from rollstream.agent.sandbox import SandboxLimits
from rollstream.agent.sandbox_shared import install_sandbox
from rollstream.config import ConfigError, load_config
from rollstream.data.sources import source_rewards
from rollstream.reward.registry import Response, build_resolver
from rollstream.runtime.build import check_inputs
from rollstream.trajectory import Task

SANDBOX = ["agent.sandbox.size=2", "agent.sandbox.wall_s=2", "agent.sandbox.cpu_s=1",
           "agent.sandbox.memory_mb=128", "agent.sandbox.max_procs=8"]


def _config(tmp_path: Path, source: dict, *overrides: str):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    entry = {"name": "s", "kind": "jsonl", "path": str(tmp_path / "d.jsonl"), **source}
    return load_config(None, [f"tasks.sources=[{json.dumps(entry)}]", *SANDBOX, *overrides,
                              f"run_root={tmp_path}"])


async def test_the_settings_reach_the_python_tool_and_a_tool_that_asks_for_the_pool(
        tmp_path: Path, monkeypatch):
    artifacts = tmp_path / "art"
    artifacts.mkdir()
    (artifacts / "data.txt").write_text("shared")
    artifacts.chmod(0o755)
    monkeypatch.setenv("ROLLSTREAM_TEST_TOKEN", "passed")
    monkeypatch.setenv("ROLLSTREAM_TEST_SECRET", "kept")
    cfg = _config(tmp_path, {"harness": "agent",
                             "environment": "tests.agent.user_pkg.envs:GuessNumber",
                             "tools": ["python", "tests.agent.user_pkg.tools:Shell"]},
                  f"agent.sandbox.artifacts={artifacts}",
                  "agent.sandbox.pass_env=[ROLLSTREAM_TEST_TOKEN]")
    sandbox = install_sandbox(cfg.agent.sandbox)
    python, shell = episode_sources(cfg.tasks, sandbox)["s"].tools
    try:
        with socket.socket() as server:  # a host service on loopback: not reachable inside
            server.bind(("127.0.0.1", 0))
            server.listen()
            port = server.getsockname()[1]
            out = await python(code=f"import socket; socket.create_connection(('127.0.0.1', "
                                    f"{port}), 2)")
        assert "ConnectionRefusedError" in out and "[exit code 1]" in out
        out = await python(code="import os; print(open('/artifacts/data.txt').read(), "
                                "os.environ.get('ROLLSTREAM_TEST_TOKEN'), "
                                "os.environ.get('ROLLSTREAM_TEST_SECRET'))")
        assert out == "shared passed None"
        out = await python(code="x = bytearray(1 << 30)")
        assert out.endswith("[stopped: memory limit of 128 MB exceeded]"), out
        t0 = time.monotonic()
        out = await shell(code="import time; time.sleep(30)")
        assert out == "|None|timeout: wall time limit of 2 s exceeded"
        assert time.monotonic() - t0 < 6
        assert sandbox.pool is not None and sandbox.pool.limits == SandboxLimits(
            wall_s=2, cpu_s=1, memory_mb=128, max_procs=8)
    finally:
        await sandbox.close()


ADD = "Here it is:\n```python\nimport sys\na, b = map(int, sys.stdin.read().split())\n" \
      "print(a + b)\n```\n"


async def test_the_code_reward_scores_the_share_of_the_rows_tests_passed(tmp_path: Path):
    cfg = _config(tmp_path, {"reward": "code", "reward_kwargs": ["tests"]})
    reward = build_resolver(cfg.reward, source_rewards(cfg.tasks))(
        Task(uid="s/0", source="s", prompt_ids=(1,), prompt_text="p", reference=""))
    sandbox = install_sandbox(cfg.agent.sandbox)

    async def score(text: str, tests, finish_reason: str = "stop") -> float:
        task = Task(uid="s/0", source="s", prompt_ids=(1,), prompt_text="p", reference="",
                    extra={"tests": tests})
        call = reward.call_args(task, [Response(text=text, token_ids=(1,),
                                                finish_reason=finish_reason)])
        return await reward.fn(call.task, call.text, **call.kwargs)

    pairs = [{"stdin": "1 2", "stdout": "3"}, {"stdin": "5 5\n", "stdout": "10\n"},
             {"stdin": "2 2", "stdout": "5"}]
    try:
        assert await score(ADD, pairs) == pytest.approx(2 / 3)
        assert await score(ADD, pairs, finish_reason="length") == 0.0
        assert await score("print(3)", pairs) == 0.0  # no fenced block
        func = "```\ndef add(a, b):\n    return a + b\n```"
        assert await score(func, "assert add(2, 3) == 5") == 1.0
        assert await score(func, "assert add(2, 3) == 6") == 0.0
        t0 = time.monotonic()
        assert await score("```python\nwhile True: pass\n```", "pass") == 0.0  # cpu limit
        assert await score("```python\nx = bytearray(1 << 30)\n```", "pass") == 0.0
        assert time.monotonic() - t0 < 8
        with pytest.raises(ValueError, match=r"tests\[0\] must be \{stdin: str, stdout: str\}"):
            await score(ADD, [{"input": "1 2"}])
    finally:
        await sandbox.close()


def test_sandbox_settings_that_cannot_work_are_refused_naming_the_field(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"agent\.sandbox.*file_size_mb = 64 must be <= "
                                          r"disk_mb = 32"):
        _config(tmp_path, {}, "agent.sandbox.file_size_mb=64")
    with pytest.raises(ConfigError, match=r"allow_net\[0\] 'example.com:80'.*not an IP"):
        _config(tmp_path, {}, "agent.sandbox.allow_net=[example.com:80]")
    with pytest.raises(ConfigError, match=r"agent\.sandbox\.backend"):
        _config(tmp_path, {}, "agent.sandbox.backend=docker")
    cfg = _config(tmp_path, {}, f"agent.sandbox.artifacts={tmp_path / 'none'}")
    with pytest.raises(ValueError, match=r"agent\.sandbox\.artifacts: .* is not a folder"):
        check_inputs(cfg)
    cfg = _config(tmp_path, {}, "agent.sandbox.pass_env=[ROLLSTREAM_TEST_UNSET]")
    with pytest.raises(ValueError, match=r"agent\.sandbox\.pass_env: .*ROLLSTREAM_TEST_UNSET"
                                         r"' is not set"):
        check_inputs(cfg)
    cfg = _config(tmp_path, {"reward": "code"})  # the reward needs the row's tests
    with pytest.raises(TypeError, match=r"needs keyword arguments \['tests'\]"):
        check_inputs(cfg)
    assert os.listdir(tmp_path) == ["d.jsonl"]
