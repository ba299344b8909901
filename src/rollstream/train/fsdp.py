"""Trainer backend ``fsdp``: the single-process trainer's step, data-parallel over rank
processes with PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``).

Two halves:

* :class:`RankTrainer`, one per rank process: the :class:`~rollstream.train.trainer.Trainer`
  with its parameters (and so AdamW's state) sharded by ``fully_shard`` (each decoder layer,
  then the root), computing its share of the step's token-budget micro-batches. The loss,
  batching and masks are the trainer's own; only its data-parallel hooks differ:

  - every rank packs the whole batch the same way (packing is deterministic) and computes
    micro-batches ``rank, rank + W, ...``; a rank with fewer pads with empty micro-batches
    (:func:`~rollstream.train.batching.padding_micro_batch`), so that every rank runs the
    same forward and backward passes, whose collectives FSDP pairs up;
  - gradients are *summed* over ranks (FSDP's reduce-scatter divides by ``W`` by default) and
    the step's loss normaliser is made of every rank's counts (an all-reduce), so the summed
    gradient divided by it is the single-process one, up to float summation order;
  - the step's metrics and per-sample kept tokens are merged from every rank.

* :class:`FsdpTrainer`, in the controller's process: starts the ``world_size`` ranks
  through a :class:`Ranks` transport and forwards each call of the trainer's interface
  (``step``, ``logprobs``, ``state_dict``, checkpoints) to all of them; rank 0 answers. A
  rank that raises or dies ends every rank and raises here (with its traceback, or
  :class:`TrainerRankDied`); :meth:`FsdpTrainer.close` stops them. Two transports, the only
  difference between the two ways a run hosts its ranks: spawned processes of this one
  behind pipes, rendezvous through a file store (``train/rank_processes.py``, the
  default), and Ray actors placed in the run's scale units, rendezvous through a TCP store
  on rank 0's node (``runtime/ray/ranks.py``, ``runtime.kind: ray``). Both run
  :func:`start_rank` and :func:`run_command` in the rank.

Simplified: the reference model (``kl_coef > 0``) is a full copy on every rank, not
sharded; ``state_dict`` gathers the full weights to rank 0 and ships them to the controller
through shared memory (one copy per sync), not by a bucketed broadcast to the engines.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import AutoModelForCausalLM

from rollstream.config.schema import TrainConfig
from rollstream.train.step_stats import StepSums
from rollstream.train.trainer import Trainer
from rollstream.trajectory import Group, KeptTokens, Sample, StepResult

if TYPE_CHECKING:
    from rollstream.staleness import StalenessPolicy

DEATH_GRACE_S = 2.0  # after a rank's error: how long a peer's death may take to show
REPLICATED = frozenset({"grad_norm", "num_updates"})  # sums every rank adds alike (global)
COMMANDS = frozenset({"step", "logprobs", "state_dict", "save_checkpoint",
                      "save_training_state", "load_training_state", "follow"})


class TrainerRankDied(RuntimeError):
    """A rank process of the fsdp trainer died (killed, crashed, out of memory), as opposed
    to a rank that raised (an error that would happen again on resume)."""

    def __init__(self, rank: int, exitcode: int | None, cause: str | None = None) -> None:
        """``exitcode``: the process's, where the driver can read it (a spawned process);
        ``cause``: Ray's account of an actor's death."""
        self.rank, self.exitcode = rank, exitcode
        super().__init__(f"fsdp rank {rank} died ({cause or f'exit code {exitcode}'})")


class RankTrainer(Trainer):
    """One rank's trainer: a shard of the policy, a share of each step's micro-batches."""

    backward_masked = True  # a zero-loss micro-batch still joins the gradient reduction

    def __init__(self, cfg: TrainConfig, model_path: Path, *, rank: int, world_size: int,
                 **kwargs: Any) -> None:
        self.rank, self.world_size = rank, world_size
        super().__init__(cfg, model_path, **kwargs)

    def _shard(self, model: torch.nn.Module) -> None:
        """Shard each decoder layer, then the root. One rank has nothing to shard with: it
        keeps plain parameters (DTensor's dispatch cost ~17% of a step on a tiny model)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.world_size == 1:
            return

        blocks = set(getattr(model, "_no_split_modules", None) or ())  # HF: decoder layers
        for module in list(model.modules()):
            if type(module).__name__ in blocks:
                fully_shard(module)
        fully_shard(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # sum over ranks, not the mean
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    def _share(self, packed: list[list[list[int]]]) -> list[list[list[int]]]:
        mine = packed[self.rank :: self.world_size]
        per_rank = -(-len(packed) // self.world_size)
        return mine + [[]] * (per_rank - len(mine))

    def _step_counts(self, sums: StepSums) -> dict[str, int]:
        counts = super()._step_counts(sums)
        total = torch.tensor(list(counts.values()), dtype=torch.long)
        dist.all_reduce(total)
        return dict(zip(counts, (int(v) for v in total.tolist())))

    def _merge(self, sums: StepSums, kept: dict[str, KeptTokens]
               ) -> tuple[StepSums, dict[str, KeptTokens]]:
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, (sums.values, kept))
        merged, all_kept = StepSums(), {}
        for rank, (values, rank_kept) in enumerate(parts):
            merged.add(**{k: v for k, v in values.items() if rank == 0 or k not in REPLICATED})
            all_kept.update(rank_kept)
        return merged, all_kept

    def follow(self, settings: dict[str, Any]) -> None:
        """:meth:`Trainer.follow_rollout` with the driver's keyword arguments."""
        self.follow_rollout(**settings)

    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        mine = super().logprobs(samples)  # [] for the samples of other ranks
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        return [next((p[i] for p in parts if p[i]), []) for i in range(len(samples))]

    def state_dict(self) -> dict[str, Tensor]:
        """The full weights, HF-named (tied ones under both names), on every rank: a
        collective, so every rank calls it."""
        full: dict[int, Tensor] = {}  # tied weights: one gather
        out = {}
        for name, t in self.model.state_dict().items():
            if id(t) not in full:
                full[id(t)] = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[name] = full[id(t)]
        return out

    def save_checkpoint(self, out_dir: Path) -> Path:
        weights = self.state_dict()
        out_dir = Path(out_dir)
        if self.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(out_dir, state_dict=weights, safe_serialization=True)
            self._copy_tokenizer(out_dir)
        return out_dir

    def save_training_state(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        optim = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))  # full, on rank 0 only
        if self.rank == 0:
            torch.save({"optimizer": optim, "torch_rng": torch.get_rng_state(),
                        "python_rng": random.getstate()}, path)

    def load_training_state(self, model_dir: Path, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        saved = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        set_model_state_dict(self.model, saved.state_dict(), options=full)
        state = torch.load(path, weights_only=False)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=full)
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])


