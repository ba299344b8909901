"""``bench models``' LoRA sync on vLLM: what a weight sync moves and costs with an adapter
against full weights, on one launched vLLM server with LoRA enabled (docs/lora.md, "LoRA on
vLLM").

On the demo shape's folder, at rank 8 on every linear layer (the adapter of
:func:`.models.bench_shape`): ``lora_sync_bytes_vs_full``, the adapter's bytes / the full
state dict's (what the engine wrote for its server, ``SyncTiming.num_bytes``), and
``lora_sync_s_vs_full``, the median seconds of ``VllmEngine.load_weights`` with the adapter
(PEFT folder written to shared memory, then loaded into the server's adapter slot in place)
/ with the full state dict (buckets written, ``reload_weights``, and, this engine serving
LoRA, its slot reset to the zero adapter, which a full load on a LoRA engine does), over
``NUM_SYNCS`` loads after a warm-up, each inside the server's ``/pause`` ... ``/resume``.
Training runs on vLLM (``lora_vs_full_samples_per_s``) are not measured here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rollstream.bench.models import RANK, _load_s, _nbytes

MAX_MODEL_LEN = 128


def bench_vllm_sync(folder: Path, full: dict, adapter: dict, log_dir: Path) -> dict[str, Any]:
    """Load seconds and bytes on a LoRA vLLM engine serving ``folder`` (module docstring)."""
    from rollstream.config.model import LoraConfig
    from rollstream.config.schema import EngineConfig, VllmEngineConfig
    from rollstream.engine.vllm import build_vllm_engine

    cfg = EngineConfig(kind="vllm", vllm=VllmEngineConfig(max_model_len=MAX_MODEL_LEN))
    engine = build_vllm_engine(cfg, folder, log_dir=log_dir,
                               lora=LoraConfig(rank=RANK, alpha=2.0 * RANK))

    async def timed() -> tuple[float, float, int, int]:
        full_s = await _load_s(engine, full, 1)
        full_moved = engine.sync_timings[-1].num_bytes
        adapter_s = await _load_s(engine, adapter, 100)
        return full_s, adapter_s, full_moved, engine.sync_timings[-1].num_bytes

    try:
        full_s, adapter_s, full_moved, adapter_moved = asyncio.run(timed())
    finally:
        engine.shutdown()
    return {"full_bytes": full_moved, "adapter_bytes": adapter_moved,
            "adapter_payload_bytes": _nbytes(adapter),
            "lora_sync_bytes_vs_full": adapter_moved / full_moved,
            "full_sync_s": full_s, "adapter_sync_s": adapter_s,
            "lora_sync_s_vs_full": adapter_s / full_s}
