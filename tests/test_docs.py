"""The docs site builds with ``mkdocs build --strict``: a broken link or anchor, a page left
out of the nav, a missing included example or a failing reference hook fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "WARNING" not in log, log
    site = tmp_path / "site"
    # the generated reference pages hold what `rollstream config` and `--help` print
    assert "checkpoint_every" in (site / "reference" / "config" / "index.html").read_text()
    assert "rollstream export" in (site / "reference" / "cli" / "index.html").read_text()
