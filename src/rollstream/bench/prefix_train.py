"""``bench prefix``'s trainer part: shared-prefix training against the flat layout.

The same batch (:data:`GROUPS` groups of the long-prompt shape of
:mod:`rollstream.bench.prefix`: 8 samples sharing a 256 to 1,024-token prompt, answers of 16
to 128 tokens, random rewards; fewer groups than the engine part, so that a 2-vCPU machine
steps the flat layout in tens of seconds) is trained by two trainers on the same weights
that differ only in ``train.shared_prefix`` (``auto`` and ``off``), one update per step;
after a warm-up step each on the first group alone, their steps alternate (flat, shared,
flat, ...), so that the machine's load drifts onto both. Key ``shared_prefix_vs_flat_trainer_step_s``: the
median over repeats of the flat step's seconds ÷ the shared one's. Bound beside it: the flat
layout's tokens ÷ the shared layout's (what the forward and backward passes compute, padding
excluded), the speed-up if time were proportional to tokens; attention's share, which grows
with the rows' width, and the fixed per-step work keep the ratio below it.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from rollstream.config.schema import TrainConfig
from rollstream.staleness import StalenessPolicy
from rollstream.train.trainer import Trainer
from rollstream.trajectory import Group, Segment, SegmentKind, Task

MODES = ("off", "auto")
GROUPS = 4
"""Groups per trainer step."""


def random_groups(prompts: list[list[int]], lengths: list[int], group_size: int, vocab: int,
                  seed: int) -> list[Group]:
    """Groups of ``group_size`` consecutive requests (one prompt each), answered at random."""
    rng = random.Random(seed)
    groups = []
    for g in range(0, len(prompts), group_size):
        task = Task(uid=f"bench/{g}", source="bench", prompt_ids=tuple(prompts[g]),
                    prompt_text="", reference="")
        group = Group.new(task, group_size)
        for s, n in zip(group.samples, lengths[g : g + group_size], strict=True):
            s.segments.append(Segment(kind=SegmentKind.POLICY,
                                      token_ids=[rng.randrange(2, vocab) for _ in range(n)],
                                      logprobs=[-1.0] * n, versions=[0] * n, loss_mask=[True] * n))
            s.reward = float(rng.random() < 0.5)
        groups.append(group)
    return groups


def _tokens(trainer: Trainer, groups: list[Group]) -> int:
    samples = [s for g in groups for s in g.samples]
    return sum(int(mb.token_mask.sum()) for _, mb in trainer._micro_batches(samples))


def trainer_part(folder: Path, prompts: list[list[int]], lengths: list[int], *,
                 group_size: int, vocab: int, threads: int, repeats: int) -> dict[str, Any]:
    """Seconds per trainer step, flat and shared, on one batch (module docstring)."""
    groups = random_groups(prompts, lengths, group_size, vocab, seed=0)[:GROUPS]
    trainers = {mode: Trainer(TrainConfig(shared_prefix=mode, updates_per_step=1,
                                          threads=threads), folder,
                              staleness=StalenessPolicy(max_staleness=0))
                for mode in MODES}
    step_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    for trainer in trainers.values():
        trainer.step(groups[:1], step=0)  # warm-up
    for rep in range(1, repeats + 1):
        for mode, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.step(groups, step=rep)
            step_s[mode].append(time.perf_counter() - t0)
    tokens = {mode: _tokens(t, groups) for mode, t in trainers.items()}
    ratios = [f / s for f, s in zip(step_s["off"], step_s["auto"], strict=True)]
    return {
        "trainer_step_s": {"flat": step_s["off"], "shared": step_s["auto"]},
        "shared_prefix_vs_flat_trainer_step_s": statistics.median(ratios),
        "trainer_ratios": ratios,
        "trainer_tokens": {"flat": tokens["off"], "shared": tokens["auto"]},
        "shared_prefix_bound": tokens["off"] / tokens["auto"],
        "trainer_groups": len(groups),
    }
