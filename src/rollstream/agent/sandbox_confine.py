"""What keeps a sandboxed program off its executor, and the system calls the executor's
first step makes as root of its namespaces (stdlib only, like ``sandbox_executor``, which
runs it inside the sandbox).

Run as another user, a program has the executor's uid: the executor makes itself non-dumpable
(no ptrace, no /proc/<pid>/mem or environ for its uid) and each program starts under the
seccomp filter built here with ctypes (the executor imports nothing outside the standard
library). Run as root the uids differ, and the filter is there all the same.
"""

from __future__ import annotations

import functools
import os

PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAP_AMBIENT = 4, 38, 22, 47
PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 4, 2
# per architecture: its audit arch; syscalls refused outright; the signal syscalls (and
# prlimit64: another process's limits, same uid) with the arguments that name a process; clone
# and unshare, refused with a namespace flag
SYSCALLS = {
    "x86_64": (0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
                            "pidfd_send_signal": 424, "pidfd_getfd": 438, "process_madvise": 440,
                            "setns": 308},
               {62: (0,), 200: (0,), 234: (0, 1), 129: (0,), 297: (0, 1), 302: (0,)},
               {"clone": 56, "unshare": 272}),
    "aarch64": (0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
                             "pidfd_send_signal": 424, "pidfd_getfd": 438,
                             "process_madvise": 440, "setns": 268},
                {129: (0,), 130: (0,), 131: (0, 1), 138: (0,), 240: (0, 1), 261: (0,)},
                {"clone": 220, "unshare": 97}),
}
CLONE3 = 435  # its flags are in memory, out of a filter's reach: ENOSYS, and libc falls back
CLONE_NEW = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NEWTIME = 0x80  # unshare only: in clone's flags these bits are the exit signal
X32_SYSCALL_BIT = 0x40000000
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, RET|K
RET_ALLOW, RET_EPERM, RET_ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38


def _refuse_when(nr: int, checks: list[tuple[int, int, list[int]]]) -> list[tuple]:
    """Syscall ``nr`` refused when one of ``checks`` (argument, jump op, values) holds, else
    allowed; any other syscall goes on to the next block."""
    body = [insn for arg, op, values in checks
            for insn in ((LD_ABS, 0, 0, 16 + 8 * arg), *((op, "deny", 0, v) for v in values))]
    return [(LD_ABS, 0, 0, 0), (JEQ, 0, len(body) + 1, nr), *body, (RET, 0, 0, RET_ALLOW)]


def seccomp_filter(protected: list[int]) -> bytes:
    """A BPF program (``struct sock_filter[]``) that refuses, with EPERM: ``ptrace``, access to
    another process's memory, ``pidfd_send_signal`` (a pidfd may be any /proc/<pid> folder),
    the signal syscalls and ``prlimit64`` when a pid argument is one of ``protected`` (the
    executor's pid, threads, process group as ``-pgid``, the namespace's init and ``-1``, all
    processes), and new namespaces (a user namespace of its own would let a program mount a
    tmpfs past the sandbox's disk cap). Only a pid's low 32 bits are compared, as the kernel
    reads it; other ABIs (i386, x32) get EPERM for every call."""
    import struct

    machine = os.uname().machine
    if machine not in SYSCALLS:
        raise OSError(f"sandbox: no seccomp filter for {machine} (x86_64 and aarch64 only)")
    arch, refused, signalling, namespaces = SYSCALLS[machine]
    pids = [pid & 0xFFFFFFFF for pid in protected]
    code: list[tuple] = [(LD_ABS, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, RET_EPERM),
                         (LD_ABS, 0, 0, 0), (JGE, "deny", 0, X32_SYSCALL_BIT),
                         (JEQ, "enosys", 0, CLONE3)]
    code += [(JEQ, "deny", 0, nr) for nr in refused.values()]
    for nr, args in signalling.items():
        code += _refuse_when(nr, [(arg, JEQ, pids) for arg in args])
    code += _refuse_when(namespaces["clone"], [(0, JSET, [CLONE_NEW])])
    code += _refuse_when(namespaces["unshare"], [(0, JSET, [CLONE_NEW | CLONE_NEWTIME])])
    code += [(RET, 0, 0, RET_ALLOW), (RET, 0, 0, RET_ENOSYS), (RET, 0, 0, RET_EPERM)]
    labels = {"deny": len(code) - 1, "enosys": len(code) - 2}
    assert labels["deny"] < 256, "a jump of BPF goes at most 255 instructions"
    return b"".join(struct.pack("HBBI", op, labels[jt] - i - 1 if jt in labels else jt, jf, k)
                    for i, (op, jt, jf, k) in enumerate(code))


@functools.cache
def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def prctl(*args: int) -> None:
    ctypes, libc = _libc()
    if libc.prctl(*(ctypes.c_ulong(a) for a in args)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl{args}: {os.strerror(errno)}")


def install_seccomp(program: bytes) -> None:
    """In the program's process, after its last privileged step: ``program`` from then on."""
    ctypes, libc = _libc()
    buffer = ctypes.create_string_buffer(program, len(program))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(program) // 8, ctypes.addressof(buffer))
    prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"seccomp: {os.strerror(errno)}")


def protected_ids() -> list[int]:
    """The ids a program may not signal: this process (each of its threads), its process
    group, the namespace's init (the sandbox dies with it), and every process at once."""
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    return sorted({os.getpid(), *tids, -os.getpgid(0), 1, -1})


def become_program(uid: int | None) -> None:
    """Run as root, the executor keeps CAP_SETUID/SETGID/KILL as ambient capabilities: here
    the child takes the programs' uid and gives every capability up before it execs."""
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    ctypes, libc = _libc()
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # none effective/permitted/inheritable
        raise OSError(ctypes.get_errno(), "capset")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None):
    ctypes, libc = _libc()
    if libc.mount(source.encode(), target.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")
