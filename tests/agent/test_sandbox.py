"""Sandboxes contain what untrusted code tries, say why, reset between uses, and recover."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
from pathlib import Path

import pytest

from rollstream.agent.sandbox import (
    EXECUTOR_UID_OFFSET,
    SandboxLimits,
    SandboxPool,
    process_uid,
)

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1.0, memory_mb=256, max_procs=8, file_size_mb=4)


def _processes_in(programs: range, *, programs_only: bool = False) -> list[int]:
    """The processes of these programs' uids and of their executors' (``EXECUTOR_UID_OFFSET``)."""
    uids = [*programs, *(() if programs_only else (u + EXECUTOR_UID_OFFSET for u in programs))]
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and process_uid(p) in uids]


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
    assert out.error == "write refused: only /work, /tmp and /dev/shm are writable"
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
    run = asyncio.create_task(pool.run("import time; time.sleep(30)"))
    while not _processes_in(range(62000, 62001), programs_only=True):  # it runs
        await asyncio.sleep(0.01)
    # its programs cannot kill it: the host does
    [executor] = set(_processes_in(range(62000, 62001))) - set(
        _processes_in(range(62000, 62001), programs_only=True))
    os.kill(executor, signal.SIGKILL)
    out = await run
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
        assert out.error == "write refused: only /work, /tmp and /dev/shm are writable"
    assert (tmp_path / "data.txt").read_text() == "cached"


def test_bad_limits_and_pool_settings_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="SandboxLimits.cpu_s must be > 0"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match=r"SandboxLimits.file_size_mb \(64\) must be <= disk_mb "
                                         r"\(32\): no file can be larger than the disk"):
        SandboxLimits(file_size_mb=64)
    with pytest.raises(ValueError, match="size must be in 1..1000, got 0"):
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


class EchoServer:
    """A TCP server on the host's loopback that answers in upper case and counts connections."""

    def __init__(self) -> None:
        self.num_connections = 0
        self.closed = asyncio.Event()  # a connection it served has ended

    async def _serve(self, reader, writer) -> None:
        self.num_connections += 1
        while data := await reader.read(1 << 16):
            writer.write(data.upper())
            await writer.drain()
        writer.close()
        self.closed.set()

    async def __aenter__(self):
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()


async def test_allow_net_reaches_the_allowed_endpoint_and_nothing_else():
    async with EchoServer() as allowed, EchoServer() as other, SandboxPool(
            1, limits=LIMITS, uid_base=62040, allow_net=[f"127.0.0.1:{allowed.port}"]) as pool:
        out = await pool.run(
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {allowed.port}), 2)\n"
            "s.sendall(b'ab' * 1_000_000)\n"
            "s.shutdown(socket.SHUT_WR)\n"  # a half-close reaches the server as its end of file
            "got = b''\n"
            "while data := s.recv(1 << 16):\n"
            "    got += data\n"
            "print(len(got), got == b'AB' * 1_000_000)")
        assert out.ok and out.stdout == "2000000 True\n", out.stderr[-300:]
        out = await pool.run("import socket\n"
                             f"socket.create_connection(('127.0.0.1', {other.port}), 2)")
        assert out.exit_code == 1 and "ConnectionRefusedError" in out.stderr
        assert other.num_connections == 0
        out = await pool.run("import socket; socket.create_connection(('192.0.2.1', 80), 2)")
        assert out.error == ("network access refused: the sandbox reaches only "
                             f"127.0.0.1:{allowed.port}")
        assert allowed.num_connections == 1


async def test_allowed_connections_end_with_the_run_that_opened_them():
    async with EchoServer() as server, SandboxPool(
            1, limits=LIMITS, uid_base=62050, allow_net=[f"127.0.0.1:{server.port}"]) as pool:
        holder = ("import socket, time\n"
                  f"s = socket.create_connection(('127.0.0.1', {server.port}))\n"
                  "s.sendall(b'held'); print(s.recv(4).decode(), flush=True); time.sleep(1000)")
        out = await pool.run(
            "import subprocess, sys\n"  # a process left behind, holding its connection open
            f"p = subprocess.Popen([sys.executable, '-c', {holder!r}], stdout=subprocess.PIPE,"
            " start_new_session=True)\n"
            "print(p.stdout.readline().decode().strip())")
        assert out.ok and out.stdout == "HELD\n", out.stderr[-300:]
        await asyncio.wait_for(server.closed.wait(), 5.0)  # killed with the run: closed on the host
        assert (await pool.run("print('next')")).stdout == "next\n"


async def test_net_bridge_close_ends_its_connections_and_removes_its_sockets(tmp_path):
    from rollstream.agent.sandbox_net import NetBridge, parse_allow_net

    async with EchoServer() as server:
        bridge = NetBridge(parse_allow_net([f"127.0.0.1:{server.port}"]), tmp_path / "net")
        await bridge.start()
        [(port, path)] = bridge.sockets()
        assert port == server.port
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"hi")
        assert await reader.readexactly(2) == b"HI"
        await bridge.close()
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # ended on both sides
        await asyncio.wait_for(server.closed.wait(), 5.0)
        assert not (tmp_path / "net").exists()
        assert not [t for t in asyncio.all_tasks() if "NetBridge" in repr(t.get_coro())]
        writer.close()


