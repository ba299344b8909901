"""The one HTML page behind both the live dashboard and the report.

`render_page` inlines static/app.css and static/app.js into static/page.html together with a
boot object: the dashboard's says "poll these URLs", the report's carries the whole run's data.
So both draw with the same code and neither page loads anything from elsewhere. `payload` is
the data shape the page draws (the dashboard's /api/poll returns it in increments).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from rollstream.monitor.runlog import RunLog, read_config_text, read_summary


def payload(log: RunLog, run_dir: Path | None, *, name: str, metrics_since: int = 0,
            spans_since: int = 0) -> dict[str, Any]:
    """Everything the page draws; metric lines and spans from the given cursors on."""
    metrics, metrics_next = log.records(metrics_since)
    spans, spans_next = log.spans(spans_since)
    summary = read_summary(run_dir)
    return {
        "name": name,
        "state": log.state(),
        "metrics": metrics,
        "metrics_next": metrics_next,
        "spans": spans,
        "spans_next": spans_next,
        "ledger": log.ledger_summary(),
        "config": read_config_text(run_dir),
        "summary": summary,
        "tiles": log.tiles(summary),
        "num_bad_lines": log.num_bad_lines,
    }


def _asset(name: str) -> str:
    return resources.files("rollstream.monitor").joinpath("static", name).read_text("utf-8")


def script_json(obj: Any) -> str:
    """JSON that is safe inside a <script> element (no '</script>' or '<!--' breakouts)."""
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(*, title: str, boot: dict[str, Any]) -> str:
    """The self-contained page: markup, styles, script and the boot object inline."""
    html = _asset("page.html")
    title_text = (title.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))
    parts = {
        "__TITLE__": title_text,
        "/*__CSS__*/": _asset("app.css"),
        "/*__BOOT__*/": f"window.ROLLSTREAM = {script_json(boot)};",
        "/*__JS__*/": _asset("app.js"),
    }
    for marker in parts:
        assert html.count(marker) == 1, f"page.html needs exactly one {marker}"
    # One pass over the template, so data that happens to contain a marker stays as it is.
    return re.sub("|".join(re.escape(m) for m in parts), lambda m: parts[m.group(0)], html)
