"""Versioned delta sync (``sync/delta.py``): an engine actor's body (a real local engine)
fed each AdamW step through the delta transport holds, bit for bit, the weights of an engine
loaded with each full state dict, in float32 and bfloat16, over several steps, across an
engine that missed a version and across a replaced actor; and a delta reaches only the
version it was made from (no Ray: the actor body runs in this process; the shared-memory
transport is the real one, the object store's is a pickled copy)."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rollstream.config.schema import LocalEngineConfig
from rollstream.engine.local import LocalEngine
from rollstream.runtime.ray.engine_actor import EngineActor
from rollstream.sync.delta import IDX, DeltaSync, encode, receive
from rollstream.sync.protocol import Destination, Payload
from rollstream.sync.shm import SharedMemory, WeightStore, iter_folder
from tests.engine.helpers import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-delta"))


class Pickled:
    """The object store's delivery without Ray: the actor gets a pickled copy."""

    async def send(self, payload: Payload, to: Destination) -> None:
        await to.actor.install.remote(pickle.loads(pickle.dumps(payload)))

    revive = send

    def close(self) -> None: ...


def _handle(actor: EngineActor) -> SimpleNamespace:
    """An actor handle's call shape (``install.remote``) over the body in this process."""
    return SimpleNamespace(install=SimpleNamespace(remote=actor.install), body=actor)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def _assert_same(engine: LocalEngine, reference: LocalEngine) -> None:
    assert engine.stats().version == reference.stats().version
    ref = reference._weights.hf_views
    for name, t in engine._weights.hf_views.items():
        assert _bits_equal(t, ref[name]), name


def _trainer(model: Path, trained: str) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    """The model's tensors in float32, those named ``trained*`` trained by AdamW."""
    params = {k: torch.nn.Parameter(t.float()) for k, t in
              load_file(model / "model.safetensors").items() if k.startswith(trained)}
    frozen = {k: t.float() for k, t in load_file(model / "model.safetensors").items()
              if k not in params}
    return {**params, **frozen}, torch.optim.AdamW(list(params.values()), lr=2e-4)


def _step(state: dict, opt: torch.optim.Optimizer, g: torch.Generator) -> dict:
    """One AdamW step of a random linear loss on the trained tensors; the state dict a
    publish hands weight sync (a new dict of copies per version)."""
    opt.zero_grad()
    loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in state.values()
               if isinstance(p, torch.nn.Parameter))
    loss.backward()  # type: ignore[union-attr]
    opt.step()
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.parametrize(("dtype", "transport", "trained"), [
    ("bfloat16", "shared_memory", ""),  # every tensor trained: sparse changes in bfloat16
    ("float32", "object_store", "model.layers.0."),  # one layer trained: whole tensors
])
def test_delta_sync_installs_the_full_sync_weights_bit_for_bit(model, dtype, transport,
                                                               trained) -> None:
    cfg = LocalEngineConfig(max_slots=2, max_seq_len=32, threads=1, dtype=dtype)
    reference = LocalEngine(model, cfg, engine_id="full")
    bodies = {e: EngineActor(str(model), cfg, e, 0, 0, 0) for e in ("delta", "lagging")}
    inner = SharedMemory(1 << 20) if transport == "shared_memory" else Pickled()
    if isinstance(inner, SharedMemory):
        inner.fallback = Pickled()  # a replaced actor's path (the object store) without Ray
    sync = DeltaSync(inner, dtype=dtype, name=transport)
    to = {e: Destination(engine_id=e, actor=_handle(b)) for e, b in bodies.items()}
    state, opt = _trainer(model, trained)
    g = torch.Generator().manual_seed(0)

    async def main() -> list[tuple[int, str, str]]:
        for v in range(1, 7):
            tensors = _step(state, opt, g)
            await reference.load_weights(v, tensors)  # the full sync
            if v == 4:  # the delta engine's actor is replaced: a new one from the folder
                await bodies["delta"].close()
                bodies["delta"] = EngineActor(str(model), cfg, "delta", v, 0, 0)
                to["delta"] = Destination(engine_id="delta", actor=_handle(bodies["delta"]))
                await sync.revive(Payload.full(v, tensors), to["delta"])
            else:
                await sync.send(Payload.full(v, tensors), to["delta"])
            if v != 3:  # the lagging engine misses version 3
                await sync.send(Payload.full(v, tensors), to["lagging"])
                _assert_same(bodies["lagging"].engine, reference)
            _assert_same(bodies["delta"].engine, reference)
        return [(r.version, r.engine_id, r.kind) for r in sync.records]

    try:
        kinds = asyncio.run(main())
    finally:
        sync.close()
        reference.shutdown()
        for b in bodies.values():
            b.engine.shutdown()
    full = {(1, "delta"), (1, "lagging"), (4, "lagging"), (4, "delta")}  # first, lag, revive
    assert {(v, e) for v, e, k in kinds if k == "full"} == full, kinds
    assert len([k for *_, k in kinds if k == "delta"]) == 7, kinds
    records = list(sync.records)
    delta = [r for r in records if r.kind == "delta"]
    assert all(r.dtype == dtype and r.num_bytes < r.full_bytes for r in delta), records
    assert sync.totals("delta") == {  # an engine's EngineStats.work on Ray
        "weight_loads_full": 2.0, "weight_loads_delta": 4.0,
        "weight_bytes": float(sum(r.num_bytes for r in records if r.engine_id == "delta"))}


def test_a_delta_applies_only_to_its_base_and_vllm_reads_only_full(tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    base = {"a": torch.randn(100, generator=g).bfloat16(), "b": torch.ones(4).bfloat16()}
    new = {"a": base["a"].clone(), "b": base["b"]}
    new["a"][7] += 1
    delta = encode(base, new, version=5, base_version=4)
    assert delta is not None and set(delta.tensors) == {"a" + IDX, "a.@val"}
    applied = receive(delta, held=4, served=base)
    assert all(_bits_equal(applied[k], new[k]) for k in new)
    assert _bits_equal(base["a"], base["a"]) and base["a"][7] != new["a"][7]  # not modified
    with pytest.raises(ValueError, match="delta from v4 to v5 reached an engine at v3"):
        receive(delta, held=3, served=base)
    moved = {"a": base["a"] + 1, "b": base["b"]}  # above half of the elements changed
    assert encode(base, moved, version=5, base_version=4) is None
    written = WeightStore(root=tmp_path / "store").write(delta)
    with pytest.raises(ValueError, match="kind 'delta' cannot be applied here"):
        next(iter_folder(written.path))
