"""``rollstream report RUN_DIR``: a self-contained HTML report of a run.

The report is the dashboard page with the run's data embedded instead of polled: reward and
throughput curves, histograms, the rollout timeline, the ledger summary, summary.json and the
resolved config, in one file that makes no network request (styles, script and data inline).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from rollstream.monitor.page import payload, render_page
from rollstream.monitor.runlog import RunDirReader
from rollstream.run_files import RunFiles


def build_report(run_dir: Path) -> str:
    """The report page for `run_dir` (ValueError when it is not a run directory)."""
    reader = RunDirReader(Path(run_dir))
    log = reader.refresh()
    name = reader.run_dir.resolve().name
    data = payload(log, reader.run_dir, name=name)
    generated = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return render_page(title=f"rollstream report · {name}",
                       boot={"mode": "static", "data": data, "generated": generated})


def write_report(run_dir: Path) -> Path:
    """Write ``run_dir/report.html`` and return its path."""
    html = build_report(run_dir)
    out = RunFiles(run_dir).report
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a report
    return out
