"""Sandboxes contain what untrusted code tries, say why, reset between uses, and recover."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from rollstream.agent.sandbox import SandboxLimits, SandboxPool

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1.0, memory_mb=256, max_procs=8, file_size_mb=4)


def _processes_in(uids: range) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid in uids:
                    found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.fixture
async def pool():
    async with SandboxPool(2, limits=LIMITS, uid_base=62000) as pool:
        yield pool
    assert not _processes_in(range(62000, 62002)), "sandbox processes left behind"


async def test_runs_python_with_stdin_in_a_private_workdir(pool):
    out = await pool.run("import os, sys; print(os.getcwd(), sys.stdin.read().upper())",
                         stdin="abc")
    assert out.ok and out.stdout == "/work ABC\n"
    out = await pool.run("raise SystemExit(3)")
    assert out.exit_code == 3 and out.error is None and not out.ok


async def test_no_network_out_and_no_host_loopback(pool):
    with socket.socket() as server:  # a host service on loopback: the sandbox cannot see it
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        out = await pool.run(f"import socket; socket.create_connection(('127.0.0.1', {port}), 2)")
        assert out.exit_code == 1 and "ConnectionRefusedError" in out.stderr
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()
    out = await pool.run("import socket; socket.create_connection(('192.0.2.1', 80), 2)")
    assert out.error == "network access refused: the sandbox has no network"


async def test_fork_bomb_stops_at_the_process_limit(pool):
    out = await pool.run("import os\nwhile True:\n    os.fork()")
    assert out.error == "process limit of 8 exceeded", (out.error, out.stderr[-300:])
    assert (await pool.run("print('after')")).stdout == "after\n"  # the pool recovers


async def test_memory_cpu_and_wall_time_are_limited(pool):
    out = await pool.run("x = bytearray(1 << 30)")
    assert out.error == "memory limit of 256 MB exceeded"
    out = await pool.run("while True: pass")
    assert out.error == "cpu time limit of 1 s exceeded" and out.exit_code is not None
    out = await pool.run("import time; time.sleep(60)")
    assert out.error == "timeout: wall time limit of 3 s exceeded" and out.exit_code is None
    assert out.duration_s < 5.0


async def test_writes_only_inside_its_dirs_and_files_are_size_limited(pool, tmp_path):
    out = await pool.run("open('/usr/evil', 'w')")
    assert out.error == "write refused: only /work and /tmp are writable"
    # the host's folders are not there at all
    out = await pool.run(f"import os; print(os.path.exists({str(tmp_path)!r}))")
    assert out.stdout == "False\n"
    out = await pool.run("open('big', 'wb').write(b'x' * (8 << 20))")
    assert out.error == "file size limit of 4 MB exceeded"


async def test_reset_between_uses_files_and_processes(tmp_path):
    async with SandboxPool(1, limits=LIMITS, uid_base=62010) as pool:
        out = await pool.run("import subprocess\nopen('left', 'w').write('x')\n"
                             "open('/tmp/left', 'w').write('x')\n"
                             "subprocess.Popen(['sleep', '1000'], start_new_session=True)")
        assert out.ok, out.stderr
        out = await pool.run("import os\nprint(os.listdir('.'), os.listdir('/tmp'))\n"
                             "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))")
        listing, pids = out.stdout.splitlines()
        assert listing == "[] []"
        assert len(eval(pids)) == 3  # bwrap's init, the executor and this program
        assert pool.num_started == 1  # the same warm sandbox
    assert not _processes_in(range(62010, 62011))


async def test_a_killed_executor_is_replaced(pool):
    out = await pool.run("import os, signal; os.kill(os.getppid(), signal.SIGKILL)")
    assert out.exit_code is None and "sandbox died" in out.error
    outs = await asyncio.gather(*(pool.run(f"print({i})") for i in range(4)))
    assert [o.stdout for o in outs] == [f"{i}\n" for i in range(4)]
    assert pool.num_started == 3  # two warm ones and the replacement


async def test_cancelled_run_kills_its_sandbox():
    async with SandboxPool(1, limits=LIMITS, uid_base=62020) as pool:
        task = asyncio.create_task(pool.run("import time; time.sleep(60)"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not _processes_in(range(62020, 62021))
        assert (await pool.run("print('fresh')")).stdout == "fresh\n"


async def test_artifacts_are_shared_read_only(tmp_path: Path):
    (tmp_path / "data.txt").write_text("cached")
    if os.geteuid() == 0:  # programs run under uids of their own
        with pytest.raises(ValueError, match="must be readable by others"):
            SandboxPool(1, artifacts=tmp_path)  # pytest makes it 0700
    tmp_path.chmod(0o755)
    async with SandboxPool(1, limits=LIMITS, artifacts=tmp_path, uid_base=62030) as pool:
        out = await pool.run("print(open('/artifacts/data.txt').read())")
        assert out.stdout == "cached\n"
        out = await pool.run("open('/artifacts/data.txt', 'w').write('changed')")
        assert out.error == "write refused: only /work and /tmp are writable"
    assert (tmp_path / "data.txt").read_text() == "cached"


def test_bad_limits_and_pool_settings_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="SandboxLimits.cpu_s must be > 0"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match="size must be >= 1"):
        SandboxPool(0)
    with pytest.raises(ValueError, match="is not a folder"):
        SandboxPool(1, artifacts=tmp_path / "missing")


async def test_python_tool_runs_parsed_calls_concurrently_and_reports_limits(pool):
    from rollstream.agent.sandbox import PythonTool
    from rollstream.agent.tools import HermesToolParser, ToolCall, ToolManager, render_tool_call

    manager = ToolManager([PythonTool(pool=pool)], timeout_s=30.0)
    calls = [ToolCall(id=f"call_{i}", name="python", arguments={"code": code})
             for i, code in enumerate(["print(sum(range(10)))", "import time; time.sleep(1)",
                                       "while True: pass", "1/0"])]
    turn = "Let me compute.\n" + "\n".join(render_tool_call(c) for c in calls)
    parsed = HermesToolParser().parse(turn)
    assert parsed.calls == calls and not parsed.errors
    results = await manager.run(parsed.calls)
    assert all(r.ok for r in results)  # the programs' failures are answers, not failed calls
    assert [r.content for r in results[:3]] == [
        "45", "", "[stopped: cpu time limit of 1 s exceeded]"]
    assert "ZeroDivisionError" in results[3].content and "[exit code 1]" in results[3].content
    assert results[0].duration_s < 2.0