def rank_cores(cores: Sequence[int], rank: int, world_size: int) -> tuple[int, ...]:
    """The cores of ``train.cpu_affinity`` that rank ``rank`` is pinned to: consecutive
    equal slices (the remainder to the first ranks); with fewer cores than ranks, ranks
    share them round-robin."""
    cores = sorted(cores)
    if len(cores) < world_size:
        return (cores[rank % len(cores)],)
    size, extra = divmod(len(cores), world_size)
    start = rank * size + min(rank, extra)
    return tuple(cores[start:start + size + (rank < extra)])


def start_rank(rank: int, world_size: int, device: str, kwargs: dict[str, Any], *,
               init_method: str | None = None, store: Any = None) -> RankTrainer:
    """In a rank's process (either transport): pin it to its share of the trainer's cores
    (or share the cores' threads), join the process group (``init_method``, or a
    torch.distributed ``store``) and build the rank's trainer."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    elif kwargs["cfg"].cpu_affinity:  # this rank's share of the trainer's cores
        cores = rank_cores(kwargs["cfg"].cpu_affinity, rank, world_size)
        kwargs = {**kwargs, "cfg": kwargs["cfg"].model_copy(update={
            "cpu_affinity": cores, "threads": kwargs["cfg"].threads or len(cores)})}
    elif not kwargs["cfg"].threads:  # ranks share the cores instead of each taking all
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init_method,
                            store=store, rank=rank, world_size=world_size)
    on = f"cuda:{rank}" if device == "cuda" else "cpu"
    return RankTrainer(rank=rank, world_size=world_size, device=on, **kwargs)


def run_command(trainer: RankTrainer, name: str, args: Sequence[Any]) -> Any:
    """One call of the driver on a rank: rank 0's result (the others' is None)."""
    assert name in COMMANDS, name
    out = getattr(trainer, name)(*args)
    return out if trainer.rank == 0 else None


class Ranks(Protocol):
    """The transport between :class:`FsdpTrainer` and its rank processes: spawned processes
    behind pipes (``train/rank_processes.py``) or Ray actors (``runtime/ray/ranks.py``).
    Made by a :data:`LaunchRanks` with every rank's trainer built."""

    def call(self, name: str, args: tuple[Any, ...]) -> Any:
        """Run ``name`` on every rank; rank 0's result. A rank that died raises
        :class:`TrainerRankDied` (a death is reported before the errors it causes in its
        peers' collectives, waiting up to ``DEATH_GRACE_S`` for it to show); one that raised
        raises :func:`rank_failed`'s error. Either way the caller then :meth:`kill` s them."""

    def kill(self) -> None:
        """End every rank now (one may wait in a collective that never completes)."""

    def close(self) -> None:
        """Stop the ranks (idempotent)."""


