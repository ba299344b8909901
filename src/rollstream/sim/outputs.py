"""What ``rollstream sim ... --out DIR`` writes: the results as JSON, PNG plots and one HTML page.

``DIR/result.json`` holds every number; ``DIR/index.html`` is self-contained (styles inline,
plots embedded as data URIs) with the comparison table across the scenario's modes (sync /
one_step / async-k / partial rollout / predictive dispatch, whatever the scenario lists);
``DIR/*.png`` are the plots. Plots need matplotlib, an optional extra (``pip install
rollstream[sim]``): without it the page and the JSON are still written and the page says why
there is no plot. The study (``sim/study.py``) writes its page with the same helpers.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

NO_PLOTS = ("no plots: matplotlib is not installed (it is an optional extra: "
            "pip install 'rollstream[sim]')")

Plot = Callable[[Any], None]  # draws on a matplotlib Figure


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def save_png(path: Path, draw: Plot, *, size: tuple[float, float] = (10, 7)) -> Path:
    """Draw a figure with ``draw(fig)`` and save it as ``path`` (matplotlib's Agg backend:
    no display needed)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    draw(fig)
    fig.savefig(path, dpi=100)
    return path


def table_html(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page_html(title: str, parts: Sequence[str], pngs: Sequence[Path]) -> str:
    """A self-contained page: ``parts`` (HTML) then each PNG inline, or why there is none."""
    imgs = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{html.escape(p.name)}'
        "</figcaption></figure>" for p in pngs) or f"<p><em>{html.escape(NO_PLOTS)}</em></p>"
    style = ("body{font:14px system-ui,sans-serif;margin:2em;max-width:1100px}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
             "padding:3px 8px;text-align:right}th{background:#f3f3f3}"
             "img{max-width:100%}figure{margin:1em 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{style}</style></head><body><h1>{html.escape(title)}</h1>"
            + "".join(parts) + imgs + "</body></html>")


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2))
    return path


# ---- one scenario: the modes side by side -------------------------------------------------
COLUMNS = ("mode", "step s", "engine util", "tail share", "trained tok/s", "vs first",
           "gen tok/s", "staleness max", "dropped stale", "filtered", "interrupts", "wall s")


def mode_rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, r in result["rows"].items():
        tail = r["tail_share_mean"]
        rows.append([name, f"{r['step_s_mean']:,.1f}", f"{r['engine_utilization']:.2f}",
                     "-" if tail is None else f"{tail:.2f}", f"{r['trained_tok_s']:,.0f}",
                     "-" if r["vs_first"] is None else f"{r['vs_first']:.2f}",
                     f"{r['gen_tok_s']:,.0f}", str(r["staleness_max"]),
                     str(r["statuses"].get("dropped_stale", 0)),
                     str(r["statuses"].get("filtered", 0)), str(r["interrupts"]),
                     f"{r['wall_s']:.1f}"])
    return rows


def _draw_modes(result: dict[str, Any]) -> Plot:
    rows = result["rows"]
    names = list(rows)

    def draw(fig: Any) -> None:
        panels = [("trained tokens/s (simulated)", "trained_tok_s"),
                  ("mean step time, simulated s", "step_s_mean"),
                  ("engine utilization", "engine_utilization"),
                  ("tail share (last 10% of a step's samples)", "tail_share_mean")]
        for ax, (title, key) in zip(fig.subplots(2, 2).flat, panels, strict=True):
            values = [rows[n][key] or 0.0 for n in names]
            bars = ax.bar(range(len(names)), values, color="#4a7ab5")
            ax.bar_label(bars, fmt="{:,.2f}" if max(values, default=0) < 10 else "{:,.0f}",
                         fontsize=8)
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
            ax.set_title(title, fontsize=10)
    return draw


def _draw_staleness(result: dict[str, Any]) -> Plot:
    rows = result["rows"]

    def draw(fig: Any) -> None:
        ax = fig.subplots()
        ages = sorted({int(k) for r in rows.values() for k in r["staleness_hist"]})
        width = 0.8 / max(len(rows), 1)
        for i, (name, r) in enumerate(rows.items()):
            n = max(sum(r["staleness_hist"].values()), 1)
            ax.bar([a + i * width for a in ages],
                   [r["staleness_hist"].get(str(a), 0) / n for a in ages], width, label=name)
        ax.set_xticks([a + 0.4 - width / 2 for a in ages], [str(a) for a in ages])
        ax.set_xlabel("staleness of a trained sample (trainer step - oldest token version)")
        ax.set_ylabel("share of trained samples")
        ax.legend(fontsize=8)
    return draw


def write_scenario_outputs(result: dict[str, Any], out_dir: Path) -> Path:
    """``result`` (``report.run_scenario``) as ``result.json``, PNGs and ``index.html`` in
    ``out_dir``; returns the page's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "result.json", result)
    pngs = []
    if have_matplotlib():
        pngs = [save_png(out_dir / "comparison.png", _draw_modes(result)),
                save_png(out_dir / "staleness.png", _draw_staleness(result), size=(9, 4.5))]
    sc, prof = result["scenario"], result["profile"]
    intro = (f"<p>{sc['engines']} simulated engines, profile <b>{html.escape(prof['name'])}"
             f"</b>, {sc['steps']} steps of {sc['groups_per_step']} groups x "
             f"{sc['group_size']}; simulated in {result['wall_s']:.1f} s of wall time. "
             "Ratios (<i>vs first</i>) are trained tokens/s over the first mode's.</p>")
    page = out_dir / "index.html"
    page.write_text(page_html(f"rollstream sim {sc['name']}",
                              [intro, table_html(COLUMNS, mode_rows(result))], pngs))
    return page
