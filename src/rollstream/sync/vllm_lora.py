"""vLLM's LoRA path: the ``adapter`` payload of ``protocol.py`` as the PEFT folder vLLM's
LoRA loader reads, and the one adapter slot a LoRA engine's requests name.

One name, reloaded in place. A vLLM request names its adapter when it is submitted and
cannot switch to another while it runs; so a new adapter version under a new name would
leave every in-flight request on the old one (``on_update: continue`` could not continue
them on the new version). Instead the server holds one adapter, :data:`ADAPTER_NAME`,
registered when the engine starts (``/v1/load_lora_adapter``, with a zero adapter: B = 0
serves the base model, version 0), and every request names it. A sync then loads the new
version's folder into that same slot inside the worker (``worker_ext.py``'s
``rollstream_load_adapter``: vLLM's in-place load, the adapter's id unchanged) between two
engine steps, under the same pause as a full reload (``vllm.py``): in-flight requests
continue on the new adapter, and the server's weight-version spans label each token with
the version that sampled it, exactly as for full weights.

Why not ``/v1/load_lora_adapter`` with ``load_inplace`` for every version: vLLM 0.32 keeps
that flag on the request object the API server hands each new request, and its worker
reloads an adapter whose request carries it from disk at every step (``LRUCacheWorkerLoRA
Manager.add_adapter``, called for each scheduled step's adapters; read in its source, not
run), from the path registered when the request was submitted: a request sent at version v
would load v's folder back over v+1 at each step.

The folder (:func:`write_peft_folder`): ``adapter_config.json`` with ``lora_alpha = r`` (scale
1: the payload's B has the scale multiplied in) and ``adapter_model.safetensors`` under peft's
names (:data:`PEFT_PREFIX`). A full payload on a LoRA engine replaces the base weights and
resets the slot to the zero adapter (a full version serves no adapter, as on the embedded
engine).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.config.model import VLLM_LORA_RANKS
from rollstream.sync.protocol import ADAPTER_FILE, ADAPTER_SUFFIXES, PEFT_PREFIX, check_adapter

if TYPE_CHECKING:
    import torch

ADAPTER_NAME = "rollstream-lora"  # the served adapter every request of a LoRA engine names


def max_lora_rank(rank: int) -> int:
    """The ``--max-lora-rank`` a server needs for adapters of rank ``rank`` (vLLM takes a
    fixed set of values)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"model.lora.rank {rank}: vLLM serves LoRA ranks up to "
                     f"{VLLM_LORA_RANKS[-1]}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSlot:
    """The adapter slot of one LoRA vLLM engine: adapters of rank at most ``rank`` on layers
    named ``targets``; ``zero_path``: its zero adapter's folder (version 0, and what a full
    load resets the slot to)."""

    rank: int
    targets: tuple[str, ...]
    zero_path: Path

    @classmethod
    def create(cls, *, rank: int, targets: tuple[str, ...], folder: Path,
               shapes: Mapping[str, tuple[int, ...]]) -> LoraSlot:
        """Write the zero adapter of rank ``rank`` on ``targets`` (by their last name, e.g.
        ``q_proj``) of a model with these weight ``shapes`` under ``folder``."""
        import torch

        zero: dict[str, torch.Tensor] = {}
        a_end, b_end = ADAPTER_SUFFIXES
        for name, shape in shapes.items():
            module = name.removesuffix(".weight")
            if module == name or len(shape) != 2 or module.rsplit(".", 1)[-1] not in targets:
                continue
            zero[module + a_end] = torch.zeros(rank, shape[1])
            zero[module + b_end] = torch.zeros(shape[0], rank)
        if not zero:
            raise ValueError(f"model.lora.target_modules {list(targets)} name no linear layer "
                             "of the served model")
        write_peft_folder(folder, zero)
        return cls(rank=rank, targets=targets, zero_path=folder)

    def check(self, tensors: Mapping[str, torch.Tensor],
              shapes: Mapping[str, tuple[int, ...]]) -> None:
        """ValueError, before anything is sent, for an adapter this slot cannot take."""
        for weight, a, _ in check_adapter(tensors, shapes, model="the served checkpoint"):
            if a.shape[0] > self.rank:
                raise ValueError(f"adapter for {weight}: rank {a.shape[0]} exceeds the rank "
                                 f"{self.rank} its vLLM engine was started with "
                                 "(model.lora.rank)")


def write_peft_folder(folder: Path, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write an ``adapter`` payload as a PEFT adapter folder; the tensor bytes written."""
    from safetensors.torch import save_file

    a_end, _ = ADAPTER_SUFFIXES
    ranks = {int(t.shape[0]) for n, t in tensors.items() if n.endswith(a_end)}
    if len(ranks) != 1:
        raise ValueError(f"an adapter payload has one rank, this one {sorted(ranks)}")
    (rank,) = ranks
    targets = sorted({n.removesuffix(a_end).rsplit(".", 1)[-1] for n in tensors
                      if n.endswith(a_end)})
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "lora_dropout": 0.0, "bias": "none", "target_modules": targets,
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}
    weights = {PEFT_PREFIX + n: t.detach().to("cpu").contiguous()
               for n, t in tensors.items()}
    save_file(weights, str(folder / ADAPTER_FILE))
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return sum(t.numel() * t.element_size() for t in tensors.values())
