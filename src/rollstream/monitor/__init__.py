"""Monitoring: one metrics registry, terminal progress, the live dashboard and the run report.

    metrics.Metrics      record / observe / span / ledger -> run-dir JSONL, Prometheus, trackers
    progress.Progress    rich progress bar (plain lines off a terminal)
    dashboard.Dashboard  FastAPI + uvicorn on 127.0.0.1, a page that polls and redraws
    report.write_report  run_dir/report.html, the same page with the data embedded

Submodules are imported where used, so ``import rollstream.monitor`` stays light (the
dashboard pulls in FastAPI and uvicorn). docs/monitoring.md lists the metric names.
"""
