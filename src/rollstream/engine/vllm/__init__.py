"""The ``vllm`` engine: a real vLLM server behind the engine protocol.

``build_vllm_engine`` returns one :class:`VllmEngine` per server. With ``engine.vllm.urls``
set, engine ``<kind>-<i>`` attaches to ``urls[i]`` (the servers must serve ``model_path``
and run with ``VLLM_SERVER_DEV_MODE=1``, ``--enable-scale-out`` and this package's
``--worker-extension-cls``); otherwise each engine launches its own server on a free port
of 127.0.0.1, logging to ``.cache/vllm/logs/<engine_id>-<pid>.log``. The factory builds
``engine.num_engines`` of them: one server per engine.

Importing this package does not import vLLM or torch: the server is a separate process.
"""

from __future__ import annotations

import atexit
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollstream.config.schema import EngineConfig, LoraConfig
from rollstream.engine.vllm.checkpoint import CheckpointSpec
from rollstream.engine.vllm.engine import VllmEngine
from rollstream.engine.vllm.server import ServerProcess, VllmServer, VllmServerError, cpu_build
from rollstream.sync.shm import BUCKET_BYTES, SHM_ROOT, WeightStore
from rollstream.sync.vllm import SyncTiming
from rollstream.sync.vllm_lora import LoraSlot

CPU_DEFAULT_MAX_NUM_SEQS = 128  # vLLM's default for the API server on CPU
# vLLM 0.32's CPU attention kernels; other head sizes crash the worker on the first request
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"  # vLLM's per-token expert output

__all__ = ["BUCKET_BYTES", "SyncTiming", "VllmEngine", "VllmServer", "VllmServerError",
           "build_vllm_engine"]


def build_vllm_engine(cfg: EngineConfig, model_path: str | Path, *, engine_id: str = "vllm-0",
                      version: int = 0, port: int | None = None,
                      log_dir: str | Path | None = None,
                      host: Callable[[VllmServer], ServerProcess] | None = None,
                      weights: Callable[[Any, WeightStore], WeightStore] | None = None,
                      lora: LoraConfig | None = None) -> VllmEngine:
    """A started engine serving ``model_path`` with its weights labelled ``version``.

    Blocks until the server answers /health (launching takes ~30 s on CPU with
    ``enforce_eager``). ``port`` fixes the launch port (default: a free one). ``host``: who
    launches a server this process would launch (None: this process; ``runtime.kind: ray``
    hands it to an actor, ``rollstream.runtime.ray.vllm``). ``weights(server, store)``: the
    store the engine writes each version to, given its server and this process's shared
    memory store (None: that store; Ray's may write on the server's node instead).
    ``lora``: the run's ``model.lora``; the server then serves one LoRA adapter slot
    (``sync/vllm_lora.py``), and an attached server must run with LoRA enabled
    (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 --enable-lora --max-lora-rank`` >= the rank).
    """
    vcfg = cfg.vllm
    path = Path(model_path).resolve()
    checkpoint = CheckpointSpec.from_folder(path)
    if vcfg.urls:
        index = _engine_index(engine_id)
        if index >= len(vcfg.urls):
            raise ValueError(f"engine {engine_id!r} needs engine.vllm.urls[{index}], but only "
                             f"{len(vcfg.urls)} url(s) are given")
        server = VllmServer(cfg=vcfg, attach_url=vcfg.urls[index])
    else:
        _check_cpu_head_dim(checkpoint.head_dim, path)
        _check_cpu_routed_experts(vcfg.extra_args)
        logs = Path(log_dir) if log_dir is not None else Path(".cache/vllm/logs")
        server = VllmServer(cfg=vcfg, model_path=path, port=port,
                            log_path=logs.resolve() / f"{engine_id}-{os.getpid()}.log",
                            lora_rank=None if lora is None else lora.rank)
        if host is not None:
            server = host(server)
    store = WeightStore(root=SHM_ROOT / "rollstream-vllm"
                        / f"{engine_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    atexit.register(store.clear)
    slot = None if lora is None else LoraSlot.create(
        rank=lora.rank, targets=lora.target_modules, folder=store.root / "zero-adapter",
        shapes=checkpoint.shapes)
    if weights is not None:
        store = weights(server, store)
    return VllmEngine(server, engine_id=engine_id, version=version, checkpoint=checkpoint,
                      store=store, capacity=_max_num_seqs(vcfg.extra_args),
                      startup_timeout_s=vcfg.startup_timeout_s, lora=slot)


def _check_cpu_head_dim(head_dim: int, path: Path) -> None:
    if not cpu_build():
        return  # a GPU build of vLLM: its own checks apply
    if head_dim not in CPU_HEAD_DIMS:
        raise ValueError(f"model {path} has head_dim {head_dim}; vLLM's CPU attention supports "
                         f"{list(CPU_HEAD_DIMS)} (use hidden_size / num_attention_heads >= 32)")


def _check_cpu_routed_experts(extra_args: tuple[str, ...]) -> None:
    """vLLM 0.32's CPU build cannot return routed experts (docs/moe.md): refused here, with
    why, instead of a server that exits at start."""
    if cpu_build() and ROUTED_EXPERTS_FLAG in {a.split("=", 1)[0] for a in extra_args}:
        raise ValueError(
            f"engine.vllm.extra_args has {ROUTED_EXPERTS_FLAG}, which vLLM's CPU build "
            "cannot serve: it needs Model Runner V2 (the server exits with 'AuxOutput "
            "Connector requires Model Runner V2'), and Model Runner V2 needs Triton's GPU "
            "kernels ('Model Runner V2 requires Triton.'); drop the flag (routing replay "
            "runs on engine.kind: local, docs/moe.md)")


def _engine_index(engine_id: str) -> int:
    m = re.search(r"(\d+)$", engine_id)
    return int(m.group(1)) if m else 0


def _max_num_seqs(extra_args: tuple[str, ...]) -> int:
    for i, arg in enumerate(extra_args):
        if arg == "--max-num-seqs" and i + 1 < len(extra_args):
            return int(extra_args[i + 1])
        if arg.startswith("--max-num-seqs="):
            return int(arg.split("=", 1)[1])
    return CPU_DEFAULT_MAX_NUM_SEQS
