"""The ``rollstream`` command line.

    rollstream train CONFIG.yaml [key=value ...]   run RL post-training (the main job)
    rollstream train CONFIG.yaml --resume          continue runs/<name> from its checkpoint
    rollstream bench NAME [--json OUT]             run a benchmark: prints a table, writes JSON
    rollstream report RUN_DIR                      write a self-contained HTML report of a run

Heavy modules are imported inside each command so that ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

BENCHES = {
    "engine": "local engine vs HF generate: fixed-length batches 1/16/64 and a long-tail mix",
    "modes": "sync / one_step / async (k=1,2,4) with and without partial rollout",
    "peers": "rollstream async vs TRL's GRPOTrainer on the same model and task",
    "vllm": "local engine vs a real vLLM server; weight-sync time",
    "resume": "a run killed with SIGKILL 5 times and resumed: lost, duplicated, repeated",
    "soak": "resident memory over a long run (--minutes, default 20): RSS slope in MB/h",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollstream",
        description="Asynchronous RL post-training for LLMs, built around rollout infrastructure.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser(
        "train",
        help="run RL post-training from a YAML config",
        description="Run RL post-training. The run directory (runs/<name>) receives the resolved "
        "config, metrics.jsonl, the ledger, checkpoints and summary.json.",
    )
    t.add_argument("config", type=Path, help="YAML config file (see examples/)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4 rollout.mode=sync")
    t.add_argument("--resume", action="store_true",
                   help="continue runs/<name> from its newest durable checkpoint (= resume=true)")

    b = sub.add_parser(
        "bench",
        help="run a benchmark (prints a table, writes JSON)",
        description="Benchmarks measure; they do not assert. Available:\n"
        + "\n".join(f"  {k:8s} {v}" for k, v in BENCHES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    b.add_argument("--json", dest="json_out", type=Path, default=None, help="write results here")
    b.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    b.add_argument("--minutes", type=float, default=None,
                   help="length of `soak` (default 20 minutes; --quick: 2)")
    b.add_argument("--config", type=Path, default=None,
                   help="base YAML of `modes` (default examples/tick_long.yaml, the long-tail "
                   "shape; examples/tick.yaml is the demo's)")

    r = sub.add_parser(
        "report",
        help="write a self-contained HTML report of a run directory",
        description="Write RUN_DIR/report.html with reward and throughput curves, the staleness "
        "histogram, the rollout timeline, the resolved config and the ledger summary.",
    )
    r.add_argument("run_dir", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rollstream.config import ConfigError

    try:
        if args.command == "train":
            from rollstream.config import load_config
            from rollstream.runtime.train import RunStopped, run_training

            overrides = [*args.overrides, *(["resume=true"] if args.resume else [])]
            cfg = load_config(args.config, overrides)
            try:
                run_training(cfg)
            except RunStopped as e:
                print(f"rollstream: the run stopped before its last step: {e}", file=sys.stderr)
                return 1
        elif args.command == "bench":
            extra = {}
            if args.config is not None:
                if args.name != "modes":
                    raise ValueError(f"bench {args.name}: --config is an option of `modes` only")
                extra["config"] = args.config
            if args.minutes is not None:
                if args.name != "soak":
                    raise ValueError(f"bench {args.name}: --minutes is an option of `soak` only")
                extra["minutes"] = args.minutes
            mod = importlib.import_module(f"rollstream.bench.{args.name}")
            mod.main(json_out=args.json_out, quick=args.quick, **extra)
        elif args.command == "report":
            from rollstream.monitor.report import write_report

            print(write_report(args.run_dir))
    except (ConfigError, ValueError) as e:
        print(f"rollstream: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
