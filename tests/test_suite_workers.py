"""`make test` runs two pytest-xdist workers with ``--dist loadgroup``, and tests/conftest.py
gives each test its group: every test that starts vLLM servers or Ray clusters on one
worker, one after another, and each other module whole on one worker. Checked on a small
suite of its own run the way `make test` runs, so that a pytest or pytest-xdist release
that loses the groups (pytest 9.2's node ids did) fails here instead of scattering the real
suite's modules (and its shared vLLM server) over both workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"test_a.py": "", "test_b.py": "",
           "test_ray_one.py": "pytestmark = pytest.mark.ray\n",
           "test_vllm_one.py": "pytestmark = pytest.mark.vllm\n"}


def test_each_module_and_every_server_test_stay_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    ray\n    vllm\n")
    for name, mark in MODULES.items():
        tests = "".join(f"def test_{i}():\n    time.sleep(0.05)\n\n\n" for i in range(4))
        (tmp_path / name).write_text(f"import time\n\nimport pytest\n\n{mark}\n\n{tests}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
         "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, module in re.findall(r"\[(gw\d)\] .*PASSED (test_\w+\.py)::", done.stdout):
        workers["servers" if "_one" in module else module].add(worker)
    assert set(workers) == {"test_a.py", "test_b.py", "servers"}, done.stdout
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert len(re.findall(r"PASSED", done.stdout)) == 16
