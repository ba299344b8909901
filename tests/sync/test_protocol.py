"""The weight transport protocol's header, as the shared-memory path carries it (the vLLM
reload and the Ray ``shared_memory`` transport): a version folder read back is the payload
that was written (version, kind, names, dtypes, values, across buckets), and a folder of
another protocol or kind, or without a header, is refused before any tensor is read."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from rollstream.sync.protocol import PROTOCOL, Header, Payload
from rollstream.sync.shm import WeightStore, iter_folder, read_folder


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(64, 8, generator=g), "b": torch.randn(300, generator=g),
            "c": torch.randn(16, generator=g).to(torch.bfloat16), "d": torch.ones(10)}


def test_a_folder_reads_back_as_the_payload_written(tmp_path) -> None:
    tensors = _tensors()
    store = WeightStore(root=tmp_path / "store", bucket_bytes=2048)
    written = store.write(Payload.full(7, tensors))
    assert written.num_buckets > 1
    payload = read_folder(written.path)
    assert payload.header == Header.describe(7, "full", tensors)
    assert payload.header.protocol == PROTOCOL and payload.header.names == tuple(tensors)
    assert [m.dtype for m in payload.header.tensors] == ["float32", "float32", "bfloat16",
                                                         "float32"]
    assert all(torch.equal(payload.tensors[k], v) for k, v in tensors.items())
    assert [n for n, _ in iter_folder(written.path)] == list(tensors)


@pytest.mark.parametrize(("meta", "error"), [
    ({"rollstream.protocol": str(PROTOCOL + 1), "rollstream.version": "3",
      "rollstream.kind": "full"}, f"transport protocol {PROTOCOL + 1}; this rollstream reads"),
    ({"rollstream.protocol": str(PROTOCOL), "rollstream.version": "3",
      "rollstream.kind": "adapter"},
     r"kind 'adapter' cannot be applied here \(accepted: full"),
    (None, "not a rollstream weight payload"),
])
def test_a_folder_of_another_protocol_or_kind_is_refused(tmp_path, meta, error) -> None:
    folder = tmp_path / "v3"
    folder.mkdir()
    save_file({"a": torch.ones(4)}, str(folder / "bucket-000.safetensors"), meta)
    with pytest.raises(ValueError, match=error):
        read_folder(folder)
    with pytest.raises(ValueError, match=error):  # the vLLM worker's reader
        next(iter_folder(folder))


def test_a_delivered_payload_of_another_kind_is_refused() -> None:
    payload = Payload.full(1, {"a": torch.ones(2)})
    assert payload.open() is payload
    other = dataclasses.replace(payload, header=dataclasses.replace(payload.header,
                                                                    kind="adapter"))
    with pytest.raises(ValueError, match="kind 'adapter' cannot be applied here"):
        other.open()
