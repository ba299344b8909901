"""``shared_memory``: a version as safetensors buckets in a RAM-backed folder, read by the
processes that install it: engine actors on this host (:class:`SharedMemory`) and the vLLM
server's worker (``sync/vllm.py``, ``engine/vllm/worker_ext.py``).

``WeightStore.write(payload)`` writes an ``adapter`` payload as a PEFT folder for vLLM's LoRA
loader (``vllm_lora.py``), any other the payload's tensors as ``bucket-000.safetensors``,
``bucket-001.safetensors``, ... under a new folder of ``/dev/shm/rollstream-<who>/...``, each
file carrying the payload's header fields in its metadata (:meth:`Header.metadata`; a
reader refuses another protocol or kind). Each bucket holds at most :data:`BUCKET_BYTES`
(512 MiB by default) of tensors, because ``safetensors.torch.save_file`` builds a whole file
in memory before writing it: buckets bound the extra memory of a sync to one bucket however
large the model, and a reader (:func:`iter_folder`, memory-mapped) holds one tensor at a time.

The latest written version stays on disk: after a vLLM server crash the restarted server
restores it (``latest``). Older versions are deleted once a newer one is installed. Tensors
that share storage (tied embeddings) are cloned, since safetensors refuses shared storage.

Same host only: a destination on another node would need the folder written on its node
(``RayConfig`` refuses ``shared_memory`` with a cluster's address). Simplification: each
vLLM engine keeps its own copy; several engines in one process could share one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.sync.buckets import plan_buckets
from rollstream.sync.object_store import ObjectStore
from rollstream.sync.protocol import (
    KINDS,
    Destination,
    Header,
    Payload,
    PayloadKind,
    check,
    read_metadata,
)
from rollstream.sync.vllm_lora import write_peft_folder

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

BUCKET_BYTES = 512 << 20
SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


@dataclass(slots=True, kw_only=True)
class WrittenWeights:
    version: int
    path: Path
    num_bytes: int
    num_buckets: int
    write_s: float
    kind: PayloadKind = "full"  # "adapter": a PEFT folder (sync/vllm_lora.py), not buckets


@dataclass(slots=True, kw_only=True)
class WeightStore:
    root: Path  # e.g. /dev/shm/rollstream-vllm/vllm-0-1234
    bucket_bytes: int = BUCKET_BYTES
    latest: WrittenWeights | None = None
    _older: list[Path] = field(default_factory=list)

    def write(self, payload: Payload) -> WrittenWeights:
        """Write ``payload`` as buckets of a new version folder (blocking; run off the loop)."""
        from safetensors.torch import save_file

        version, tensors, meta = payload.version, payload.tensors, payload.header.metadata()
        if not tensors:
            raise ValueError("load_weights needs a non-empty state dict")
        t0 = time.perf_counter()
        path = self.root / f"v{version}-{time.monotonic_ns()}"
        path.mkdir(parents=True)
        if payload.header.kind == "adapter":  # what vLLM's LoRA loader reads: a PEFT folder
            written = WrittenWeights(version=version, path=path, kind="adapter",
                                     num_bytes=write_peft_folder(path, tensors), num_buckets=1,
                                     write_s=time.perf_counter() - t0)
            return self._keep(written)
        plan = plan_buckets(tensors, self.bucket_bytes)
        seen: set[int] = set()
        for i, planned in enumerate(plan):
            bucket: dict[str, torch.Tensor] = {}
            for entry in planned.entries:
                t = tensors[entry.name].detach().to("cpu").contiguous()
                if t.untyped_storage().data_ptr() in seen:
                    t = t.clone()
                seen.add(t.untyped_storage().data_ptr())
                bucket[entry.name] = t
            save_file(bucket, str(path / f"bucket-{i:03d}.safetensors"), meta)
        num_bytes = sum(e.num_bytes for planned in plan for e in planned.entries)
        return self._keep(WrittenWeights(version=version, path=path, num_bytes=num_bytes,
                                         num_buckets=len(plan),
                                         write_s=time.perf_counter() - t0))

    def _keep(self, written: WrittenWeights) -> WrittenWeights:
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


def iter_folder(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a ``full`` version folder, one at a time (memory-mapped), each file's
    header checked first (blocking): vLLM's reload takes whole weights only."""
    for _, f in _buckets(path, kinds=("full",)):
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            yield name, f.get_tensor(name)


def read_folder(path: str | Path) -> Payload:
    """A version folder's payload, its tensors in memory (blocking)."""
    tensors: dict[str, torch.Tensor] = {}
    for (version, kind, base), f in _buckets(path):
        tensors.update((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118
    return Payload(header=Header.describe(version, kind, tensors, base), tensors=tensors)


def _buckets(path: str | Path, kinds: tuple[str, ...] = KINDS
             ) -> Iterator[tuple[tuple[int, PayloadKind, int | None], Any]]:
    """Each bucket file of a version folder, open, with its checked version, kind (one of
    ``kinds``) and base."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("bucket-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no bucket-*.safetensors files in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            yield read_metadata(f.metadata(), str(file), kinds), f


@dataclass(frozen=True, slots=True, kw_only=True)
class ShmFolder:
    """:class:`~rollstream.sync.protocol.Delivery` of shared memory: the version's folder."""

    path: str

    def open(self, group: Any = None) -> Payload:
        return read_folder(self.path)


class SharedMemory:
    """:class:`~rollstream.sync.protocol.Transport`: each version written once under
    /dev/shm, read by every destination (module docstring)."""

    name = "shared_memory"

    def __init__(self, bucket_bytes: int) -> None:
        self.store = WeightStore(root=SHM_ROOT / "rollstream-ray"
                                 / f"{os.getpid()}-{uuid.uuid4().hex[:8]}",
                                 bucket_bytes=bucket_bytes)
        self.fallback = ObjectStore()
        self._round: tuple[Mapping[str, torch.Tensor], asyncio.Future] | None = None

    async def send(self, payload: Payload, to: Destination) -> None:
        if self._round is None or self._round[0] is not payload.tensors:
            self._round = (payload.tensors, asyncio.ensure_future(
                asyncio.to_thread(self._write, payload)))
        path = await asyncio.shield(self._round[1])
        await to.actor.install.remote(ShmFolder(path=str(path)))

    def _write(self, payload: Payload) -> Path:
        t0 = time.perf_counter()
        check(payload.header.protocol, payload.header.kind)  # its readers apply KINDS only
        written = self.store.write(payload)
        self.store.prune()  # rounds are sequential: no actor reads an older version now
        log.info("weights v%d: %d bytes written to %s in %.3f s", payload.version,
                 written.num_bytes, written.path, time.perf_counter() - t0)
        return written.path

    async def revive(self, payload: Payload, to: Destination) -> None:
        await self.fallback.send(payload, to)

    def close(self) -> None:
        self.store.clear()
        with contextlib.suppress(OSError):  # the shared parent, once no run uses it
            self.store.root.parent.rmdir()
        self._round = None
        self.fallback.close()
