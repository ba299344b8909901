"""The ``rollstream`` command line.

    rollstream train CONFIG.yaml [key=value ...]   run RL post-training (the main job)
    rollstream train CONFIG.yaml --resume          continue runs/<name> from its checkpoint
    rollstream bench NAME [--json OUT]             run a benchmark: prints a table, writes JSON
    rollstream report RUN_DIR                      write a self-contained HTML report of a run
    rollstream engines RUN_DIR [--drain ID]        a live run's engines; drain / undrain one,
                                                   add N (--add N), remove one (--remove ID)
    rollstream proxy MODEL_DIR [--out FILE]        an OpenAI-compatible endpoint for agents
    rollstream export RUN_DIR [--step N] --out DIR [--dtype bfloat16]
                                                   a run's model folder for other tools, checked
    rollstream sim SCENARIO.yaml [--json OUT] [--out DIR] [--study 8,...,1024]
                                                   the real schedulers on simulated engines
    rollstream config [SECTION]                    the config tree: defaults and what each means

Heavy modules are imported inside each command so that ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from rollstream.logs import LEVELS, configure

BENCHES = {
    "agentic": "multi-turn episodes with slow heavy-tailed tools: batched by turn vs async",
    "dispatch": "a synchronous rollout's makespan: engine queues vs fifo vs longest-first; "
                "then training runs: mixture error, waste, length bias",
    "engine": "local engine vs HF generate: fixed-length batches 1/16/64 and a long-tail mix",
    "modes": "sync / one_step / async (k=1,2,4) with and without partial rollout",
    "models": "the model shapes users train: LoRA's adapter-only weight sync vs full weights "
              "(bytes, seconds) and a LoRA run vs a full one (trained samples/s) on the "
              "embedded engine; MoE routing replay vs a bf16 engine",
    "prefix": "the local engine's prefix cache vs none on groups of 8 sharing a long prompt: "
              "generated tok/s and its bound 1/(1 - p*h); shared-prefix training vs flat: "
              "trainer seconds per step and its bound; an async run with both vs neither: "
              "trained samples/s",
    "pair": "partial rollout vs drain at k=1 and k=2 over many seeds: ratio with its 95% CI",
    "peers": "rollstream async vs TRL's GRPOTrainer on the same model and task",
    "vllm": "local engine vs a real vLLM server; weight-sync time",
    "weightsync": "weight sync to Ray engine actors: object store vs broadcast vs shared memory",
    "scale": "embedded runtime vs ray (disaggregated, colocated): samples/s, weight sync s/MB, "
             "bytes per sample on the control and data planes, actor restart",
    "sim": "the simulator: calibration error against real runs, 512-engine speed, GPU gain",
    "sim_agent": "the simulator's replay of real agent runs (tally): step time, utilization, "
                 "the harness's own time per turn",
    "resume": "a run killed with SIGKILL 5 times and resumed: lost, duplicated, repeated",
    "soak": "resident memory over a long run (--minutes, default 20): RSS slope in MB/h",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollstream",
        description="Asynchronous RL post-training for LLMs, built around rollout infrastructure.",
    )
    p.add_argument("--log-level", choices=LEVELS, default="info",
                   help="the least severe messages shown on stderr (default: info)")
    # also after the command (`rollstream train x.yaml --log-level warning`); SUPPRESS keeps
    # the value given before it when it is not repeated
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=LEVELS, default=argparse.SUPPRESS,
                        help="as before the command")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser(
        "train",
        parents=[common],
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
        parents=[common],
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
                   help="base YAML of `modes` and `pair` (default examples/tick_long.yaml, the "
                   "long-tail shape; examples/tick.yaml is the demo's)")
    b.add_argument("--seeds", type=int, default=None,
                   help="seeds of `pair` (default 6; --quick: 2)")

    r = sub.add_parser(
        "report",
        parents=[common],
        help="write a self-contained HTML report of a run directory",
        description="Write RUN_DIR/report.html with reward and throughput curves, the staleness "
        "histogram, the rollout timeline, the resolved config and the ledger summary.",
    )
    r.add_argument("run_dir", type=Path)

    e = sub.add_parser(
        "engines",
        parents=[common],
        help="list a live run's engines; drain, undrain, add or remove engines",
        description="Talks to the run's live dashboard (monitor.dashboard=true; its URL is in "
        "RUN_DIR/dashboard.url, the run's token in RUN_DIR/dashboard.token). --drain takes "
        "the engine out of routing: its requests come back with their tokens and continue on "
        "another engine; --undrain routes to it again. --add N starts N engines built as the "
        "run built its own, each loading the current weight version before its first request; "
        "--remove drains an engine, then closes it and releases its process or Ray actor.",
    )
    e.add_argument("run_dir", type=Path)
    act = e.add_mutually_exclusive_group()
    act.add_argument("--drain", metavar="ENGINE_ID", default=None)
    act.add_argument("--undrain", metavar="ENGINE_ID", default=None)
    act.add_argument("--add", metavar="N", type=int, default=None,
                     help="add N engines (1 to 16)")
    act.add_argument("--remove", metavar="ENGINE_ID", default=None)

    s = sub.add_parser(
        "sim",
        parents=[common],
        help="simulate a scenario's modes at cluster scale on virtual time (table + JSON)",
        description="Run the real controller, rollout and weight sync against simulated "
        "engines and a simulated trainer on virtual time, once per mode of the scenario, and "
        "print a comparison table (docs/simulator.md; examples/sim/).",
    )
    s.add_argument("scenario", type=Path, help="scenario YAML (see examples/sim/)")
    s.add_argument("--json", dest="json_out", type=Path, default=None, help="write results here")
    s.add_argument("--out", dest="out_dir", type=Path, default=None,
                   help="write result.json, PNG plots (with the `sim` extra: matplotlib) and "
                   "index.html, the comparison page, into this folder")
    s.add_argument("--study", default=None, metavar="ENGINES",
                   help="instead of the scenario's own size: the scaling study, the scenario "
                   "at each of these engine counts (comma-separated, e.g. 8,64,512,1024), its "
                   "groups and trainer devices scaled alike; tail share and speedups beside "
                   "the published figures (docs/simulator.md)")
    s.add_argument("--steps", type=int, default=None,
                   help="with --study: simulated steps per mode (default: the scenario's)")

    c = sub.add_parser(
        "config",
        parents=[common],
        help="print the documented config tree with its defaults",
        description="Print every config setting as YAML: its default, what it means and what "
        "values are allowed (the whole tree is a valid config of the defaults).",
    )
    c.add_argument("section", nargs="?", default=None,
                   help="a section or field, e.g. rollout, tasks.sources, reward.timeout_s")

    x = sub.add_parser(
        "proxy",
        parents=[common],
        help="serve a model folder through the OpenAI-compatible agent proxy",
        description="The embedded engine on MODEL_DIR behind an OpenAI-compatible endpoint on "
        "127.0.0.1: prints base_url and one api_key per session; an agent using the openai SDK "
        "with them is recorded token by token. On Ctrl-C (or SIGTERM) each session's samples "
        "are written to --out as JSON lines.",
    )
    x.add_argument("model_dir", type=Path)
    x.add_argument("--port", type=int, default=0, help="default: a free port")
    x.add_argument("--sessions", type=int, default=1, help="sessions (API keys) to open")
    x.add_argument("--out", type=Path, default=None, help="write the samples here (JSONL)")
    for flag in ("max_request_bytes", "max_session_calls", "max_session_history_bytes"):
        x.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=None,
                       help=f"the proxy's limit (agent.proxy.{flag} of a run's config)")

    o = sub.add_parser(
        "export",
        help="write a run's model folder for other tools (HF, vLLM) and check it",
        description="Write the run's final checkpoint (or durable checkpoint --step N) into "
        "--out: weights (cast to --dtype), config, generation config and the tokenizer files "
        "as trained. Then check it: AutoTokenizer encodes and decodes as training did, and "
        "AutoModelForCausalLM's greedy tokens equal the embedded engine's (docs/export.md).",
    )
    o.add_argument("run_dir", type=Path)
    o.add_argument("--step", type=int, default=None,
                   help="a durable checkpoint's step (default: the final checkpoint)")
    o.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    o.add_argument("--dtype", default=None,
                   help="weights' dtype: float32, bfloat16 or float16 (default: as saved)")
    o.add_argument("--threads", type=int, default=0,
                   help="torch threads of the check's two decoders on a CPU (default 0: "
                   "torch's own; 1 is fastest for the tiny models on a busy machine)")
    return p


def _export(run_dir: Path, step: int | None, out: Path, dtype: str | None,
            threads: int) -> None:
    from rollstream.models.export import export_run

    done = export_run(run_dir, out=out, step=step, dtype=dtype, threads=threads)
    for tie in done.ties:
        print(f"note: {tie}")
    print(f"exported {done.source} to {done.folder} ({done.dtype}); checked in "
          f"{done.check_s:.1f} s: AutoTokenizer reads its tokenizer as trained and "
          f"AutoModelForCausalLM's greedy tokens equal the engine's on {done.num_prompts} "
          f"prompts ({len(done.ties)} near ties)")


JOIN_WAIT_S = 660.0  # an answer may wait for engines to join (runtime/control.py: 600 s)


def _engines(run_dir: Path, act: dict[str, str | int | None]) -> None:
    import httpx

    from rollstream.run_files import RunFiles

    url_file, token_file = RunFiles(run_dir).dashboard_url, RunFiles(run_dir).dashboard_token
    if not url_file.exists():
        raise ValueError(f"{url_file} does not exist: is the run live, with "
                         "monitor.dashboard=true?")
    base = url_file.read_text().strip().rstrip("/")
    token = token_file.read_text().strip() if token_file.is_file() else ""
    try:
        _talk(base, token, act)
    except httpx.TransportError as e:
        raise ValueError(f"no run answers at {base} ({e}): it has ended, or was killed "
                         f"(then {url_file} is left behind)") from None


def _talk(base: str, token: str, act: dict[str, str | int | None]) -> None:
    import httpx

    with httpx.Client(base_url=base, timeout=JOIN_WAIT_S,
                      headers={"Authorization": f"Bearer {token}"}) as client:
        for verb, arg in act.items():
            if arg is None:
                continue
            if verb == "add":
                r = _answer(client.post("/api/engines/add", params={"count": arg}))
                print(f"added {', '.join(r['added'])}")
                continue
            r = _answer(client.post(f"/api/engines/{arg}/{verb}"))
            extra = (f": {r['handed_back']} requests handed back"
                     if verb in ("drain", "remove") else "")
            print(f"{verb.removesuffix('e')}ed {arg}{extra}")
        rows = _answer(client.get("/api/engines"))
        print(f"{'engine':12s} {'health':10s} {'routing':11s} {'version':>7s} "
              f"{'in flight':>9s} {'member':8s} {'node':12s}")
        for row in rows:
            why = "; ".join(w for w in (row["health_reason"], row["routing_reason"]) if w)
            print(f"{row['engine_id']:12s} {row['health']:10s} {row['routing']:11s} "
                  f"{row['version']:7d} {row['in_flight']:9d} {row['member']:8s} "
                  f"{_node(row):12s}" + (f"  {why}" if why else ""))


def _node(row: dict[str, Any]) -> str:
    """An engine's node for the table: the first 8 hex digits of Ray's node id (``local``
    without Ray; ``-``: a joining engine's, not known yet); GET /api/nodes has the whole id."""
    node = row.get("node_id")
    return "-" if node is None else node[:8]


def _answer(r: Any) -> Any:
    """The JSON of a dashboard's answer; its reason as a ValueError for a 4xx."""
    if 400 <= r.status_code < 500:
        detail = r.json().get("detail", r.text)
        if isinstance(detail, list):  # a validation error: the field and what it allows
            detail = "; ".join(f"{d['loc'][-1]}: {d['msg']}" for d in detail)
        raise ValueError(detail)
    r.raise_for_status()
    return r.json()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure(args.log_level)
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
                if args.name not in ("modes", "pair"):
                    raise ValueError(
                        f"bench {args.name}: --config is an option of `modes` and `pair` only")
                extra["config"] = args.config
            if args.seeds is not None:
                if args.name != "pair":
                    raise ValueError(f"bench {args.name}: --seeds is an option of `pair` only")
                extra["seeds"] = args.seeds
            if args.minutes is not None:
                if args.name != "soak":
                    raise ValueError(f"bench {args.name}: --minutes is an option of `soak` only")
                extra["minutes"] = args.minutes
            mod = importlib.import_module(f"rollstream.bench.{args.name}")
            mod.main(json_out=args.json_out, quick=args.quick, **extra)
        elif args.command == "report":
            from rollstream.monitor.report import write_report

            print(write_report(args.run_dir))
        elif args.command == "engines":
            _engines(args.run_dir, {"drain": args.drain, "undrain": args.undrain,
                                    "add": args.add, "remove": args.remove})
        elif args.command == "sim":
            if args.study is not None:
                from rollstream.sim.study import main as study_main

                study_main(args.scenario, engines=args.study, steps=args.steps,
                           out_dir=args.out_dir, json_out=args.json_out)
            else:
                if args.steps is not None:
                    raise ValueError("--steps is an option of --study (set steps in the "
                                     "scenario otherwise)")
                from rollstream.sim.report import main as sim_main

                sim_main(args.scenario, json_out=args.json_out, out_dir=args.out_dir)
        elif args.command == "config":
            from rollstream.config.describe import describe

            print(describe(args.section))
        elif args.command == "proxy":
            from rollstream.agent.proxy_cli import serve

            if args.sessions < 1:
                raise ValueError(f"--sessions must be >= 1, got {args.sessions}")
            from rollstream.config.tasks import ProxyConfig

            limits = ProxyConfig(**{k: v for k in ProxyConfig.model_fields
                                    if (v := getattr(args, k)) is not None})
            serve(args.model_dir, port=args.port, num_sessions=args.sessions, out=args.out,
                  limits=limits)
        elif args.command == "export":
            _export(args.run_dir, args.step, args.out, args.dtype, args.threads)
    except (ConfigError, ValueError) as e:
        print(f"rollstream: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
