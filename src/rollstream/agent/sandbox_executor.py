"""The program that runs inside a sandbox (stdlib only; started by ``agent.sandbox``).

Its one argument is its layout (JSON): ``workdir`` (where programs run), ``scratch`` (the
folders emptied after each run), ``keep`` (paths in them never removed), ``forward`` (``[port,
unix socket]`` pairs: the network allow-list, see ``_forward_allowed``), ``uid`` (the programs'
uid, run as root; else None: its own) and ``nproc`` (their process limit, or None). It reads
one JSON request per line on stdin (``code``, ``stdin``, ``limits``), runs the code in a fresh
interpreter with the limits applied (CPU time, address space, file size, a session of its
own), under the programs' uid and a seccomp filter, and answers one JSON line on stdout: exit
code, stdout and stderr (capped), and why it was stopped, if it was. After every run it kills
every other process of the sandbox (the sandbox has its own PID namespace, where ``kill(-1)``
reaches only its own processes) and empties the scratch folders: the next run starts from a
clean sandbox. The executor serves every program of its sandbox, so no program may touch it:
it is non-dumpable, and programs run under another uid (as root) and a seccomp filter
(``sandbox_confine``).

Run as ``--enter SETUP COMMAND...``, it first prepares the fresh namespaces as their root
(``_enter``: the size-capped folders), then execs ``COMMAND``: the privilege drop and the
executor proper.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
import warnings

try:
    from rollstream.agent import sandbox_confine as confine
except ImportError:  # in a sandbox: the bootstrap (``sandbox_isolation``) defined it from source
    import sandbox_confine as confine  # type: ignore[no-redef]


def _child(code: str, stdin_fd: int, out_w: int, err_w: int, limits: dict, layout: dict,
           program_filter: bytes) -> None:
    """In the forked child: its own session, limits, its uid, redirections, the seccomp filter,
    then a fresh isolated interpreter."""
    try:
        os.setsid()  # a session of its own: it cannot join the executor's process group
        # its own /proc files again (the exec would do it too): the OOM score below
        confine.prctl(confine.PR_SET_DUMPABLE, 1, 0, 0, 0)
        with open("/proc/self/oom_score_adj", "w") as f:  # the OOM killer takes it first
            f.write("1000")
        cpu_s = max(1, math.ceil(limits["cpu_s"]))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        memory = limits["memory_mb"] << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        size = limits["file_size_mb"] << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        if layout["nproc"] is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (layout["nproc"], layout["nproc"]))
        confine.become_program(layout["uid"])
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.chdir(layout["workdir"])
        confine.install_seccomp(program_filter)
        os.execv(sys.executable, [sys.executable, "-I", "-c", code])
    except BaseException as e:  # noqa: BLE001 - the child must never return into the loop
        os.write(err_w, f"sandbox: could not start the program: {e!r}\n".encode())
    finally:
        os._exit(127)


def _read_until(proc_pid: int, fds: list[int], deadline: float, cap: int) -> tuple:
    """Collect the child's output until it exits or ``deadline``; (status, outputs, timed out)."""
    bufs = {fd: bytearray() for fd in fds}
    open_fds, status = list(fds), None
    while True:
        if status is None:
            pid, st = os.waitpid(proc_pid, os.WNOHANG)
            if pid:
                status = st
        if status is not None and not open_fds:
            return status, bufs, False
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            return status, bufs, status is None
        if not open_fds:  # output closed; the child is about to exit
            time.sleep(min(timeout, 0.002))
            continue
        ready, _, _ = select.select(open_fds, [], [], min(timeout, 0.1 if status is None else 0.05))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
            elif len(bufs[fd]) < cap:
                bufs[fd] += chunk[: cap - len(bufs[fd])]
        if status is not None and not ready:
            return status, bufs, False  # exited; a background process may hold the pipes


def _kill_the_rest() -> None:
    """Kill every process of the sandbox but init and this one, and reap our children."""
    me = str(os.getpid())
    for _ in range(50):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        others = [p for p in os.listdir("/proc") if p.isdigit() and p not in ("1", me)]
        if not others:
            return
        time.sleep(0.01)


