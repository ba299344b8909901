"""``bench prefix``'s training part: a short async run with the engine's prefix cache and
shared-prefix training both on, against the same run with both off.

examples/tick_fewshot.yaml, the long-prompt workload (tick tasks each asked after its own
few-shot instruction of 256 to about 1,000 tokens, groups of 8, async k = 2, answers of up to
128 tokens, ``prefix_cache_tokens`` 16,384, ``shared_prefix: auto``), on the bench's model
(random weights: only shapes matter for speed; it writes up to ``max_new_tokens`` tokens and
no group is filtered, as the YAML trains every group whatever its rewards), ``STEPS`` steps
of ``GROUPS`` groups, placed as ``bench modes`` places a run (engine thread on core 0, trainer
thread on core 1). ``both``, then ``neither`` (``engine.local.prefix_cache_tokens=0``,
``train.shared_prefix=off``), once each, back to back (:mod:`.short_runs`), the same seed:
the first run pays what is still cold in the process, which lowers the ratio if anything.

Key ``both_vs_neither_trained_samples_per_s``: trained samples/s of ``both`` ÷ ``neither``.
Its bound ``both_vs_neither_bound`` = the larger of the engine part's bound ``1 / (1 - p h)``
and the trainer part's ``shared_prefix_bound`` (:mod:`.prefix`): a run's training time is
made of engine work and trainer work (overlapped or not) and of what neither setting changes,
so it shrinks by no more than the part that shrinks most. Those two are measured on the
bench's own batch of the same shape, not inside the runs: with prefill fused into decode
passes (the engine's default) a run cannot read its prefill share apart. The runs' own hit
share (``run_hit_share``, the ``both`` run's engine) says how far the cache hit there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollstream.bench.modes import bench_overrides
from rollstream.bench.sampling import ROOT
from rollstream.bench.short_runs import run_back_to_back, samples_per_s_ratio

FEWSHOT_YAML = ROOT / "examples" / "tick_fewshot.yaml"
FEWSHOT_ROWS = ROOT / "examples" / "data" / "tick_fewshot.jsonl"
STEPS, GROUPS = 6, 4
ROWS = {"both": [],
        "neither": ["engine.local.prefix_cache_tokens=0", "train.shared_prefix=off"]}


def run_part(folder: Path, run_root: Path, *, max_seq_len: int, quick: bool
             ) -> dict[str, Any]:
    """The two runs (module docstring) on ``folder``, an engine of ``max_seq_len``."""
    steps, groups, new_tokens = (2, 1, 16) if quick else (STEPS, GROUPS, 128)
    common = [*bench_overrides(folder, run_root), f"tasks.sources.0.path={FEWSHOT_ROWS}",
              f"engine.local.max_seq_len={max_seq_len}", f"train.steps={steps}",
              f"train.groups_per_step={groups}", f"sampling.max_new_tokens={new_tokens}",
              "tasks.num_eval=2", "eval.samples_per_task=1"]
    runs = run_back_to_back(FEWSHOT_YAML, common, ROWS, bench="prefix")
    work = runs["both"]["engine_work"]
    return {"runs": runs, "run_steps": steps, "run_groups_per_step": groups,
            "run_max_new_tokens": new_tokens,
            "both_vs_neither_trained_samples_per_s": samples_per_s_ratio(runs, "both",
                                                                         "neither"),
            "run_hit_share": work["prefix_hit_tokens"] / max(work["prefix_query_tokens"], 1.0)}
