"""Limits hold per sandbox, not per process: memory and processes over all of a sandbox's
processes (a cgroup), the bytes it may write over all its folders (one size-capped tmpfs), and
what a tool's output may put in front of the tokenizer."""

from __future__ import annotations

import json
import logging

import pytest

from rollstream.agent.sandbox import PythonTool, SandboxLimits, SandboxPool
from rollstream.agent.tools import ToolManager
from rollstream.trajectory import ToolCall
from tests.security.sandbox_unprivileged import run_unprivileged

# eight children, each holding 200 MB (under its own address-space limit of 256 MB) until every
# one of them holds it or was killed; then they are released and the parent counts those that
# were still alive
EIGHT_CHILDREN = r"""
import os, select, time
release_r, release_w = os.pipe()
children = {}
for i in range(8):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(release_w)
        held = bytearray(200 << 20)
        for page in range(0, len(held), 4096):
            held[page] = 1
        os.write(w, b"h")
        os.read(release_r, 1)
        os._exit(0)
    os.close(w)
    children[pid] = r
state = {}
while len(state) < len(children):
    for pid, r in children.items():
        if pid not in state and select.select([r], [], [], 0)[0]:
            state[pid] = "held" if os.read(r, 1) else "killed"
    time.sleep(0.01)
os.close(release_w)
print("children that held to the end:",
      sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 for pid in children))
"""
SIXTY_FILES = r"""
for i in range(60):  # 1 MB each, in the working directory and /tmp
    with open(f"/tmp/{i}" if i % 2 else str(i), "wb") as f:
        f.write(b"x" * (1 << 20))
"""


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
async def test_memory_is_bounded_over_all_of_a_sandboxes_processes(backend):
    limits = SandboxLimits(wall_s=20.0, cpu_s=10.0, memory_mb=256, max_procs=16)
    async with SandboxPool(1, limits=limits, backend=backend, uid_base=62300) as pool:
        out = await pool.run(EIGHT_CHILDREN)  # 1,678 MB together without a cgroup
        assert "children that held to the end: 1\n" in out.stdout, out.stdout
        assert out.error == "memory limit of 256 MB exceeded", (out.error, out.stderr[-500:])
        assert pool.limits_enforced_by in ("cgroup v1", "cgroup v2")
        again = await pool.run("print('served')")  # the executor was spared
        assert again.stdout == "served\n" and pool.num_started == 1


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
async def test_what_a_sandbox_writes_is_bounded_over_all_its_folders(backend):
    limits = SandboxLimits(wall_s=10.0, cpu_s=5.0, file_size_mb=1)  # disk_mb: 32 by default
    async with SandboxPool(1, limits=limits, backend=backend, uid_base=62310) as pool:
        out = await pool.run(SIXTY_FILES)
        assert out.error is not None and out.error.startswith("disk limit of 32 MB exceeded")
        assert "No space left on device" in out.stderr
        # emptied after the run: the next program has the whole of it again
        out = await pool.run("open('big', 'wb').write(b'x' * (1 << 20)); print('ok')")
        assert out.stdout == "ok\n", out.stderr[-500:]


async def test_a_program_cannot_make_namespaces_past_the_disk_cap():
    """A user namespace of its own would let a program mount a tmpfs of any size."""
    program = r"""
import ctypes, json, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
tried = {"unshare": libc.unshare(0x10000000 | 0x00020000)}  # CLONE_NEWUSER | CLONE_NEWNS
tried["errno"] = os.strerror(ctypes.get_errno())
tried["unshare -Urm"] = subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode
thread = threading.Thread(target=print)  # threads and processes still start: libc falls
thread.start()                           # back from clone3 (refused) to clone
thread.join()
tried["subprocess"] = subprocess.run(["true"]).returncode
print(json.dumps(tried))
"""
    async with SandboxPool(1, limits=SandboxLimits(wall_s=10.0), uid_base=62330) as pool:
        out = await pool.run(program)
    tried = json.loads(out.stdout.splitlines()[-1])
    assert tried["unshare"] == -1 and tried["errno"] == "Operation not permitted", out.stdout
    assert tried["unshare -Urm"] != 0 and tried["subprocess"] == 0, out.stdout