def _clean(layout: dict) -> None:
    """Empty the scratch folders, as the programs' uid (the owner of what they left, whatever
    its modes: a folder it made unreadable is opened again first)."""
    if layout["uid"] is None:  # one uid: its own
        for folder in layout["scratch"]:
            _empty(folder, layout["keep"])
        return
    pid = os.fork()
    if pid == 0:
        try:
            confine.become_program(layout["uid"])
            for folder in layout["scratch"]:
                _empty(folder, layout["keep"])
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _empty(folder: str, keep: list[str]) -> None:
    try:
        names = os.listdir(folder)
    except PermissionError:
        os.chmod(folder, 0o700)
        names = os.listdir(folder)
    for name in names:
        path = os.path.join(folder, name)
        if path in keep:
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, 0o700)
                _empty(path, keep)
                os.rmdir(path)
            else:
                os.unlink(path)
        except OSError:  # not its own (the keep list's folders' parents): left as they are
            pass


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                up_reader: asyncio.StreamReader, up_writer: asyncio.StreamWriter) -> None:
    """Copy both ways until both sides are done (an end of file is passed on as one, so
    half-closed connections work); a side that fails closes both. Used on both sides of the
    allow-list: here, and on the host (``agent.sandbox_net``)."""

    async def copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(1 << 16):
                sink.write(data)
                await sink.drain()
            if sink.can_write_eof():
                sink.write_eof()
        except OSError:  # reset, or the other direction closed it: the connection is over
            writer.close()
            up_writer.close()

    try:
        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
    finally:
        writer.close()
        up_writer.close()


async def _forward_one(path: str, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(path)
    except OSError:
        writer.close()
        return
    await relay(reader, writer, up_reader, up_writer)


def _forward_allowed(forward: list) -> None:
    """The allow-list, inside: each connection to 127.0.0.1:PORT on the sandbox's own loopback
    is relayed to that endpoint's Unix socket, whose host side relays it to the endpoint (and
    to nothing else). One thread of this process, for every endpoint: it lives as long as
    the sandbox, which ``_kill_the_rest`` would not allow a process to (``Sandbox`` raises the
    process limit by one for it)."""
    if not forward:
        return
    warnings.filterwarnings("ignore", "This process .* is multi-threaded")  # we fork, then exec
    listening, failed = threading.Event(), []

    async def serve() -> None:
        servers = []
        for port, path in forward:
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            servers.append(await asyncio.start_server(
                functools.partial(_forward_one, path), sock=sock))
        listening.set()
        await asyncio.Event().wait()  # until the sandbox ends (a daemon thread)

    def run() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:  # noqa: BLE001 - reported by the thread that waits
            failed.append(e)
            listening.set()

    threading.Thread(target=run, name="allow-net", daemon=True).start()
    listening.wait()
    if failed:
        raise failed[0]


def _loopback_up() -> None:
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = fcntl.ioctl(s, siocgifflags, struct.pack("16s24x", b"lo"))
        flags = struct.unpack_from("16sH", ifreq)[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def _enter(setup: dict) -> None:
    """As root of the new namespaces: one tmpfs of ``disk_bytes`` behind every folder a
    program may write (``scratch``, ``/tmp`` first, and ``work``, owned by ``owner``), so that
    they share its cap; the extra ``tmpfs`` (``[folder, mode]``), the ``binds`` (``[source,
    target, read_only]``, missing folders of the target made) and, if asked, the loopback up."""
    ms_rdonly, ms_nosuid, ms_nodev, ms_remount, ms_bind = 1, 2, 4, 32, 4096
    # opened before a tmpfs hides them: they may live under /tmp
    sources = [(os.open(src, os.O_PATH | os.O_DIRECTORY), dst, ro)
               for src, dst, ro in setup["binds"]]
    tmp, *others = setup["scratch"]
    size = setup["disk_bytes"]  # and an inode per KiB of it: empty files cost memory too
    confine.mount("tmpfs", tmp, "tmpfs", ms_nosuid | ms_nodev,
                  f"size={size},nr_inodes={size >> 10},mode=755")
    work, owner = setup["work"], setup["owner"]
    staged = [(f"{tmp}/.{i}", folder, 0o1777) for i, folder in enumerate(others)]
    if not work.startswith(tmp + "/"):
        staged.append((f"{tmp}/.work", work, 0o755))
    staged.append((f"{tmp}/.tmp", tmp, 0o1777))  # last: it hides the tmpfs's root
    for stage, target, mode in staged:
        os.mkdir(stage)
        os.chmod(stage, mode)
        if target == work and owner is not None:
            os.chown(stage, owner, owner)
        confine.mount(stage, target, None, ms_bind)
    for folder, mode in setup["tmpfs"]:
        confine.mount("tmpfs", folder, "tmpfs", ms_nosuid | ms_nodev, f"mode={mode}")
    if work.startswith(tmp + "/"):
        os.makedirs(work, 0o755)
        if owner is not None:
            os.chown(work, owner, owner)
    for fd, dst, read_only in sources:
        os.makedirs(dst, 0o755, exist_ok=True)
        confine.mount(f"/proc/self/fd/{fd}", dst, None, ms_bind)
        if read_only:  # keeping the flags a user namespace may not drop (nosuid, nodev, ...)
            locked = os.statvfs(dst).f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC
                                               | os.ST_NOATIME | os.ST_NODIRATIME)
            confine.mount("none", dst, None, ms_bind | ms_remount | ms_rdonly | locked)
        os.close(fd)
    if setup["loopback"]:
        _loopback_up()


def _no_route(layout: dict) -> str:
    ports = [port for port, _ in layout["forward"]]
    if not ports:
        return "the sandbox has no network"
    return "the sandbox reaches only " + ", ".join(f"127.0.0.1:{port}" for port in ports)


def _why(status: int | None, timed_out: bool, stderr: str, limits: dict, cpu_used_s: float,
         layout: dict):
    """Why the run was stopped or failed on a limit (None: it ran and exited by itself)."""
    if timed_out:
        return f"timeout: wall time limit of {limits['wall_s']:g} s exceeded"
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used_s >= limits["cpu_s"]):
            return f"cpu time limit of {limits['cpu_s']:g} s exceeded"
        return f"killed by signal {signal.Signals(sig).name}"
    tail = stderr[-2000:]
    *rest, last = [f for f in layout["scratch"] if f not in layout["keep"]]
    no_route, writable = _no_route(layout), f"{', '.join(rest)} and {last}"
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return f"memory limit of {limits['memory_mb']} MB exceeded"
    if "No space left on device" in tail:
        return (f"disk limit of {limits['disk_mb']} MB exceeded (what {writable} hold "
                "together)")
    if "File too large" in tail:
        return f"file size limit of {limits['file_size_mb']} MB exceeded"
    if "Resource temporarily unavailable" in tail and ("fork" in tail or "thread" in tail
                                                        or "BlockingIOError" in tail):
        return f"process limit of {limits['max_procs']} exceeded"
    if "Network is unreachable" in tail:
        return f"network access refused: {no_route}"
    if "Read-only file system" in tail:
        return f"write refused: only {writable} are writable"
    return None


