"""Weights on their way into a vLLM server: safetensors buckets in shared memory.

``WeightStore.write(version, tensors)`` writes a full HF-named state dict as
``bucket-000.safetensors``, ``bucket-001.safetensors``, ... under
``/dev/shm/rollstream-vllm/<engine>-<pid>/v<version>/`` (a RAM-backed folder the server's
worker reads with ``safe_open``, memory-mapped). Each bucket holds at most
:data:`BUCKET_BYTES` (512 MiB) of tensors, because ``safetensors.torch.save_file`` builds a
whole file in memory before writing it: buckets bound the extra memory of a sync to one bucket
however large the model, and the worker reads tensors one at a time.

The latest written version stays on disk: after a server crash the restarted server restores
it (``latest``). Older versions are deleted once a newer one is installed. Tensors that share
storage (tied embeddings) are cloned, since safetensors refuses shared storage.

Simplification: each engine keeps its own copy; several engines in one process could share
one (noted in the vLLM engine's report).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BUCKET_BYTES = 512 << 20
SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


@dataclass(slots=True, kw_only=True)
class WrittenWeights:
    version: int
    path: Path
    num_bytes: int
    num_buckets: int
    write_s: float


@dataclass(slots=True, kw_only=True)
class WeightStore:
    root: Path  # e.g. /dev/shm/rollstream-vllm/vllm-0-1234
    bucket_bytes: int = BUCKET_BYTES
    latest: WrittenWeights | None = None
    _older: list[Path] = field(default_factory=list)

    def write(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WrittenWeights:
        """Write ``tensors`` as buckets of a new version folder (blocking; run off the loop)."""
        from safetensors.torch import save_file

        if not tensors:
            raise ValueError("load_weights needs a non-empty state dict")
        t0 = time.perf_counter()
        path = self.root / f"v{version}-{time.monotonic_ns()}"
        path.mkdir(parents=True)
        seen: set[int] = set()
        bucket: dict[str, torch.Tensor] = {}
        size = num_bytes = num_buckets = 0
        for name, tensor in tensors.items():
            t = tensor.detach().to("cpu").contiguous()
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > self.bucket_bytes:
                save_file(bucket, str(path / f"bucket-{num_buckets:03d}.safetensors"))
                bucket, size, num_buckets = {}, 0, num_buckets + 1
            bucket[name] = t
            size += nbytes
            num_bytes += nbytes
        save_file(bucket, str(path / f"bucket-{num_buckets:03d}.safetensors"))
        written = WrittenWeights(version=version, path=path, num_bytes=num_bytes,
                                 num_buckets=num_buckets + 1,
                                 write_s=time.perf_counter() - t0)
        if self.latest is not None:
            self._older.append(self.latest.path)
        self.latest = written
        return written

    def prune(self) -> None:
        """Delete every version folder but the latest (call once it is installed)."""
        for path in self._older:
            shutil.rmtree(path, ignore_errors=True)
        self._older.clear()

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.latest = None
        self._older.clear()
