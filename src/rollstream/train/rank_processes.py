"""The fsdp trainer's ranks as spawned processes of the controller's, one pipe each: the
:class:`~rollstream.train.fsdp.Ranks` transport of ``runtime.kind: embedded``.

Rendezvous through a file store in a temporary folder (one host). A rank sends each reply
(or its error's traceback) down its pipe; a rank whose process ends (its sentinel is ready)
without answering died, and its exit code says how. The ranks are daemon processes, so
garbage collection or the interpreter's exit stops them if :meth:`ProcessRanks.close` was
not called.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollstream.train.fsdp import (
    DEATH_GRACE_S,
    TrainerRankDied,
    rank_failed,
    run_command,
    start_rank,
)


def _rank_main(rank: int, world_size: int, store: str, device: str, kwargs: dict[str, Any],
               conn: Connection) -> None:
    """A rank process: build the rank's trainer, then run the driver's calls until it
    closes the pipe. An error is sent back with its traceback (the driver ends every rank)."""
    try:
        trainer = start_rank(rank, world_size, device, kwargs, init_method=f"file://{store}")
        conn.send(("ok", None))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the driver is gone
                break
            if msg is None:
                break
            conn.send(("ok", run_command(trainer, *msg)))
        dist.destroy_process_group()
    except BaseException:  # a fault boundary: the driver raises it and ends every rank
        conn.send(("error", traceback.format_exc()))


class ProcessRanks:
    """``world_size`` spawned rank processes (``name`` ``rollstream-fsdp-<rank>``) with every
    rank's trainer built."""

    def __init__(self, world_size: int, device: str, kwargs: dict[str, Any]) -> None:
        if device == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"train.fsdp.world_size = {world_size} with device cuda needs "
                             f"as many GPUs; {torch.cuda.device_count()} found")
        self._folder = folder = tempfile.mkdtemp(prefix="rollstream-fsdp-")  # the store
        ctx = mp.get_context("spawn")
        self.procs, self._conns = [], []
        for rank in range(world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, daemon=True, name=f"rollstream-fsdp-{rank}",
                               args=(rank, world_size, os.path.join(folder, "store"), device,
                                     kwargs, theirs))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self._conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._conns, folder)
        try:
            self._replies()  # every rank built its shard
        except BaseException:
            self.kill()
            raise

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        for conn in self._conns:
            try:
                conn.send((name, args))
            except OSError:  # BrokenPipeError: a rank died since the last call
                self._raise_death(wait_s=DEATH_GRACE_S)
                raise
        return self._replies()

    def kill(self) -> None:
        for proc in self.procs:
            proc.terminate()
        self._finalizer()

    def close(self) -> None:
        self._finalizer()

    def _replies(self) -> Any:
        """Every rank's reply to the last call (rank 0's result); a rank that failed or died
        raises."""
        replies: dict[int, Any] = {}
        waiting = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while waiting:
            ready = wait([*waiting, *sentinels])
            for conn in [c for c in ready if c in waiting]:  # before deaths: an error's reason
                rank = waiting.pop(conn)
                try:
                    status, out = conn.recv()
                except (EOFError, OSError):  # it died before it could answer (reset pipe)
                    self._raise_death(wait_s=DEATH_GRACE_S)
                    raise
                if status == "error":
                    # after a peer's death a rank fails in its collective: the death is the cause
                    self._raise_death(wait_s=DEATH_GRACE_S)
                    raise rank_failed(rank, out)
                replies[rank] = out
            ended = [r for s, r in sentinels.items() if s in ready]
            if ended:
                for r in ended:  # its pipe closes before its exit code can be read
                    self.procs[r].join(timeout=DEATH_GRACE_S)
                self._raise_death()
                raise RuntimeError(f"fsdp rank {ended[0]} ended without answering")  # exit 0
        return replies[0]

    def _raise_death(self, wait_s: float = 0.0) -> None:
        """Raise :class:`TrainerRankDied` if a rank process was killed or crashed (a rank
        that raised reports it and exits 0), waiting up to ``wait_s`` for one to be."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs)
                    if p.exitcode not in (None, 0)]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if dead:
            raise TrainerRankDied(*dead[0])


def _stop(procs: list[Any], conns: list[Connection], folder: str) -> None:
    """End the ranks: ask, then wait a little, then terminate (and kill) what is left."""
    for conn in conns:
        try:
            conn.send(None)
        except (BrokenPipeError, OSError):
            pass
    for proc in procs:
        proc.join(timeout=10)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    shutil.rmtree(folder, ignore_errors=True)