def run_one(request: dict, layout: dict, program_filter: bytes) -> dict:
    limits = request["limits"]
    stdin_path = "/tmp/.stdin"  # unlinked once open: the program sees only its stdin
    with open(stdin_path, "w") as f:
        f.write(request.get("stdin", ""))
    stdin_fd = os.open(stdin_path, os.O_RDONLY)
    os.unlink(stdin_path)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start, cpu_before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(err_r)
        _child(request["code"], stdin_fd, out_w, err_w, limits, layout, program_filter)
    os.close(out_w)
    os.close(err_w)
    os.close(stdin_fd)
    status, bufs, timed_out = _read_until(
        pid, [out_r, err_r], start + limits["wall_s"], limits["max_output_bytes"])
    _kill_the_rest()
    if status is None:
        try:
            status = os.waitpid(pid, 0)[1]
        except ChildProcessError:
            status = None
    os.close(out_r)
    os.close(err_r)
    duration_s = time.monotonic() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_used_s = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime
                                                                 - cpu_before.ru_stime)
    stdout = bufs[out_r].decode(errors="replace")
    stderr = bufs[err_r].decode(errors="replace")
    exit_code = None
    if status is not None and not timed_out:
        exit_code = os.waitstatus_to_exitcode(status)
    _clean(layout)
    return {"exit_code": exit_code, "stdout": stdout, "stderr": stderr,
            "error": _why(status, timed_out, stderr, limits, cpu_used_s, layout),
            "duration_s": duration_s, "cpu_s": cpu_used_s}


def main() -> None:
    if sys.argv[1] == "--enter":
        _enter(json.loads(sys.argv[2]))
        os.execv(sys.argv[3], sys.argv[3:])
    # first: no process of its uid may trace it or read its memory
    confine.prctl(confine.PR_SET_DUMPABLE, 0, 0, 0, 0)
    layout = json.loads(sys.argv[1])
    _forward_allowed(layout["forward"])
    # after the allow-list's thread started: its id is known
    program_filter = confine.seccomp_filter(confine.protected_ids())
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing else may write on the reply channel
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        reply = run_one(json.loads(line), layout, program_filter)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
