"""Where engines and the trainer run on this host's CPUs (``runtime.ray.placement``).

    disaggregated  the engine actors and the trainer on separate cores: the engines' step
                   threads are pinned to the lower half of the cores this process may use,
                   the trainer's thread to the upper half (on 2 cores: engines on one, the
                   trainer on the other), each with as many torch threads as it has cores
    colocated      they share every core and take turns: before each trainer step the
                   dispatch gate closes and the engines' requests stop at a token boundary
                   (or, without partial rollout, finish: the sync policy's ``drain``); the
                   engines wake when weight sync has loaded the step's new version and
                   reopens the gate, and the stopped requests continue from their tokens
    null           Ray places the actors by ``engine_num_cpus``; nothing pinned, no turns

The derived settings (which cores, how many threads) are returned by :func:`placed_engine`
and :func:`placed_train`, never written back into the config. Simplifications: CPU only and
this host only (refused with a cluster's ``address`` at load); a colocated engine keeps its
KV cache while it waits (CPU memory is not the constraint the GPU's is). With the fsdp
backend the trainer's cores are shared out among its rank processes
(:func:`rollstream.train.fsdp.rank_cores`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollstream.config.schema import LocalEngineConfig, RunConfig, TrainConfig
    from rollstream.rollout.dispatcher import Dispatcher
    from rollstream.sync.weights import WeightSync


def split_cores(cores: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(engine cores, trainer cores): the lower half to the engines (the larger half when
    odd: generation is most of the work), the upper half to the trainer."""
    cores = sorted(cores)
    if len(cores) < 2:
        raise ValueError(f"runtime.ray.placement = 'disaggregated' needs 2 cores or more; "
                         f"this process may use {cores}")
    n_engine = len(cores) - len(cores) // 2
    return tuple(cores[:n_engine]), tuple(cores[n_engine:])


def _disaggregated(cfg: RunConfig) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if cfg.runtime.kind != "ray" or cfg.runtime.ray.placement != "disaggregated":
        return None
    return split_cores(sorted(os.sched_getaffinity(0)))


def placed_engine(cfg: RunConfig) -> LocalEngineConfig:
    """The engine actors' local-engine settings under the run's placement."""
    split = _disaggregated(cfg)
    local = cfg.engine.local
    if split is None:
        return local
    return local.model_copy(update={"cpu_affinity": split[0],
                                    "threads": local.threads or len(split[0])})


def placed_train(cfg: RunConfig) -> TrainConfig:
    """The trainer's settings under the run's placement."""
    split = _disaggregated(cfg)
    if split is None:
        return cfg.train
    return cfg.train.model_copy(update={"cpu_affinity": split[1],
                                        "threads": cfg.train.threads or len(split[1])})


class TimeShare:
    """``colocated``: the engines stop while the trainer steps; new weights wake them."""

    def __init__(self, dispatcher: Dispatcher, sync: WeightSync) -> None:
        self.dispatcher, self.sync = dispatcher, sync

    @contextlib.asynccontextmanager
    async def trainer_turn(self) -> AsyncIterator[None]:
        """Stop generation, then let the trainer step; weight sync reopens the gate once
        the engines serve the step's version (every policy resumes it after its load). The
        last version's load goes first, or its end would reopen the gate during the step."""
        await self.sync.wait_applied()
        self.dispatcher.pause()
        if self.sync.policy == "drain":  # no partial rollout: in-flight samples finish first
            await self.dispatcher.wait_idle()
        else:
            await self.dispatcher.interrupt()
        yield