def test_without_a_cgroup_the_pool_warns_once_naming_the_rlimits():
    script = """
import json, logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("rollstream").addHandler(Keep())
from rollstream.agent.sandbox import SandboxPool
pool = SandboxPool(2)
print(json.dumps([pool.limits_enforced_by, records]))
"""
    done = run_unprivileged(script)  # another user may not make cgroups here
    assert done.returncode == 0, done.stderr[-2000:]
    enforced_by, records = json.loads(done.stdout)
    assert enforced_by == "rlimit"
    assert len(records) == 1 and "the limits are per-process rlimits" in records[0]


async def test_a_tools_output_is_cut_before_it_is_tokenized(caplog):
    caplog.set_level(logging.WARNING)
    limits = SandboxLimits(wall_s=10.0, cpu_s=5.0, max_output_bytes=1 << 20)
    async with SandboxPool(1, limits=limits, uid_base=62320) as pool:
        # at its cap, every byte written as a 6-byte JSON escape: the reply still comes back
        out = await pool.run("import sys; sys.stdout.write('\\0' * (2 << 20)); "
                             "sys.stderr.write('\\0' * (2 << 20)); sys.exit(1)")
        assert len(out.stdout) == len(out.stderr) == 1 << 20
        tools = ToolManager([PythonTool(pool=pool)], timeout_s=20.0, max_output_chars=1000)
        [result] = await tools.run([ToolCall(id="c0", name="python",
                                             arguments={"code": "print('y' * 100_000)"})])
    assert result.ok and result.content.startswith("y" * 1000)
    assert result.content.endswith("[output cut: 99000 more characters]")
    assert len(result.content) < 1100


def test_the_run_config_sets_the_tool_output_cut():
    from types import SimpleNamespace

    from pydantic import ValidationError

    from rollstream.agent.harness import AgentHarness
    from rollstream.config.tasks import AgentConfig

    assert AgentConfig().max_tool_output_chars == 16384
    with pytest.raises(ValidationError, match="max_tool_output_chars"):
        AgentConfig(max_tool_output_chars=0)
    source = SimpleNamespace(tool_list=list)
    harness = AgentHarness(renderer=None, budgets=None, sources={"s": source},
                           tool_timeout_s=1.0, max_tool_output_chars=10)
    assert harness.tools["s"].max_output_chars == 10
    with pytest.raises(ValueError, match="max_output_chars must be >= 1, got 0"):
        ToolManager([], timeout_s=1.0, max_output_chars=0)


def test_cgroup_v2_files_where_it_offers_memory_and_pids(tmp_path):
    """These machines have v1; the v2 files, on a folder laid out as a v2 cgroup is."""
    from rollstream.agent.sandbox_cgroup import CgroupRoots, SandboxCgroup, _v2

    own = tmp_path / "service"
    own.mkdir()
    (own / "cgroup.controllers").write_text("cpu memory pids\n")
    (own / "cgroup.subtree_control").write_text("cpu\n")
    roots = _v2([(str(tmp_path), "/", "cgroup2", {"rw"})], {"": "/service"})
    assert roots == CgroupRoots(version=2, memory=own, pids=own) and roots.name == "cgroup v2"
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"  # handed down
    cgroup = SandboxCgroup(roots, "sandbox-0")
    cgroup.create()
    for name, value in [("memory.current", "1000"), ("memory.swap.max", "max"),
                        ("pids.current", "3"), ("memory.events", "low 0\noom_kill 2\n"),
                        ("pids.events", "max 1\n")]:
        (cgroup.memory / name).write_text(value)
    cgroup.limit(memory_bytes=1 << 20, num_procs=8)
    assert (cgroup.memory / "memory.max").read_text() == str(1000 + (1 << 20))
    assert (cgroup.memory / "memory.swap.max").read_text() == "0"
    assert (cgroup.pids / "pids.max").read_text() == "11"
    assert cgroup.refusals() == (2, 1)
    (own / "cgroup.controllers").write_text("cpu hugetlb\n")
    with pytest.raises(OSError, match="offers cpu hugetlb, not memory and pids"):
        _v2([(str(tmp_path), "/", "cgroup2", {"rw"})], {"": "/service"})
