"""A program cannot take over its executor, which serves every later program of its sandbox:
ptrace, the executor's memory through /proc or process_vm_readv, signals to it and changing
its resource limits all fail;
both backends, run as root (two uids) and as another user (one uid: the executor is
non-dumpable and programs run under a seccomp filter)."""

from __future__ import annotations

import json

import pytest

from rollstream.agent.sandbox import SandboxLimits, SandboxPool
from tests.security.sandbox_unprivileged import run_in_sandboxes_unprivileged

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2.0, memory_mb=256, max_procs=8, file_size_mb=4)
# what a program tries on its parent, the executor; each entry: what the call returned
ATTACK = r"""
import ctypes, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
executor, tried = os.getppid(), {}

def call(name, result):
    tried[name] = "ok" if result >= 0 else os.strerror(ctypes.get_errno())

call("ptrace attach", libc.ptrace(16, executor, 0, 0))  # PTRACE_ATTACH
call("ptrace seize", libc.ptrace(0x4206, executor, 0, 0))  # PTRACE_SEIZE
for mode in ("r+b", "rb"):
    try:
        open(f"/proc/{executor}/mem", mode, buffering=0).close()
        tried[f"open mem {mode}"] = "ok"
    except OSError as e:
        tried[f"open mem {mode}"] = e.strerror

class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

buffer = ctypes.create_string_buffer(8)
local, remote = Iovec(ctypes.addressof(buffer), 8), Iovec(0x400000, 8)
call("process_vm_readv", libc.process_vm_readv(executor, ctypes.byref(local), 1,
                                               ctypes.byref(remote), 1, 0))
for name, pid, sig in [("SIGSTOP", executor, signal.SIGSTOP), ("SIGKILL", executor,
                       signal.SIGKILL), ("SIGKILL to all", -1, signal.SIGKILL),
                       ("SIGKILL to its group", -os.getpgid(executor), signal.SIGKILL)]:
    call(f"kill {name}", libc.kill(pid, sig))
x86 = os.uname().machine == "x86_64"
call("tgkill SIGKILL", libc.syscall(234 if x86 else 131, executor, executor, signal.SIGKILL))
# the kernel reads a pid as 32 bits: high bits set must not slip past the filter
call("kill SIGSTOP, high bits", libc.syscall(62 if x86 else 129,
                                             ctypes.c_long((1 << 32) | executor), signal.SIGSTOP))
no_files = (ctypes.c_uint64 * 2)(0, 0)  # RLIMIT_NOFILE 0 would break the executor's next run
call("prlimit", libc.syscall(302 if x86 else 261, executor, 7, no_files, None))
print(json.dumps(tried))
"""
REFUSED = {"Operation not permitted", "Permission denied"}


def _refused(stdout: str) -> dict[str, str]:
    tried = json.loads(stdout)
    assert len(tried) == 12, tried
    return {name: result for name, result in tried.items() if result not in REFUSED}


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
async def test_as_root_a_program_cannot_trace_read_or_signal_its_executor(backend):
    async with SandboxPool(1, limits=LIMITS, backend=backend, uid_base=62200) as pool:
        out = await pool.run(ATTACK)
        assert out.ok, (out.error, out.stderr[-800:])
        assert _refused(out.stdout) == {}
        # two uids: the program's and the executor's
        out = await pool.run("import os; print(os.getuid(), *[line.split()[1] for line in "
                             "open(f'/proc/{os.getppid()}/status') if line.startswith('Uid')])")
        program, executor = map(int, out.stdout.split())
        assert program == 62200 and executor != program, out.stderr[-500:]
        assert pool.num_started == 1  # the same executor served both


def test_as_another_user_a_program_cannot_trace_read_or_signal_its_executor():
    runs = run_in_sandboxes_unprivileged(ATTACK)
    assert set(runs) == {"bwrap", "unshare"}
    for backend, run in runs.items():
        assert run["stdout"], (backend, run["stderr"])
        assert _refused(run["stdout"]) == {}, backend
        assert (run["again"], run["num_started"]) == ("still served\n", 1), backend
