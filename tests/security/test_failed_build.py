"""A build that fails closes what it built: engine threads, the run's open files."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
import torch

import rollstream
from rollstream.durable import checkpoint as durable
from tests.security.conftest import small


def _open_files_under(folder: Path) -> list[str]:
    fds = Path("/proc/self/fd")
    found = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


def test_failed_resumes_leave_no_engine_thread_and_no_open_file(run_copy: Path,
                                                                kit_model: Path) -> None:
    """A trainer.pt that is a whole archive but holds another model's optimizer state fails
    when the trainer loads it, after the engines, ledger and metrics were built: three such
    resumes in one process used to leave three engine threads and two open ledgers. Each
    fails naming the file and closes everything."""
    for ckpt in durable.folder(run_copy).iterdir():
        torch.save({"optimizer": {"state": {}, "param_groups": [{"params": [0, 1, 2]}]},
                    "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()},
                   ckpt / durable.TRAINER)
    engines_before = {t.ident for t in threading.enumerate() if t.name.startswith("rollstream-")}
    for _ in range(3):
        with pytest.raises(ValueError, match=r"step_000002: the trainer cannot continue from "
                                             r".*step_000002/trainer.pt"):
            rollstream.run(None, small(run_copy.parent, kit_model, "resume=true"))
        left = [t.name for t in threading.enumerate()
                if t.name.startswith("rollstream-") and t.ident not in engines_before]
        assert left == [] and _open_files_under(run_copy) == []