@pytest.mark.parametrize(("entry", "message"), [
    ("127.0.0.1", r"allow_net\[1\] '127.0.0.1' has no port"),
    ("127.0.0.1:", r"allow_net\[1\] '127.0.0.1:' has no port"),
    ("::1:80", r"allow_net\[1\] '::1:80' has no port"),
    ("127.0.0.1:70000", r"allow_net\[1\] '127.0.0.1:70000': port '70000' is not in 1..65535"),
    ("127.0.0.1:0", r"port '0' is not in 1..65535"),
    ("127.0.0.1:http", r"port 'http' is not in 1..65535"),
    ("localhost:80", r"allow_net\[1\] 'localhost:80': 'localhost' is not an IP address"),
    ("[127.0.0.1]:80", r"only IPv6 addresses go in brackets"),
    ("127.0.0.2:9", r"allow_net\[1\] '127.0.0.2:9': port 9 is already allowed for 127.0.0.1:9"),
])
def test_bad_allow_net_entries_are_clear_errors(entry, message):
    with pytest.raises(ValueError, match=message):
        SandboxPool(1, allow_net=["127.0.0.1:9", entry])


def test_allow_net_entries_parse_to_endpoints():
    from rollstream.agent.sandbox_net import Endpoint, parse_allow_net

    assert parse_allow_net(["127.0.0.1:8080", "[::1]:9000"]) == (
        Endpoint(host="127.0.0.1", port=8080), Endpoint(host="::1", port=9000))
    with pytest.raises(TypeError, match="allow_net must be a list of 'IP:PORT' strings, got str"):
        SandboxPool(1, allow_net="127.0.0.1:8080")


async def test_unshare_backend_contains_limits_and_cleans_up(tmp_path):
    async with EchoServer() as allowed, EchoServer() as other, SandboxPool(
            1, limits=LIMITS, uid_base=62060, backend="unshare",
            allow_net=[f"127.0.0.1:{allowed.port}"]) as pool:
        assert pool.isolation.name == "unshare"
        out = await pool.run("import os, sys; print(os.getcwd(), os.getuid(), sys.stdin.read())",
                             stdin="abc")
        assert out.ok and out.stdout == "/tmp/.sandbox/work 62060 abc\n", out.stderr[-300:]
        # network: the allowed endpoint only
        out = await pool.run("import socket\n"
                             f"s = socket.create_connection(('127.0.0.1', {allowed.port}), 2)\n"
                             "s.sendall(b'hi'); print(s.recv(2).decode())")
        assert out.stdout == "HI\n", out.stderr[-300:]
        out = await pool.run("import socket\n"
                             f"socket.create_connection(('127.0.0.1', {other.port}), 2)")
        assert "ConnectionRefusedError" in out.stderr and other.num_connections == 0
        out = await pool.run("import socket; socket.create_connection(('192.0.2.1', 80), 2)")
        assert out.error.startswith("network access refused: the sandbox reaches only")
        # the limits, set by the same code as for bwrap
        out = await pool.run("import os\nwhile True:\n    os.fork()")
        assert out.error == "process limit of 8 exceeded", (out.error, out.stderr[-300:])
        assert (await pool.run("x = bytearray(1 << 30)")).error == "memory limit of 256 MB exceeded"
        assert (await pool.run("while True: pass")).error == "cpu time limit of 1 s exceeded"
        out = await pool.run("open('big', 'wb').write(b'x' * (8 << 20))")
        assert out.error == "file size limit of 4 MB exceeded"
        # writes: private scratch folders; the host's own are neither seen nor written
        name = f"rollstream-test-{os.getpid()}"
        out = await pool.run(f"open('/tmp/{name}', 'w'); open('/dev/shm/{name}', 'w')\n"
                             f"import os; print(os.path.exists({str(tmp_path)!r}))\n"
                             "open('/usr/evil', 'w')")
        assert out.stdout == "False\n" and "PermissionError" in out.stderr
        assert not Path(f"/tmp/{name}").exists() and not Path(f"/dev/shm/{name}").exists()
        # reset between uses: files and processes
        out = await pool.run("import subprocess\nopen('left', 'w').write('x')\n"
                             "subprocess.Popen(['sleep', '1000'], start_new_session=True)")
        assert out.ok, out.stderr
        out = await pool.run("import os\nprint(os.listdir('.'), os.listdir('/tmp'))\n"
                             "print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
        assert out.stdout == "[] ['.sandbox']\n2\n"  # the executor (its init) and this program
        # a run cancelled mid-way kills the whole namespace
        task = asyncio.create_task(pool.run("import time; time.sleep(60)"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not _processes_in(range(62060, 62061))
        assert (await pool.run("print('fresh')")).stdout == "fresh\n"
        assert pool.num_started == 2
    assert not _processes_in(range(62060, 62061))


def test_backend_choice_and_its_errors(tmp_path, monkeypatch):
    from rollstream.agent.sandbox_isolation import SandboxError, pick_isolation

    assert pick_isolation("auto").name == "bwrap"  # installed here (make test installs it)
    only_unshare = tmp_path / "bin"
    only_unshare.mkdir()
    for tool in ("unshare", "setpriv"):
        (only_unshare / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(only_unshare))
    assert pick_isolation("auto").name == "unshare"
    with pytest.raises(SandboxError, match="need `bwrap`: install it"):
        pick_isolation("bwrap")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SandboxError, match="need bubblewrap or util-linux's unshare"):
        pick_isolation("auto")
    with pytest.raises(ValueError, match="SandboxPool.backend must be one of auto, bwrap, "
                                         "unshare, got 'docker'"):
        SandboxPool(1, backend="docker")