LaunchRanks = Callable[[int, str, dict[str, Any]], Ranks]
"""``(world_size, device, trainer kwargs) -> Ranks`` with every rank's trainer built."""


def rank_failed(rank: int, trace: str) -> RuntimeError:
    """The error of a rank that raised (not a death: runtime/train.py does not restart it)."""
    return RuntimeError(f"fsdp rank {rank} failed:\n{trace}")


class FsdpTrainer:
    """The trainer interface of the controller, computed by ``cfg.fsdp.world_size`` FSDP
    ranks (module docstring). Arguments: as :class:`~rollstream.train.trainer.Trainer`, and
    ``launch``, which starts the ranks: spawned processes of this one
    (``train/rank_processes.py``) or Ray actors; the runtime chooses (runtime/build.py)."""

    def __init__(self, cfg: TrainConfig, model_path: Path, *, staleness: StalenessPolicy,
                 max_response_tokens: int | None = None, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, launch: LaunchRanks) -> None:
        self.world_size = cfg.fsdp.world_size
        self._lock = threading.Lock()  # one call at a time: the ranks pair collectives
        self._closed = False
        kwargs = dict(cfg=cfg, model_path=Path(model_path), staleness=staleness,
                      max_response_tokens=max_response_tokens, temperature=temperature,
                      top_p=top_p, top_k=top_k)
        self.ranks = launch(self.world_size, cfg.fsdp.device, kwargs)

    # -- the trainer interface ------------------------------------------------------------------

    def step(self, groups: Sequence[Group], step: int) -> StepResult:
        return self._call("step", list(groups), step)

    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        return self._call("logprobs", list(samples))

    def follow_rollout(self, *, staleness: StalenessPolicy, max_response_tokens: int,
                       temperature: float) -> None:
        """A reconfiguration between steps (``runtime.reconfigure``), on every rank."""
        self._call("follow", dict(staleness=staleness, max_response_tokens=max_response_tokens,
                                  temperature=temperature))

    def state_dict(self) -> dict[str, Tensor]:
        """The full HF-named weights, gathered from the shards: a copy (in shared memory, or
        out of Ray's object store), so unlike the local trainer's it does not change with the
        next step."""
        return self._call("state_dict")

    def save_checkpoint(self, out_dir: Path) -> Path:
        return self._call("save_checkpoint", Path(out_dir))

    def save_training_state(self, path: Path) -> None:
        self._call("save_training_state", Path(path))

    def load_training_state(self, model_dir: Path, path: Path) -> None:
        self._call("load_training_state", Path(model_dir), Path(path))

    def close(self) -> None:
        """Stop the ranks (waits for them to leave their process group)."""
        self._closed = True
        self.ranks.close()

    # -- internals ------------------------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> Any:
        assert name in COMMANDS, name
        with self._lock:
            if self._closed:
                raise RuntimeError("the fsdp trainer is closed")
            try:
                return self.ranks.call(name, args)
            except BaseException:  # a rank raised or died: the others may wait in a collective
                self._closed = True
                self.ranks.kill()
                self.ranks.close()
                raise
