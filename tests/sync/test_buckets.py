"""The broadcast's buckets (sync/buckets.py), for both its backends: gloo's rounds and NCCL's
plan the same buckets and differ only in the device they are packed on; packing and
unpacking gives back every tensor bit for bit, views of the bucket. The CUDA path itself (an
NCCL group, buckets in GPU memory) is a part of the optional GPU check
(``python -m rollstream.bench.gpu_check``, its ``broadcast`` part)."""

from __future__ import annotations

import pytest
import torch

from rollstream.config import load_config
from rollstream.config.loader import ConfigError
from rollstream.sync.broadcast import Broadcast, receive_buckets, send_buckets
from rollstream.sync.buckets import ALIGN_BYTES, pack_bucket, plan_buckets, unpack_bucket
from rollstream.sync.protocol import Payload

BUCKET = 1 << 12


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(40, 8, generator=g),  # 1280 bytes
            "norm": torch.randn(7, generator=g).to(torch.bfloat16),  # 14: unaligned
            "big": torch.randn(33, 40, generator=g),  # 5280: more than a bucket, alone
            "ids": torch.arange(5, dtype=torch.int64),
            "half": torch.randn(3, 5, generator=g).to(torch.float16)}


def test_gloo_and_nccl_rounds_plan_the_same_buckets_and_round_trip_bit_for_bit():
    tensors = _tensors()
    payload = Payload.full(3, tensors)
    gloo = Broadcast(BUCKET).round(payload)
    nccl = Broadcast(BUCKET, backend="nccl").round(payload)
    assert gloo.plan == nccl.plan == plan_buckets(tensors, BUCKET)
    assert (gloo.device, nccl.device) == ("cpu", "cuda") and gloo.header == nccl.header
    # the plan: tensors in order, each aligned, a bucket over BUCKET only for one tensor
    assert [[e.name for e in b.entries] for b in gloo.plan] == \
        [["embed", "norm"], ["big"], ["ids", "half"]]
    for bucket in gloo.plan:
        assert all(e.offset % ALIGN_BYTES == 0 for e in bucket.entries)
        assert bucket.num_bytes <= BUCKET or len(bucket.entries) == 1
    out = {}
    for bucket in gloo.plan:
        buf = pack_bucket(tensors, bucket)
        assert buf.dtype == torch.uint8 and buf.numel() == bucket.num_bytes
        views = unpack_bucket(buf, bucket)
        assert all(v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                   for v in views.values())
        out.update(views)
    assert out.keys() == tensors.keys()
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize(("cuda", "overrides", "message"), [
    (False, ["runtime.ray.weight_sync=broadcast"],
     ("runtime.ray.broadcast_backend = 'nccl' needs CUDA, and this machine has no CUDA "
      "device (torch.cuda.is_available() is False): use gloo (allowed: gloo, nccl)")),
    (True, ["runtime.ray.weight_sync=object_store"],
     ("runtime.ray.broadcast_backend = 'nccl' is read only with runtime.ray.weight_sync: "
      "broadcast (it is object_store)")),
])
def test_nccl_is_refused_at_load_without_cuda_or_without_the_broadcast(
        cuda, overrides, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(ConfigError) as info:
        load_config(None, ["runtime.kind=ray", "runtime.ray.broadcast_backend=nccl",
                           *overrides])
    assert message in str(info.value)


def test_nccl_loads_where_cuda_is_and_the_run_s_transport_uses_it(monkeypatch):
    from rollstream.runtime.ray.transport import build_transport

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(None, ["runtime.kind=ray", "runtime.ray.weight_sync=broadcast",
                             "runtime.ray.broadcast_backend=nccl", "runtime.ray.delta=false"])
    transport = build_transport(cfg.runtime.ray, "float32")
    assert isinstance(transport, Broadcast)
    assert (transport.backend, transport.device) == ("nccl", "cuda")
